"""ppd: Parallel Prompt Decoding.

Trained prompt tokens appended to the input let a frozen causal LM guess several tokens ahead; a sparse
tree of those guesses is verified in one forward pass, and greedy output stays identical to ordinary
greedy decoding.
"""

from .config import Acceptance, AttentionType, CaptureMode, DecodeConfig, DecodeMethod, PromptTokenConfig
from .decoder import Decoder, GenerationOutput, PromptTooLongError, StepOutput, eos_ids_of
from .models import DEFAULT_MODEL, EMBEDDED_MODELS, ModelInfo, load_model, load_tokenizer
from .ppd_model import PPDModel
from .prompt_tokens import AdapterMismatchError, PromptTokens
from .tree import Tree, TreeBuffers, TreeSet

__version__ = "0.1.0"

__all__ = [
    "Acceptance",
    "AdapterMismatchError",
    "AttentionType",
    "CaptureMode",
    "DEFAULT_MODEL",
    "DecodeConfig",
    "DecodeMethod",
    "Decoder",
    "EMBEDDED_MODELS",
    "GenerationOutput",
    "ModelInfo",
    "PPDModel",
    "PromptTokenConfig",
    "PromptTokens",
    "PromptTooLongError",
    "StepOutput",
    "Tree",
    "TreeBuffers",
    "TreeSet",
    "eos_ids_of",
    "load_model",
    "load_tokenizer",
]

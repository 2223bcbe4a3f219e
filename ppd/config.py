"""Configuration dataclasses shared by the library and the programs.

``PromptTokenConfig`` is what an adapter directory records about its prompt tokens; ``DecodeConfig`` is how
one generation call behaves. Both validate themselves in ``__post_init__`` so that an impossible setting
fails where it is made, with a message naming the field.
"""

from __future__ import annotations

import enum
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

# EOS ids one decoding row checks its tokens against (a fixed width, so that the step compiles once).
MAX_EOS_IDS = 8
# Bumped when the on-disk adapter layout changes in a way older readers cannot follow: 2 added deep prompt
# tokens' per-layer offsets, 3 their low-rank maps (an adapter without them is written as the oldest format
# that holds it: 1 for plain prompt tokens, 2 for offsets only).
ADAPTER_FORMAT_VERSION = 3


def env_choice(name: str, choices: Sequence[str], default: str) -> str:
    """Environment switch ``name``'s value (``default`` where unset), refused with an error that names the variable
    and its choices where it is none of ``choices``."""
    found = os.environ.get(name, default)
    if found not in choices:
        listed = ", ".join(choices[:-1]) + f" or {choices[-1]}"
        raise ValueError(f"${name} must be {listed}, got {found!r}")
    return found


def env_count(name: str, default: int) -> int:
    """Environment switch ``name`` as a whole number of at least 1 (``default`` where unset), refused with an error
    that names the variable otherwise."""
    found = os.environ.get(name)
    if found is None:
        return default
    if not found.strip().isdigit() or int(found) < 1:
        raise ValueError(f"${name} must be a whole number of at least 1, got {found!r}")
    return int(found)


class AttentionType(str, enum.Enum):
    """How the copies of the prompt tokens attend to each other (REFERENCE section 1).

    ``ensemble``: copy j of prompt token i sees copy j of every prompt token k <= i (V causal chains).
    ``decoder``: causal over the flattened order (token, copy): every earlier copy and itself.
    ``encoder``: only the copies of its own prompt token.
    """

    ENSEMBLE = "ensemble"
    DECODER = "decoder"
    ENCODER = "encoder"


class DecodeMethod(str, enum.Enum):
    PPD = "ppd"
    BASELINE = "baseline"


class Acceptance(str, enum.Enum):
    """How a sampled (temperature > 0) step decides which guesses to keep (``ppd.acceptance``).

    ``lossless``: the model's next token is drawn at the last accepted node and a guess is kept when it is
    that token, so every emitted token is an exact sample from the model (the text has the model's own
    distribution, and with the same seed it is the baseline's text). ``typical``: Medusa's typical
    acceptance, which keeps any guess the model finds likely enough; it accepts more guesses but does not
    sample from the model's distribution.
    """

    LOSSLESS = "lossless"
    TYPICAL = "typical"


class CaptureMode(str, enum.Enum):
    """How the decoding step runs (``ppd.decoding.graphs``).

    ``eager``: plain PyTorch, one kernel launch at a time. ``graph``: the eager step captured once in a
    CUDA graph and replayed. ``compile``: the step compiled by ``torch.compile`` (fused kernels, launched one
    by one). ``compiled_graph``: the compiled step captured in a CUDA graph. ``reduce_overhead``:
    ``torch.compile(mode="reduce-overhead")``, whose CUDA graphs torch manages. ``auto``: the fastest
    measured for the device (``compiled_graph`` on CUDA, ``compile`` on a CPU), or what the environment
    variable ``PPD_CAPTURE`` names (``PPD_CAPTURE=eager`` skips compiling, for quick runs).
    """

    AUTO = "auto"
    EAGER = "eager"
    GRAPH = "graph"
    COMPILE = "compile"
    COMPILED_GRAPH = "compiled_graph"
    REDUCE_OVERHEAD = "reduce_overhead"


class StepAttention(str, enum.Enum):
    """How a decoding step's attention reads the cache (``ppd.decoding.tree_attention``).

    ``dense``: the model's own attention with a float mask over every slot the step attends to (any
    model). ``flex``: FlexAttention over a block mask made from each row's length, whose cost does not grow
    with the mask's width, only with the keys it must read (checked once per model: a model whose attention
    layers do not run it exactly is refused). ``auto``: ``dense``, measured faster on an H100 so far.
    """

    AUTO = "auto"
    DENSE = "dense"
    FLEX = "flex"


@dataclass
class PromptTokenConfig:
    num_prompt_tokens: int = field(default=3, metadata={"help": "N: prompt tokens appended after the input."})
    num_ensemble: int = field(default=1, metadata={"help": "V: copies of each prompt token; logits averaged."})
    attention_type: AttentionType = field(
        default=AttentionType.ENSEMBLE, metadata={"help": "ensemble | decoder | encoder"}
    )
    hidden_size: int = field(default=0, metadata={"help": "Hidden size of the base model."})
    vocab_size: int = field(default=0, metadata={"help": "Vocabulary size of the base model's LM head."})
    base_model: str = field(default="", metadata={"help": "Identifier of the base model the tokens were trained on."})
    base_model_revision: str = field(default="", metadata={"help": "Revision of that base model."})
    init_text: str = field(default="Next 2 word", metadata={"help": "Text whose embeddings initialised the tokens."})
    base_adapter: str = field(default="", metadata={
        "help": "PEFT LoRA adapter merged onto the base model before training (empty: none)."})
    deep: bool = field(default=False, metadata={
        "help": "Deep prompt tokens: also an offset added to each prompt token's hidden state after every "
                "decoder layer (ppd.deep_prompts)."})
    num_layers: int = field(default=0, metadata={"help": "Decoder layers of the base model (deep prompt tokens)."})
    map_rank: int = field(default=0, metadata={
        "help": "Deep prompt tokens: rank of each prompt row's low-rank map of its hidden state, added after "
                "every decoder layer with the offset (0: offsets only)."})
    format_version: int = field(default=1, metadata={"help": "On-disk format version."})

    def __post_init__(self) -> None:
        self.attention_type = AttentionType(self.attention_type)
        if self.num_prompt_tokens < 1:
            raise ValueError(f"num_prompt_tokens must be >= 1, got {self.num_prompt_tokens}")
        if self.num_ensemble < 1:
            raise ValueError(f"num_ensemble must be >= 1, got {self.num_ensemble}")
        if self.hidden_size < 0 or self.vocab_size < 0 or self.num_layers < 0 or self.map_rank < 0:
            raise ValueError("hidden_size, vocab_size, num_layers and map_rank must be non-negative")
        if self.map_rank and not self.deep:
            raise ValueError(f"map_rank={self.map_rank} needs deep prompt tokens (the maps act where the offsets do)")
        # an older ppd cannot read the offsets or the maps: it must refuse the adapter, not drop them
        needed = 3 if self.map_rank else 2 if self.deep else 1
        self.format_version = max(self.format_version, needed)

    @property
    def num_rows(self) -> int:
        """Rows of the embedding table: N prompt tokens times V copies."""
        return self.num_prompt_tokens * self.num_ensemble

    def to_dict(self) -> dict:
        """The adapter's ``ppd_config.json``. Plain prompt tokens are written as format 1 (without the deep
        fields), so that an older ppd still reads them."""
        data = {
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_ensemble": self.num_ensemble,
            "attention_type": self.attention_type.value,
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
            "base_model": self.base_model,
            "base_model_revision": self.base_model_revision,
            "init_text": self.init_text,
            "base_adapter": self.base_adapter,
            "format_version": self.format_version,
        }
        if self.deep:
            data.update(deep=True, num_layers=self.num_layers)
        if self.map_rank:
            data.update(map_rank=self.map_rank)
        return data


@dataclass
class DecodeConfig:
    method: DecodeMethod = field(default=DecodeMethod.PPD, metadata={"help": "ppd | baseline (autoregressive)"})
    max_new_tokens: int = field(default=512, metadata={"help": "Stop after this many new tokens."})
    temperature: float = field(default=0.0, metadata={"help": "0 = greedy (lossless); > 0 samples."})
    top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling mass when temperature > 0."})
    top_k: int = field(default=0, metadata={"help": "Sample among the k most likely tokens (0: all)."})
    acceptance: Acceptance = field(default=Acceptance.LOSSLESS, metadata={
        "help": "lossless (exact samples from the model) | typical (Medusa's, not lossless); temperature > 0"})
    posterior_threshold: float = field(default=0.09, metadata={"help": "Typical acceptance: hard threshold."})
    posterior_alpha: float = field(default=0.3, metadata={"help": "Typical acceptance: entropy-scaled threshold."})
    stop_on_eos: bool = field(default=True, metadata={"help": "Stop a sequence at the tokenizer's EOS ids."})
    eos_token_ids: tuple[int, ...] | None = field(default=None, metadata={
        "help": "The EOS ids of this call, instead of the decoder's (the model's and tokenizer's)."})
    seed: int | None = field(default=None, metadata={"help": "Seed of the sampling generator."})
    capture: CaptureMode = field(
        default=CaptureMode.AUTO,
        metadata={"help": "eager | graph | compile | compiled_graph | reduce_overhead | auto (see CaptureMode)"},
    )

    def __post_init__(self) -> None:
        self.method = DecodeMethod(self.method)
        self.capture = CaptureMode(self.capture)
        self.acceptance = Acceptance(self.acceptance)
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.eos_token_ids is not None:
            self.eos_token_ids = tuple(sorted({int(i) for i in self.eos_token_ids}))
            if len(self.eos_token_ids) > MAX_EOS_IDS:
                raise ValueError(f"at most {MAX_EOS_IDS} EOS ids are supported, got {len(self.eos_token_ids)}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = no top-k filter), got {self.top_k!r}")
        # Typical acceptance takes a guess whose probability exceeds min(threshold, alpha * exp(-entropy)):
        # a bound of 0 or below would accept every guess, whatever the model thinks of it.
        if not 0 < self.posterior_threshold <= 1:
            raise ValueError(f"posterior_threshold must be in (0, 1], got {self.posterior_threshold}")
        if not (math.isfinite(self.posterior_alpha) and self.posterior_alpha > 0):
            raise ValueError(f"posterior_alpha must be a finite number > 0, got {self.posterior_alpha}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def filtered(self) -> bool:
        """Samples from a truncated distribution (top-k or top-p)."""
        return not self.greedy and (self.top_k > 0 or self.top_p < 1.0)

    @property
    def typical(self) -> bool:
        """Samples with typical acceptance."""
        return not self.greedy and self.acceptance is Acceptance.TYPICAL

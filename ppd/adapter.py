"""Which prompt tokens and trees a model decodes with: the adapter a user names (a folder or a hub id), else
the one shipped for the model, else freshly initialised prompt tokens; and the adapter's batch policy or
tree set for the device type and dtype the model runs in, unless a tree file is named."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from .config import PromptTokenConfig
from .hub import resolve_adapter
from .models import ModelInfo
from .policy import BatchPolicy
from .prompt_tokens import PromptTokens, packaged_adapter
from .tree import TreeSet

logger = logging.getLogger(__name__)


@dataclass
class AdapterFiles:
    """Prompt tokens read from an adapter folder, and how reports name where they came from."""

    prompt_tokens: PromptTokens
    directory: Path | None  # None: freshly initialised prompt tokens, with no folder (and no trees)
    source: str  # the folder, "hub:org/name@<commit>", "shipped:<name>" or "untrained"

    @classmethod
    def read(cls, name: str | Path, revision: str | None = None) -> "AdapterFiles":
        """The adapter ``name`` (a folder, or a hub id as :func:`ppd.hub.resolve_adapter` takes it)."""
        location = resolve_adapter(name, revision)
        return cls(PromptTokens.from_pretrained(location.path), location.path, location.source)

    @classmethod
    def default_for(cls, model, tokenizer, info: ModelInfo) -> "AdapterFiles":
        """The prompt tokens for ``model`` when no adapter is named: the shipped ones, else freshly
        initialised ones (decoding stays exact, it just guesses badly)."""
        shipped = packaged_adapter(info.model_id)
        if shipped is not None:
            return cls(PromptTokens.from_pretrained(shipped, model), shipped, f"shipped:{shipped.name}")
        logger.warning("no adapter given and none shipped for %s: using untrained prompt tokens "
                       "(output is unchanged, decoding is just slower)", info.model_id)
        config = PromptTokenConfig(base_model=info.model_id, base_model_revision=info.revision)
        return cls(PromptTokens.from_text(model, tokenizer, config), None, "untrained")


@dataclass
class TreeChoice:
    """The tree set (or batch policy) a decoder verifies with, and where it came from."""

    trees: TreeSet | None  # None with no policy: ppd's packaged default tree for the adapter's shape
    policy: BatchPolicy | None
    source: str

    @classmethod
    def for_model(cls, model, adapter: AdapterFiles, given: TreeSet | None = None,
                  given_name: str = "") -> "TreeChoice":
        """``given`` when a tree file was named, else the adapter's batch policy or tree set for the model's
        device type and dtype (``policy_<device>_<dtype>.json``, ``tree_<device>_<dtype>.json``,
        ``tree_<device>.json``), else the packaged default."""
        if given is not None:
            return cls(given, None, given_name)
        weight = model.get_input_embeddings().weight
        device_type, dtype = weight.device.type, str(weight.dtype).removeprefix("torch.")
        folder = adapter.directory
        if folder is not None and (path := BatchPolicy.adapter_file(folder, device_type, dtype)) is not None:
            return cls(None, BatchPolicy.load(path), f"{adapter.source}:{path.name}")
        if folder is not None and (path := TreeSet.adapter_file(folder, device_type, dtype)) is not None:
            return cls(TreeSet.load(path), None, f"{adapter.source}:{path.name}")
        return cls(None, None, "packaged:default.json")


def prompt_tokens_and_trees(model, tokenizer, info: ModelInfo, given: AdapterFiles | None = None,
                            given_trees: TreeSet | None = None, tree_name: str = "") -> tuple[AdapterFiles, TreeChoice]:
    """The prompt tokens a model decodes with (``given``, checked against the model, else
    :meth:`AdapterFiles.default_for`) and their tree set (:meth:`TreeChoice.for_model`)."""
    if given is not None:
        given.prompt_tokens.check_compatible(model)
    files = given or AdapterFiles.default_for(model, tokenizer, info)
    return files, TreeChoice.for_model(model, files, given_trees, tree_name)

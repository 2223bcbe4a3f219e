"""The trained prompt tokens: an N x V table of embeddings, and its on-disk adapter format.

An adapter directory holds ``ppd_config.json`` (sorted keys: N, V, attention type, base model id and
revision, hidden and vocabulary sizes, format version) and ``prompt_tokens.safetensors`` with one tensor,
``embeddings`` of shape ``[N * V, hidden]`` (row ``k * V + j`` is copy j of prompt token k); deep prompt tokens
(``ppd.deep_prompts``) add ``offsets`` of shape ``[layers, N * V, hidden]``, and with ``map_rank`` r the low-rank maps
``map_down`` ``[layers, hidden, N * V * r]`` and ``map_up`` ``[layers, N * V * r, hidden]``. No pickles.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from .config import ADAPTER_FORMAT_VERSION, PromptTokenConfig
from .files import atomic_write

logger = logging.getLogger(__name__)

CONFIG_NAME = "ppd_config.json"
WEIGHTS_NAME = "prompt_tokens.safetensors"
TENSOR_NAME = "embeddings"
OFFSETS_NAME = "offsets"
MAP_NAMES = ("map_down", "map_up")


class AdapterMismatchError(ValueError):
    """The prompt tokens were made for a model of another shape."""


class PromptTokens(nn.Module):
    """``embeddings``: float32 parameter [N * V, hidden]; with ``config.deep`` also ``offsets``, float32
    [layers, N * V, hidden] (zeros when not given), and with ``config.map_rank`` the maps ``map_down`` and
    ``map_up`` (when not given: ``down`` random, ``up`` zeros, so that a new map changes nothing yet gets a
    gradient). The only trained weights of PPD."""

    def __init__(self, config: PromptTokenConfig, embeddings: torch.Tensor | None = None,
                 offsets: torch.Tensor | None = None, maps: tuple[torch.Tensor, torch.Tensor] | None = None):
        super().__init__()
        self.config = config
        if embeddings is None:
            embeddings = torch.zeros(config.num_rows, config.hidden_size)
        if tuple(embeddings.shape) != (config.num_rows, config.hidden_size):
            raise ValueError(
                f"embeddings have shape {tuple(embeddings.shape)}, config expects "
                f"[{config.num_rows}, {config.hidden_size}] (N={config.num_prompt_tokens}, V={config.num_ensemble})"
            )
        self.embeddings = nn.Parameter(embeddings.detach().to(torch.float32).clone())
        self.offsets: nn.Parameter | None = None
        if config.deep:
            shape = (config.num_layers, config.num_rows, config.hidden_size)
            if offsets is None:
                offsets = torch.zeros(shape)
            if tuple(offsets.shape) != shape:
                raise ValueError(f"offsets have shape {tuple(offsets.shape)}, config expects {list(shape)}")
            self.offsets = nn.Parameter(offsets.detach().to(torch.float32).clone())
        elif offsets is not None:
            raise ValueError("offsets were given for prompt tokens that are not deep (config.deep is False)")
        self.map_down: nn.Parameter | None = None
        self.map_up: nn.Parameter | None = None
        if config.map_rank:
            width = config.num_rows * config.map_rank
            shapes = ((config.num_layers, config.hidden_size, width), (config.num_layers, width, config.hidden_size))
            if maps is None:
                generator = torch.Generator().manual_seed(0)
                maps = (torch.randn(shapes[0], generator=generator) / config.hidden_size ** 0.5, torch.zeros(shapes[1]))
            for name, tensor, shape in zip(MAP_NAMES, maps, shapes):
                if tuple(tensor.shape) != shape:
                    raise ValueError(f"{name} has shape {tuple(tensor.shape)}, config expects {list(shape)}")
                setattr(self, name, nn.Parameter(tensor.detach().to(torch.float32).clone()))
        elif maps is not None:
            raise ValueError("low-rank maps were given for prompt tokens without them (config.map_rank is 0)")

    def tensors(self) -> dict[str, torch.Tensor]:
        """The trained tensors by their on-disk names."""
        found = {TENSOR_NAME: self.embeddings}
        if self.offsets is not None:
            found[OFFSETS_NAME] = self.offsets
        if self.map_down is not None:
            found.update(zip(MAP_NAMES, (self.map_down, self.map_up)))
        return found

    @property
    def num_prompt_tokens(self) -> int:
        return self.config.num_prompt_tokens

    @property
    def num_ensemble(self) -> int:
        return self.config.num_ensemble

    def forward(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Embeddings of the given table rows (all rows by default), float32."""
        return self.embeddings if rows is None else self.embeddings[rows]

    @classmethod
    def from_text(cls, model, tokenizer, config: PromptTokenConfig) -> "PromptTokens":
        """Initialise every row from the word embeddings of ``config.init_text``, cycled to N * V rows, as the
        model's embedding module gives them (Gemma scales its embeddings there): prompt tokens enter the model
        as they are, so they start where the text's own tokens would."""
        config = _fill_from_model(config, model)
        ids = tokenizer(config.init_text, add_special_tokens=False)["input_ids"]
        if not ids:
            raise ValueError(f"init_text {config.init_text!r} tokenizes to nothing")
        embedding = model.get_input_embeddings()
        rows = torch.tensor([ids[i % len(ids)] for i in range(config.num_rows)], device=embedding.weight.device)
        with torch.no_grad():
            table = embedding(rows)
        return cls(config, table.float().cpu())

    def check_compatible(self, model) -> None:
        """Raise :class:`AdapterMismatchError` unless these prompt tokens fit ``model``."""
        hidden, vocab = _model_sizes(model)
        problems = []
        if self.config.hidden_size != hidden:
            problems.append(f"hidden size {self.config.hidden_size} != model's {hidden}")
        if self.config.vocab_size and self.config.vocab_size != vocab:
            problems.append(f"vocabulary size {self.config.vocab_size} != model's {vocab}")
        if self.config.deep and self.config.num_layers != _num_layers(model):
            problems.append(f"{self.config.num_layers} layers of offsets != model's {_num_layers(model)} layers")
        if problems:
            raise AdapterMismatchError(
                f"prompt tokens trained for {self.config.base_model or 'another model'} do not fit this model: "
                + "; ".join(problems)
            )

    def save_pretrained(self, directory: str | Path) -> None:
        """Write the adapter directory atomically (a reader never sees half an adapter)."""
        tensors = {name: t.detach().float().cpu().contiguous() for name, t in self.tensors().items()}
        for tensor in tensors.values():
            _check_finite(tensor, "refusing to save prompt tokens with")
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        config = json.dumps(self.config.to_dict(), indent=2, sort_keys=True) + "\n"
        atomic_write(directory / CONFIG_NAME, lambda p: Path(p).write_text(config))
        atomic_write(directory / WEIGHTS_NAME, lambda p: save_file(tensors, p, metadata={"format": "pt"}))

    @classmethod
    def from_pretrained(cls, directory: str | Path, model=None) -> "PromptTokens":
        """Load an adapter directory; with ``model``, also check that it fits that model."""
        directory = Path(directory)
        config_path, weights_path = directory / CONFIG_NAME, directory / WEIGHTS_NAME
        if not config_path.exists() or not weights_path.exists():
            raise FileNotFoundError(f"{directory} is not a ppd adapter: it needs {CONFIG_NAME} and {WEIGHTS_NAME}")
        try:
            raw = json.loads(config_path.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"{config_path} is not valid JSON: {err}") from err
        known = {f.name for f in dataclasses.fields(PromptTokenConfig)}
        unknown = sorted(set(raw) - known)
        if unknown:
            logger.warning("ignoring unknown keys in %s: %s", config_path, ", ".join(unknown))
        config = PromptTokenConfig(**{k: v for k, v in raw.items() if k in known})
        if config.format_version > ADAPTER_FORMAT_VERSION:
            raise ValueError(
                f"{directory} has adapter format {config.format_version}; this ppd reads up to {ADAPTER_FORMAT_VERSION}"
            )
        try:
            tensors = load_file(str(weights_path))
        except Exception as err:  # safetensors raises its own error type, naming no file
            raise ValueError(f"{weights_path} cannot be read as a safetensors file (truncated or damaged?): "
                             f"{err}") from err
        wanted = [TENSOR_NAME] + ([OFFSETS_NAME] if config.deep else []) + (list(MAP_NAMES) if config.map_rank else [])
        for name in wanted:
            if name not in tensors:
                raise ValueError(f"{weights_path} holds no {name!r} tensor (found {sorted(tensors)})")
            _check_finite(tensors[name], f"{weights_path} holds")
        maps = tuple(tensors[name] for name in MAP_NAMES) if config.map_rank else None
        tokens = cls(config, tensors[TENSOR_NAME], tensors.get(OFFSETS_NAME) if config.deep else None, maps)
        if model is not None:
            tokens.check_compatible(model)
        return tokens


def count_non_finite(tokens: "PromptTokens | torch.Tensor", read: bool = True) -> "int | torch.Tensor":
    """How many prompt-token values (of a tensor, or of all of a :class:`PromptTokens`' tensors) are NaN or
    inf. A single one reaches the real rows of the same forward and turns lossless decoding into garbage, so
    such prompt tokens are refused where they are read, written or trained. ``read=False``: the count as a tensor
    where the values are, not read back (training reads it a step later)."""
    tensors = tokens.tensors().values() if isinstance(tokens, PromptTokens) else [tokens]
    count = sum((~torch.isfinite(t.detach())).sum() for t in tensors)
    return int(count) if read else count


def _check_finite(embeddings: torch.Tensor, where: str) -> None:
    bad = count_non_finite(embeddings)
    if bad:
        raise ValueError(f"{where} {bad} of {embeddings.numel()} prompt-token values that are not finite "
                         "(NaN or inf): the adapter is damaged, or came from a training run that diverged")


def packaged_adapter(model_id: str) -> Path | None:
    """The adapter shipped inside the package for ``model_id`` (exact match of its ``base_model``), if any."""
    from importlib import resources

    root = resources.files("ppd").joinpath("adapters")
    if not root.is_dir():
        return None
    for entry in sorted(root.iterdir(), key=lambda e: e.name):
        config = entry.joinpath(CONFIG_NAME)
        if config.is_file() and json.loads(config.read_text()).get("base_model") == model_id:
            return Path(str(entry))
    return None


def _model_sizes(model) -> tuple[int, int]:
    hidden = model.get_input_embeddings().weight.shape[1]
    head = model.get_output_embeddings()
    vocab = head.weight.shape[0] if head is not None else model.config.vocab_size
    return hidden, vocab


def _num_layers(model) -> int:
    return model.config.get_text_config().num_hidden_layers


def _fill_from_model(config: PromptTokenConfig, model) -> PromptTokenConfig:
    """Copy the model's sizes (and identity, where the caller left it empty) into the config."""
    hidden, vocab = _model_sizes(model)
    base = config.base_model or getattr(model.config, "_name_or_path", "")
    layers = _num_layers(model) if config.deep else 0
    return dataclasses.replace(config, hidden_size=hidden, vocab_size=vocab, base_model=base, num_layers=layers)

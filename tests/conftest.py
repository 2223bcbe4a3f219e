"""Shared fixtures: tiny random models built from configs (fast, no network) and the real default model."""

from __future__ import annotations

import os
import random

import pytest
import torch

from ppd import PromptTokenConfig, PromptTokens, Tree, TreeSet

TINY_VOCAB = 24

# ``auto`` compiles the step on a CPU, tens of seconds per model and step kind; the suite's decoders run
# eagerly unless a test names a mode (the compiled CPU path has tests of its own, tests/test_cpu_path.py).
os.environ.setdefault("PPD_CAPTURE", "eager")
# ``auto`` means bfloat16 on a CPU with bfloat16 instructions (AVX-512 BF16, AMX); the suite's equivalences
# with transformers' float32 forward run in float32 on every CPU, and its bfloat16 tests name the dtype.
os.environ.setdefault("PPD_CPU_BF16", "0")
# Under pytest-xdist (`make test` runs two workers) the workers share the cores: each takes its share of threads
# rather than all of them, so two compute-bound tests do not fight over every core.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


def tiny_model(arch: str = "llama", vocab: int = TINY_VOCAB, seed: int = 0, max_positions: int = 512,
               window: int | None = None, tie_word_embeddings: bool = False, layers: int = 2):
    """A causal LM of ``layers`` layers (default 2) with random weights. Small vocabularies make guesses often
    right. ``window`` turns on sliding-window attention where the architecture has it: every layer for Mistral
    and Phi-3, the second layer for Qwen2 (``max_window_layers=1``) and every second one for Gemma 3, Gemma 2's
    own alternation. GPT-NeoX has its own field names, no grouped keys and rotary embeddings on half of each
    head (``partial_rotary_factor``); ``tie_word_embeddings`` makes the head share the input embeddings'
    weight."""
    from transformers import (AutoModelForCausalLM, Gemma2Config, Gemma3TextConfig, GPTNeoXConfig, LlamaConfig,
                              MistralConfig, Phi3Config, Qwen2Config)

    common = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                  tie_word_embeddings=tie_word_embeddings)
    if arch in ("mistral", "phi3") and window is not None:
        common.update(sliding_window=window)
    elif arch == "qwen2" and window is not None:
        common.update(use_sliding_window=True, sliding_window=window, max_window_layers=1)
    elif arch in ("gemma2", "gemma3"):
        common.update(head_dim=8, query_pre_attn_scalar=8, sliding_window=window or 4096)
        if arch == "gemma3":
            common.update(layer_types=(["sliding_attention", "full_attention"] * layers)[:layers])
    if arch == "phi3":  # its defaults name special tokens of a 32K vocabulary
        common.update(pad_token_id=None, bos_token_id=1, eos_token_id=2)
    elif arch == "gpt_neox":
        del common["num_key_value_heads"]
        common.update(rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
    config = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig, "gemma2": Gemma2Config,
              "gemma3": Gemma3TextConfig, "phi3": Phi3Config, "gpt_neox": GPTNeoXConfig}[arch](**common)
    attention = "eager" if arch == "gemma2" else "sdpa"  # transformers runs Gemma 2 (logit soft-capping) eagerly
    config._attn_implementation = attention
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=attention)
    # Sharper distributions than the default init, so greedy text repeats and guesses get accepted.
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
        if tie_word_embeddings:
            # A tied head over a residual stream that is mostly the input embedding predicts the last token
            # again and again; larger layers make the text (and the guesses) depend on the context.
            for weight in model.parameters():
                if weight.dim() == 2 and weight is not model.get_input_embeddings().weight:
                    weight.mul_(8.0)
    return model.eval().requires_grad_(False)


def random_prompt_tokens(model, n: int = 3, v: int = 1, attention: str = "ensemble", seed: int = 0,
                         deep: bool = False, rank: int = 0) -> PromptTokens:
    """Random prompt tokens for ``model``; ``deep``: with random per-layer offsets too; ``rank``: and random
    low-rank maps of that rank."""
    hidden = model.get_input_embeddings().weight.shape[1]
    vocab = model.get_output_embeddings().weight.shape[0]
    layers = model.config.num_hidden_layers if deep else 0
    generator = torch.Generator().manual_seed(seed)
    config = PromptTokenConfig(num_prompt_tokens=n, num_ensemble=v, attention_type=attention, hidden_size=hidden,
                               vocab_size=vocab, base_model="tiny", deep=deep, num_layers=layers, map_rank=rank)
    embeddings = torch.randn(n * v, hidden, generator=generator)
    offsets = 0.5 * torch.randn(layers, n * v, hidden, generator=generator) if deep else None
    maps = None
    if rank:
        width = n * v * rank
        maps = (torch.randn(layers, hidden, width, generator=generator) / hidden ** 0.5,
                0.3 * torch.randn(layers, width, hidden, generator=generator) / width ** 0.5)
    return PromptTokens(config, embeddings, offsets, maps)


def random_tree(rng: random.Random, key: int, n_prompt: int, top_k: int, size: int) -> Tree:
    """A random prefix-closed tree of about ``size`` candidates with depth <= key."""
    paths: list[tuple[int, ...]] = []
    frontier: list[tuple[int, ...]] = [()]
    while len(paths) < size and frontier:
        parent = rng.choice(frontier)
        children = [p for p in paths if p[:-1] == parent and len(p) == len(parent) + 1]
        if len(parent) >= key or len(children) >= top_k:
            frontier.remove(parent)
            continue
        child = parent + (len(children),)
        paths.append(child)
        frontier.append(child)
    counts = tuple(rng.randint(1, n_prompt) for _ in paths)
    return Tree(tuple(paths), counts, rng.randint(1, n_prompt))


def random_tree_set(seed: int, n_prompt: int = 3, top_k: int = 6, size: int = 12) -> TreeSet:
    rng = random.Random(seed)
    trees = {key: random_tree(rng, key, n_prompt, top_k, rng.randint(0, size)) for key in range(1, n_prompt + 1)}
    return TreeSet(n_prompt, top_k, trees)


_SESSION_MODELS: list = []  # models shared by the whole session, whose derived data a module's end drops


@pytest.fixture(scope="session")
def real_model():
    """The embedded default model (SmolLM2-135M-Instruct), float32 on CPU."""
    from ppd import load_model

    model, tokenizer, info = load_model("smollm2-135m-instruct", device="cpu", dtype="float32")
    _SESSION_MODELS.append(model)
    return model, tokenizer, info


def _release_freed_memory() -> None:
    """Hand the C heap's free pages back to the system (glibc keeps large freed blocks for reuse, so one test's
    peak would otherwise stay resident for the rest of the session)."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


MODULE_HEADROOM_GIB = 10.0  # what a module may add to a test process's resident memory (peaks ~11.5 GB in all)
HEADROOM_WAIT_S = 300.0


def _meminfo_gib(field: str, path: str = "/proc/meminfo") -> float | None:
    """A ``/proc/meminfo`` field (or another such file's, e.g. ``/proc/self/status``) in GiB (Linux), or None where
    it cannot be read."""
    try:
        with open(path) as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields[field].split()[0]) / 2**20
    except (OSError, KeyError, ValueError):
        return None


def _wait_for_headroom() -> None:
    """Start a module only once the machine has room for its peak, waiting up to ``HEADROOM_WAIT_S`` for the
    other test process to end a module and hand its pages back: two processes at their peaks at once (~11.5 GB
    each) passed this 24 GiB machine, and the kernel killed one (a CI run, thirty-third session). Only with
    several test processes (xdist) on a machine that can hold one peak beside the others' idle memory."""
    import time

    total = _meminfo_gib("MemTotal")
    if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) < 2 or total is None or total < 2 * MODULE_HEADROOM_GIB:
        return
    deadline = time.monotonic() + HEADROOM_WAIT_S
    while (available := _meminfo_gib("MemAvailable")) is not None and available < MODULE_HEADROOM_GIB:
        if time.monotonic() > deadline:
            return
        time.sleep(2.0)


MEMORY_LOG_ENV = "PPD_TEST_MEMORY_LOG"  # a file: each module's name and the test process's peak so far, appended


def _log_peak(module: str) -> None:
    """Where ``$PPD_TEST_MEMORY_LOG`` names a file, append the module, this process's resident memory now and its
    peak so far (GiB): a module that raises the peak is the one to trim."""
    path = os.environ.get(MEMORY_LOG_ENV)
    if not path:
        return
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    now = _meminfo_gib("VmRSS", "/proc/self/status")
    with open(path, "a", encoding="utf-8") as f:
        f.write(f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')} {module} now {now or 0:.2f} peak {peak:.2f}\n")


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_steps(request):
    """Drop what a test module left behind once it is done: the compiled variants of every module's decoders
    (with the caches they were traced on), the weights the shared real model packed for the row counts that
    module's decoders ran (``ppd.decoding.packed_linear``; up to 770 MB each), and the heap's free pages.
    Without this the suite's peak memory grew past this 24 GiB machine. Before the module, waits for room
    (:func:`_wait_for_headroom`)."""
    _wait_for_headroom()
    yield
    _log_peak(request.module.__name__)
    import gc

    from ppd.decoding.packed_linear import PackedLinear

    torch._dynamo.reset()
    for model in _SESSION_MODELS:
        for layer in model.modules():
            if isinstance(layer, PackedLinear):
                layer.unpack_all()
    gc.collect()
    _release_freed_memory()

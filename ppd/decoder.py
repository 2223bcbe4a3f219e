"""The public decoding API: a :class:`Decoder` over one model, its prompt tokens and tree set.

``Decoder.generate`` decodes one prompt or a batch; ``Decoder.stream`` yields the tokens of every forward
pass as soon as they are known. The decoder owns what decoding needs across requests: the tree set as
device tables, its caches (one per batch bucket, allocated once and reset per request) and the compiled
and captured steps, so a second request neither allocates nor captures again.

The work is split by where it runs (``ppd/decoding``): ``step.py`` is the device step, ``graphs.py``
compiles and captures it, ``loop.py`` is the host loop that reads one small tensor per step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from . import compile_cache
from .config import MAX_EOS_IDS, CaptureMode, DecodeConfig, StepAttention
from .decoding.graphs import Capture, StepRunner, captures_graphs, compiles_prefill, resolve_mode
from .decoding.loop import PromptTooLongError, batch_bucket, decode, steps_to_prepare, whole_width
from .decoding.packed_linear import pack_linears
from .decoding.prefill_graphs import warm_prompt_lengths
from .decoding.state import DecodeState, StatePool
from .decoding.step import LanguageModel, StepKind
from .decoding.support import UnsupportedModelError, checked_tree_attention
from .decoding.tree_attention import BLOCK, MIN_CHUNK
from .decoding.confident import build_tables
from .decoding.tables import MIN_SIZE, TreeTables
from .deep_prompts import deep_weights, hooks_for, merge_maps, merges_maps
from .policy import BatchPolicy
from .prompt_tokens import PromptTokens
from .tree import TreeSet
from .tree_builder import default_tree_set

__all__ = ["Decoder", "GenerationOutput", "PromptTooLongError", "StepOutput", "eos_ids_of"]

DEFAULT_MAX_SEQ_LEN = 8192
# Cache slots a new state allocates at first; it grows as longer requests need more (``KVBuffer.reserve``), or
# takes its whole capacity before its first captured graph.
INITIAL_SLOTS = 512


@dataclass
class StepOutput:
    """New tokens of one forward pass (the prefill is step 0) for each batch row."""

    step: int
    tokens: list[list[int]]  # empty for a row that had already finished
    guessed: list[int]  # how many leading tokens of ``tokens`` were accepted guesses
    finished: list[bool]
    finish_reason: list[str | None] = field(default_factory=list)  # "eos" | "length" | "max_length" once finished


@dataclass
class GenerationOutput:
    token_ids: list[int]
    steps: int  # forward passes after the prefill
    finish_reason: str  # "eos" | "length" | "max_length"
    wall_time_s: float
    step_tokens: list[int] = field(default_factory=list)  # tokens emitted by each step
    # Of ``wall_time_s``, the seconds until the prefill's first token was on the host (the rest: the steps).
    prefill_time_s: float = 0.0
    # The seconds from the start until each of the batch's step reports was on the host (one per forward pass of
    # the batch: its longest row's steps), to tell steady passes from a slow one.
    report_times_s: list[float] = field(default_factory=list)

    @property
    def new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def accept_length(self) -> float:
        """New tokens per decoding step (prefill excluded), as the reference reports it."""
        return self.new_tokens / self.steps if self.steps else float(self.new_tokens)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_time_s if self.wall_time_s > 0 else 0.0

    def stats(self) -> dict:
        return {
            "new_tokens": self.new_tokens,
            "steps": self.steps,
            "accept_length": self.accept_length,
            "tokens_per_s": self.tokens_per_s,
            "wall_time_s": self.wall_time_s,
            "finish_reason": self.finish_reason,
        }


def eos_ids_of(model, tokenizer=None) -> set[int]:
    """Every EOS id that the model's generation config or the tokenizer names."""
    ids: set[int] = set()
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for source in (eos, getattr(tokenizer, "eos_token_id", None)):
        if source is None:
            continue
        ids.update([source] if isinstance(source, int) else source)
    return ids


class Decoder:
    """Decodes with trained prompt tokens over a tree set; ``method=baseline`` decodes one token per step.

    ``prompt_tokens`` may be ``None`` for a decoder that only runs the baseline. ``max_seq_len`` caps the
    cache (prompt plus new tokens) below the model's context window (default: the window, at most
    8192 tokens); every batch bucket's cache holds that many tokens per row. With a ``policy``, PPD
    verifies a batch with the tree set the policy names for its bucket, or runs the one-row step where
    it names none (``trees`` defaults to the policy's tree for batch 1).

    ``packed_weights`` (default: wherever it is available, a float32 model on a CPU with MKL) wraps the
    model's linear layers so that steps of more than one row multiply with weights packed for their row
    count (``ppd.decoding.packed_linear``); the model's parameters and its one-row and prefill products
    are unchanged. On a CPU a tree step also computes the LM head in one pass over all its rows.

    ``attention`` says how a step's attention reads the cache (:class:`~ppd.config.StepAttention`):
    FlexAttention over a block mask, whose cost does not grow with the cache's width, or the model's own
    attention over a dense float mask (``auto``).
    """

    def __init__(
        self,
        model,
        prompt_tokens: PromptTokens | None = None,
        trees: TreeSet | None = None,
        eos_token_ids: Iterable[int] = (),
        max_seq_len: int | None = None,
        policy: BatchPolicy | None = None,
        packed_weights: bool | None = None,
        attention: StepAttention | str = StepAttention.AUTO,
    ):
        self.model = model
        self.packed = pack_linears(model) if packed_weights is not False else []
        if packed_weights and not self.packed:
            raise ValueError("packed weights need a float32 model on a CPU and a torch built with MKL; this model "
                             f"is {self.dtype} on {self.device}")
        self.lm = LanguageModel.of(model)
        self.lm.one_head_pass = self.device.type == "cpu"
        self.lm.flex = self._use_flex(StepAttention(attention))
        self.prompt_tokens = prompt_tokens
        self.eos_token_ids = set(eos_token_ids)
        if len(self.eos_token_ids) > MAX_EOS_IDS:
            raise ValueError(f"at most {MAX_EOS_IDS} EOS ids are supported, got {len(self.eos_token_ids)}")
        self.tables: TreeTables | None = None
        self.policy = policy if prompt_tokens is not None else None
        self._tables_of: dict[int, TreeTables] = {}  # each tree set's tables, by the set's id
        if prompt_tokens is not None:
            prompt_tokens.check_compatible(model)
            prompt_tokens.to(self.device)
            self.lm.offsets = hooks_for(model, prompt_tokens)
            if self.lm.offsets is not None:
                table = deep_weights(prompt_tokens, self.dtype, detach=True)
                # (merged maps serve the tree steps; prefills keep the low-rank products)
                self.lm.offset_table = merge_maps(table) if merges_maps(self.device, table) else table
            n, v = prompt_tokens.num_prompt_tokens, prompt_tokens.num_ensemble
            if trees is None and policy is not None:
                trees = policy.for_batch(1)
            trees = trees if trees is not None else default_tree_set(n, v)
            sets = [trees] + (policy.tree_sets if policy is not None else [])
            vocab = self.model.get_output_embeddings().weight.shape[0]
            for tree_set in sets:
                if tree_set.num_prompt_tokens != n:
                    raise ValueError(f"the tree set is built for N={tree_set.num_prompt_tokens} prompt tokens, "
                                     f"the adapter has N={n}")
                if tree_set.top_k > vocab:
                    raise ValueError(f"the tree set guesses from the top-{tree_set.top_k} tokens, more than the "
                                     f"model's vocabulary of {vocab}")
            # One state serves every tree set of the decoder: they keep the same number of guesses.
            top_k = max(t.top_k for t in sets)
            for tree_set in sets:
                if id(tree_set) not in self._tables_of:
                    self._tables_of[id(tree_set)] = build_tables(
                        tree_set, v, prompt_tokens.config.attention_type, self.device, top_k=top_k)
            self.tables = self._tables_of[id(trees)]
        self.trees = trees
        if max_seq_len is not None and max_seq_len < 2:
            raise ValueError(f"max_seq_len must be >= 2, got {max_seq_len}")
        self.capacity = min(self.max_positions, max_seq_len or DEFAULT_MAX_SEQ_LEN)
        self.capacity_reason = ("the model's context window" if self.capacity == self.max_positions
                                else "the decoder's max_seq_len")
        self._prompt_embeds: dict[int, torch.Tensor] = {}
        self._runners: dict[CaptureMode, StepRunner] = {}
        self.states = StatePool(self._new_state)

    # ------------------------------------------------------------------ properties and set-up
    def _use_flex(self, attention: StepAttention) -> bool:
        if attention is not StepAttention.FLEX:
            return False
        gap = checked_tree_attention(self.model, self.lm)
        if gap is not None:
            raise UnsupportedModelError(f"attention 'flex' is not available for this model: {gap}; use 'dense'")
        return True

    @property
    def attention(self) -> StepAttention:
        """The step's attention as it runs: ``flex`` or ``dense``."""
        return StepAttention.FLEX if self.lm.flex else StepAttention.DENSE

    @property
    def guess_k(self) -> int:
        """Guesses kept per prompt token: the largest top-k of the decoder's tree sets."""
        return self.tables.top_k

    @property
    def device(self) -> torch.device:
        return self.model.get_input_embeddings().weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.get_input_embeddings().weight.dtype

    @property
    def max_positions(self) -> int:
        return int(getattr(self.model.config.get_text_config(), "max_position_embeddings", 0) or 1 << 30)

    def check_prompt_fits(self, num_tokens: int) -> None:
        """Raise :class:`PromptTooLongError` unless a prompt of ``num_tokens`` leaves room for a new token."""
        if num_tokens >= self.capacity:
            raise PromptTooLongError(f"the prompt has {num_tokens} tokens but {self.capacity_reason} is "
                                     f"{self.capacity}: no room for a single new token")

    def tables_for(self, batch_size: int, static: bool = False) -> TreeTables | None:
        """The tree tables PPD verifies a batch of ``batch_size`` rows with (``None``: the one-row step): a
        continuously refilled batch (the serving engine's), or a ``static`` one (:meth:`generate`'s)."""
        if self.policy is None:
            return self.tables
        trees = self.policy.for_batch(batch_size, static)
        return None if trees is None else self._tables_of[id(trees)]

    def tables_for_batch(self, size: int, capture: CaptureMode | str, static: bool = True) -> TreeTables | None:
        """The tree tables a batch of ``size`` prompts decodes with under ``capture``: those of the bucket of rows
        that the mode's state holds (a power of two where graphs are captured), in a static batch (default) or a
        continuously refilled one."""
        bucket = batch_bucket(size, exact=not captures_graphs(resolve_mode(capture, self.device)))
        return self.tables_for(bucket, static)

    def max_tree_width(self, batch_size: int) -> int | None:
        """The widest attention (cache slots) the batch policy runs a tree at for ``batch_size`` rows (``None``:
        any width, or no policy)."""
        return None if self.policy is None else self.policy.max_width_for(batch_size)

    def _state_slots(self) -> int:
        """Cache slots of every state of this decoder: its capacity and room past the longest committed prefix
        for one step's rows (or the prefill's prompt rows), in whole key blocks of FlexAttention's size, so that a
        step may attend over the whole buffer (with FlexAttention, whole pieces of MIN_CHUNK slots, so that a step
        may split the buffer into pieces)."""
        t = self.tables
        widest = max((x.num_rows for x in self._tables_of.values()), default=1)
        rows = max(widest, (t.num_prompt_tokens * t.num_ensemble if t else 0) + 1)
        unit = MIN_CHUNK if self.lm.flex else BLOCK
        return -(-(self.capacity + rows) // unit) * unit

    def _new_state(self, batch_size: int) -> DecodeState:
        t = self.tables
        n_prompt = t.num_prompt_tokens if t else 0
        # A step emits at most N + 1 tokens (a path is at most N deep), or L + 1 with a longer lookup chain, whatever
        # the tree set: the report has a column for each of them.
        emitted = max((x.most_emitted for x in self._tables_of.values()), default=MIN_SIZE + 1)
        layers = self.model.config.get_text_config().num_hidden_layers  # a multimodal model: its text model's
        return DecodeState(layers, batch_size, self._state_slots(), n_prompt, t.top_k if t else 0,
                           emitted, MAX_EOS_IDS, self.device, reserved=INITIAL_SLOTS,
                           spare_slots=0 if self.lm.flex else 1, history=self.looks_up)

    @property
    def looks_up(self) -> bool:
        """Whether any tree set of the decoder has a prompt-lookup chain (its states then keep each row's text)."""
        return any(x.lookup for x in self._tables_of.values())

    def with_trees(self, trees: TreeSet) -> "Decoder":
        """A decoder of the same model, prompt tokens, EOS ids and cache size over another tree set (at every
        batch size: without a batch policy)."""
        return Decoder(self.model, self.prompt_tokens, trees, self.eos_token_ids, max_seq_len=self.capacity,
                       packed_weights=bool(self.packed), attention=self.attention)

    def prompt_embeds(self, tables: TreeTables | None = None) -> torch.Tensor:
        """Each tree's prompt-token rows [N + 1, prompt rows, hidden] in the model's dtype, made once per
        tree set (``tables``, default the decoder's own)."""
        tables = tables or self.tables
        found = self._prompt_embeds.get(id(tables))
        if found is None or found.dtype != self.dtype:
            with torch.no_grad():
                found = self.prompt_tokens(tables.prompt_index).detach().to(self.dtype)
            self._prompt_embeds[id(tables)] = found
        return found

    def runner(self, mode: CaptureMode) -> StepRunner:
        if mode not in self._runners:
            self._runners[mode] = StepRunner(self.lm, mode, self.device, self.packed)
        return self._runners[mode]

    @property
    def captures(self) -> list[Capture]:
        """Every graph captured so far, with the seconds it took (compilation included)."""
        return [c for runner in self._runners.values() for c in runner.captures]

    def warmup(self, batch_sizes: Sequence[int] = (1,), methods: Sequence[str] = ("ppd", "baseline"),
               capture: CaptureMode | str = CaptureMode.AUTO, sampling: DecodeConfig | None = None,
               max_width: int | None = None) -> float:
        """Compile and capture ahead of time the steps that these batch sizes and methods run (the tree step
        for ``ppd`` up to the batch policy's widest attention for it and the one-row step past that, the one-row
        step for ``baseline``, and for ``ppd`` the one-row step it falls back to at the end of the model's context
        window, where a decoding can get there), at every attention width up to ``max_width``
        (default: the whole cache), for requests sampled as ``sampling`` says (default: greedy). Returns the
        seconds it took; :attr:`captures` has each graph's share.
        In eager mode there is nothing to prepare."""
        mode = resolve_mode(capture, self.device)
        if mode is CaptureMode.EAGER:
            return 0.0
        start = time.perf_counter()
        compile_cache.load()  # PPD_COMPILE_CACHE: what other processes compiled
        runner = self.runner(mode)
        use_ppd = "ppd" in methods and self.tables is not None
        method = "ppd" if use_ppd else "baseline"
        # A two-token request allocates the bucket's cache (the state it used is the one leased next); where
        # prefills run compiled, one per method compiles its prefill (a one-token prompt would compile a variant
        # of its own: torch specialises a size of one).
        both = compiles_prefill(mode, self.device) and use_ppd and "baseline" in methods
        prefills = ["ppd", "baseline"] if both else [method]
        for size in batch_sizes:
            bucket = batch_bucket(size, exact=not captures_graphs(mode))
            tables = self.tables_for(bucket, static=True) if use_ppd else None
            for name in prefills:
                for _ in decode(self, [[0, 0]] * size, DecodeConfig(method=name, max_new_tokens=1, capture=mode)):
                    pass
            if runner.prefill_graphs is not None and not compiles_prefill(mode, self.device):
                # A prefill graph for every width bucket, each way of prefilling.
                slots = self._state_slots()  # (the buckets run up to the state's slots, past the capacity)
                # PPD prefills with its prompt rows where the bucket has a tree, else as the baseline does.
                with_rows = use_ppd and tables is not None
                for name in (["ppd"] if with_rows else []) + (["baseline"] if "baseline" in methods or not with_rows
                                                              else []):
                    rows = self.prompt_tokens.config.num_rows if name == "ppd" else 0
                    for length in warm_prompt_lengths(rows, size, slots, self.capacity):
                        for _ in decode(self, [[0] * length] * size,
                                        DecodeConfig(method=name, max_new_tokens=1, capture=mode)):
                            pass
            state = self.states.acquire(bucket)
            try:
                top = min(max_width or state.capacity, state.capacity)
                for tree, widths in steps_to_prepare(self, tables, bucket, top, whole_width(self, mode),
                                                     one_row="baseline" in methods):
                    with torch.no_grad():
                        runner.prepare(tables if tree else None, self.prompt_embeds(tables) if tree else None,
                                       state, StepKind.of(tree, [sampling or DecodeConfig()]), widths)
            finally:
                self.states.release(state)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        compile_cache.save()
        return time.perf_counter() - start

    # ------------------------------------------------------------------ public API
    def generate(self, input_ids: Sequence[int] | Sequence[Sequence[int]], config: DecodeConfig | None = None,
                 on_report: Callable[[int], None] | None = None, **overrides
                 ) -> GenerationOutput | list[GenerationOutput]:
        """Decode one prompt (a list of ids) or a batch (a list of lists); returns one output per prompt.
        ``on_report(i)`` is called on the host as report i arrives (0: the prefill's, then one per step)."""
        config = _with_overrides(config, overrides)
        single = len(input_ids) > 0 and isinstance(input_ids[0], int)
        batch = [list(input_ids)] if single else [list(x) for x in input_ids]
        start = time.perf_counter()
        progress = None
        reports = []  # when each report was on the host: the first follows the prefill, then one per step
        for progress in decode(self, batch, config):
            reports.append(time.perf_counter() - start)
            if on_report is not None:
                on_report(len(reports) - 1)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        end = time.perf_counter()
        outputs = [
            GenerationOutput(progress.tokens[b], progress.steps[b], progress.reason[b] or "length", end - start,
                             progress.step_tokens[b], reports[0], reports[1:])
            for b in range(len(batch))
        ]
        return outputs[0] if single else outputs

    def stream(self, input_ids: Sequence[int], config: DecodeConfig | None = None, **overrides) -> Iterator[StepOutput]:
        """Decode one prompt, yielding the tokens of every forward pass as soon as they are known."""
        config = _with_overrides(config, overrides)
        for progress in decode(self, [list(input_ids)], config):
            yield StepOutput(progress.current_step, [list(progress.current_tokens[0])],
                             [progress.current_guessed[0]], progress.finished(), list(progress.reason))


def _with_overrides(config: DecodeConfig | None, overrides: dict) -> DecodeConfig:
    config = config or DecodeConfig()
    if overrides:
        config = DecodeConfig(**{**config.__dict__, **overrides})
    return config

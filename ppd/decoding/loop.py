"""The host side of decoding: prefill, then one device step after another until every row has stopped.

The host never builds a tensor per step. It picks which step to run (the PPD tree step, or one row near
the end of the context window) and how many cache slots it must attend over, runs it (a graph replay under
capture), and reads back one small tensor, the state's report: for each row the tokens it emitted, how
many were accepted guesses, why it stopped and its cache length. EOS and token limits were already
decided on the device.

On a GPU :func:`decode` runs ahead: it queues the next step before it reads the last one's report (a
:class:`~ppd.downloads.Download`, copied behind that step), choosing the next step's width and tree for the
longest any row can have grown by then, so the device runs one step after another while the host reads,
records and hands out the progress. Every row's tokens are the same either way; at most one step is queued
after the last row stopped, and it changes nothing a row reports.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from ..attention import plan_free_sdpa
from ..config import CaptureMode, DecodeConfig, DecodeMethod
from ..downloads import Download
from ..prefill import average_copies, build_prefill
from .graphs import StepRunner, captures_graphs, compile_limits, compiles_prefill, inductor_options, resolve_mode
from . import causal_prefill, lookup
from .prefill_graphs import PrefillGraphs
from .state import LENGTH, MAX_LENGTH, REASONS, REPORT_HEAD, DecodeState
from .step import LanguageModel, StepKind, next_tokens, set_guesses, start_rows
from .tables import TreeTables

if TYPE_CHECKING:
    from ..decoder import Decoder

MIN_WIDTH = 256  # the narrowest attention width a captured step is made for
# A prefill's width is rounded up to a multiple of this where the cache has room. SDPA's memory-efficient kernel, the
# one a masked prefill gets on a GPU, copies a mask whose rows are not a multiple of 16 long into a padded one, in
# every layer: 30 copies of 1.9 GiB for 16 prompts of 8K tokens on an H200 (results/deep_gpu/h200/v28/).
PREFILL_WIDTH_MULTIPLE = 16


class PromptTooLongError(ValueError):
    """The prompt leaves no room in the model's context window (or the decoder's cache)."""


@dataclass
class Progress:
    """What each row has emitted so far, as the host sees it after every forward pass."""

    tokens: list[list[int]]
    steps: list[int]  # forward passes after the prefill in which the row was still running
    step_tokens: list[list[int]]  # tokens each of those passes emitted
    reason: list[str | None]  # "eos" | "length" | "max_length" once finished
    current_step: int = 0  # the forward pass the latest tokens came from (0 = the prefill)
    current_tokens: list[list[int]] = field(default_factory=list)
    current_guessed: list[int] = field(default_factory=list)  # accepted guesses among the latest tokens

    def finished(self) -> list[bool]:
        return [r is not None for r in self.reason]

    def record(self, report: list[list[int]], count_step: bool) -> None:
        self.current_tokens, self.current_guessed = [], []
        for b, line in enumerate(report):
            count, guessed, reason = line[0], line[1], line[2]
            new = line[REPORT_HEAD: REPORT_HEAD + count]
            if count_step and self.reason[b] is None:
                self.steps[b] += 1
                self.step_tokens[b].append(count)
            self.tokens[b].extend(new)
            self.current_tokens.append(new)
            self.current_guessed.append(guessed)
            if reason and self.reason[b] is None:
                self.reason[b] = REASONS[reason]


def attention_width(need: int, capacity: int, exact: bool, whole: bool = False) -> int:
    """Cache slots a step attends over: exactly ``need`` when nothing is captured, else the next power of
    two (at least :data:`MIN_WIDTH`), so that a few captured graphs serve every length; or, ``whole``, the
    whole buffer (a FlexAttention step, which reads only the key blocks its rows need whatever its width:
    one captured or compiled step serves every length)."""
    if whole:
        return capacity
    if exact:
        return min(need, capacity)
    width = MIN_WIDTH
    while width < need:
        width *= 2
    return min(width, capacity)


def capture_widths(rows: int, capacity: int, whole: bool = False) -> list[int]:
    """Every width :func:`attention_width` picks for a step of ``rows`` rows, up to ``capacity`` slots."""
    if whole:
        return [capacity]
    widths = [attention_width(rows + 1, capacity, exact=False)]
    while widths[-1] < capacity:
        widths.append(attention_width(widths[-1] + 1, capacity, exact=False))
    return widths


def steps_to_prepare(decoder: "Decoder", tables: TreeTables | None, bucket: int, capacity: int, whole: bool,
                     one_row: bool = False) -> list[tuple[bool, list[int]]]:
    """(tree step or not, widths) of every step a bucket's decoding reaches up to ``capacity`` slots: the tree
    step of ``tables`` up to the batch policy's widest attention for the bucket, and the one-row step where
    there is no tree, past that width, where ``one_row`` asks for it (the baseline), or near the end of the
    model's context window (:func:`window_widths`)."""
    limit = decoder.max_tree_width(bucket) if tables is not None else None
    limited = limit is not None and limit < capacity
    plan = []
    if tables is not None:
        # A whole-width step (FlexAttention) has one width for every length: the tree keeps it, and decoding
        # past the limit still runs the one-row step (``tree_fits`` applies the limit whatever the attention).
        widths = capture_widths(tables.num_rows, capacity, whole)
        plan.append((True, widths if whole or not limited else [w for w in widths if w <= limit]))
    if one_row or tables is None or limited:
        plan.append((False, capture_widths(1, capacity, whole)))
    else:
        plan.append((False, window_widths(decoder, tables, capacity, whole)))
    return [(tree, widths) for tree, widths in plan if widths]


def window_widths(decoder: "Decoder", tables: TreeTables, capacity: int, whole: bool) -> list[int]:
    """The widths of the one-row steps that a decoding with ``tables`` runs near the end of the model's context
    window, where the tree's positions would pass it (see :func:`queue_step`), up to ``capacity`` slots: none
    where no row gets that far. (Captured lazily instead, the first of them held a timed 8K generation on an
    H200 for 30-145 ms, and a fresh process would compile it there.)"""
    window = decoder.max_positions - tables.max_offset  # a step reaching this length runs one row
    # The longest row a step is chosen for: a row stopped at the capacity may have committed a step's tokens past
    # it, and :func:`decode` reads the lengths one step behind, adding the most a queued step may commit.
    if window > decoder.capacity + 2 * tables.most_emitted:
        return []
    if capacity < decoder.capacity and window + 1 > capacity:
        return []  # the plan stops short of the one-row steps (warm-up's ``max_width``)
    first = attention_width(min(window + 1, capacity), capacity, exact=False)
    return [w for w in capture_widths(1, capacity, whole) if w >= first]


def batch_bucket(size: int, exact: bool) -> int:
    """Rows a state holds for a batch of ``size``: the next power of two when graphs are captured."""
    if exact:
        return size
    bucket = 1
    while bucket < size:
        bucket *= 2
    return bucket


def decode(decoder: "Decoder", batch: list[list[int]], config: DecodeConfig) -> Iterator[Progress]:
    """Decode ``batch`` (lists of token ids); yields the progress after the prefill and after every step."""
    if not batch or any(len(x) == 0 for x in batch):
        raise ValueError("every prompt needs at least one token")
    use_ppd = config.method is DecodeMethod.PPD
    if use_ppd and decoder.prompt_tokens is None:
        raise ValueError("method 'ppd' needs prompt tokens (an adapter); use method 'baseline' without one")
    mode = resolve_mode(config.capture, decoder.device)
    exact = not captures_graphs(mode)
    whole = whole_width(decoder, mode)
    runner = decoder.runner(mode)
    n = len(batch)
    lengths = [len(x) for x in batch]
    decoder.check_prompt_fits(max(lengths))
    bucket = batch_bucket(n, exact)
    # The batch policy's tree for this bucket's static batches; none where the one-row step is faster there.
    tables = decoder.tables_for(bucket, static=True) if use_ppd else None
    kind = StepKind.of(tables is not None, [config])

    state = decoder.states.acquire(bucket)
    try:
        with torch.no_grad():
            reset_rows(decoder, state, lengths, config)
            # Where the policy runs no tree at this batch size, the prompt tokens are left out of the prefill too:
            # PPD then runs the baseline's forwards exactly.
            prefill(decoder, batch, state, tables is not None, kind, compiles_prefill(mode, decoder.device),
                    runner.prefill_graphs)
            report = state.report[:n].tolist()
        progress = Progress([[] for _ in batch], [0] * n, [[] for _ in batch], [None] * n)
        progress.record(report, count_step=False)
        yield progress

        host_lengths = [line[3] for line in report]
        # Steps queued whose reports are not read yet: with a run ahead, the next step is queued before the
        # last one's report is read, so the device never waits for the host between two steps.
        depth = 2 if runs_ahead(decoder.device) else 1
        advance = state.report.shape[1] - REPORT_HEAD  # the most cache entries one step commits to a row
        queued: deque[Download] = deque()
        step = 0
        while not all(progress.finished()):
            while len(queued) < depth:
                # The lengths read are those before the queued steps, each of which may commit ``advance``
                # entries more: the step's width and tree are chosen for the longest a row can be by then.
                longest = max(host_lengths) + len(queued) * advance
                queue_step(decoder, runner, state, tables, longest, kind, exact, whole)
                queued.append(Download(state.report[:n]))
            report = queued.popleft().wait().tolist()
            step += 1
            progress.current_step = step
            progress.record(report, count_step=True)
            host_lengths = [line[3] for line in report]
            yield progress
        # A step queued after every row had stopped changed nothing a row reports: it is left unread.
    finally:
        decoder.states.release(state)


RUN_AHEAD_ENV = "PPD_RUN_AHEAD"  # "1" or "0": whether decode() queues a step before reading the last one's report


def runs_ahead(device: torch.device) -> bool:
    """Whether :func:`decode` queues each step before it reads the report of the step before (``$PPD_RUN_AHEAD``
    = ``1`` or ``0``; by default on a GPU). On a CPU the host computes each step itself, so nothing overlaps and
    a run ahead only adds a step after the last row stops."""
    found = os.environ.get(RUN_AHEAD_ENV)
    if found not in (None, "", "0", "1"):
        raise ValueError(f"${RUN_AHEAD_ENV} must be 1 or 0, got {found!r}")
    return found == "1" if found else device.type == "cuda"


def reset_rows(decoder: "Decoder", state: DecodeState, lengths: list[int], config: DecodeConfig) -> None:
    """Prepare the state's first rows for prompts of ``lengths`` decoded as ``config`` says (the rest are
    padding): each row's token limit (``max_new_tokens``, or what the cache leaves, which ends the row with
    ``max_length``), its EOS ids (the call's, else the decoder's), seed and sampling settings."""
    capacity = decoder.capacity
    limits = [min(config.max_new_tokens, capacity - length) for length in lengths]
    reasons = [LENGTH if config.max_new_tokens <= capacity - length else MAX_LENGTH for length in lengths]
    eos = decoder.eos_token_ids if config.eos_token_ids is None else config.eos_token_ids
    state.reset(len(lengths), limits, reasons, sorted(eos) if config.stop_on_eos else [], config)


def whole_width(decoder: "Decoder", mode: CaptureMode) -> bool:
    """Whether steps attend over the whole buffer: FlexAttention steps that are compiled or captured (an
    eager one, written out on a CPU, computes every score it is given)."""
    return decoder.lm.flex and mode is not CaptureMode.EAGER


def tree_fits(decoder: "Decoder", bucket: int, need: int, capacity: int, exact: bool) -> bool:
    """Whether a tree step whose rows reach slot ``need`` stays within the batch policy's widest attention for
    this bucket (measured as the dense step's width, whatever the step's attention)."""
    limit = decoder.max_tree_width(bucket)
    return limit is None or attention_width(need, capacity, exact) <= limit


def queue_step(decoder: "Decoder", runner: StepRunner, state: DecodeState, tables: TreeTables | None, longest: int,
               kind: StepKind, exact: bool, whole: bool = False) -> None:
    """Queue one step of every row of ``state`` (verifying ``tables``' trees, or one row each where ``tables`` is
    None), whose longest row has at most ``longest`` committed tokens; the step writes its report into the state.
    ``kind`` says how the rows sample (its ``tree`` is decided here)."""
    # Near the end of the context window the tree's positions would not fit, and past the batch policy's
    # widest attention for this bucket the tree costs more than it returns: one row a step.
    tree = (tables is not None and longest + tables.max_offset < decoder.max_positions
            and tree_fits(decoder, state.batch_size, longest + tables.num_rows, state.capacity, exact))
    rows = tables.num_rows if tree else 1
    width = attention_width(longest + rows, state.capacity, exact, whole)
    kind = replace(kind, tree=tree)
    with torch.no_grad():
        runner.run(tables if tree else None, decoder.prompt_embeds(tables) if tree else None, state, kind, width)


def prefill_logits(lm: LanguageModel, state: DecodeState, embeds: torch.Tensor, mask, positions: torch.Tensor,
                   read: torch.Tensor, prompt_rows: torch.Tensor | None) -> torch.Tensor:
    """One prefill forward over the first ``n`` rows of ``state``'s cache (inputs ``embeds`` [n, W, hidden],
    ``mask``, ``positions``), written to slots ``[0, W)``; returns the logits at each row's slots ``read``
    [n, K] ([n, K, vocab]). The deep prompt tokens' hooks are told the ``prompt_rows``."""
    n, width = embeds.shape[:2]
    slots = torch.arange(width, device=embeds.device)[None].expand(n, -1)
    if lm.offsets is not None:
        lm.offsets.set(prompt_rows, lm.offset_table)
    hidden = lm.body(inputs_embeds=embeds, attention_mask=mask, position_ids=positions, use_cache=True,
                     **{lm.cache_key: state.kv.view(slots, width, rows=n)}).last_hidden_state
    if lm.offsets is not None:
        lm.offsets.set(None, None)
    return lm.logits(hidden.gather(1, read[..., None].expand(-1, -1, hidden.shape[-1])))


def prefill_width_multiple(batch: list[list[int]], prompt_rows: int, capacity: int) -> int:
    """What a prefill of ``batch`` with ``prompt_rows`` prompt rows a prompt rounds its width up to:
    :data:`PREFILL_WIDTH_MULTIPLE` where the rounded width fits the cache's ``capacity``, else 1 (its padding slots
    see only themselves and write cache slots past each row's length, which no step attends)."""
    need = max(len(x) for x in batch) + prompt_rows
    rounded = -(-need // PREFILL_WIDTH_MULTIPLE) * PREFILL_WIDTH_MULTIPLE
    return PREFILL_WIDTH_MULTIPLE if rounded <= capacity else 1


@functools.cache
def compiled_prefill():
    """:func:`prefill_logits` compiled with every size symbolic (rows, prompt width, cache capacity), shared by
    every decoder of the process: one compilation serves every prompt length and batch of two or more rows
    (torch specialises a size of one, so a single row has a variant of its own)."""
    return torch.compile(prefill_logits, dynamic=True, fullgraph=True, options=inductor_options())


def prefill(decoder: "Decoder", batch: list[list[int]], state: DecodeState, use_ppd: bool, kind: StepKind,
            compiled: bool = False, graphs: PrefillGraphs | None = None) -> None:
    """Run ``[x_b, prompt tokens]`` into the first rows of the state's cache; set each row's length, root,
    guesses and key. ``kind`` says how the rows sample. ``compiled``: the forward runs compiled
    (:func:`compiled_prefill`) instead of launching each of the model's operators from Python (a state's first
    prefill runs eagerly before it, to allocate the cache); else, with ``graphs``, the eager forward is replayed
    from a CUDA graph at a bucketed width where one fits (``prefill_graphs``; the state's first prefill, which
    allocates its cache, and prefills too wide to capture run eagerly)."""
    n = len(batch)
    pt = decoder.prompt_tokens
    n_prompt = pt.num_prompt_tokens if use_ppd else 0
    V = pt.num_ensemble if use_ppd else 1
    attention = pt.config.attention_type if use_ppd else "ensemble"
    table = pt().detach() if use_ppd else None
    found = None
    if graphs is not None and not compiled and state.kv.allocated:
        state.kv.reserve(state.kv.capacity)  # a graph writes the cache where it was when captured
        found = graphs.logits(decoder, batch, state, table, n_prompt, V, attention, prefill_logits)
    if found is not None:
        rows, lengths = found
    else:
        # An eager prefill runs as plain causal attention where its layout allows (``causal_prefill``); a compiled
        # one keeps the mask its compiled graph was traced with.
        causal = not compiled and causal_prefill.applies(decoder.model.config, n_prompt, V, attention)
        inputs = build_prefill(decoder.model, batch, table, n_prompt, V, attention,
                               width_multiple=prefill_width_multiple(batch, n_prompt * V, state.kv.capacity),
                               causal=causal)
        state.kv.reserve(inputs.width)
        read = inputs.keep[inputs.where]  # [n, 1 + N*V]: each row's last token and its prompt rows (one cut a row)
        args = (decoder.lm, state, inputs.embeds, inputs.mask, inputs.positions, read, inputs.prompt_rows)
        switched = causal_prefill.switched(decoder.model.config) if causal else contextlib.nullcontext()
        with plan_free_sdpa(), switched:
            if compiled and not state.kv.allocated:
                prefill_logits(*args)  # the first forward into a state allocates its cache: eagerly, once
            if compiled:
                state.kv.buffers()  # a row range's cache slices itself here, eagerly (as for a compiled step)
                with compile_limits():
                    rows = compiled_prefill()(*args)
            else:
                rows = prefill_logits(*args)  # [n, 1 + N*V, vocab]
        lengths = inputs.lengths
    state.lengths[:n] = lengths
    first = state.rows(0, n)
    state.root[:n] = next_tokens(rows[:, 0], first, kind, first.generated)  # output token 0
    if use_ppd:
        set_guesses(state, average_copies(rows[:, 1:], n_prompt, V), decoder.guess_k, n)
        state.key[:n] = n_prompt
    if state.history is not None:
        lookup.start(state.history, batch, state.root)
    start_rows(state)

"""Prefills replayed from CUDA graphs: the eager prefill's device time without launching its kernels from Python.

An eager prefill launches the model's operators one by one from Python: 30 ms a prompt for the default model on an
H200 (``results/deep_gpu/h200/v8/``), 48-56 ms to the first report on an H100 with the prompt tokens' hooks, a fifth
of PPD's time at batch 1 (``results/deep_gpu/h100/v10/``), for a few milliseconds of device work.
Compiling it (``PPD_COMPILED_PREFILL=1``) costs 100-150 s a variant at start-up. Here the eager prefill forward is
captured in a CUDA graph instead, once per (rows, width bucket, with prompt tokens or not), which takes a fraction
of a second: the prompt is padded to the next power of two of at least :data:`MIN_WIDTH` slots (the padding slots
see only themselves and write cache slots past the row's length, which no step attends), and its tokens, lengths
and read positions are copied into the graph's input buffers before each replay. The layout, mask, positions and
embeddings are made in the graph from those few numbers (``prefill.prefill_inputs``), the logits of each row's last
token and prompt rows are its output; what follows (the first token, the guesses) runs as before.

Prefills of more than :data:`MAX_TOKENS` slots (rows x width) run eagerly: their time is the arithmetic's, not
the launches', and a graph would hold their activations.

A batcher replays prefills on a stream of its own while the steps' graphs replay on theirs (``serving.batcher``), so
two graphs may run at once. Graphs run at once must share no memory: neither a memory pool (two replays would write
each other's activations) nor a cuBLAS workspace, which torch 2.11 keeps per handle and stream, and so per capture
stream, and a graph keeps the workspace of the stream it was captured on (pytorch/pytorch#193402). So the graphs
made while a stream is current, the one that will replay them, are warmed up and captured on that stream itself
(or, for the device's default stream, where nothing can be captured, on a stream of its own from
:func:`~ppd.decoding.streams.own_stream`), into a pool of their own: graphs of one stream run one after another,
and a prefill's logits are read after its replay, before the next. The steps' graphs are captured on a stream of
their own (``decoding.graphs``), and a batcher's side streams are its own streams too, so none is another.

Without ``capture`` (a CPU, tests) the same padded inputs go through the same function eagerly, so the padding and
the buffers are tested where no graph can be captured.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from ..attention import plan_free_sdpa
from ..prefill import PrefillPlan, plan_prefill, prefill_inputs
from ..uploads import upload_into
from .streams import ordered_on, own_stream

logger = logging.getLogger(__name__)

MIN_WIDTH = 64  # the narrowest prefill width captured
MAX_TOKENS = 16384  # rows x width past which a prefill runs eagerly
PLAN_FIELDS = ("ids", "lengths", "cuts", "counts")  # the plan's tensors the graph reads (keep/where are host-side)


def bucket_width(need: int, rows: int, capacity: int) -> int | None:
    """The width a prefill of ``rows`` rows needing ``need`` slots is captured at (a power of two, at least
    :data:`MIN_WIDTH`, at most the cache's ``capacity``), or None where it runs eagerly."""
    width = MIN_WIDTH
    while width < need:
        width *= 2
    width = min(width, capacity)
    return width if need <= width and rows * width <= MAX_TOKENS else None


def bucket_widths(rows: int, capacity: int) -> list[int]:
    """Every width :func:`bucket_width` captures a prefill of ``rows`` rows at (what a warm-up captures)."""
    widths, need = [], 1
    while (width := bucket_width(need, rows, capacity)) is not None and (not widths or width > widths[-1]):
        widths.append(width)
        need = width + 1
    return widths


def warm_prompt_lengths(prompt_rows: int, rows: int, slots: int, capacity: int) -> list[int]:
    """A prompt length for every width bucket of ``rows`` rows over ``slots`` cache slots (the longest that falls
    in it; a prompt leaves room for a token of the decoder's ``capacity``), with ``prompt_rows`` prompt rows after
    it: prefilling one of each captures every graph ahead of the requests."""
    lengths = []
    for width in bucket_widths(rows, slots):
        length = min(width - prompt_rows, capacity - 1)
        if length >= 1 and bucket_width(length + prompt_rows, rows, slots) == width:
            lengths.append(length)
    return lengths


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph | None  # None: run eagerly (no capture)
    inputs: dict[str, torch.Tensor]  # the buffers the graph reads
    table: torch.Tensor | None  # the prompt-token table it reads
    output: torch.Tensor | None  # [rows, 1 + N * V, vocab]: the logits it writes
    state: object = None  # the state whose cache it writes, kept alive so that its id (the key) is not reused


@dataclass
class _Replayer:
    """What the graphs replayed on one stream are made with: the stream they are warmed up and captured on (that
    stream itself, or one of its own for the default stream) and their memory pool."""

    capture: torch.cuda.Stream
    pool: tuple


class PrefillGraphs:
    """The prefill graphs of one decoder; ``capture`` False runs each padded prefill eagerly instead."""

    def __init__(self, capture: bool):
        self.capture = capture
        self._graphs: dict[tuple, _Graph] = {}
        self._replayers: dict[int, _Replayer] = {}  # by the replaying stream's handle
        self.captures: list[tuple[int, int, float]] = []  # (rows, width, seconds) of each capture
        self.refused: str | None = None  # why this model's prefill cannot be captured (then every prefill is eager)

    def logits(self, decoder, batch: list[list[int]], state, table: torch.Tensor | None, n_prompt: int,
               num_ensemble: int, attention, prefill_logits) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Prefill ``batch`` into the first rows of ``state`` through a graph (``prefill_logits`` is the forward,
        ``loop.prefill_logits``); returns the logits [n, 1 + N * V, vocab] and the rows' lengths [n] on the device,
        or None where the prefill is too wide to capture (the caller runs it eagerly)."""
        n, n_rows = len(batch), n_prompt * num_ensemble
        width = bucket_width(max(len(x) for x in batch) + n_rows, n, state.kv.capacity)
        if width is None or self.refused is not None:
            return None
        plan = plan_prefill(batch, n_prompt, num_ensemble, width_multiple=width, read_prompt_rows=table is not None)
        key = (id(state), n, width, n_prompt, num_ensemble, str(attention), table is None)
        found = self._graphs.get(key)
        if found is None:
            found = self._make(decoder, plan, state, table, n_prompt, num_ensemble, attention, prefill_logits)
            if found is None:
                return None
            self._graphs[key] = found
        for name in PLAN_FIELDS:  # from pinned memory: the host does not wait for the device
            upload_into(found.inputs[name], getattr(plan, name))
        upload_into(found.inputs["read"], plan.keep[plan.where])
        if table is not None:
            found.table.copy_(table)
        if found.graph is None:
            return self._forward(decoder, found, state, n_prompt, num_ensemble, attention, prefill_logits), \
                found.inputs["lengths"]
        found.graph.replay()
        return found.output, found.inputs["lengths"]

    @staticmethod
    def _forward(decoder, found: _Graph, state, n_prompt, num_ensemble, attention, prefill_logits) -> torch.Tensor:
        inputs = found.inputs
        plan = PrefillPlan(inputs["ids"], inputs["lengths"], inputs["cuts"], inputs["counts"], None, None, None)
        made = prefill_inputs(decoder.model, plan, found.table, n_prompt, num_ensemble, attention)
        with plan_free_sdpa():
            return prefill_logits(decoder.lm, state, made.embeds, made.mask, made.positions, inputs["read"],
                                  made.prompt_rows)

    def _make(self, decoder, plan: PrefillPlan, state, table, n_prompt, num_ensemble, attention,
              prefill_logits) -> _Graph | None:
        """The buffers (and, capturing, the graph) of a new key; None where the model's prefill cannot be captured:
        its eager forward waits for the device somewhere (a rotary embedding that reads its longest position back,
        say), which a graph cannot hold. The warm-up forward runs with torch's sync debug mode set to raise, so
        such a model is found before any capture; from then on its prefills run eagerly, as before."""
        device = state.lengths.device
        inputs = {name: getattr(plan, name).to(device) for name in PLAN_FIELDS}
        inputs["read"] = plan.keep[plan.where].to(device)
        found = _Graph(None, inputs, None if table is None else table.clone(), None, state)
        if not self.capture:
            return found
        start = time.perf_counter()
        current = torch.cuda.current_stream(device)
        replayer = self.replayer(current)
        side = replayer.capture
        before = torch.cuda.get_sync_debug_mode()
        try:
            with ordered_on(side):  # cuBLAS and the attention kernels initialised outside the capture
                torch.cuda.set_sync_debug_mode("error")
                try:
                    self._forward(decoder, found, state, n_prompt, num_ensemble, attention, prefill_logits)
                finally:
                    torch.cuda.set_sync_debug_mode(before)
            found.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(found.graph, pool=replayer.pool, stream=side):
                found.output = self._forward(decoder, found, state, n_prompt, num_ensemble, attention,
                                             prefill_logits)
        except RuntimeError as error:
            current.wait_stream(side)
            torch.cuda.synchronize(device)
            self.refused = str(error).splitlines()[0] if str(error) else type(error).__name__
            logger.warning("prefills run eagerly: this model's prefill cannot be captured in a CUDA graph (%s)",
                           self.refused)
            return None
        torch.cuda.synchronize(device)
        seconds = time.perf_counter() - start
        self.captures.append((plan.ids.shape[0], plan.width, seconds))
        logger.info("captured the prefill of %d rows at width %d in %.2f s", plan.ids.shape[0], plan.width, seconds)
        return found

    def replayer(self, stream: torch.cuda.Stream) -> _Replayer:
        """The capture stream and memory pool of the graphs that ``stream`` replays (made on first use)."""
        found = self._replayers.get(stream.cuda_stream)
        if found is None:
            default = stream == torch.cuda.default_stream(stream.device)  # no capture there
            found = _Replayer(own_stream(stream.device) if default else stream, torch.cuda.graph_pool_handle())
            self._replayers[stream.cuda_stream] = found
        return found


__all__ = ["MAX_TOKENS", "MIN_WIDTH", "PrefillGraphs", "bucket_width", "bucket_widths", "warm_prompt_lengths"]

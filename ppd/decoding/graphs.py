"""Running the device step: eager, compiled, or captured once and replayed as a CUDA graph.

A :class:`StepRunner` owns the compiled step function and every CUDA graph of one decoder. A graph is
captured the first time a (state, tree tables, step kind, width) combination runs, and replayed from then
on: the state's buffers never move, so the graph reads and writes them directly and the host only copies
out the small report. All graphs of a runner share one memory pool (they never run at the same time).

Capture runs the step a few times first (which also compiles it) on the runner's capture stream, restoring the
state's small tensors after each run, so capturing never changes what a request decodes; the graph is captured on
that stream too, one of ppd's own (``decoding.streams``: no prefill a batcher runs beside the steps is captured or
run on it, so none shares its cuBLAS workspace). Under capture nothing executes. Each capture's seconds
(compilation included) are kept in :attr:`StepRunner.captures`.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import torch

from ..config import CaptureMode, env_choice
from .packed_linear import PackedLinear, ensure_packed
from .prefill_graphs import PrefillGraphs
from .state import DecodeState
from .step import LanguageModel, StepKind, decode_step
from .streams import ordered_on, own_stream
from .tables import TreeTables

logger = logging.getLogger(__name__)

WARMUP_RUNS = 2
PREFILL_GRAPHS_ENV = "PPD_PREFILL_GRAPHS"  # "0": prefills run eagerly even where the steps replay graphs


@dataclass
class Capture:
    """One captured graph (or, without graphs, one compiled step): what it is for and how long compiling and
    capturing took."""

    kind: StepKind
    batch_size: int
    width: int
    seconds: float


AUTO_ENV = "PPD_CAPTURE"  # what ``auto`` means in this process, where set (``eager`` skips compiling)


def resolve_mode(mode: CaptureMode | str, device: torch.device) -> CaptureMode:
    """``auto`` -> the fastest mode measured for this device type (``compiled_graph`` on CUDA, ``compile`` on a
    CPU), or the mode that ``$PPD_CAPTURE`` names; CUDA-only modes refuse other devices."""
    mode = CaptureMode(mode)
    if mode is CaptureMode.AUTO:
        chosen = os.environ.get(AUTO_ENV)
        if chosen:
            try:
                mode = CaptureMode(chosen)
            except ValueError:
                raise ValueError(f"${AUTO_ENV}={chosen!r} is not a capture mode; choose one of "
                                 f"{', '.join(m.value for m in CaptureMode if m is not CaptureMode.AUTO)}") from None
        if mode is CaptureMode.AUTO:
            return CaptureMode.COMPILED_GRAPH if device.type == "cuda" else CaptureMode.COMPILE
    if mode in (CaptureMode.GRAPH, CaptureMode.COMPILED_GRAPH, CaptureMode.REDUCE_OVERHEAD) and device.type != "cuda":
        raise ValueError(f"capture mode {mode.value!r} needs a CUDA device; on {device.type} use 'eager' or 'compile'")
    return mode


def captures_graphs(mode: CaptureMode) -> bool:
    """Whether ``mode`` replays captured graphs, so that batches and attention widths are padded to the few
    sizes captured (eager and compiled steps run at the exact sizes)."""
    return mode not in (CaptureMode.EAGER, CaptureMode.COMPILE)


def compile_limits():
    """Room for one compiled step per batch bucket and step kind (torch's default stops at 8 variants)."""
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    return config.patch(**{name: 64})


COMPILED_PREFILL_ENV = "PPD_COMPILED_PREFILL"  # "1": prefills run compiled where the step is compiled on CUDA


def compiles_prefill(mode: CaptureMode, device: torch.device) -> bool:
    """Whether prefills run compiled (``loop.compiled_prefill``): on CUDA wherever the step is compiled, where
    ``$PPD_COMPILED_PREFILL`` is ``1``. Off by default: on one H200 (the default model, bf16, MT-Bench prompts)
    a compiled prefill took 16.5 ms against an eager one's 30 ms (launching the model's operators one by one
    from Python), but each of its variants (one row or several, with prompt tokens or without) took 100-150 s
    to compile, which a server pays at every start (results/deep_gpu/h200/v8/)."""
    return (os.environ.get(COMPILED_PREFILL_ENV) == "1" and device.type == "cuda"
            and mode in (CaptureMode.COMPILE, CaptureMode.COMPILED_GRAPH, CaptureMode.REDUCE_OVERHEAD))


_COMPILED: dict[str | None, object] = {}


def compiled_step(mode: str | None):
    """``decode_step`` compiled with ``torch.compile`` (``mode`` None or "reduce-overhead"), shared by every
    decoder of the process: torch keeps one compiled variant per step kind and shapes, guarded, and a second
    decoder of the same model and trees reuses them instead of compiling again."""
    if mode not in _COMPILED:
        _COMPILED[mode] = torch.compile(decode_step, fullgraph=True,
                                        options=inductor_options(cudagraphs=mode == "reduce-overhead"))
    return _COMPILED[mode]


AUTOTUNE_ENV = "PPD_AUTOTUNE"
AUTOTUNE_CHOICES = ("off", "gemm", "full")


def autotune_options() -> dict:
    """Inductor's autotuning as ``$PPD_AUTOTUNE`` asks: ``off`` (the default), ``gemm`` (each matrix product of a
    compiled step timed over Inductor's Triton templates and the vendor library's kernel, the fastest kept, with
    the step's elementwise work fused into the template where it can) or ``full`` (``gemm``, with pointwise and
    reduction kernels' launch settings tuned as well). Tuning makes each compilation longer; its picks land in
    Inductor's cache like the rest of a compilation."""
    chosen = env_choice(AUTOTUNE_ENV, AUTOTUNE_CHOICES, "off")
    if chosen == "off":
        return {}
    options = {"max_autotune_gemm": True}
    if chosen == "full":
        options.update({"max_autotune_pointwise": True, "coordinate_descent_tuning": True})
    return options


def inductor_options(cudagraphs: bool = False) -> dict:
    """Options of ppd's compilations (``cudagraphs``: what torch's \"reduce-overhead\" mode sets; the autotuning
    that ``$PPD_AUTOTUNE`` asks for)."""
    options = {"triton.cudagraphs": True} if cudagraphs else {}
    options.update(autotune_options())
    if hasattr(torch._inductor.config.triton, "coalesce_tiling_analysis"):
        # Inductor's coalescing analysis (on by default outside Meta) fails an internal assertion on this
        # step's symbolic sizes once the batch is larger than one (seen with torch 2.11 on an H200); without it
        # Inductor picks tilings as it did before the analysis existed.
        options["triton.coalesce_tiling_analysis"] = False
    return options


TREE_SHAPES_ENV = "PPD_TREE_SHAPES"  # static | symbolic | auto: whether a compiled step keeps a tree set's sizes


def symbolic_tree_sizes(device: torch.device) -> bool:
    """Whether a compiled tree step keeps its tree set's sizes (rows, candidates, paths, depth) symbolic, so that one
    compilation serves every tree set, or compiles each tree set with its sizes as constants (``$PPD_TREE_SHAPES``;
    ``auto``: constants on CUDA, symbolic elsewhere).

    A step's rows are the root, the candidates and the prompt rows, ``1 + C + P`` of them: with C and P symbolic,
    Inductor cannot show that a layer's ``[B, 1 + C + P, hidden]`` hidden states flatten to ``[B (1 + C + P),
    hidden]`` as a view, and copies them before the first matrix product that reads them: the query projection's,
    the gate projection's, the down projection's and the deep maps' inputs, four copies a layer (a single symbolic
    row count, or a constant one, flattens as a view). On a GPU each copy is a kernel of its own: 132 kernels and
    262 us, 9.7 % of the device time of the default model's 40-row tree step at batch 16 on an H100
    (results/deep_gpu/h100/v29/). On a CPU Inductor writes the copy in the kernel that makes the hidden states,
    where it costs little, and one compilation for every tree set spares the compile time."""
    chosen = env_choice(TREE_SHAPES_ENV, ("auto", "static", "symbolic"), "auto")
    return chosen == "symbolic" or (chosen == "auto" and device.type != "cuda")


def _mark_tree_sizes(tables: TreeTables, prompt_embeds: torch.Tensor, symbolic: bool) -> None:
    """Tree rows, candidates, prompt rows, paths and depth vary between tree sets: symbolic where ``symbolic``
    (:func:`symbolic_tree_sizes`), else constants of each tree set's compilation (marked static, so that a second
    tree set compiles a step of its own instead of turning the sizes symbolic)."""
    sized = [(tables.candidate_index, (1,)), (tables.parent_row, (1,)), (tables.is_candidate, (1,)), (tables.prompt_index, (1,)),
             (tables.position_offset, (1,)), (tables.allowed, (1, 2)), (tables.retrieve_indices, (1, 2)),
             (tables.retrieve_valid, (1, 2)), (tables.node_prompt_rows, (1,)), (tables.node_prompt_count, (1,)),
             (prompt_embeds, (1,))]
    if tables.confident:  # the layout of a confident set's prompt rows (``ppd.decoding.confident``)
        sized += [(tables.prompt_owner, (1,)), (tables.prompt_level, (1,)), (tables.prompt_used, (1,))]
    if tables.lookup:  # where each set's lookup chain lies among its candidates (``ppd.decoding.lookup``)
        sized.append((tables.chain_node, (0,)))
    mark = torch._dynamo.maybe_mark_dynamic if symbolic else torch._dynamo.mark_static
    for tensor, dims in sized:
        for dim in dims:
            mark(tensor, dim)


class StepRunner:
    def __init__(self, lm: LanguageModel, mode: CaptureMode, device: torch.device,
                 packed: list[PackedLinear] = ()):
        if lm.flex and device.type != "cuda" and mode is not CaptureMode.EAGER:
            raise ValueError(f"FlexAttention steps on {device.type} run eagerly only (Inductor's CPU FlexAttention "
                             f"kernel does not compile ppd's tree step); use capture 'eager' or attention 'dense'")
        self.lm = lm
        self.mode = mode
        self.device = device
        self.packed = list(packed)  # the model's packed linear layers, if it has them
        self.symbolic_tree_sizes = symbolic_tree_sizes(device)  # read once: which step a tree set compiles
        self._graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, tuple]] = {}
        self._static: set[int] = set()  # states whose buffers torch's own CUDA graphs may treat as fixed
        self._pool = None
        self._capture_stream: torch.cuda.Stream | None = None
        self.captures: list[Capture] = []
        # Prefills replayed from graphs of their own, where steps are (``$PPD_PREFILL_GRAPHS=0``: eager prefills)
        self.prefill_graphs = PrefillGraphs(capture=True) if (
            mode in (CaptureMode.GRAPH, CaptureMode.COMPILED_GRAPH) and device.type == "cuda"
            and os.environ.get(PREFILL_GRAPHS_ENV) != "0") else None

    def _call(self, tables, prompt_embeds, state: DecodeState, kind: StepKind, width: int) -> None:
        with self.lm.stepping():
            self._call_step(tables, prompt_embeds, state, kind, width)

    def _call_step(self, tables, prompt_embeds, state: DecodeState, kind: StepKind, width: int) -> None:
        slot_ids = state.slot_ids[:width]
        if self.mode is CaptureMode.EAGER or self.mode is CaptureMode.GRAPH:
            decode_step(self.lm, tables, prompt_embeds, state, kind, slot_ids)
            return
        # Read eagerly: a row range's cache hands the compiled step the slices this read makes (KVRows).
        buffers = state.kv.buffers()
        if not self.lm.flex:
            # One compiled step serves every width (the length of ``slot_ids``), batch size of two or more
            # rows, cache capacity and, where ``symbolic_tree_sizes``, tree set (the row, candidate and path
            # counts of its tables): those sizes are symbolic from the first compilation, not only after a second
            # size made torch recompile
            # (torch specialises a size of 1, so a batch of one row has a step of its own: padding it to two
            # rows spared that compilation but made the 64-row tree step 8-10% slower on an H100 and an H200).
            # A FlexAttention step always attends over the whole buffer and is compiled per tree set: Inductor
            # (torch 2.13) fails on FlexAttention calls that share a mask over symbolic sizes.
            torch._dynamo.maybe_mark_dynamic(slot_ids, 0)  # "maybe": a width equal to the capacity may specialise
            for buffer in buffers:
                torch._dynamo.maybe_mark_dynamic(buffer, 0)
                torch._dynamo.maybe_mark_dynamic(buffer, 2)
            for tensor in state.row_tensors():
                torch._dynamo.maybe_mark_dynamic(tensor, 0)
            if tables is not None:
                _mark_tree_sizes(tables, prompt_embeds, self.symbolic_tree_sizes)
        if self.mode is CaptureMode.REDUCE_OVERHEAD and id(state) not in self._static:
            # torch's CUDA graphs accept in-place updates only of inputs whose address never changes.
            for tensor in [*state.small_tensors(), *state.kv.buffers(), state.slot_ids]:
                torch._dynamo.mark_static_address(tensor)
            self._static.add(id(state))
        compiled = compiled_step("reduce-overhead" if self.mode is CaptureMode.REDUCE_OVERHEAD else None)
        with compile_limits(), torch._dynamo.config.patch(automatic_dynamic_shapes=not self.lm.flex):
            compiled(self.lm, tables, prompt_embeds, state, kind, slot_ids)

    # ------------------------------------------------------------------ public
    def run(self, tables: TreeTables | None, prompt_embeds: torch.Tensor | None, state: DecodeState,
            kind: StepKind, width: int) -> None:
        """One step of every row of ``state``, attending over ``width`` cache slots."""
        self.pack_for(tables, state)
        self.reserve_for(state, width)
        if self.mode in (CaptureMode.GRAPH, CaptureMode.COMPILED_GRAPH):
            self.graph(tables, prompt_embeds, state, kind, width).replay()
        else:
            self._call(tables, prompt_embeds, state, kind, width)

    def reserve_for(self, state: DecodeState, width: int) -> None:
        """Have the state's cache hold ``width`` slots, or its whole capacity where steps replay captured graphs
        (whose buffers must never move again)."""
        state.kv.reserve(state.kv.capacity if captures_graphs(self.mode) else width)

    def pack_for(self, tables: TreeTables | None, state: DecodeState) -> None:
        """Have the weights packed for the rows of this step's forward (every batch row's tree rows). One row runs
        with the plain weights, which are as fast there."""
        rows = state.batch_size * (tables.num_rows if tables is not None else 1)
        if rows > 1:
            ensure_packed(self.packed, rows)

    def prepare(self, tables, prompt_embeds, state: DecodeState, kind: StepKind, widths: list[int]) -> None:
        """Do ahead of time what the first steps of this kind would do: capture a graph for every width, or,
        for a compiled step without graphs, compile it (one variant serves every width). The state is left
        as it was."""
        self.pack_for(tables, state)
        self.reserve_for(state, max(widths))
        if self.mode in (CaptureMode.GRAPH, CaptureMode.COMPILED_GRAPH):
            for width in widths:
                self.graph(tables, prompt_embeds, state, kind, width)
        elif self.mode is not CaptureMode.EAGER:
            start = time.perf_counter()
            saved = state.snapshot()
            self._call(tables, prompt_embeds, state, kind, widths[0])
            state.restore(saved)
            self.captures.append(Capture(kind, state.batch_size, widths[0], time.perf_counter() - start))

    def graph(self, tables, prompt_embeds, state: DecodeState, kind: StepKind, width: int) -> torch.cuda.CUDAGraph:
        """The CUDA graph of this step, captured on first use."""
        key = (id(state), id(tables), id(prompt_embeds), kind, width)
        found = self._graphs.get(key)
        if found is None:
            found = (self._capture(tables, prompt_embeds, state, kind, width), (state, tables, prompt_embeds))
            self._graphs[key] = found  # the objects are kept alive so that their ids are not reused
        return found[0]

    # ------------------------------------------------------------------ capture
    def _capture(self, tables, prompt_embeds, state: DecodeState, kind: StepKind, width: int) -> torch.cuda.CUDAGraph:
        start = time.perf_counter()
        saved = state.snapshot()
        if self._capture_stream is None:  # warm-ups and captures on a stream of the runner's own (``streams``)
            self._capture_stream = own_stream(self.device)
        side = self._capture_stream
        with ordered_on(side):
            for _ in range(WARMUP_RUNS):  # compiles (if compiled) and initialises cuBLAS outside the capture
                self._call(tables, prompt_embeds, state, kind, width)
                state.restore(saved)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, stream=side):
            self._call(tables, prompt_embeds, state, kind, width)
        state.restore(saved)
        torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - start
        self.captures.append(Capture(kind, state.batch_size, width, seconds))
        logger.info("captured the %s step (batch %d, width %d) in %.2f s", "tree" if kind.tree else "one-row",
                    state.batch_size, width, seconds)
        return graph

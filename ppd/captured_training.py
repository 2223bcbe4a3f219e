"""The training step's forward and backward captured in CUDA graphs, one graph per width bucket.

Eager, a step of the default model launches ~3,000-5,500 kernels one by one from Python, and at a few
conversations a step the host takes 2-6x the device's time (``results/train/profile/``): a second GPU with half
the batch each finishes no sooner. Captured, a step is one graph launch.

A graph needs fixed shapes and fixed addresses, so every batch is padded on the host to the shapes of its bucket
(:meth:`CapturedTrainingStep.static_batch`): ``rows`` batch rows (missing ones are one token with no cut), the
width rounded up to a multiple of ``width_multiple`` (the bucket), ``rows * cuts_per_row`` cuts (missing ones
repeat the first cut with weight 0) and as many kept logit slots as those cuts could need. The batch is copied into
the bucket's input buffers without waiting for the device, the graph replayed, and its outputs, the loss and the
gradient of every prompt-token tensor, taken at once: the graph builds the layout (``attention.layout_tensors``),
runs the model and the loss and differentiates it, all from those buffers. Weighted by 0, a padded cut adds exactly
nothing, so the loss and gradients are those of the unpadded batch (tested against the eager step).

Gradients are added into the tensors' ``.grad`` as a backward would, so the optimizer, clipping and gradient
accumulation work as they do eagerly; every ``.grad`` is a slice of one buffer (:meth:`grad_buffer`), which with
several processes the caller sums across them in one all-reduce (the graph replaces DDP's backward hooks).
:meth:`CapturedTrainingStep.prepare` captures every bucket a dataset needs before the first step, on every process
alike; a bucket met later is captured at its first use. Without CUDA the same padded computation runs eagerly (what
the tests on a CPU check). All graphs share one memory pool: they never run at once, and each replay's outputs are
consumed before the next one is queued.
"""

from __future__ import annotations

import collections
import logging
import time

import torch

from .attention import packed_width
from .decoding.streams import ordered_on
from .prefill import PrefillPlan, plan_prefill
from .training import HostCuts, PromptTokenModel

logger = logging.getLogger(__name__)

WARMUP_RUNS = 2  # eager runs on the side stream before the first capture (cuDNN plans, cuBLAS workspaces)
LATER_WARMUP_RUNS = 1  # before each later one (the new width's cuDNN plans)
PLAN_FIELDS = ("ids", "lengths", "cuts", "counts", "keep", "where", "cut_rows")
TARGETS = ("labels", "teacher_topk_ids", "teacher_topk_logprobs")


class CapturedTrainingStep:
    """``step(batch, divisor)``: add the gradient of ``sum(cut losses) / divisor`` to the prompt tokens' ``.grad``
    and return the loss, by replaying the CUDA graph of the batch's width bucket (captured on first use)."""

    def __init__(self, model: PromptTokenModel, rows: int, cuts_per_row: int, width_multiple: int = 512):
        if rows < 1 or cuts_per_row < 1 or width_multiple < 1:
            raise ValueError(f"a captured step needs rows, cuts per row and a width multiple of at least 1, got "
                             f"{rows}, {cuts_per_row}, {width_multiple}")
        if model.checkpointing:
            raise ValueError("a captured training step cannot recompute activations (gradient checkpointing)")
        self.model, self.rows, self.cuts_per_row, self.width_multiple = model, rows, cuts_per_row, width_multiple
        config = model.prompt_tokens.config
        self.num_cuts = rows * cuts_per_row
        self.rows_per_cut = config.num_rows  # prompt rows of a cut's block
        self.num_slots = self.num_cuts * (1 + self.rows_per_cut)
        self.params = list(model.prompt_tokens.tensors().values())
        self.device = self.params[0].device
        # One buffer whose slices, shaped as the tensors, are every tensor's ``.grad`` (one all-reduce sums them all);
        # None where the tensors' dtypes differ.
        self._grad_buffer: torch.Tensor | None = None
        self._grad_views: list[torch.Tensor | None] = [None] * len(self.params)
        if len({p.dtype for p in self.params}) == 1:
            sizes = [p.numel() for p in self.params]
            self._grad_buffer = torch.empty(sum(sizes), dtype=self.params[0].dtype, device=self.device)
            self._grad_views = [part.view_as(p) for part, p in zip(self._grad_buffer.split(sizes), self.params)]
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, dict, torch.Tensor, tuple]] = {}
        self.captures: list[tuple[int, float]] = []  # (width, seconds of warm-up and capture)
        self.steps = 0  # micro-batches run
        self.replays: collections.Counter = collections.Counter()  # micro-batches run at each width
        self.buckets: list[int] = []  # the widths prepare() named, widest first (alike on every process)
        self._pool = None
        self._side: torch.cuda.Stream | None = None  # the stream every warm-up and capture runs on
        self._timed: collections.deque = collections.deque()  # (start, end) events of replays not yet read
        self._replay_seconds = 0.0  # device time of the replays read so far
        self._last_end: torch.cuda.Event | None = None  # the end of the latest replay read
        self._gaps: list[float] = []  # device seconds from each replay's end to the next one's start

    # ------------------------------------------------------------------ host
    def bucket(self, width: int) -> int:
        """The captured width of a batch whose widest row needs ``width`` slots."""
        return packed_width([width], [0], 0, self.width_multiple)

    def prepare(self, template: dict, row_widths) -> list[int]:
        """Capture, before training, the graph of every bucket a batch of these rows can fall in (a batch's width
        is its widest row's bucket), widest first, and return those widths. Every process of a run captures the
        same buckets in the same order at its first step, so none waits at an all-reduce while another captures
        later on. ``template``: a collated batch of the dataset, whose target columns give the buffers' shapes.
        Nothing is captured without CUDA."""
        widths = self.buckets = sorted({self.bucket(w) for w in row_widths}, reverse=True)
        if self.device.type != "cuda":
            return widths
        for width in widths:
            if width in self.graphs:
                continue
            length = width - self.rows_per_cut  # one row of one cut filling the bucket
            batch = {name: template[name][:1] for name in TARGETS if template.get(name) is not None}
            batch["host"] = HostCuts([[0] * length], [[length]])
            self.graphs[width] = self._capture(self.static_batch(batch, 1))
        return widths

    def static_batch(self, batch: dict, divisor) -> dict[str, torch.Tensor]:
        """The batch (from :class:`PromptTokenCollator`) padded to its bucket's shapes, as host tensors: the plan's
        fields, the targets, ``weights`` [cuts] (1 for a real cut, 0 for padding) and ``divisor`` (a number or a
        tensor: what the summed loss is divided by)."""
        config = self.model.prompt_tokens.config
        host = batch.get("host") or HostCuts.read_back(batch["input_ids"], batch["lengths"], batch.get("cut_lengths"),
                                                       batch.get("cut_rows"))
        if len(host.sequences) > self.rows:
            raise ValueError(f"a batch of {len(host.sequences)} sequences, but the captured step has {self.rows} rows")
        widest = max(len(row) for row in host.cuts)
        if widest > self.cuts_per_row:
            raise ValueError(f"a sequence with {widest} cuts, but the captured step has room for {self.cuts_per_row}")
        missing = self.rows - len(host.sequences)
        plan = plan_prefill(host.sequences + [[0]] * missing, config.num_prompt_tokens, config.num_ensemble,
                            host.cuts + [[]] * missing, self.width_multiple)
        real = plan.where.shape[0]

        def pad(values: torch.Tensor, size: int) -> torch.Tensor:  # rows past the real ones repeat the first
            return torch.cat([values, values[:1].expand(size - len(values), *values.shape[1:])])

        # (the kept slots are positions of one row: never more than the width, whatever the cuts could need)
        static = {"ids": plan.ids, "lengths": plan.lengths, "counts": plan.counts,
                  "cuts": torch.nn.functional.pad(plan.cuts, (0, self.cuts_per_row - plan.cuts.shape[1])),
                  "keep": pad(plan.keep, min(self.num_slots, plan.width)), "where": pad(plan.where, self.num_cuts),
                  "cut_rows": pad(plan.cut_rows, self.num_cuts),
                  "weights": torch.cat([torch.ones(real), torch.zeros(self.num_cuts - real)]),
                  "divisor": torch.as_tensor(divisor, dtype=torch.float32).reshape(())}
        for name in TARGETS:
            if batch.get(name) is not None:
                static[name] = pad(batch[name], self.num_cuts)
        return static

    # ------------------------------------------------------------------ device
    def loss_and_grads(self, static: dict[str, torch.Tensor]) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """From tensors on the device alone: the weighted loss and its gradient for every trained tensor."""
        plan = PrefillPlan(*(static[name] for name in PLAN_FIELDS))
        # The gradient is taken at views of the tensors, made here, not at the tensors themselves: autograd would
        # otherwise sync with the stream each tensor's gradient accumulator was made on, and DDP makes those on
        # the default stream, which a capture must not touch.
        views = {name: tensor.view_as(tensor) for name, tensor in self.model.prompt_tokens.tensors().items()}
        logits = self.model.plan_logits(plan, views)
        losses = self.model.loss(logits, static.get("labels"), static.get("teacher_topk_ids"),
                                 static.get("teacher_topk_logprobs"), per_example=True)
        loss = (losses * static["weights"]).sum() / static["divisor"]
        return loss.detach(), torch.autograd.grad(loss, list(views.values()))

    def step(self, batch: dict, divisor) -> torch.Tensor:
        """Add this batch's gradients to ``.grad`` (as ``backward`` would) and return its loss (a new tensor)."""
        static = self.static_batch(batch, divisor)
        self.steps += 1
        self.replays[static["ids"].shape[1]] += 1
        if self.device.type != "cuda":
            loss, grads = self.loss_and_grads({name: value.to(self.device) for name, value in static.items()})
        else:
            graph, inputs, loss, grads = self._graph(static)
            for name, value in static.items():
                inputs[name].copy_(value.pin_memory() if value.device.type == "cpu" else value, non_blocking=True)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            self._timed.append((start, end))
            self._read_timings(wait=False)
        # Taken before the next replay (of any graph: they share memory) overwrites them.
        for param, grad, view in zip(self.params, grads, self._grad_views):
            if param.grad is None:
                param.grad = grad.clone() if view is None else view.copy_(grad)
            else:
                param.grad.add_(grad)
        return loss.clone()

    def grad_buffer(self) -> torch.Tensor | None:
        """The one buffer that holds every trained tensor's ``.grad``, or None where some ``.grad`` lies elsewhere
        (set by other code, or tensors of several dtypes): summing it across processes sums every gradient."""
        if self._grad_buffer is None or any(p.grad is None or p.grad.data_ptr() != v.data_ptr()
                                            for p, v in zip(self.params, self._grad_views)):
            return None
        return self._grad_buffer

    def replay_seconds(self) -> float:
        """The device time of every replay so far (waits for the last ones): set beside the run's time, what the
        graphs themselves cost, apart from the optimizer, the transfers and any wait for another process."""
        self._read_timings(wait=True)
        return self._replay_seconds

    def gap_seconds(self) -> list[float]:
        """The device time between consecutive replays (waits for the last ones): what runs between two graphs
        (the transfers, the optimizer, an all-reduce and the wait for another process), or nothing, where the
        device waited for the host."""
        self._read_timings(wait=True)
        return list(self._gaps)

    def _read_timings(self, wait: bool) -> None:
        while self._timed and (wait or self._timed[0][1].query()):
            start, end = self._timed.popleft()
            end.synchronize()
            self._replay_seconds += start.elapsed_time(end) / 1000
            if self._last_end is not None:
                self._gaps.append(self._last_end.elapsed_time(start) / 1000)
            self._last_end = end

    def _graph(self, static: dict[str, torch.Tensor]):
        width = static["ids"].shape[1]
        found = self.graphs.get(width)
        if found is None:
            found = self.graphs[width] = self._capture(static)
        return found

    def _capture(self, static: dict[str, torch.Tensor]):
        start = time.perf_counter()
        inputs = {name: value.to(self.device) for name, value in static.items()}
        if self._side is None:
            self._side = torch.cuda.Stream(self.device)
        side = self._side
        with ordered_on(side):
            for _ in range(LATER_WARMUP_RUNS if self.graphs else WARMUP_RUNS):
                self.loss_and_grads(inputs)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # thread_local: other threads' CUDA calls (NCCL's watchdog in a multi-GPU run, the loader's pinning) go on
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            loss, grads = self.loss_and_grads(inputs)
        torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - start
        width = static["ids"].shape[1]
        self.captures.append((width, seconds))
        logger.info("captured the training step at width %d (%d rows, %d cuts) in %.2f s", width, self.rows,
                    self.num_cuts, seconds)
        return graph, inputs, loss, grads

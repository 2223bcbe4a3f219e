"""Continuous batching: requests join the running batch between steps and leave when they finish.

One thread runs the decoder's captured step over a persistent batch state of ``max_batch`` rows. Running
requests occupy its first rows; a step runs over the smallest power-of-two bucket that holds them (a view
of the state's first rows, so graphs captured for a bucket stay valid). Between steps the thread

1. drops finished and cancelled requests, moving the last running row into each freed row, so the
   running rows stay packed at the front and the bucket shrinks as the batch does;
2. admits waiting requests into free rows, each with its own prefill into its row of the cache. Where
   prefills replay CUDA graphs (a GPU), a joining request is prefilled alone in a one-row staging state on a
   side stream while the running rows go on stepping, and its row is copied into the batch once that prefill
   has run: the running rows wait for the copy only, not for the prefill (``_Lane.advance_admissions``;
   ``BatcherConfig.staging_rows`` such states let that many prefills be under way at once, and with
   ``BatcherConfig.prefill_ahead`` they are prefilled while every row still runs, each joining as a row frees);
3. runs one step for the bucket: the PPD tree step with the tree the decoder's batch policy names for
   that bucket, or the one-row step where the policy says speculation does not pay. On a GPU the thread
   runs one step ahead, as ``decoding.loop.decode`` does: it queues the next step before it reads the last
   one's report, so rows learnt finished from a report leave one step late (the step between changes nothing
   they report) and a joining request waits until the queued step's report is read.

Greedy requests decode exactly the tokens they would decode alone: rows never see each other (each row
attends only to its own cache), and which tree verifies a row changes only how many tokens a step emits,
never which. ``ppd`` and ``baseline`` requests run in separate lanes (one state each) whose steps
alternate.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .. import compile_cache
from ..config import CaptureMode, DecodeConfig, DecodeMethod, env_choice, env_count
from ..decoding.graphs import captures_graphs, compiles_prefill, resolve_mode
from ..decoding.loop import batch_bucket, prefill, queue_step, reset_rows, runs_ahead, steps_to_prepare, whole_width
from ..decoding.prefill_graphs import warm_prompt_lengths
from ..decoding.state import REASONS, REPORT_HEAD, RUNNING, DecodeState
from ..decoding.step import StepKind
from ..decoding.streams import ordered_on, own_stream
from ..downloads import Download
from .heap import CollectionWatch, freeze_heap, thaw_heap
from .stream import EngineClosedError, QueueFullError, Stream

if TYPE_CHECKING:
    from ..decoder import Decoder

logger = logging.getLogger(__name__)

ADMISSIONS_ENV = "PPD_ADMISSIONS"
ADMISSIONS = ("after_step", "before_step")  # BatcherConfig.admissions: the first is the default
BACKLOG_ENV = "PPD_BACKLOG"
BACKLOGS = ("beside", "waited")  # BatcherConfig.backlog: the first is the default
PREFILL_PRIORITY_ENV = "PPD_PREFILL_PRIORITY"
PREFILL_PRIORITIES = ("normal", "high")  # BatcherConfig.prefill_priority: the first is the default
STAGING_ROWS_ENV = "PPD_STAGING_ROWS"
PREFILL_AHEAD_ENV = "PPD_PREFILL_AHEAD"


@dataclass
class BatcherConfig:
    max_batch: int = 64  # rows of each lane's state: requests that decode at once
    max_queue: int = 256  # requests that may wait for a row; past that ``submit`` raises QueueFullError
    capture: CaptureMode = CaptureMode.AUTO
    # Where prefills replay graphs on a GPU: a joining request's prefill runs on a side stream, beside the running
    # rows' steps; False queues it on their stream, between two steps (the host waits for neither; for comparison).
    prefill_beside: bool = True
    # Freeze the heap the load and warm-up built when the thread starts (``serving.heap``), so that the garbage
    # collector's full passes stop walking it; thawed again at close. False leaves the collector alone.
    freeze_heap: bool = True
    # With a staging row: when a lane's step first looks for a joining request's prefill that has run, and starts
    # the next one. ``after_step`` (the default) queues the next step first, so the host's admission work never
    # keeps the device waiting, and the joined row takes part in the step after; ``before_step`` admits first, so
    # the row takes part in the step queued now and the next prefill starts a step earlier, beside the step in
    # flight. Default from $PPD_ADMISSIONS.
    admissions: str = field(default_factory=lambda: env_choice(ADMISSIONS_ENV, ADMISSIONS, ADMISSIONS[0]))
    # With a staging row: how a backlog of joining requests is admitted. ``beside``: each prefill runs beside the
    # running rows' steps, one request at a time, and joins once a later step finds it done (an H100 at batch 16,
    # h100/v32: 4-5 steps in flight, 6-7 waiting for the staging row, a burst at the start included). ``waited``:
    # while the lane runs fewer rows than requests are joining it (a burst, a server's start), the host waits for
    # each prefill and joins it at once, so the batch fills in the prefills' own time; past that, as ``beside``.
    # Default from $PPD_BACKLOG.
    backlog: str = field(default_factory=lambda: env_choice(BACKLOG_ENV, BACKLOGS, BACKLOGS[0]))
    # The side stream's priority on a GPU: ``high`` lets the joining request's prefill kernels take the device's
    # free blocks before the running rows' step kernels queued beside them (a shorter admission, slower steps while
    # it runs). Default from $PPD_PREFILL_PRIORITY.
    prefill_priority: str = field(default_factory=lambda: env_choice(PREFILL_PRIORITY_ENV, PREFILL_PRIORITIES,
                                                                     PREFILL_PRIORITIES[0]))

    # Staging rows a lane prefills joining requests in, each a one-row state with its own graphs: with more than
    # one, that many prefills may be under way at once (queued one after another on the side stream), so that a
    # lane whose rows finish faster than one prefill at a time refills them (h100/v33: at batch 32 each request
    # waited 62-69 steps for the one row under small trees). Default from $PPD_STAGING_ROWS, else 1.
    staging_rows: int = field(default_factory=lambda: env_count(STAGING_ROWS_ENV, 1))
    # With staging rows: take joining requests from the queue, and prefill them, while every row of the lane still
    # runs, up to one per staging row, so that each joins the moment a row frees instead of starting its prefill
    # then (the rows a step leaves empty cost ppd, whose requests live fewer steps, more than the baseline). Each
    # still gets its first token when it joins. Default from $PPD_PREFILL_AHEAD (0 or 1), else off.
    prefill_ahead: bool = field(default_factory=lambda: env_choice(PREFILL_AHEAD_ENV, ("0", "1"), "0") == "1")

    def __post_init__(self) -> None:
        self.capture = CaptureMode(self.capture)
        if self.staging_rows < 1:
            raise ValueError(f"staging_rows must be >= 1, got {self.staging_rows}")
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {self.max_batch}")
        if self.max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {self.max_queue}")
        for name, choices in (("admissions", ADMISSIONS), ("backlog", BACKLOGS),
                              ("prefill_priority", PREFILL_PRIORITIES)):
            if getattr(self, name) not in choices:
                raise ValueError(f"{name} must be one of {', '.join(choices)}, got {getattr(self, name)!r}")


class ContinuousBatcher:
    """Decodes every submitted request with ``decoder`` in one shared, continuously refilled batch.

    Use as a context manager (or call :meth:`start` and :meth:`close`). :meth:`submit` returns a
    :class:`~ppd.serving.stream.Stream` at once; it raises ``PromptTooLongError`` / ``ValueError`` for a
    request that cannot run and :class:`QueueFullError` when ``max_queue`` requests already wait.
    """

    def __init__(self, decoder: "Decoder", config: BatcherConfig | None = None):
        self.decoder = decoder
        self.config = config or BatcherConfig()
        self.mode = resolve_mode(self.config.capture, decoder.device)
        self._exact = not captures_graphs(self.mode)
        self._whole = whole_width(decoder, self.mode)
        self._compiled_prefill = compiles_prefill(self.mode, decoder.device)
        self._runner = decoder.runner(self.mode)
        self._lanes: dict[DecodeMethod, _Lane] = {}
        self._waiting: collections.deque[_Pending] = collections.deque()
        self._cond = threading.Condition()
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._admitting = 0  # requests taken from the queue whose prefill has not reported yet
        self.steps_run = 0  # forward passes of every lane so far, prefills included
        self.batch_steps = 0  # of them, the steps over a lane's running rows (its admissions' prefills not)
        self.admission_steps = AdmissionSteps()  # where joining requests spent their lane's steps (staging row)
        self.error: BaseException | None = None
        self._collections: CollectionWatch | None = None  # while the thread runs: logs slow collections

    # ------------------------------------------------------------------ life cycle
    def __enter__(self) -> "ContinuousBatcher":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> "ContinuousBatcher":
        if self._thread is None:
            if self.config.freeze_heap:
                freeze_heap()
            self._collections = CollectionWatch().start()
            self._thread = threading.Thread(target=self._run, name="ppd-batcher", daemon=True)
            self._thread.start()
        return self

    def close(self) -> None:
        """Stop the thread; requests still waiting or running end with :class:`EngineClosedError`."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        if self._collections is not None:
            self._collections.stop()
            self._collections = None
            if self.config.freeze_heap:
                thaw_heap()

    def warmup(self, methods: tuple[str, ...] | None = None, greedy: bool = True) -> float:
        """Capture (and compile) ahead of time the steps of every bucket up to ``max_batch`` for these
        methods (default: ``ppd`` where the decoder has prompt tokens, and ``baseline``). Call before
        :meth:`start` or while nothing runs. Returns the seconds it took (nothing to do on a CPU)."""
        if self.mode is CaptureMode.EAGER:
            return 0.0
        if self.running or self.waiting:
            raise RuntimeError("warm the batcher up before it serves requests")
        start = time.perf_counter()
        compile_cache.load()  # PPD_COMPILE_CACHE: what other processes compiled
        methods = methods or (("ppd", "baseline") if self.decoder.tables is not None else ("baseline",))
        for method in methods:
            lane = self._lane(DecodeMethod(method))
            bucket = 1
            while bucket <= self._bucket(self.config.max_batch):
                tables = lane.tables(bucket)
                view = lane.view(bucket)
                if not lane.state.kv.allocated:
                    lane.allocate()
                    if lane.staging is not None:
                        lane.warm_prefills()
                for tree, widths in steps_to_prepare(self.decoder, tables, bucket, view.capacity, self._whole):
                    with torch.no_grad():
                        self._runner.prepare(tables if tree else None, lane.prompt_embeds(tables if tree else None),
                                             view, StepKind(tree=tree, greedy=greedy), widths)
                bucket *= 2
        compile_cache.save()
        return time.perf_counter() - start

    # ------------------------------------------------------------------ requests
    @property
    def running(self) -> int:
        """Requests decoding now (taken from the queue, not yet finished)."""
        return self._admitting + sum(lane.occupied - len(lane.rows) + sum(not row.done for row in list(lane.rows))
                                     for lane in list(self._lanes.values()))

    @property
    def cache_bytes(self) -> int:
        """Bytes of every lane's KV cache allocated so far (each holds ``max_batch`` rows of the decoder's
        whole ``capacity``)."""
        return sum(b.numel() * b.element_size() for lane in self._lanes.values() for b in lane.state.kv.buffers())

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def submit(self, prompt_ids: list[int], config: DecodeConfig | None = None) -> Stream:
        """Queue a request; returns its stream at once. Raises ``PromptTooLongError`` (a ``ValueError``) for a
        prompt that leaves no room in the cache, ``ValueError`` for an impossible request,
        :class:`QueueFullError` when ``max_queue`` requests already wait, :class:`EngineClosedError` after
        :meth:`close`."""
        config = config or DecodeConfig()
        ids = [int(i) for i in prompt_ids]
        if not ids:
            raise ValueError("the prompt needs at least one token")
        if config.method is DecodeMethod.PPD and self.decoder.prompt_tokens is None:
            raise ValueError("method 'ppd' needs prompt tokens (an adapter); use method 'baseline' without one")
        self.decoder.check_prompt_fits(len(ids))
        with self._cond:
            if self._closed:
                raise EngineClosedError("the batcher is closed")
            if len(self._waiting) >= self.config.max_queue:
                raise QueueFullError(f"{len(self._waiting)} requests are already waiting (max_queue "
                                     f"{self.config.max_queue}); try again later")
            stream = Stream(next(self._ids), len(ids), config.method.value)
            self._waiting.append(_Pending(stream, ids, config))
            self._cond.notify_all()
        return stream

    # ------------------------------------------------------------------ the batcher thread
    def _bucket(self, size: int) -> int:
        return batch_bucket(size, self._exact)

    def _lane(self, method: DecodeMethod) -> "_Lane":
        if method not in self._lanes:
            self._lanes[method] = _Lane(self, method)
        return self._lanes[method]

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._closed and not self._waiting and not any(
                            lane.occupied for lane in self._lanes.values()):
                        self._cond.wait()
                    if self._closed:
                        break
                    joining = self._take_joining()
                    self._admitting = sum(len(p) for p in joining.values())
                for lane in list(self._lanes.values()):
                    lane.drop_cancelled()
                for method, pending in joining.items():
                    self._lanes[method].admit(pending)
                    self._admitting -= len(pending)
                for lane in list(self._lanes.values()):
                    if not lane.rows:  # else the step starts admissions once its next step is queued
                        lane.advance_admissions()
                    if lane.rows:
                        lane.step()
        except BaseException as error:  # noqa: BLE001 - every request must learn that the engine died
            logger.exception("the batcher stopped")
            self.error = error
            with self._cond:
                self._closed = True
        finally:
            closed = EngineClosedError("the batcher was closed")
            if self.error is not None:
                closed = EngineClosedError(f"the batcher stopped: {self.error!r}")
                closed.__cause__ = self.error
            self._admitting = 0
            with self._cond:
                for pending in self._waiting:
                    pending.stream._finish("cancelled", error=closed)
                self._waiting.clear()
            for lane in self._lanes.values():
                for stream in lane.admitting_streams():
                    stream._finish("cancelled", error=closed)
                for row in lane.rows:
                    row.stream._finish("cancelled", error=closed)
                lane.rows.clear()
                lane.joining.clear()
                lane.flights.clear()

    def _take_joining(self) -> dict[DecodeMethod, list["_Pending"]]:
        """Waiting requests that fit their lane's free rows, in arrival order (called under the lock);
        requests cancelled while waiting end here."""
        joining: dict[DecodeMethod, list[_Pending]] = {}
        kept: collections.deque[_Pending] = collections.deque()
        for pending in self._waiting:
            if pending.stream.cancelled:
                pending.stream._end_cancelled()
                continue
            lane = self._lane(pending.config.method)
            if len(joining.get(lane.method, [])) < lane.holds - lane.occupied:
                joining.setdefault(lane.method, []).append(pending)
            else:
                kept.append(pending)
        self._waiting = kept
        return joining


@dataclass
class AdmissionSteps:
    """Where requests that joined through a staging row spent their lane's steps: waiting for the staging row
    (``waiting``: from being taken from the queue to their prefill's launch) and with their prefill in flight
    there (``in_flight``: from its launch to the copy of their row into the batch; with ``prefill_ahead`` this
    includes the steps a prefilled request waits for a row to free), summed over ``admissions``."""

    admissions: int = 0
    waiting: int = 0
    in_flight: int = 0

    def means(self) -> dict:
        n = max(self.admissions, 1)
        return {"admissions": self.admissions, "waiting": self.waiting / n, "in_flight": self.in_flight / n}


@dataclass
class _Pending:
    stream: Stream
    ids: list[int]
    config: DecodeConfig
    taken_at: int = 0  # its lane's steps queued when it was taken from the queue


@dataclass
class _Flight:
    """A joining request whose prefill in a staging row is queued: its report's download says when it has run."""

    pending: _Pending
    report: Download
    launched_at: int  # its lane's steps queued when its prefill was
    slot: int = 0  # its staging row


@dataclass
class _Row:
    stream: Stream
    config: DecodeConfig
    length: int = 0  # committed cache entries, as of the last report
    done: bool = False


@dataclass
class _Lane:
    """The rows of one method: a state of ``max_batch`` rows whose first ``len(rows)`` are running."""

    batcher: ContinuousBatcher
    method: DecodeMethod
    rows: list[_Row] = field(default_factory=list)
    # Steps queued whose reports are not read yet, each with the rows it ran (in their order then).
    queued: collections.deque = field(default_factory=collections.deque)
    # With staging rows: requests taken from the queue for this lane and not prefilled yet, and those whose prefill
    # in a staging row is under way (their rows not copied into the batch yet), in the order they were launched.
    joining: collections.deque = field(default_factory=collections.deque)
    flights: collections.deque = field(default_factory=collections.deque)
    steps: int = 0  # steps queued over its rows so far

    def __post_init__(self) -> None:
        decoder = self.batcher.decoder
        self.use_ppd = self.method is DecodeMethod.PPD
        self.state: DecodeState = decoder._new_state(self.batcher._bucket(self.batcher.config.max_batch))
        reset_rows(decoder, self.state, [], DecodeConfig())  # every row starts as finished padding
        self._views: dict[int, DecodeState] = {}
        # Where prefills replay CUDA graphs (``decoding.prefill_graphs``), a joining request is prefilled alone
        # into a one-row staging state, whose graphs serve every admission through it, and its row copied into
        # the batch: a graph made for the batch's own rows would serve only the rows it was captured at.
        graphs = self.batcher._runner.prefill_graphs
        config = self.batcher.config
        self.staging: list[DecodeState] | None = (
            [decoder._new_state(1) for _ in range(config.staging_rows)]
            if graphs is not None and not self.batcher._compiled_prefill else None)
        # On a GPU the staging rows' prefills run on a stream of their own, beside the running rows' steps; a
        # staging row's event says when the last row copied out of it has been copied (it may be written again).
        priority = -1 if config.prefill_priority == "high" else 0  # CUDA: the lower number runs first
        self.side: torch.cuda.Stream | None = (own_stream(decoder.device, priority=priority)
                                               if self.staging is not None and decoder.device.type == "cuda"
                                               and config.prefill_beside else None)
        self._staging_free: list[torch.cuda.Event | None] = [None] * config.staging_rows

    @property
    def occupied(self) -> int:
        """The rows its running and joining requests take (or will); safe to read from another thread."""
        return len(self.rows) + len(self.joining) + len(self.flights)

    @property
    def holds(self) -> int:
        """The requests it takes from the queue at most: a row each, and with ``prefill_ahead`` one more in each
        staging row while every row runs."""
        config = self.batcher.config
        return config.max_batch + (len(self.staging) if config.prefill_ahead and self.staging is not None else 0)

    def admitting_streams(self) -> list[Stream]:
        """The streams of the requests joining this lane (not in a row yet)."""
        return [p.stream for p in list(self.joining)] + [f.pending.stream for f in list(self.flights)]

    @property
    def advance(self) -> int:
        """The most cache entries one step commits to a row (its report's token columns)."""
        return self.state.report.shape[1] - REPORT_HEAD

    def view(self, bucket: int) -> DecodeState:
        """The state's first ``bucket`` rows; the same object each time (graphs are keyed by it)."""
        if bucket not in self._views:
            self._views[bucket] = self.state.rows(0, bucket)
        return self._views[bucket]

    def tables(self, bucket: int):
        return self.batcher.decoder.tables_for(bucket) if self.use_ppd else None

    def prompt_embeds(self, tables):
        return self.batcher.decoder.prompt_embeds(tables) if tables is not None else None

    def allocate(self) -> None:
        """Allocate the cache with a prefill into the first row, left as padding; where prefills run compiled,
        this compiles them for a single row, and one of two rows (where the batch holds two) for several."""
        batcher = self.batcher
        sizes = [1, 2] if batcher._compiled_prefill and batcher.config.max_batch >= 2 else [1]
        with torch.no_grad():
            for n in sizes:
                view = self.view(n)
                reset_rows(batcher.decoder, view, [2] * n, DecodeConfig(max_new_tokens=1, stop_on_eos=False))
                prefill(batcher.decoder, [[0, 0]] * n, view, self.use_ppd, StepKind(tree=False),
                        batcher._compiled_prefill)
            for row in range(max(sizes)):
                self.state.vacate(row)
            for staging in self.staging or []:  # its first prefill allocates its cache (eagerly)
                self.prefill_alone(staging, [0, 0], DecodeConfig(max_new_tokens=1, stop_on_eos=False))

    def prefill_alone(self, staging: DecodeState, ids: list[int], config: DecodeConfig) -> None:
        """Reset a staging row for one request and prefill it there (through a graph where one is captured or
        fits): the row then holds everything the request's row of the batch needs."""
        decoder = self.batcher.decoder
        reset_rows(decoder, staging, [len(ids)], config)
        prefill(decoder, [ids], staging, self.use_ppd, StepKind.of(False, [config]),
                graphs=self.batcher._runner.prefill_graphs)

    def warm_prefills(self) -> None:
        """Capture each staging row's prefill graph at every width bucket (no request waits on a capture), on the
        stream that will replay them: the side stream captures them itself, into a memory pool of its own
        (``prefill_graphs``), so that no prefill shares a cuBLAS workspace or memory with the steps beside it."""
        decoder = self.batcher.decoder
        rows = decoder.prompt_tokens.config.num_rows if self.use_ppd else 0
        with torch.no_grad():
            for staging in self.staging:  # the whole cache, here: allocated on this stream, which copies from it
                staging.kv.reserve(staging.kv.capacity)
            with ordered_on(self.side) if self.side is not None else contextlib.nullcontext():
                for staging in self.staging:
                    for length in warm_prompt_lengths(rows, 1, staging.capacity, decoder.capacity):
                        self.prefill_alone(staging, [0] * length, DecodeConfig(max_new_tokens=1, stop_on_eos=False))

    def admit(self, joining: list[_Pending]) -> None:
        """Take the joining requests into the rows after the running ones. Without staging rows they are
        prefilled there together, now; with them (prefills replayed from graphs) they join one by one through
        them (:meth:`advance_admissions`)."""
        if self.staging is not None:
            for pending in joining:
                pending.taken_at = self.steps
            self.joining.extend(joining)
            return
        decoder = self.batcher.decoder
        self.drain()
        start = len(self.rows)
        with torch.no_grad():
            for pending in joining:
                pending.stream._started_now()
            view = self.state.rows(start, start + len(joining))
            for i, pending in enumerate(joining):
                # Reset alone, as a request of one row: its seed (and so its samples) are those it has alone.
                reset_rows(decoder, self.state.rows(start + i, start + i + 1), [len(pending.ids)], pending.config)
            kind = StepKind.of(False, [p.config for p in joining])
            prefill(decoder, [p.ids for p in joining], view, self.use_ppd, kind, self.batcher._compiled_prefill)
            report = view.report.tolist()
        self.batcher.steps_run += 1
        for pending, line in zip(joining, report):
            row = _Row(pending.stream, pending.config)
            self.rows.append(row)
            self._deliver(row, line, counts_as_step=False)
        self._remove_finished()

    def advance_admissions(self) -> None:
        """With staging rows: start the prefills of joining requests in the staging rows free, and copy each
        request whose prefill has run into the batch, in the order they started. While rows run (on a GPU), the
        prefills run on the side stream and this returns at once, to be called again after the next step; with no
        row running (or, with ``BatcherConfig.backlog`` ``waited``, fewer rows running than requests joining), each
        admission is waited for."""
        if self.staging is None:
            return
        waits_for_backlog = self.batcher.config.backlog == "waited"
        while True:
            while self.joining and (slot := self.free_staging_row()) is not None:
                pending = self.joining.popleft()
                if pending.stream.cancelled:
                    pending.stream._end_cancelled()
                    continue
                self.flights.append(self._launch(pending, slot))
            self._drop_cancelled_flights()
            if not self.flights or len(self.rows) == self.batcher.config.max_batch:  # (prefilled ahead: no row yet)
                return
            backlog = len(self.joining) + len(self.flights)  # the requests in flight and those after them
            waited = not self.rows or (waits_for_backlog and len(self.rows) < backlog)
            if not waited and not self.flights[0].report.ready():
                return
            self._join(self.flights.popleft())

    def _drop_cancelled_flights(self) -> None:
        """End the requests cancelled while their prefill was under way, once it has run, and free their staging
        rows: such a request never joins (with ``prefill_ahead`` it might otherwise hold its staging row until a row
        of the batch frees). The next prefill in that staging row is queued after this one on the same stream."""
        for flight in [f for f in self.flights if f.pending.stream.cancelled and f.report.ready()]:
            self.flights.remove(flight)
            flight.pending.stream._end_cancelled()

    def free_staging_row(self) -> int | None:
        """The first staging row no prefill under way holds, or None."""
        held = {flight.slot for flight in self.flights}
        return next((slot for slot in range(len(self.staging)) if slot not in held), None)

    def _launch(self, pending: _Pending, slot: int) -> "_Flight":
        """Queue the request's prefill in staging row ``slot`` (on the side stream, once the last row copied out of
        it has been) and the download of its report."""
        pending.stream._started_now()
        with torch.no_grad():
            if not self.state.kv.allocated:
                self.allocate()
            if self.side is not None:  # after the warm-up's (or allocation's) prefills, then after the last copy
                if self._staging_free[slot] is None:
                    self.side.wait_stream(torch.cuda.current_stream(self.side.device))
                else:
                    self.side.wait_event(self._staging_free[slot])
            with torch.cuda.stream(self.side) if self.side is not None else contextlib.nullcontext():
                self.prefill_alone(self.staging[slot], pending.ids, pending.config)
                return _Flight(pending, Download(self.staging[slot].report[:1]), launched_at=self.steps, slot=slot)

    def _join(self, flight: "_Flight") -> None:
        """Copy the staging row of a prefill that has run into the row after the running ones (queued after the
        steps before it, so it overwrites whatever they left in that padding row), free the staging row, and give
        the request its first token."""
        pending, length = flight.pending, len(flight.pending.ids)
        stats = self.batcher.admission_steps
        stats.admissions += 1
        stats.waiting += flight.launched_at - pending.taken_at
        stats.in_flight += self.steps - flight.launched_at
        with torch.no_grad():
            flight.report.order_after()
            self.state.kv.reserve(length)
            # every per-row buffer, the cache
            self.state.copy_row_from(self.staging[flight.slot], 0, len(self.rows), length)
            if self.side is not None:
                self._staging_free[flight.slot] = torch.cuda.Event()
                self._staging_free[flight.slot].record(torch.cuda.current_stream(self.side.device))
        line = flight.report.wait()[0].tolist()
        self.batcher.steps_run += 1
        row = _Row(pending.stream, pending.config)
        self.rows.append(row)
        self._deliver(row, line, counts_as_step=False)
        self._remove_finished()

    def step(self) -> None:
        """One step of every running row over the smallest bucket that holds them. Where the decoder runs ahead
        (``decoding.loop.runs_ahead``: on a GPU), the next step is queued before this one's report is read, as
        :func:`~ppd.decoding.loop.decode` does, so the device never waits for the host's bookkeeping."""
        batcher = self.batcher
        depth = 2 if runs_ahead(batcher.decoder.device) else 1
        if batcher.config.admissions == "before_step":
            self.advance_admissions()  # a row joined now takes part in the step queued next
        while len(self.queued) < depth:
            n = len(self.rows)
            bucket = batcher._bucket(n)
            view = self.view(bucket)
            # The lengths known are those before the queued steps, each of which may commit ``advance`` more.
            longest = max(row.length for row in self.rows) + len(self.queued) * self.advance
            queue_step(batcher.decoder, batcher._runner, view, self.tables(bucket), longest,
                       StepKind.of(False, [row.config for row in self.rows]), batcher._exact, batcher._whole)
            batcher.steps_run += 1
            batcher.batch_steps += 1
            self.steps += 1
            # The rows as they stand when the step is queued: removals move rows before its report is read.
            self.queued.append((Download(view.report[:n]), list(self.rows)))
        self.advance_admissions()  # a prefill started now runs beside the steps just queued
        self._read_step()
        if not self.rows:  # a step queued after the last row stopped changed nothing a row reports
            self.queued.clear()

    def drain(self) -> None:
        """Read the report of every queued step (before an admission prefills rows and reads its own)."""
        while self.queued:
            self._read_step()
        if not self.rows:
            self.queued.clear()

    def _read_step(self) -> None:
        download, rows = self.queued.popleft()
        for row, line in zip(rows, download.wait().tolist()):
            self._deliver(row, line, counts_as_step=True)
        self._remove_finished()

    def drop_cancelled(self) -> None:
        for row in self.rows:
            if row.stream.cancelled and not row.done:
                row.done = True
                row.stream._end_cancelled()
        self._remove_finished()

    def _deliver(self, row: _Row, line: list[int], counts_as_step: bool) -> None:
        if row.done:
            return
        count, guessed, reason, length = line[0], line[1], line[2], line[3]
        row.length = length
        finish = REASONS.get(reason) if reason != RUNNING else None
        row.stream._push(line[REPORT_HEAD: REPORT_HEAD + count], guessed, finish, counts_as_step)
        if finish is not None:
            row.done = True

    def _remove_finished(self) -> None:
        """Free the rows of finished requests, moving the last running rows into them (rows stay packed)."""
        i = 0
        while i < len(self.rows):
            if not self.rows[i].done:
                i += 1
                continue
            last = len(self.rows) - 1
            if i != last:
                moved = self.rows[last]
                # Steps still queued run before the move and may each commit ``advance`` entries to the row.
                self.state.move_row(last, i, moved.length + len(self.queued) * self.advance)
                self.rows[i] = moved
            self.state.vacate(last)
            self.rows.pop()

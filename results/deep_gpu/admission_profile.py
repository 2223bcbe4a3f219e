"""What one request joining the continuous batcher costs, phase by phase, on a warmed-up engine (no HTTP).

The load benchmark's chunk gaps (``admission_gaps.py`` on ``h200/v22/load_bfloat16.json.gz``) say that on an H200
each admission stalled the running rows 7.5-9.6 ms, 27-38% of the time at 16 clients, where the prefill's own
device work is a few milliseconds. This finds out where the rest goes. ``--max_batch`` - 1 requests keep that many
rows running (long greedy answers that ignore EOS), and ``--admissions`` requests of one new token (the prefill's
own) join one at a time, each waited for before the next is sent. Each admission (``_Lane.admit``) is timed on the
host as a whole and by phase:

- ``drain``: reading the reports of the steps queued before it (the batcher runs one step ahead on a GPU);
- ``reset_rows``: the staging row's per-row buffers set for the request (host-to-device copies);
- ``prefill``: its prefill, replayed from a CUDA graph where one is captured, with the first token and guesses;
- ``copy_row_from``: the staging row copied into the batch (every per-row buffer, the cache slots layer by layer);
- ``remove_finished``: the finished request's row freed (and the last row moved into it);
- the rest (``other``): the admission's report read back, bookkeeping.

By default the phases run as the server runs them (a phase's time is then its host time, and the device work it
queued may fall into a later phase that waits for it); with ``--sync`` the device is synchronised around each phase,
so each phase's time includes its own device work. The running rows' steps are timed too (the median step, and the
host time between the last step before an admission and the first after it). ``--profile`` adds torch's profiler
over a few admissions: the operators with the most host time and the kernels with the most device time.

    python results/deep_gpu/admission_profile.py --dtype bfloat16 --capture compiled_graph --max_seq_len 1024 \\
        --max_batch 16 --admissions 40 [--sync] [--profile] --output results/deep_gpu/h200/vNN/admission.json
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import threading
import time

import torch

from eval.benchmarks import load_benchmark
from eval.records import environment, write_json
from ppd.chat import chat_input_ids
from ppd.cli import add_adapter_args, add_engine_args, add_model_args, load_decoder_or_exit
from ppd.config import DecodeConfig
from ppd.decoding.state import DecodeState
from ppd.serving import batcher as batcher_module
from ppd.serving.batcher import BatcherConfig, ContinuousBatcher

PHASES = ("drain", "reset_rows", "prefill", "copy_row_from", "remove_finished")
ADMISSION = "ppd.admission"  # the profiler's label of each admission


class AdmissionClock:
    """Times ``_Lane.admit`` and its phases (``PHASES``, host seconds; with ``sync``, the device synchronised
    around each), and the lane's steps, by patching them for the ``with`` block."""

    def __init__(self, device: torch.device, sync: bool, profiler=None, profiled: int = 0):
        self.sync = sync and device.type == "cuda"
        # torch's profiler, started in the batcher's thread (it records the operators of the thread that starts it)
        # at the first admission and stopped after ``profiled`` of them
        self.profiler, self.profiled = profiler, profiled
        self._profiling = False
        self.requests = 0  # requests admitted so far (several may join in one admission)
        self._inside = threading.Event()  # set while the batcher's thread is in an admission
        self.device = device
        self.admissions: list[dict[str, float]] = []
        self.steps: list[float] = []
        self.step_ends: list[float] = []
        self.admit_spans: list[tuple[float, float]] = []
        self._current: dict[str, float] | None = None  # the phases' seconds of the admission under way
        self._phase: str | None = None  # the phase under way
        self._stack = contextlib.ExitStack()

    def _wait(self) -> None:
        if self.sync:
            torch.cuda.synchronize(self.device)

    def _timed(self, owner, name: str, phase: str) -> None:
        real = getattr(owner, name)
        clock = self

        def timed(*args, **kwargs):
            # outside an admission, or inside another phase (the row move of ``remove_finished`` copies a row):
            # the outer phase's time holds it, so that the phases add up to no more than the admission
            if clock._current is None or clock._phase is not None:
                return real(*args, **kwargs)
            clock._wait()
            clock._phase = phase
            start = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                clock._wait()
                clock._phase = None
                clock._current[phase] = clock._current.get(phase, 0.0) + time.perf_counter() - start

        setattr(owner, name, timed)
        self._stack.callback(setattr, owner, name, real)

    def __enter__(self) -> "AdmissionClock":
        lane = batcher_module._Lane
        real_admit, real_step = lane.admit, lane.step
        clock = self

        def admit(lane_self, joining):
            if clock.profiler is not None and not clock.admissions:
                clock.profiler.start()
                clock._profiling = True
            clock._inside.set()
            clock._wait()
            clock._current = {}
            start = time.perf_counter()
            try:
                with torch.profiler.record_function(ADMISSION):
                    return real_admit(lane_self, joining)
            finally:
                clock._wait()
                end = time.perf_counter()
                clock.requests += len(joining)
                if clock._profiling and clock.requests >= clock.profiled:
                    clock.profiler.stop()
                    clock._profiling = False
                phases, clock._current = clock._current, None
                phases["other"] = (end - start) - sum(phases.values())
                phases["total"] = end - start
                clock.admissions.append(phases)
                clock.admit_spans.append((start, end))
                clock._inside.clear()

        def step(lane_self):
            start = time.perf_counter()
            try:
                return real_step(lane_self)
            finally:
                end = time.perf_counter()
                clock.steps.append(end - start)
                clock.step_ends.append(end)

        lane.admit, lane.step = admit, step
        self._stack.callback(setattr, lane, "admit", real_admit)
        self._stack.callback(setattr, lane, "step", real_step)
        self._timed(lane, "drain", "drain")
        self._timed(batcher_module, "reset_rows", "reset_rows")
        self._timed(batcher_module, "prefill", "prefill")
        self._timed(DecodeState, "copy_row_from", "copy_row_from")
        self._timed(lane, "_remove_finished", "remove_finished")
        return self

    def __exit__(self, *exc) -> None:
        # a request's result arrives while its admission is still running in the batcher's thread: let it end
        deadline = time.perf_counter() + 30
        while self._inside.is_set() and time.perf_counter() < deadline:
            time.sleep(0.001)
        self._stack.close()
        if self._profiling:
            raise RuntimeError(f"the profiler saw {self.requests} of the {self.profiled} requests it was to see")
        self.requests = 0  # requests admitted so far (several may join in one admission)
        self._inside = threading.Event()  # set while the batcher's thread is in an admission

    def summary(self, skip: int) -> dict:
        """Median milliseconds of each phase over the admissions after the first ``skip``, and of the steps."""
        kept = self.admissions[skip:]
        phases = {name: round(1e3 * statistics.median(a.get(name, 0.0) for a in kept), 3)
                  for name in (*PHASES, "other", "total")} if kept else {}
        # the running rows' wait: from the end of the last step before an admission to the end of the first after
        waits = []
        for start, end in self.admit_spans[skip:]:
            before = [t for t in self.step_ends if t <= start]
            after = [t for t in self.step_ends if t > end]
            if before and after:
                waits.append(after[0] - before[-1])
        return {"admissions": len(kept), "median_ms": phases,
                "step_median_ms": round(1e3 * statistics.median(self.steps), 3) if self.steps else None,
                "rows_wait_median_ms": round(1e3 * statistics.median(waits), 3) if waits else None}


def profile_table(prof, device: torch.device, top: int = 25) -> dict:
    """The operators with the most host time inside the admissions (``ADMISSION`` spans), and, on a GPU, the kernels
    with the most device time over the whole window (the running rows' steps between the admissions included)."""
    events = prof.events()
    spans = [(e.time_range.start, e.time_range.end) for e in events if e.name == ADMISSION]
    host: dict[str, list[float]] = {}
    for e in events:
        if e.name != ADMISSION and any(a <= e.time_range.start < b for a, b in spans):
            found = host.setdefault(e.name, [0, 0.0])
            found[0] += 1
            found[1] += e.self_cpu_time_total
    ranked = sorted(host.items(), key=lambda kv: kv[1][1], reverse=True)[:top]
    rows = {"admissions": len(spans),
            "host": [{"op": name, "calls": calls, "self_host_us": round(us, 1)} for name, (calls, us) in ranked]}
    if device.type == "cuda":
        kernels = sorted(prof.key_averages(), key=lambda e: getattr(e, "self_device_time_total", 0.0),
                         reverse=True)[:top]
        rows["device"] = [{"kernel": e.key[:160], "calls": e.count,
                           "self_device_us": round(getattr(e, "self_device_time_total", 0.0), 1)} for e in kernels]
    return rows


def run_admissions(batcher, ids_list, method: str, count: int) -> None:
    for i in range(count):
        stream = batcher.submit(ids_list[i % len(ids_list)], DecodeConfig(method=method, max_new_tokens=1,
                                                                        stop_on_eos=False))
        stream.result(timeout=120)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(parser)
    add_adapter_args(parser)
    add_engine_args(parser)
    parser.add_argument("--max_batch", type=int, default=16, help="rows of the batcher; all but one keep running")
    parser.add_argument("--admissions", type=int, default=40, help="timed admissions per method")
    parser.add_argument("--methods", nargs="+", default=["ppd", "baseline"], choices=["ppd", "baseline"])
    parser.add_argument("--sync", action="store_true", help="synchronise the device around each phase")
    parser.add_argument("--profile", action="store_true",
                        help="torch's profiler over 10 admissions more (their operators' host time, the kernels' "
                             "device time)")
    parser.add_argument("--output", required=True)
    args = parser.parse_args(argv)
    if args.max_batch < 2:
        parser.error("--max_batch must be >= 2: one row joins while the others run")
    loaded = load_decoder_or_exit(args)
    decoder, tokenizer = loaded.decoder, loaded.tokenizer
    questions = load_benchmark("mt_bench")
    ids_list = [chat_input_ids(tokenizer, [{"role": "user", "content": q.turns[0]}]) for q in questions]
    batcher = ContinuousBatcher(decoder, BatcherConfig(max_batch=args.max_batch, capture=args.capture))
    warmup_s = batcher.warmup()  # the seconds it took
    results = []
    with batcher:
        for method in args.methods:
            running = [batcher.submit(ids_list[i], DecodeConfig(
                method=method, max_new_tokens=decoder.capacity - len(ids_list[i]) - 1, stop_on_eos=False))
                for i in range(args.max_batch - 1)]
            run_admissions(batcher, ids_list, method, 3)  # untimed: the running rows settle in
            with AdmissionClock(decoder.device, args.sync) as clock:
                run_admissions(batcher, ids_list, method, args.admissions)
            row = {"method": method, "max_batch": args.max_batch, "sync": args.sync, **clock.summary(skip=2)}
            if args.profile:
                from torch.profiler import ProfilerActivity, profile
                activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if decoder.device.type == "cuda"
                                                       else [])
                prof = profile(activities=activities)
                with AdmissionClock(decoder.device, False, prof, profiled=10):
                    run_admissions(batcher, ids_list, method, 10)
                row["profile"] = profile_table(prof, decoder.device)
            still = sum(not s.done for s in running)
            for s in running:
                s.cancel()
            for s in running:
                s.result(timeout=120)
            row["running_rows_left"] = still
            results.append(row)
            print(f"{method}: admission {row['median_ms'].get('total')} ms (median of {row['admissions']}; "
                  f"{', '.join(f'{k} {v}' for k, v in row['median_ms'].items() if k != 'total')}); step "
                  f"{row['step_median_ms']} ms; running rows waited {row['rows_wait_median_ms']} ms; "
                  f"{still} of {args.max_batch - 1} still running at the end", flush=True)
    write_json(args.output, {"command": " ".join(sys.argv), **environment(decoder.device), "warmup_s": warmup_s,
                             "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())

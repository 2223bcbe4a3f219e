"""What one request joining the continuous batcher costs, part by part, on a warmed-up engine (no HTTP).

``--max_batch`` - 1 requests keep that many rows running (long greedy answers that ignore EOS), and ``--admissions``
requests of one new token (the prefill's own) join one at a time, each waited for before the next is sent. Where
prefills replay CUDA graphs (a GPU), a request joins in two parts, each timed on the host as a whole and by phase:

- its launch (``_Lane._launch``), queued on the side stream while the running rows step:
  - ``reset_rows``: the staging row's per-row buffers set for the request (uploads);
  - ``prefill``: its prefill, replayed from a CUDA graph, with the first token, guesses and lookup history;
  - the rest (``other``): the report's download, bookkeeping;
- its join (``_Lane._join``), once the prefill has run:
  - ``copy_row_from``: the staging row copied into the batch (every per-row buffer and layer);
  - ``remove_finished``: the request, finished at its first token, leaving its row;
  - the rest: the report read, the first token given.

The running rows' steps (``_Lane.step``, which launches and joins between queuing a step and reading the oldest
report) are timed too: the median host time of a step with neither part in it, with a launch, with a join; and how
many steps ran while a prefill was in flight. By default everything runs as the server runs it (a phase's time is
its host time); with ``--sync`` the device is synchronised around each phase, so each includes its own device
work. ``--profile`` adds torch's profiler over a few admissions: the operators with the most host time inside
launches and joins, and the kernels with the most device time.

The twenty-sixth session's version timed the admission of that time, which drained the queued steps and
prefilled in line with them (``h200/v23/``: 8.9-10.9 ms an admission, 5.1-5.8 of it the prefill).

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

PARTS = {"launch": ("reset_rows", "prefill"), "join": ("copy_row_from", "remove_finished")}
LABELS = {part: f"ppd.{part}" for part in PARTS}  # the profiler's label of each part


class AdmissionClock:
    """Times ``_Lane._launch`` and ``_Lane._join`` and their phases (``PARTS``, host seconds; with ``sync``, the
    device synchronised around each), and the lane's steps, by patching them for the ``with`` block."""

    def __init__(self, device: torch.device, sync: bool, profiler=None, profiled: int = 0):
        self.sync = sync and device.type == "cuda"
        # torch's profiler, started in the batcher's thread (it records the operators of the thread that starts it)
        # at the first launch and stopped after ``profiled`` joins
        self.profiler, self.profiled = profiler, profiled
        self._profiling = False
        self.parts: dict[str, list[dict[str, float]]] = {part: [] for part in PARTS}
        self.steps: list[dict] = []  # each step's host seconds and what ran inside it
        self._current: dict[str, float] | None = None  # the phases' seconds of the part under way
        self._phase: str | None = None
        self._in_step: dict | None = None
        self._inside = threading.Event()  # set while the batcher's thread is in a launch or a join
        self._stack = contextlib.ExitStack()

    def _wait(self) -> None:
        if self.sync:
            torch.cuda.synchronize()

    def _timed_phase(self, owner, name: str, phase: str) -> None:
        real = getattr(owner, name)
        clock = self

        def timed(*args, **kwargs):
            # outside a part, or inside another phase (the row move of ``remove_finished`` copies a row): the
            # outer phase's time holds it, so that the phases add up to no more than the part
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

    def _timed_part(self, part: str) -> None:
        lane = batcher_module._Lane
        real = getattr(lane, f"_{part}")
        clock = self

        def timed(lane_self, *args):
            if part == "launch" and clock.profiler is not None and not clock._profiling and not clock.parts["join"]:
                clock.profiler.start()
                clock._profiling = True
            clock._inside.set()
            clock._wait()
            clock._current = {}
            start = time.perf_counter()
            try:
                with torch.profiler.record_function(LABELS[part]):
                    return real(lane_self, *args)
            finally:
                clock._wait()
                end = time.perf_counter()
                phases, clock._current = clock._current, None
                phases["other"] = (end - start) - sum(phases.values())
                phases["total"] = end - start
                phases["start"], phases["end"] = start, end
                clock.parts[part].append(phases)
                if clock._in_step is not None:
                    clock._in_step[part] = True
                if part == "join" and clock._profiling and len(clock.parts["join"]) >= clock.profiled:
                    clock.profiler.stop()
                    clock._profiling = False
                clock._inside.clear()

        setattr(lane, f"_{part}", timed)
        self._stack.callback(setattr, lane, f"_{part}", real)

    def __enter__(self) -> "AdmissionClock":
        lane = batcher_module._Lane
        real_step = lane.step
        clock = self

        def step(lane_self):
            clock._in_step = {"launch": False, "join": False, "in_flight": lane_self.flight is not None}
            start = time.perf_counter()
            try:
                return real_step(lane_self)
            finally:
                clock._in_step["seconds"] = time.perf_counter() - start
                clock.steps.append(clock._in_step)
                clock._in_step = None

        lane.step = step
        self._stack.callback(setattr, lane, "step", real_step)
        for part in PARTS:
            self._timed_part(part)
        self._timed_phase(batcher_module, "reset_rows", "reset_rows")
        self._timed_phase(batcher_module, "prefill", "prefill")
        self._timed_phase(DecodeState, "copy_row_from", "copy_row_from")
        self._timed_phase(lane, "_remove_finished", "remove_finished")
        return self

    def __exit__(self, *exc) -> None:
        # a request's result arrives while its join is still running in the batcher's thread: let it end
        deadline = time.perf_counter() + 30
        while self._inside.is_set() and time.perf_counter() < deadline:
            time.sleep(0.001)
        self._stack.close()
        if self._profiling:
            raise RuntimeError(f"the profiler saw {len(self.parts['join'])} of the {self.profiled} joins it was to see")

    def summary(self, skip: int) -> dict:
        """Median milliseconds of each part and phase over the admissions after the first ``skip``, and of the
        steps by what ran inside them."""
        def ms(values):
            return round(1e3 * statistics.median(values), 3) if values else None

        parts = {}
        for part, phases in PARTS.items():
            kept = self.parts[part][skip:]
            parts[part] = {name: ms([p.get(name, 0.0) for p in kept]) for name in (*phases, "other", "total")}
        launches, joins = self.parts["launch"][skip:], self.parts["join"][skip:]
        flights = [j["start"] - la["end"] for la, j in zip(launches, joins)]
        steps = {"neither": ms([s["seconds"] for s in self.steps if not (s["launch"] or s["join"])]),
                 "with_launch": ms([s["seconds"] for s in self.steps if s["launch"]]),
                 "with_join": ms([s["seconds"] for s in self.steps if s["join"]])}
        return {"admissions": len(joins), "median_ms": parts, "step_median_ms": steps,
                "flight_median_ms": ms(flights),
                "steps_while_in_flight": sum(s["in_flight"] for s in self.steps)}


def profile_table(prof, device: torch.device, top: int = 25) -> dict:
    """The operators with the most host time inside the launches and joins (``LABELS`` spans), and, on a GPU, the
    kernels with the most device time over the whole window (the running rows' steps included)."""
    events = prof.events()
    labels = set(LABELS.values())
    spans = [(e.time_range.start, e.time_range.end) for e in events if e.name in labels]
    host: dict[str, list[float]] = {}
    for e in events:
        if e.name not in labels and any(a <= e.time_range.start < b for a, b in spans):
            found = host.setdefault(e.name, [0, 0.0])
            found[0] += 1
            found[1] += e.self_cpu_time_total
    ranked = sorted(host.items(), key=lambda kv: kv[1][1], reverse=True)[:top]
    rows = {"spans": len(spans),
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
    parser.add_argument("--in_line", action="store_true",
                        help="prefill joining requests on the running rows' stream (BatcherConfig.prefill_beside off)")
    parser.add_argument("--output", required=True)
    args = parser.parse_args(argv)
    if args.max_batch < 2:
        parser.error("--max_batch must be >= 2: one row joins while the others run")
    loaded = load_decoder_or_exit(args)
    decoder, tokenizer = loaded.decoder, loaded.tokenizer
    questions = load_benchmark("mt_bench")
    ids_list = [chat_input_ids(tokenizer, [{"role": "user", "content": q.turns[0]}]) for q in questions]
    batcher = ContinuousBatcher(decoder, BatcherConfig(max_batch=args.max_batch, capture=args.capture,
                                                       prefill_beside=not args.in_line))
    if batcher._runner.prefill_graphs is None or batcher._compiled_prefill:
        parser.error("requests join through the staging row only where prefills replay CUDA graphs: a GPU, a "
                     "--capture that captures steps, and PPD_COMPILED_PREFILL unset")
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
            row = {"method": method, "max_batch": args.max_batch, "sync": args.sync, "in_line": args.in_line,
                   **clock.summary(skip=2)}
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
            parts = "; ".join(f"{part} {m['total']} ms ({', '.join(f'{k} {v}' for k, v in m.items() if k != 'total')})"
                              for part, m in row["median_ms"].items())
            steps = ", ".join(f"{k} {v}" for k, v in row["step_median_ms"].items())
            print(f"{method}: median of {row['admissions']} admissions: {parts}; steps ms: {steps}; a prefill in "
                  f"flight {row['flight_median_ms']} ms, {row['steps_while_in_flight']} steps ran beside one; {still} "
                  f"of {args.max_batch - 1} still running at the end", flush=True)
    write_json(args.output, {"command": " ".join(sys.argv), **environment(decoder.device), "warmup_s": warmup_s,
                             "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())

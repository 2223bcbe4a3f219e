"""Run a grid of ``eval.gen_answers`` jobs (benchmarks x methods, in shards) over the devices at hand.

Usage:
    python -m eval.run_suite --benches mt_bench humaneval gsm8k alpaca_eval \\
        --methods hf_static baseline ppd --dtypes float32 bfloat16 \\
        --limit gsm8k=100 alpaca_eval=100 --max_new_tokens 256 --shard_size 40 --devices 0 1 2 3 \\
        --output_dir results/eval/h200 [--deadline_s 560] [-- any further gen_answers flags]

Every shard is one ``gen_answers`` process on one device (``CUDA_VISIBLE_DEVICES``), one device at a time,
so no two timed runs share a GPU. Each shard writes ``{bench}-{method}[-{dtype}]-{offset}.jsonl`` and logs
to ``logs/``. The queue visits the shards of a benchmark with every dtype and method side by side, so a
run cut short leaves comparable partial results. ``--deadline_s`` stops the run at that time: running shards
are ended and, like every shard, resume where they stopped when the same command is run again (a
shard that is complete is skipped). The exit status is 0 once every shard is complete, 3 otherwise.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from .benchmarks import BENCHMARKS, load_benchmark
from .gen_answers import METHODS

REPO_ROOT = Path(__file__).resolve().parents[1]  # where `python -m eval.gen_answers` resolves


@dataclass(frozen=True)
class Shard:
    bench: str
    method: str
    offset: int
    count: int
    answers: int  # expected JSON lines: questions x turns x runs
    dtype: str | None = None  # None: whatever the extra gen_answers flags say

    @property
    def name(self) -> str:
        dtype = f"-{self.dtype}" if self.dtype else ""
        return f"{self.bench}-{self.method}{dtype}-{self.offset:04d}"


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m eval.run_suite", description=__doc__.split("\n")[0])
    parser.add_argument("--benches", nargs="+", choices=BENCHMARKS, default=list(BENCHMARKS))
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--dtypes", nargs="+", default=None, help="run the grid in each of these dtypes")
    parser.add_argument("--limit", nargs="*", default=[], metavar="BENCH=K",
                        help="answer only the first K questions of BENCH")
    parser.add_argument("--max_new_tokens", type=int, default=None, help="default: gen_answers' per benchmark")
    parser.add_argument("--num_runs", type=int, default=1)
    parser.add_argument("--shard_size", type=int, default=40, help="questions per job at most")
    parser.add_argument("--devices", nargs="+", default=["0"],
                        help="CUDA device indices, one job each at a time, or 'cpu'")
    parser.add_argument("--deadline_s", type=float, default=None, help="stop after this many seconds")
    parser.add_argument("--output_dir", required=True)
    return parser


def _limits(items: list[str]) -> dict[str, int]:
    limits = {}
    for item in items:
        bench, _, value = item.partition("=")
        if bench not in BENCHMARKS or not value.isdigit() or int(value) < 1:
            raise ValueError(f"--limit takes BENCH=K with BENCH one of {', '.join(BENCHMARKS)} and K >= 1, "
                             f"not {item!r}")
        limits[bench] = int(value)
    return limits


def plan(benches: list[str], methods: list[str], limits: dict[str, int], shard_size: int,
         num_runs: int, dtypes: list[str] | None = None) -> list[Shard]:
    """Shards in queue order: per benchmark, each span of questions with every dtype and method before the
    next span."""
    shards = []
    for bench in benches:
        questions = load_benchmark(bench)[: limits.get(bench)]
        pieces = math.ceil(len(questions) / shard_size)
        bounds = [round(i * len(questions) / pieces) for i in range(pieces + 1)]
        for start, end in zip(bounds, bounds[1:]):
            answers = sum(len(q.turns) for q in questions[start:end]) * num_runs
            shards.extend(Shard(bench, method, start, end - start, answers, dtype)
                          for dtype in dtypes or [None] for method in methods)
    return shards


def answers_written(path: Path) -> int:
    """Complete JSON lines in a shard's file (a line cut short by a killed run does not count)."""
    if not path.exists():
        return 0
    count = 0
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            count += bool(line.strip()) and isinstance(json.loads(line), dict)
        except json.JSONDecodeError:
            pass
    return count


class Runner:
    def __init__(self, args: argparse.Namespace, extra: list[str], shards: list[Shard]):
        self.args, self.extra = args, extra
        self.out = Path(args.output_dir).resolve()
        (self.out / "logs").mkdir(parents=True, exist_ok=True)
        self.todo: queue.Queue[Shard] = queue.Queue()
        for shard in shards:
            if answers_written(self.out / f"{shard.name}.jsonl") < shard.answers:
                self.todo.put(shard)
        self.stopping = threading.Event()
        self.running: dict[str, subprocess.Popen] = {}
        self.lock = threading.Lock()
        self.failed: list[str] = []

    def command(self, shard: Shard, device: str) -> list[str]:
        cmd = [sys.executable, "-m", "eval.gen_answers", "--bench", shard.bench, "--method", shard.method,
               "--offset", str(shard.offset), "--limit", str(shard.count), "--num_runs", str(self.args.num_runs),
               "--output", str(self.out / f"{shard.name}.jsonl")]
        if self.args.max_new_tokens:
            cmd += ["--max_new_tokens", str(self.args.max_new_tokens)]
        if device == "cpu":
            cmd += ["--device", "cpu"]
        if shard.dtype:
            cmd += ["--dtype", shard.dtype]
        return cmd + self.extra

    def worker(self, device: str) -> None:
        env = dict(os.environ)
        if device != "cpu":
            env["CUDA_VISIBLE_DEVICES"] = device
        while not self.stopping.is_set():
            try:
                shard = self.todo.get_nowait()
            except queue.Empty:
                return
            started = time.perf_counter()
            with open(self.out / "logs" / f"{shard.name}.log", "a") as log:
                with self.lock:  # a stop either sees this process or comes before it starts
                    if self.stopping.is_set():
                        return
                    process = subprocess.Popen(self.command(shard, device), env=env, stdout=log,
                                               stderr=subprocess.STDOUT, cwd=REPO_ROOT, start_new_session=True)
                    self.running[shard.name] = process
                code = process.wait()
                with self.lock:
                    del self.running[shard.name]
            status = "done" if code == 0 else ("stopped" if self.stopping.is_set() else f"FAILED (exit {code})")
            if code != 0 and not self.stopping.is_set():
                self.failed.append(shard.name)
            print(f"[device {device}] {shard.name}: {status} in {time.perf_counter() - started:.0f} s", flush=True)

    def stop(self) -> None:
        self.stopping.set()
        with self.lock:
            for process in self.running.values():
                try:
                    os.killpg(process.pid, signal.SIGTERM)
                except ProcessLookupError:  # it had just finished
                    pass

    def run(self) -> None:
        threads = [threading.Thread(target=self.worker, args=(device,), daemon=True) for device in self.args.devices]
        for thread in threads:
            thread.start()
        start = time.monotonic()
        for thread in threads:
            while thread.is_alive():
                thread.join(timeout=1.0)
                deadline = self.args.deadline_s
                if deadline is not None and time.monotonic() - start > deadline and not self.stopping.is_set():
                    print(f"deadline of {deadline:.0f} s reached: stopping the running shards", flush=True)
                    self.stop()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    parser = make_parser()
    args = parser.parse_args(own)
    try:
        limits = _limits(args.limit)
    except ValueError as error:
        parser.error(str(error))
    if args.shard_size < 1 or args.num_runs < 1:
        parser.error("--shard_size and --num_runs must be >= 1")
    if "cpu" in args.devices and len(args.devices) > 1:
        parser.error("--devices cpu runs alone: one CPU job at a time keeps the timings honest")
    shards = plan(args.benches, args.methods, limits, args.shard_size, args.num_runs, args.dtypes)
    runner = Runner(args, extra, shards)
    print(f"{runner.todo.qsize()} of {len(shards)} shards to run on {len(args.devices)} device(s)", flush=True)
    runner.run()
    missing = [s.name for s in shards if answers_written(runner.out / f"{s.name}.jsonl") < s.answers]
    summary = {"shards": len(shards), "complete": len(shards) - len(missing), "incomplete": missing,
               "failed": runner.failed}
    print(json.dumps(summary))
    if runner.failed:
        print("failed shards (see their logs): " + ", ".join(runner.failed), file=sys.stderr)
    return 0 if not missing else 3


if __name__ == "__main__":
    sys.exit(main())

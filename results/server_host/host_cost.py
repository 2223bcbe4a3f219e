"""What streaming costs the server's host: CPU time of its event-loop thread and of the batcher's thread per
streamed token, for several HTTP stacks (uvicorn's HTTP implementation and event loop), on one machine in one
run.

At many clients a server streams one chunk per running request and step, and its event loop (HTTP framing, the
socket write, the text delta, the JSON) shares one interpreter with the batcher's thread. On a GPU that work, not
the device, sets the step's pace (``../deep_gpu/h200/v25/``: 64 clients, the server's steps every 4.5-5.7 ms
against a 2.4 ms step). Thread CPU times come from ``/proc`` (Linux), so they do not depend on how the two threads
were scheduled, which a load's wall time on a busy machine does.

Each stack gets its own server (``python -m application.serve ... --http H --loop L``), loaded by ``eval.load``
(``--clients``, greedy baseline or PPD); ``--repeats`` alternates the stacks. On a CPU the engine's step costs far
more than on a GPU, so tokens/s there says little; the CPU times a token are the figures. Run from the
repository's root with it on the path (``PYTHONPATH=.``), as the other tools under ``results/``.

    PYTHONPATH=. python results/server_host/host_cost.py --model /tmp/tiny-host --make_tiny --server_args="--device cpu --dtype float32 \\
        --capture eager --max_seq_len 1024 --max_batch 64" --clients 64 --requests 512 --repeats 2 \\
        --output results/server_host/cpu_tiny.json
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from eval.load import ROOT, LaunchedServer
from eval.records import write_json
STACKS = {"h11/asyncio": ("h11", "asyncio"), "httptools/uvloop": ("httptools", "uvloop")}


def make_tiny(folder: str) -> None:
    """A one-layer random Llama with the default model's tokenizer (seeded): a server whose step costs little
    on a CPU, so that the streaming's own cost shows."""
    import torch
    import transformers

    from ppd.models import load_tokenizer

    tokenizer = load_tokenizer("smollm2-135m-instruct")
    config = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                      max_position_embeddings=2048, tie_word_embeddings=True,
                                      bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def thread_seconds(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) of each thread of process ``pid``, by thread id (the main thread's is
    ``pid``: the server's event loop runs there)."""
    tick = os.sysconf("SC_CLK_TCK")
    found = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:  # the thread ended
            continue
        found[int(task.name)] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime (stat fields 14, 15)
    return found


def split_seconds(before: dict[int, float], after: dict[int, float], pid: int) -> tuple[float, float]:
    """The event loop's CPU seconds between two readings, and the busiest other thread's: the batcher's (the
    interpreter does not name its threads for the system, and the others, the tokenizer's and the loop's
    workers, idle)."""
    spent = {tid: seconds - before.get(tid, 0.0) for tid, seconds in after.items()}
    loop = spent.pop(pid)
    return loop, max(spent.values(), default=0.0)


def one_run(args, stack: str, work: Path, index: int) -> dict:
    http, loop = STACKS[stack]
    server = LaunchedServer(["--model", args.model, "--http", http, "--loop", loop, *shlex.split(args.server_args)],
                            work / f"server_{index}.log")
    server.start()
    try:
        server.wait_healthy(args.launch_timeout, {})
        before = thread_seconds(server.process.pid)
        load_json = work / f"load_{index}.json"
        command = [sys.executable, "-m", "eval.load", "--url", server.url, "--clients", str(args.clients),
                   "--requests", str(args.requests), "--methods", args.method, "--bench", args.bench,
                   "--max_tokens", str(args.max_tokens), "--tokenizer", args.tokenizer or args.model,
                   "--output", str(load_json)]
        subprocess.run(command, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        after = thread_seconds(server.process.pid)
        server.check()
        loop_s, batcher_s = split_seconds(before, after, server.process.pid)
    finally:
        server.stop()
    load = json.loads(load_json.read_text())
    # warm-up requests included, as in the CPU times; a server that falls behind sends several steps' tokens a chunk
    chunks = sum(len(r["chunk_times_s"]) for r in load["records"])
    tokens = sum(r["completion_tokens"] or 0 for r in load["records"])
    summary = load["summary"][0]
    return {"stack": stack, "http": http, "loop": loop, "chunks": chunks, "tokens": tokens,
            "tokens_per_s": summary["output_tokens_per_s"], "itl_p99_s": summary["itl_p99_s"],
            "event_loop_us_per_token": 1e6 * loop_s / tokens, "batcher_us_per_token": 1e6 * batcher_s / tokens,
            "tokens_per_chunk": tokens / chunks, "errors": summary["errors"]}


def table(runs: list[dict]) -> str:
    lines = ["| stack | runs | event loop us CPU a token (each run) | batcher us CPU a token | tokens a chunk | tokens/s "
             "| ITL p99 ms |", "|---|---|---|---|---|---|---|"]
    for stack in dict.fromkeys(r["stack"] for r in runs):
        mine = [r for r in runs if r["stack"] == stack]
        loop = [r["event_loop_us_per_token"] for r in mine]
        lines.append(f"| {stack} | {len(mine)} | {statistics.median(loop):.1f} ({', '.join(f'{x:.1f}' for x in loop)}) "
                     f"| {statistics.median(r['batcher_us_per_token'] for r in mine):.1f} "
                     f"| {statistics.median(r['tokens_per_chunk'] for r in mine):.2f} "
                     f"| {statistics.median(r['tokens_per_s'] for r in mine):,.0f} "
                     f"| {1e3 * statistics.median(r['itl_p99_s'] for r in mine):.1f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="what the server serves (a folder or a model name)")
    parser.add_argument("--make_tiny", action="store_true",
                        help="first write a one-layer random Llama with the default model's tokenizer into --model")
    parser.add_argument("--tokenizer", default=None, help="the clients' tokenizer (default: --model)")
    parser.add_argument("--server_args", default="", help="more arguments of application.serve, one string")
    parser.add_argument("--stacks", nargs="+", choices=list(STACKS), default=list(STACKS))
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--requests", type=int, default=512)
    parser.add_argument("--max_tokens", type=int, default=128)
    parser.add_argument("--method", choices=["baseline", "ppd"], default="baseline")
    parser.add_argument("--bench", choices=["mt_bench", "alpaca_eval"], default="mt_bench")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each stack, alternated")
    parser.add_argument("--launch_timeout", type=float, default=900.0, help="seconds a server may take to start")
    parser.add_argument("--output", default=None, help="JSON file")
    args = parser.parse_args(argv)
    if not Path("/proc/self/task").is_dir():
        parser.error("thread CPU times are read from /proc: Linux only")
    if args.make_tiny:
        make_tiny(args.model)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for stack in args.stacks:
                run = one_run(args, stack, Path(tmp), len(runs))
                runs.append(run)
                print(f"{stack}: event loop {run['event_loop_us_per_token']:.1f} us a token, batcher "
                      f"{run['batcher_us_per_token']:.1f}, {run['tokens_per_chunk']:.2f} tokens a chunk, "
                      f"{run['tokens_per_s']:,.0f} tokens/s", flush=True)
    print(table(runs))
    if args.output:
        write_json(args.output, {"command": " ".join(shlex.quote(a) for a in sys.argv), "cpu": _cpu_name(),
                                 "cores": os.cpu_count(),
                                 "settings": {k: v for k, v in vars(args).items() if k != "output"}, "runs": runs})
    return 0


def _cpu_name() -> str | None:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return None


if __name__ == "__main__":
    sys.exit(main())

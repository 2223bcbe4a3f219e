"""Where a served request's step time goes: the same greedy request timed four ways in one process, for PPD
and the baseline, on one warmed-up engine.

    python results/deep_gpu/server_overhead.py --dtype bfloat16 --capture compiled_graph --max_seq_len 1024 \\
        [--max_batch 64] --output results/deep_gpu/h200/server_overhead/max_batch_1.json

1. ``decoder``: the decoder's own loop (``Decoder.stream``), time between consecutive steps; and the same
   loop run by a thread of its own (``decoder_thread``), as the batcher's is;
2. ``batcher``: the continuous batcher of the server (a state of ``--max_batch`` rows, the request in the
   first), its stream read by this thread;
3. ``batcher + http``: the same batcher behind the real FastAPI app on uvicorn (loopback), one streamed
   chat request read with httpx, time between content chunks.

In the batcher runs each step's own time (``_Lane.step``: queuing it and reading a report, its own or, where the
batcher runs ahead, the step's before; ``run_step``, launch and read-back, when this was measured) is recorded apart
from the host time between steps, so a gap the server adds shows up as one or the other. On the load benchmark
(H200, 2026-11-26) a PPD chunk came every 3.1 ms where the decoder's loop ran a step in 2.2 ms, while the
baseline's chunk came every 1.7 ms against 1.6 ms: this script finds out why.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time

import httpx
import uvicorn

from application.serve import create_app
from eval.benchmarks import load_benchmark
from eval.load import chunk_gaps
from eval.records import environment, write_json
from ppd.cli import add_adapter_args, add_engine_args, add_model_args, load_decoder_or_exit
from ppd.config import DecodeConfig
from ppd.serving import batcher as batcher_module
from ppd.serving.batcher import BatcherConfig, ContinuousBatcher


def median_ms(values: list[float]) -> float | None:
    return round(statistics.median(values) * 1e3, 3) if values else None


class StepClock:
    """Wraps the batcher's step (``_Lane.step``): each call's duration, and the host time between calls."""

    def __init__(self):
        self.inside: list[float] = []
        self.between: list[float] = []
        self._last_end: float | None = None
        self._real = batcher_module._Lane.step

    def __enter__(self):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            if self._last_end is not None:
                self.between.append(start - self._last_end)
            out = self._real(*args, **kwargs)
            self._last_end = time.perf_counter()
            self.inside.append(self._last_end - start)
            return out

        batcher_module._Lane.step = timed
        return self

    def __exit__(self, *exc):
        batcher_module._Lane.step = self._real

    def summary(self) -> dict:
        return {"run_step_ms": median_ms(self.inside), "between_steps_ms": median_ms(self.between),
                "steps": len(self.inside)}


def time_decoder(decoder, ids, config) -> dict:
    times = [time.perf_counter() for _ in decoder.stream(ids, config)]
    return {"step_gap_ms": median_ms(chunk_gaps(times[1:])), "steps": len(times) - 1}


def time_decoder_in_thread(decoder, ids, config) -> dict:
    out = {}
    thread = threading.Thread(target=lambda: out.update(time_decoder(decoder, ids, config)))
    thread.start()
    thread.join()
    return out


def time_batcher(batcher, ids, config) -> dict:
    with StepClock() as clock:
        times = [time.perf_counter() for _ in batcher.submit(ids, config)]
    return {"chunk_gap_ms": median_ms(chunk_gaps(times[1:])), **clock.summary()}


def time_http(url: str, prompt: str, method: str, max_tokens: int) -> dict:
    body = {"model": "ppd", "messages": [{"role": "user", "content": prompt}], "stream": True,
            "temperature": 0, "max_tokens": max_tokens, "method": method}
    times = []
    with StepClock() as clock, httpx.Client(timeout=120, trust_env=False) as client:
        with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
            response.raise_for_status()
            for line in response.iter_lines():
                if line.startswith("data: {") and '"content"' in line:
                    times.append(time.perf_counter())
    return {"chunk_gap_ms": median_ms(chunk_gaps(times[1:])), **clock.summary()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(parser)
    add_adapter_args(parser)
    add_engine_args(parser)
    parser.add_argument("--max_new_tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max_batch", type=int, default=1,
                        help="rows of the batcher's state (the server's --max_batch); one request runs in row 0")
    parser.add_argument("--output", required=True)
    args = parser.parse_args()
    loaded = load_decoder_or_exit(args)
    decoder, tokenizer = loaded.decoder, loaded.tokenizer
    prompt = load_benchmark("mt_bench")[0].turns[0]
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                        tokenize=True, return_dict=False)
    batcher = ContinuousBatcher(decoder, BatcherConfig(max_batch=args.max_batch, capture=args.capture))
    warmup_s = batcher.warmup()  # the seconds it took
    rows = []
    with batcher:
        app = create_app(batcher, tokenizer, "ppd")
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        while not server.started:
            time.sleep(0.05)
        port = server.servers[0].sockets[0].getsockname()[1]
        url = f"http://127.0.0.1:{port}"
        for method in ("ppd", "baseline"):
            config = DecodeConfig(method=method, max_new_tokens=args.max_new_tokens, capture=args.capture)
            for repeat in range(args.repeats + 1):  # the first of each is a warm-up
                row = {"method": method, "repeat": repeat,
                       "decoder": time_decoder(decoder, ids, config),
                       "decoder_thread": time_decoder_in_thread(decoder, ids, config),
                       "batcher": time_batcher(batcher, ids, config),
                       "batcher_http": time_http(url, prompt, method, args.max_new_tokens)}
                rows.append(row)
                print(json.dumps(row), flush=True)
        server.should_exit = True
        thread.join(timeout=10)
    write_json(args.output, {"command": " ".join(sys.argv), **environment(decoder.device), "warmup_s": warmup_s,
                             "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Throughput and latency of the HTTP server under load: PPD against the baseline, streamed, at several concurrencies.

Usage:
    python -m eval.load --launch --model smollm2-135m-instruct --server_args "--dtype bfloat16 --max_batch 64" \\
        --clients 1 4 16 64 --methods ppd baseline --bench mt_bench --max_tokens 256 \\
        --output results/serve/load_h200.json --plot results/serve/load_h200.png
    python -m eval.load --url http://127.0.0.1:8000 --clients 1 8 --requests 32   # a server already running

``--launch`` starts ``python -m application.serve`` on loopback (``--model`` and ``--server_args`` passed
through; port 0, the URL read from the line it prints when it listens), waits for ``GET /health``
(``--launch_timeout``), runs the benchmark and stops the server; its log is saved next to ``--output``
(``NAME.server.log``). A single server flag is given as ``--server_args="--flag"``. On a CPU, bound the
server's KV cache (``--max_batch``, ``--max_seq_len``): each method holds max_batch x max_seq_len tokens. A
server that exits (before it is healthy or during the run) or never becomes healthy ends the run with exit
status 2 and the tail of its log; so does a ``--url`` that does not answer /health.

At each concurrency level (``--clients``) and for each method (``--methods``, sent as the request's
``method`` field) ``N`` clients send streamed ``POST /v1/chat/completions`` requests back to back, drawing
from one shared list of ``--requests`` requests (default 4 x N, at least N); ``--warmup`` requests (default
N, sent at the same concurrency) run first and are not counted. Request ``j`` of every level and method asks
the first turn of question ``j mod Q`` of ``--bench``, so both methods answer the same prompts. Greedy
(temperature 0), ``--max_tokens`` new tokens at most, ``stream_options.include_usage`` on. Levels run in
the order given, the methods of a level one after the other.

Metrics (times from the moment the request is sent, on this client's clock: one Python event loop reads
every stream, so at high concurrency its own delay becomes part of what it measures):

- **TTFT**: time to the first chunk whose delta carries text (the role-only first chunk does not count).
- **chunk gap**: time between consecutive content chunks (one chunk per decoding step in which the
  request took part: one token for the baseline, ``accept_length`` tokens on average for PPD).
- **ITL** (inter-token latency, what a reader sees per token): each chunk gap spread evenly over the tokens
  that chunk carried, one sample per token; tokens that came in the first chunk beyond its first count as
  0 (they arrived with it). Pooled over all tokens of all counted requests, so the mean ITL of a request
  is (last chunk - TTFT) / (tokens - 1).
- **TPOT**: (end-to-end - TTFT) / (completion tokens - 1) per request, averaged over requests.
- **end-to-end**: time to the end of the stream (``data: [DONE]``).
- **output tokens/s**: completion tokens (the server's ``usage``) of all counted requests / wall time of
  the level (from its first request sent to its last stream ended); **requests/s** likewise.
- **busy tokens/s**: the tokens that arrived before the level's last counted request was sent, over that time.
  Until then every client has a request in flight; after it the level drains, clients going idle one by one as
  their last answers end, so the whole level's tokens/s mixes the load asked for with a tail at lower
  concurrency (where PPD's lead is larger). None where the last request was sent at the start (requests <=
  clients).
- **accept length**: completion tokens / decoding steps, summed over the level's requests from the
  ``ppd`` field of the last chunk; **tokens/chunk**: completion tokens / content chunks, as the client sees it.
- for ``ppd``: ``throughput_vs_baseline`` (its tokens/s over the baseline's at the same level),
  ``busy_throughput_vs_baseline`` (the same for busy tokens/s),
  ``p99_itl_vs_baseline`` (its p99 ITL over the baseline's) and ``same_text_as_baseline`` (the fraction of
  its answers identical to the baseline's answer to the same prompt at that level).

Tokens per chunk: the request asks for ``stream_options.continuous_usage_stats`` (the running usage in
every chunk, which ppd's server and vLLM send), so each chunk's count is exact. From a server that sends
text only, each chunk's text is encoded back with the model's tokenizer (``--tokenizer``, default ``--model`` or the served model id; ``none`` or a tokenizer that
cannot be loaded offline falls back to characters). Each chunk is the detokenised output of one step, so
encoding its text back gives that step's token count unless the tokenizer would split the text otherwise.
The counts are then made to add up to the server's ``completion_tokens`` exactly: tokens without text (an
end-of-sequence token) go to the last content chunk, a surplus is taken from the largest chunks (each keeps
at least one). Where a chunk carries its own count (a cumulative ``usage`` in every chunk, as vLLM's
``continuous_usage_stats`` sends), that count is used as is. Per request, ``tokens_without_text`` records
the difference between the server's count and the text's, so the exactness of the split is visible.

Writes JSON: the settings, the command line, the server's flags and log, ``environment``, ``summary`` (one
row per level and method: the metrics above, seconds) and ``records`` (every request, warm-ups marked:
arrival time and tokens of each content chunk, TTFT, end-to-end, usage, the ``ppd`` statistics, a hash of
the text, or its error). Prints a markdown table and, with ``--plot``, draws tokens/s and p99 ITL against
clients.
Failed requests (an HTTP error, a dropped connection, a stream without ``[DONE]`` or ``usage``) are recorded
with their error and counted per level; the run goes on, and ends with exit status 1 if any failed.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from .benchmarks import load_benchmark
from .records import environment, write_json

ROOT = Path(__file__).resolve().parents[1]
METHODS = ("ppd", "baseline")
LOG_TAIL_LINES = 40
API_KEY_ENV = "PPD_API_KEY"  # the server's default key, read from the environment as it does


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m eval.load", description=__doc__.split("\n")[0])
    server = parser.add_argument_group("server")
    where = server.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", default=None, help="base URL of a running server, e.g. http://127.0.0.1:8000")
    where.add_argument("--launch", action="store_true",
                       help="start `python -m application.serve` on loopback and stop it at the end")
    server.add_argument("--model", default=None,
                        help="with --launch: the server's --model (default: the server's default); also names the "
                             "tokenizer that counts tokens per chunk")
    server.add_argument("--server_args", default="",
                        help='further server flags with --launch, one string: "--dtype bfloat16 --max_batch 64"')
    server.add_argument("--launch_timeout", type=float, default=900.0,
                        help="seconds to wait for a launched server's /health (default: %(default)s)")
    server.add_argument("--api_key", default=os.environ.get(API_KEY_ENV) or None,
                        help=f"sent as `Authorization: Bearer KEY` (and given to a launched server unless "
                             f"--server_args names one; default: ${API_KEY_ENV}, as the server's)")
    load = parser.add_argument_group("load")
    load.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16, 64], help="concurrency levels")
    load.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    load.add_argument("--requests", type=int, default=None,
                      help="counted requests per level and method (default: 4 x clients; at least clients)")
    load.add_argument("--warmup", type=int, default=None,
                      help="uncounted requests per level and method, sent first (default: clients)")
    load.add_argument("--bench", choices=["mt_bench", "alpaca_eval"], default="mt_bench",
                      help="prompts: the first turn of each question, in the file's order")
    load.add_argument("--max_tokens", type=int, default=256)
    load.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take (default: %(default)s)")
    load.add_argument("--tokenizer", default=None,
                      help="tokenizer counting the tokens of each chunk (default: --model, else the served model "
                           "id); `none`: count characters")
    out = parser.add_argument_group("output")
    out.add_argument("--output", default=None, help="JSON file for the settings, summary and every request")
    out.add_argument("--plot", default=None, help="PNG: tokens/s and p99 ITL against clients")
    return parser


# ---------------------------------------------------------------------------------------------- metrics
def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100), numpy's linear interpolation between closest ranks; None for no values."""
    return float(np.percentile(values, q)) if len(values) else None


def mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def chunk_gaps(chunk_times: Sequence[float]) -> list[float]:
    """Seconds between consecutive chunk arrivals."""
    return [b - a for a, b in zip(chunk_times, chunk_times[1:])]


def token_latencies(chunk_times: Sequence[float], chunk_tokens: Sequence[int]) -> list[float]:
    """One inter-token latency per token after the first: the gap before a chunk spread evenly over the tokens
    it carried. Tokens of the first token-carrying chunk beyond its first arrived with it (0 each); the gap
    before a chunk that carried no token is added to the next chunk that did."""
    latencies: list[float] = []
    previous = None
    pending = 0.0
    started = False
    for time_s, tokens in zip(chunk_times, chunk_tokens):
        if previous is not None:
            pending += time_s - previous
        previous = time_s
        if tokens <= 0:
            continue
        if started:
            latencies.extend([pending / tokens] * tokens)
        else:
            latencies.extend([0.0] * (tokens - 1))
            started = True
        pending = 0.0
    return latencies


def split_tokens(estimates: Sequence[int], total: int) -> list[int]:
    """Per-chunk token counts that add up to ``total`` (the server's count), from per-chunk ``estimates``.
    A shortfall goes to the last chunk (a token without text ends a stream: end of sequence); a surplus is
    taken one token at a time from the largest chunk (the later one on a tie), each keeping at least one, or
    none once every chunk is down to one."""
    counts = [max(0, int(e)) for e in estimates]
    if not counts:
        return []
    surplus = sum(counts) - total
    if surplus < 0:
        counts[-1] -= surplus
    floor = 1 if total >= len(counts) else 0
    while surplus > 0:
        index = max(range(len(counts)), key=lambda i: (counts[i], i))
        if counts[index] <= floor:
            break
        counts[index] -= 1
        surplus -= 1
    return counts


def summarize(records: list[dict], wall_s: float) -> dict:
    """The metrics of one level and method from its counted requests (see the module docstring)."""
    ok = [r for r in records if not r.get("error")]
    tokens = sum(r["completion_tokens"] for r in ok)
    chunks = sum(len(r["chunk_times_s"]) for r in ok)
    steps = [r["steps"] for r in ok if r.get("steps")]
    stepped_tokens = sum(r["completion_tokens"] for r in ok if r.get("steps"))
    ttft = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
    e2e = [r["e2e_s"] for r in ok]
    itl = [x for r in ok for x in token_latencies(r["chunk_times_s"], r["chunk_tokens"])]
    gaps = [x for r in ok for x in chunk_gaps(r["chunk_times_s"])]
    tpot = [(r["e2e_s"] - r["ttft_s"]) / (r["completion_tokens"] - 1)
            for r in ok if r["ttft_s"] is not None and r["completion_tokens"] > 1]
    return {
        "requests": len(records), "completed": len(ok), "errors": len(records) - len(ok), "wall_s": wall_s,
        "completion_tokens": tokens,
        "output_tokens_per_s": tokens / wall_s if wall_s > 0 else None,
        "busy_tokens_per_s": busy_tokens_per_s(ok, [r.get("sent_s") for r in records]),
        "requests_per_s": len(ok) / wall_s if wall_s > 0 else None,
        "ttft_mean_s": mean(ttft), "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
        "itl_mean_s": mean(itl), "itl_p50_s": percentile(itl, 50), "itl_p99_s": percentile(itl, 99),
        "chunk_gap_p50_s": percentile(gaps, 50), "chunk_gap_p99_s": percentile(gaps, 99),
        "tpot_mean_s": mean(tpot),
        "e2e_p50_s": percentile(e2e, 50), "e2e_p99_s": percentile(e2e, 99),
        "accept_length": stepped_tokens / sum(steps) if steps else None,
        "tokens_per_chunk": tokens / chunks if chunks else None,
    }


def busy_tokens_per_s(ok: list[dict], sent: list[float | None]) -> float | None:
    """Tokens/s of the completed requests ``ok`` while every client had a request in flight: those whose chunks
    arrived before the last request was sent (``sent``, every counted request's send time, seconds since the
    level began), over that time. None where any send time is unknown or the last came at the very start."""
    if not sent or any(t is None for t in sent) or max(sent) <= 0:
        return None
    end = max(sent)
    tokens = sum(n for r in ok for t, n in zip(r["chunk_times_s"], r["chunk_tokens"]) if r["sent_s"] + t < end)
    return tokens / end


def compare_with_baseline(rows: list[dict], records: list[dict]) -> None:
    """Add, to every non-baseline row, its ratios to the baseline row of the same level and the fraction of
    its answers identical to the baseline's answer to the same prompt."""
    baselines = {r["clients"]: r for r in rows if r["method"] == "baseline"}
    answers = {(r["clients"], r["prompt_index"]): r["text_sha1"] for r in records
               if r["method"] == "baseline" and not r.get("error") and not r.get("warmup")}
    for row in rows:
        base = baselines.get(row["clients"])
        if row["method"] == "baseline" or base is None:
            continue
        row["throughput_vs_baseline"] = _ratio(row["output_tokens_per_s"], base["output_tokens_per_s"])
        row["busy_throughput_vs_baseline"] = _ratio(row.get("busy_tokens_per_s"), base.get("busy_tokens_per_s"))
        row["p99_itl_vs_baseline"] = _ratio(row["itl_p99_s"], base["itl_p99_s"])
        mine = [r for r in records if r["method"] == row["method"] and r["clients"] == row["clients"]
                and not r.get("error") and not r.get("warmup") and (r["clients"], r["prompt_index"]) in answers]
        same = [r["text_sha1"] == answers[r["clients"], r["prompt_index"]] for r in mine]
        row["same_text_as_baseline"] = sum(same) / len(same) if same else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


# ---------------------------------------------------------------------------------------------- tokens per chunk
class TokenCounter:
    """Counts the tokens of each chunk's text with the model's tokenizer, or its characters without one."""

    def __init__(self, tokenizer=None, name: str = "characters"):
        self.tokenizer = tokenizer
        self.name = name

    @classmethod
    def load(cls, name: str | None) -> TokenCounter:
        if not name or name.lower() == "none":
            return cls()
        try:
            from ppd.models import load_tokenizer

            return cls(load_tokenizer(name), f"tokenizer:{name}")
        except Exception as error:  # noqa: BLE001 - any failure to load means: count characters instead
            _progress(f"cannot load the tokenizer {name!r} ({type(error).__name__}: {error}); "
                      "spreading chunk gaps over characters instead of tokens")
            return cls()

    def estimate(self, texts: Sequence[str]) -> list[int]:
        if self.tokenizer is None:
            return [len(t) for t in texts]
        return [len(self.tokenizer.encode(t, add_special_tokens=False)) for t in texts]

    def split(self, texts: Sequence[str], total: int) -> tuple[list[int], int]:
        """Tokens per chunk adding up to ``total``, and ``total`` minus what the texts alone give."""
        estimates = self.estimate(texts)
        if self.tokenizer is None:
            return _proportional(estimates, total), 0
        return split_tokens(estimates, total), total - sum(estimates)


def _proportional(weights: Sequence[int], total: int) -> list[int]:
    """``total`` spread over chunks in proportion to ``weights`` (characters), largest remainders first (the
    earlier chunk on a tie); then, where the total allows, every chunk gets at least one, from the largest."""
    if not weights:
        return []
    if sum(weights) <= 0:
        weights = [1] * len(weights)
    shares = [total * w / sum(weights) for w in weights]
    counts = [int(s) for s in shares]
    order = sorted(range(len(weights)), key=lambda i: (-(shares[i] - counts[i]), i))
    for i in order[:total - sum(counts)]:
        counts[i] += 1
    if total >= len(counts):
        for i in range(len(counts)):
            if counts[i] == 0:
                counts[max(range(len(counts)), key=lambda j: (counts[j], j))] -= 1
                counts[i] = 1
    return counts


# ---------------------------------------------------------------------------------------------- one request
def _progress(message: str) -> None:
    print(f"[eval.load] {message}", file=sys.stderr, flush=True)


async def stream_request(client, url: str, body: dict, headers: dict) -> dict:
    """Send one streamed chat completion; its chunk arrival times and texts, usage and PPD statistics, or an
    ``error``. Times are seconds since the request was sent."""
    start = time.perf_counter()
    times: list[float] = []
    texts: list[str] = []
    cumulative: list[int | None] = []  # completion tokens so far, where a chunk carries its own usage
    record: dict = {"error": None, "usage": None, "ppd": None, "finish_reason": None}
    done = False
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers) as response:
            if response.status_code != 200:
                detail = (await response.aread()).decode("utf-8", errors="replace").strip()
                record["error"] = f"HTTP {response.status_code}: {detail[:300]}"
                return record
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators, comments, event names
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                now = time.perf_counter() - start
                event = json.loads(data)
                if event.get("error"):
                    record["error"] = f"error event: {json.dumps(event['error'])[:300]}"
                    return record
                usage = event.get("usage")
                for choice in event.get("choices") or []:
                    content = (choice.get("delta") or {}).get("content")
                    if content:
                        times.append(now)
                        texts.append(content)
                        cumulative.append(usage.get("completion_tokens") if usage else None)
                    if choice.get("finish_reason"):
                        record["finish_reason"] = choice["finish_reason"]
                if usage:
                    record["usage"] = usage
                if event.get("ppd"):
                    record["ppd"] = event["ppd"]
        end = time.perf_counter() - start
    except Exception as error:  # noqa: BLE001 - httpx's errors, a malformed event: recorded, the run goes on
        record["error"] = f"{type(error).__name__}: {error}"[:300]
        return record
    if not done:
        record["error"] = "the stream ended without data: [DONE]"
    elif not record["usage"] or "completion_tokens" not in record["usage"]:
        record["error"] = "the stream carried no usage (stream_options.include_usage)"
    record.update(e2e_s=end, chunk_times_s=times, texts=texts, cumulative_tokens=cumulative)
    return record


def finish_record(record: dict, counter: TokenCounter) -> dict:
    """Turn the raw texts of a completed request into per-chunk token counts; drop the texts (keep a hash)."""
    texts = record.pop("texts", None) or []
    cumulative = record.pop("cumulative_tokens", None) or []
    if record["error"]:
        return record
    total = int(record["usage"]["completion_tokens"])
    if cumulative and all(c is not None for c in cumulative) and cumulative[-1] <= total:
        counts = [b - a for a, b in zip([0] + cumulative[:-1], cumulative)]
        counts[-1] += total - cumulative[-1] if counts else 0
        without_text = 0
    else:
        counts, without_text = counter.split(texts, total)
    ppd = record.get("ppd") or {}
    text = "".join(texts)
    record.update(
        completion_tokens=total, prompt_tokens=record["usage"].get("prompt_tokens"),
        ttft_s=record["chunk_times_s"][0] if record["chunk_times_s"] else None,
        chunk_tokens=counts, tokens_without_text=without_text,
        accept_length=ppd.get("accept_length"), steps=ppd.get("steps"), server_method=ppd.get("method"),
        characters=len(text), text_sha1=hashlib.sha1(text.encode("utf-8")).hexdigest())
    return record


# ---------------------------------------------------------------------------------------------- one level
async def run_phase(client, url: str, model_id: str, prompts: list[str], method: str, clients: int,
                    indices: list[int], args: argparse.Namespace, counter: TokenCounter,
                    warmup: bool) -> tuple[list[dict], float]:
    """``clients`` workers send the requests ``indices`` back to back; their records and the wall time."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    queue = list(reversed(indices))
    records: list[dict] = []
    start = time.perf_counter()

    async def worker(client_id: int) -> None:
        while queue:
            index = queue.pop()
            prompt_index = index % len(prompts)
            body = {"model": model_id, "messages": [{"role": "user", "content": prompts[prompt_index]}],
                    "max_tokens": args.max_tokens, "temperature": 0, "stream": True,
                    "stream_options": {"include_usage": True, "continuous_usage_stats": True}, "method": method}
            sent = time.perf_counter() - start
            try:
                raw = await asyncio.wait_for(stream_request(client, url, body, headers), args.timeout)
            except asyncio.TimeoutError:
                raw = {"error": f"no complete answer within --timeout {args.timeout:g} s"}
            record = finish_record(raw, counter)
            record = {"clients": clients, "method": method, "warmup": warmup, "index": index,
                      "prompt_index": prompt_index, "client": client_id, "sent_s": sent, **record}
            if record["error"]:
                _progress(f"clients={clients} {method} request {index} failed: {record['error']}")
            records.append(record)

    await asyncio.gather(*(worker(i) for i in range(min(clients, len(indices)))))
    return sorted(records, key=lambda r: r["index"]), time.perf_counter() - start


async def run_levels(url: str, model_id: str, prompts: list[str], args: argparse.Namespace,
                     counter: TokenCounter, check_server=lambda: None) -> tuple[list[dict], list[dict]]:
    """Every level and method in turn: the summary rows and every request's record. ``check_server`` is
    called after each phase (a launched server raises ServerError there if it has exited)."""
    import httpx

    most = max(args.clients)
    limits = httpx.Limits(max_connections=most + 4, max_keepalive_connections=most + 4)
    timeout = httpx.Timeout(args.timeout, connect=30.0)
    rows: list[dict] = []
    records: list[dict] = []
    # trust_env=False: measure the server, never a proxy that the environment names.
    async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as client:
        for clients in args.clients:
            n = max(args.requests if args.requests is not None else 4 * clients, clients)
            warmup = args.warmup if args.warmup is not None else clients
            for method in args.methods:
                if warmup:
                    _progress(f"clients={clients} {method}: {warmup} warm-up requests")
                    warm, _ = await run_phase(client, url, model_id, prompts, method, clients,
                                              [n + i for i in range(warmup)], args, counter, warmup=True)
                    records += warm
                    check_server()
                _progress(f"clients={clients} {method}: {n} requests")
                timed, wall = await run_phase(client, url, model_id, prompts, method, clients, list(range(n)),
                                              args, counter, warmup=False)
                records += timed
                check_server()
                row = {"clients": clients, "method": method, **summarize(timed, wall)}
                rows.append(row)
                _progress(f"clients={clients} {method}: {row['completed']}/{n} in {wall:.1f} s, "
                          f"{_fmt(row['output_tokens_per_s'], '{:.1f}')} tokens/s, "
                          f"p99 ITL {_fmt(row['itl_p99_s'], '{:.1f}', 1e3)} ms, {row['errors']} errors")
    compare_with_baseline(rows, records)
    return rows, records


# ---------------------------------------------------------------------------------------------- the server
class ServerError(RuntimeError):
    """The server could not be started or did not answer /health."""


def redacted(args: list[str]) -> list[str]:
    """``args`` with the value of every ``--api_key`` replaced by ``REDACTED`` (records and logs never hold it)."""
    out = []
    for i, arg in enumerate(args):
        if arg.startswith("--api_key="):
            arg = "--api_key=REDACTED"
        elif i > 0 and args[i - 1] == "--api_key":
            arg = "REDACTED"
        out.append(arg)
    return out


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        return "\n".join(path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


READY_LINE = re.compile(r"ppd serving .* on (http://\S+)")


class LaunchedServer:
    """``python -m application.serve`` in a subprocess on loopback, its output in ``log``. It is given port 0
    (the system picks a free one, so no other program can take it between a choice and the bind) and its
    URL is read from the line it prints once it listens."""

    def __init__(self, server_args: list[str], log: Path):
        self.command = [sys.executable, "-m", "application.serve", *server_args, "--host", "127.0.0.1", "--port", "0"]
        self.log = log
        self.url: str | None = None
        self.process: subprocess.Popen | None = None
        self.started = 0.0

    def start(self) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        _progress(f"starting {shlex.join(redacted(self.command[1:]))} (log: {self.log})")
        self.started = time.perf_counter()
        with open(self.log, "wb") as handle:
            self.process = subprocess.Popen(self.command, cwd=ROOT, stdout=handle, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def wait_healthy(self, timeout: float, headers: dict) -> float:
        """Seconds from the start until /health answered 200; ServerError (with the log's tail) if the
        server exits first or ``timeout`` seconds pass."""
        start = self.started
        while True:
            code = self.process.poll()
            if code is not None:
                raise ServerError(f"the server exited with status {code} before it became healthy; "
                                  f"last lines of {self.log}:\n{log_tail(self.log)}")
            if self.url is None:
                found = READY_LINE.search(self.log.read_text(encoding="utf-8", errors="replace"))
                self.url = found.group(1).rstrip("/") if found else None
            if self.url is not None and _healthy(self.url, headers):
                return time.perf_counter() - start
            if time.perf_counter() - start > timeout:
                raise ServerError(f"the server did not become healthy within {timeout:.0f} s; "
                                  f"last lines of {self.log}:\n{log_tail(self.log)}")
            time.sleep(0.5)

    def check(self) -> None:
        """ServerError, with the log's tail, if the server has exited."""
        code = self.process.poll()
        if code is not None:
            raise ServerError(f"the server exited with status {code} during the run; "
                              f"last lines of {self.log}:\n{log_tail(self.log)}")

    def stop(self) -> int | None:
        if self.process is None or self.process.poll() is not None:
            return None if self.process is None else self.process.returncode
        self.process.terminate()
        try:
            return self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait(30)


def _healthy(url: str, headers: dict) -> bool:
    import httpx

    try:
        return httpx.get(f"{url}/health", headers=headers, timeout=5.0, trust_env=False).status_code == 200
    except httpx.HTTPError:
        return False


def served_model(url: str, headers: dict) -> str | None:
    """The first model id of ``GET /v1/models``, or None."""
    import httpx

    try:
        response = httpx.get(f"{url}/v1/models", headers=headers, timeout=30.0, trust_env=False)
        response.raise_for_status()
        return response.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError):
        return None


def _server_device(server_args: list[str]):
    """The torch device the server decodes on, as far as its flags say (else this machine's default)."""
    import torch

    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--device", default=None)
    device = parser.parse_known_args(server_args)[0].device
    if device is None or (device.startswith("cuda") and not torch.cuda.is_available()):
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device)


# ---------------------------------------------------------------------------------------------- output
def _fmt(value, spec: str, scale: float = 1.0) -> str:
    return "-" if value is None else spec.format(value * scale)


def table(rows: list[dict]) -> str:
    lines = ["| clients | method | done/errors | tokens/s | busy tokens/s | req/s | TTFT p50 / p99 ms | "
             "ITL p50 / p99 ms | chunk gap p50 / p99 ms | TPOT ms | accept length | tokens/s vs baseline (busy) | "
             "p99 ITL vs baseline | same text as baseline |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['clients']} | {r['method']} | {r['completed']}/{r['errors']} | "
            f"{_fmt(r['output_tokens_per_s'], '{:.1f}')} | {_fmt(r.get('busy_tokens_per_s'), '{:.1f}')} | "
            f"{_fmt(r['requests_per_s'], '{:.2f}')} | "
            f"{_fmt(r['ttft_p50_s'], '{:.1f}', 1e3)} / {_fmt(r['ttft_p99_s'], '{:.1f}', 1e3)} | "
            f"{_fmt(r['itl_p50_s'], '{:.1f}', 1e3)} / {_fmt(r['itl_p99_s'], '{:.1f}', 1e3)} | "
            f"{_fmt(r['chunk_gap_p50_s'], '{:.1f}', 1e3)} / {_fmt(r['chunk_gap_p99_s'], '{:.1f}', 1e3)} | "
            f"{_fmt(r['tpot_mean_s'], '{:.1f}', 1e3)} | {_fmt(r['accept_length'], '{:.2f}')} | "
            f"{_fmt(r.get('throughput_vs_baseline'), '{:.2f}x')} "
            f"({_fmt(r.get('busy_throughput_vs_baseline'), '{:.2f}x')}) | "
            f"{_fmt(r.get('p99_itl_vs_baseline'), '{:.2f}x')} | "
            f"{_fmt(r.get('same_text_as_baseline'), '{:.0%}')} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: str | os.PathLike, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(9.0, 3.6))
    for method in dict.fromkeys(r["method"] for r in rows):
        mine = sorted((r for r in rows if r["method"] == method), key=lambda r: r["clients"])
        clients = [r["clients"] for r in mine]
        left.plot(clients, [r["output_tokens_per_s"] or 0 for r in mine], marker="o", label=method)
        right.plot(clients, [1e3 * r["itl_p99_s"] if r["itl_p99_s"] is not None else float("nan") for r in mine],
                   marker="o", label=method)
    levels = sorted({r["clients"] for r in rows})
    for ax, label in ((left, "output tokens / s"), (right, "p99 inter-token latency (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    left.legend(frameon=False)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = make_parser()
    args = parser.parse_args(argv)
    if min(args.clients) < 1 or (args.requests is not None and args.requests < 1) or args.max_tokens < 1:
        parser.error("--clients, --requests and --max_tokens must be at least 1")
    if args.warmup is not None and args.warmup < 0:
        parser.error("--warmup must be at least 0")
    from ppd.serving.heap import CollectionWatch, freeze_heap, slow_collections_in, thaw_heap

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    server_args = shlex.split(args.server_args)
    prompts = [q.turns[0] for q in load_benchmark(args.bench)]

    server = None
    if args.launch:
        flags = (["--model", args.model] if args.model else []) + server_args
        if args.api_key and not any(a.split("=")[0] == "--api_key" for a in server_args):
            flags += ["--api_key", args.api_key]
        log = (Path(args.output).with_suffix(".server.log") if args.output
               else Path(tempfile.mkdtemp(prefix="ppd-load-")) / "server.log")
        server = LaunchedServer(flags, log)
    try:
        counter = None
        if server is not None:
            server.start()
            if args.tokenizer or args.model:  # load it while the server loads the model
                counter = TokenCounter.load(args.tokenizer or args.model)
            ready_s = server.wait_healthy(args.launch_timeout, headers)
            _progress(f"server healthy after {ready_s:.1f} s at {server.url}")
            url = server.url
        else:
            url = args.url.rstrip("/")
            if not _healthy(url, headers):
                raise ServerError(f"{url}/health does not answer 200")
            ready_s = None
        model_id = served_model(url, headers) or args.model or "default"
        counter = counter or TokenCounter.load(args.tokenizer or args.model or model_id)
        # The client's own collector pauses would stall every stream at once and read as the server's gaps.
        freeze_heap()
        client_watch = CollectionWatch().start()
        try:
            rows, records = asyncio.run(run_levels(url, model_id, prompts, args, counter,
                                                   server.check if server is not None else lambda: None))
        finally:
            client_watch.stop()
            thaw_heap()
    except ServerError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    finally:
        if server is not None:
            code = server.stop()
            _progress(f"server stopped (exit status {code}); log: {server.log}")
    server_collections = None
    if server is not None:  # what the server's log says of garbage collections that held its batcher up
        try:
            server_collections = slow_collections_in(server.log.read_text(encoding="utf-8", errors="replace"))
        except OSError:
            pass
        if server_collections and server_collections["count"]:
            _progress(f"the server logged {server_collections['count']} slow garbage collections, the longest "
                      f"{server_collections['longest_ms']} ms")

    result = {
        "command": "python -m eval.load " + shlex.join(redacted(argv)),
        "url": None if args.launch else url, "launched": bool(args.launch),
        "server_command": shlex.join(redacted(server.command[1:])) if server else None,
        "server_args": redacted(server_args), "server_log": str(server.log) if server else None, "server_ready_s": ready_s,
        "model": model_id, "bench": args.bench, "prompts": len(prompts), "max_tokens": args.max_tokens,
        "temperature": 0.0, "clients": args.clients, "methods": args.methods, "requests": args.requests,
        "warmup": args.warmup, "token_counting": counter.name,
        "environment": environment(_server_device(server_args)),
        "server_slow_collections": server_collections,
        "client_slow_collections": client_watch.summary(), "slow_collection_ms": client_watch.slow_ms,
        "summary": rows, "records": records,
    }
    errors = sum(r["errors"] for r in rows) + sum(1 for r in records if r.get("warmup") and r.get("error"))
    print(f"{model_id} via {'a launched server' if args.launch else url}, {args.bench}, max_tokens={args.max_tokens}, "
          f"tokens per chunk counted by {counter.name}")
    print(table(rows))
    if args.output:
        write_json(args.output, result)
        _progress(f"wrote {args.output}")
    if args.plot:
        plot(rows, args.plot, f"{model_id}, {args.bench}, max_tokens={args.max_tokens}")
        _progress(f"wrote {args.plot}")
    if errors:
        _progress(f"{errors} requests failed (recorded with their error in the JSON)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

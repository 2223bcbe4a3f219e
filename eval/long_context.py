"""Long-context decoding speed: PPD against the engine's baseline and transformers' static-cache ``generate``,
by context length and batch size, on long prompts of real ShareGPT text.

Usage:
    python -m eval.long_context --contexts 1024 2048 4096 8192 --batch_sizes 1 4 16 32 \\
        --methods ppd baseline hf_static --max_new_tokens 128 --dtype bfloat16 \\
        --output results/long_context/h100.json --plot results/long_context/h100.png

A context of C tokens is a prompt of P = C - max_new_tokens tokens and the answer's max_new_tokens. Each
batch row's prompt is one user message in the model's chat template: a transcript of real ShareGPT turns
("User: ...", "Assistant: ..." from consecutive conversations, cut at a token so that the whole prompt has
between P - 16 and P tokens), a blank line, then a real ShareGPT question (the first user turn of the
conversation that follows the transcript). Rows end on different conversations, so a batch holds prompts of
(slightly) different lengths. Each ``--trees`` file adds a PPD variant ``ppd:<file name>``, a decoder of
its own over that tree set, timed beside the methods on the same prompts. A context that leaves fewer than 128
prompt tokens, or that is larger than the decoder's capacity (``--max_seq_len``, at most the model's context
window), is refused before anything decodes (one line, exit status 2).

For each context, batch size and method: untimed warm-up (``ppd``/``baseline``: capture and compilation, then
one short generation; ``hf_static``: two whole generations at the same shape, which compile on a GPU, one on a
CPU, where transformers does not compile), then the timed generation, with the peak GPU memory (the engine's
cache holds ``--max_seq_len`` tokens per row whatever the context, and stays allocated for each batch size run
before), the peak's rise over what was allocated when the timed generation began (its prefill's and steps'
working memory) and, for the engine's methods, the steps' own rise over what was allocated once the prefill had
reported (a tree step's working memory: it should not grow with the context). Its prefill time is the time until
the prefill's tokens were read back in the same run (``hf_static``: a timed one-token generation of the batch after
it). Decode-only throughput is (new tokens -
batch) / (wall time - prefill time); end-to-end throughput is new tokens / wall time. Greedy outputs are
compared with the baseline's (``hf_static``'s without a baseline). A combination that runs out of GPU memory
is recorded with its error and the run goes on. Writes JSON, a markdown table and a plot of PPD's decode-only
speed-up over the baseline by context length (one line per batch size and PPD variant). Each context and batch
size is written to ``--output`` once all its methods are measured; the same command run again after a cut-off
run measures only what is missing (a cut-off file of other settings is refused: one line, exit status 2).
``--samples N`` times N batches of different prompts one after another (after one warm-up) and sums their tokens
and times, each one's own figures kept in the row's ``per_sample``: one prompt's accept length is a noisy figure
at batch 1.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import torch

from ppd.cli import add_adapter_args, add_engine_args, add_model_args, load_decoder_or_exit, tree_files
from ppd.config import DecodeConfig
from ppd.decoding.graphs import compile_limits
from ppd.long_prompts import ContextError, conversation_source, long_prompts
from ppd.teacher import left_padded

from .batch_speed import variant_name
from .records import PartialRun, SettingsMismatch, environment, run_settings

METHODS = ("ppd", "baseline", "hf_static")
ENGINE_METHODS = ("ppd", "baseline")
MIN_PROMPT_TOKENS = 128  # below this a "long" prompt would be mostly chat template and question
WARMUP_TOKENS = 8  # new tokens of the engine's untimed warm-up generation


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m eval.long_context", description=__doc__.split("\n")[0])
    add_model_args(parser)
    add_adapter_args(parser)
    add_engine_args(parser)
    parser.add_argument("--contexts", nargs="+", type=int, default=[1024, 2048, 4096, 8192],
                        help="context lengths: prompt tokens plus max_new_tokens")
    parser.add_argument("--batch_sizes", nargs="+", type=int, default=[1, 4, 16, 32])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--trees", nargs="*", default=[],
                        help="tree-set files each added as a PPD variant (ppd:<file name>) beside the methods")
    parser.add_argument("--max_new_tokens", type=int, default=128)
    parser.add_argument("--samples", type=int, default=1,
                        help="batches of different prompts timed one after another for each context and batch size, "
                             "their tokens and times summed (one prompt's accept length varies: at batch 1 a few "
                             "samples give a steadier figure)")
    parser.add_argument("--data_path", default=None,
                        help="conversations the prompts are cut from (default: the embedded ShareGPT file)")
    parser.add_argument("--output", default=None, help="JSON file")
    parser.add_argument("--plot", default=None, help="PNG of PPD's decode-only speed-up by context length")
    return parser


# ---------------------------------------------------------------------------------------------- prompts
def check_contexts(contexts: list[int], max_new_tokens: int, capacity: int | None = None,
                   capacity_reason: str = "the decoder's capacity") -> None:
    """Raise :class:`ContextError` for a context whose prompt would be too short for a long prompt, or that is
    larger than ``capacity`` (tokens of prompt and answer the decoder holds per row)."""
    for context in contexts:
        prompt = context - max_new_tokens
        if prompt < MIN_PROMPT_TOKENS:
            raise ContextError(f"context {context} with max_new_tokens {max_new_tokens} leaves {prompt} prompt "
                               f"tokens; a long prompt needs at least {MIN_PROMPT_TOKENS}")
        if capacity is not None and context > capacity:
            hint = " (raise --max_seq_len)" if "max_seq_len" in capacity_reason else ""
            raise ContextError(f"context {context} is larger than {capacity_reason}, {capacity} tokens{hint}")


# ---------------------------------------------------------------------------------------------- timing
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _until_eos(tokens: list[int], eos: set[int]) -> list[int]:
    """A row of a batched ``generate`` up to its first EOS (included); transformers pads the rest."""
    for i, token in enumerate(tokens):
        if token in eos:
            return tokens[: i + 1]
    return tokens


def hf_static_generate(model, prompts: list[list[int]], max_new_tokens: int, eos: set[int],
                       pad_token_id: int) -> tuple[list[list[int]], float]:
    """transformers' greedy ``generate`` with a static cache over the left-padded batch: each row's new tokens
    and the wall time."""
    device = model.get_input_embeddings().weight.device
    input_ids, attention_mask, _ = left_padded(prompts, pad_token_id, device)
    _sync(device)
    start = time.perf_counter()
    out = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens, do_sample=False,
                         temperature=None, top_p=None, top_k=None, cache_implementation="static",
                         eos_token_id=sorted(eos) or None, pad_token_id=pad_token_id)
    _sync(device)
    wall = time.perf_counter() - start
    return [_until_eos(row, eos) for row in out[:, input_ids.shape[1]:].tolist()], wall


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def measure(loaded, method: str, batches: list[list[list[int]]], args: argparse.Namespace, decoder=None) -> dict:
    """Warm up, then time the whole generation of each of ``batches`` (batches of the same size, different prompts,
    one after another) and its prefill, summed over them (``method`` on ``decoder``, default the loaded one)."""
    decoder = decoder or loaded.decoder
    device = decoder.device
    batch = len(batches[0])
    warmup_s = None
    passes: list[float] = []  # the milliseconds of each pass of the timed generations
    warm = None  # what runs untimed before each sample's timed generation
    memory = StepMemory(device)
    if method in ENGINE_METHODS:
        def generate(prompts, max_new_tokens, timed=False):
            outs = decoder.generate(prompts, DecodeConfig(method=method, max_new_tokens=max_new_tokens,
                                                          capture=args.capture),
                                    on_report=memory.on_report if timed else None)
            if timed:
                passes.extend(pass_gaps([outs[0].prefill_time_s] + outs[0].report_times_s))
            return [o.token_ids for o in outs], outs[0].wall_time_s, [o.steps for o in outs], outs[0].prefill_time_s

        warmup_s = decoder.warmup(batch_sizes=[batch], methods=[method], capture=args.capture)
        generate(batches[0], WARMUP_TOKENS)
    else:
        tokenizer = loaded.tokenizer
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

        def generate(prompts, max_new_tokens, timed=False):
            tokens, wall = hf_static_generate(loaded.model, prompts, max_new_tokens, decoder.eos_token_ids, pad)
            return tokens, wall, None, None

        def warm(prompts):  # transformers compiles on a GPU only, once per padded length: each sample's twice
            for _ in range(2 if device.type == "cuda" else 0):
                generate(prompts, args.max_new_tokens)

        if device.type != "cuda":
            generate(batches[0], args.max_new_tokens)
    captured = {id(c) for c in decoder.captures}
    tokens, wall, steps, prefill_s, per_sample = [], 0.0, [], 0.0, []
    for prompts in batches:
        if warm is not None:
            warm(prompts)
        memory.start()
        here, seconds, counts, prefill = generate(prompts, args.max_new_tokens, timed=True)
        memory.stop()
        if prefill is None:  # generate gives no time of its prefill: a one-token generation of the batch's
            _, prefill, _, _ = generate(prompts, 1)
        tokens += here
        wall += seconds
        prefill_s += prefill
        steps += counts or []
        new = sum(map(len, here))
        per_sample.append({"new_tokens": new, "accept_length": new / sum(counts) if counts and sum(counts) else None,
                           "decode_tokens_per_s": _rate(new - batch, seconds - prefill)})
    # Graphs captured inside the timed generations (the warm-up should leave none): their seconds are in their time.
    late = [{"tree": c.kind.tree, "width": c.width, "seconds": c.seconds} for c in decoder.captures
            if id(c) not in captured]
    new_tokens = sum(len(t) for t in tokens)
    return {"samples": len(batches), "new_tokens": new_tokens, "steps": sum(steps) if steps else None,
            "max_steps": max(steps) if steps else None,
            "accept_length": new_tokens / sum(steps) if steps and sum(steps) else None,
            "wall_time_s": wall, "prefill_s": prefill_s, "tokens_per_s": new_tokens / wall,
            "decode_tokens_per_s": _rate(new_tokens - batch * len(batches), wall - prefill_s),
            "per_sample": per_sample if len(batches) > 1 else None,
            **memory.figures(), "warmup_s": warmup_s, "captured_while_timed": late,
            "pass_ms": pass_summary(passes), "error": None,
            "token_ids": tokens}


class StepMemory:
    """The peak GPU memory of timed generations, and its rises: over what was allocated when a generation began,
    and, where the engine reports its prefill (``on_report``), the steps' own over what was allocated once the
    prefill's report arrived (so a step's working memory, the tree's included, is told apart from the prefill's).
    The allocator's figures are the host's own bookkeeping: reading them waits for nothing on the device. Every
    figure is None off a GPU. Captured steps keep their working memory in their graphs' pools, allocated when the
    warm-up captured them and counted in what was allocated before: there the steps' rise is only what a replay
    allocates outside them; ``--capture eager`` gives a step's whole working memory."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device
        self.peak = self.rise = self.step_rise = None
        self.before = self.highest = self.steps_before = None

    def start(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
            self.before, self.highest, self.steps_before = torch.cuda.memory_allocated(self.device), 0, None

    def on_report(self, index: int) -> None:
        """Report ``index`` of the timed generation arrived (0: the prefill's): from there on, the steps."""
        if self.cuda and index == 0:
            self.highest = torch.cuda.max_memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.steps_before = torch.cuda.memory_allocated(self.device)

    def stop(self) -> None:
        if not self.cuda:
            return
        last = torch.cuda.max_memory_allocated(self.device)
        highest = max(self.highest, last)
        self.peak, self.rise = max(self.peak or 0, highest), max(self.rise or 0, highest - self.before)
        if self.steps_before is not None:
            self.step_rise = max(self.step_rise or 0, last - self.steps_before)

    def figures(self) -> dict:
        return {"peak_memory_bytes": self.peak, "peak_rise_bytes": self.rise, "step_rise_bytes": self.step_rise}


def _rate(tokens: int, seconds: float) -> float | None:
    return tokens / seconds if seconds > 0 and tokens > 0 else None


def pass_gaps(reports: list[float]) -> list[float]:
    """Milliseconds between the host's reads of successive reports (``reports``: seconds from the start, the
    prefill's first)."""
    return [1e3 * (b - a) for a, b in zip(reports, reports[1:])]


def pass_summary(gaps: list[float]) -> dict | None:
    """The passes' median, mean, slowest and count, so that one slow pass (a graph captured late) shows beside
    steady ones. With the host a step ahead (a GPU) the reads of a large batch's reports can come in pairs, short
    and long gaps in turn: there the mean is the pass's time, not the median."""
    if not gaps:
        return None
    return {"median": statistics.median(gaps), "mean": statistics.fmean(gaps), "max": max(gaps), "count": len(gaps)}


def _free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def is_ppd(method: str) -> bool:
    """Whether a row's method is PPD: the decoder as loaded, or a ``--trees`` variant."""
    return method == "ppd" or method.startswith("ppd:")


def _compare(rows: list[dict], methods: list[str]) -> None:
    """Identical-output shares against the reference and each PPD variant's speed-ups, on the rows of one
    context and batch."""
    here = {r["method"]: r for r in rows}
    reference = "baseline" if "baseline" in methods else "hf_static" if "hf_static" in methods else None
    expected = here[reference]["token_ids"] if reference and not here[reference]["error"] else None
    for row in rows:
        row["reference"] = reference
        row["identical_to_reference"] = (None if expected is None or row["error"] else
                                         sum(a == b for a, b in zip(row["token_ids"], expected)) / len(expected))
    for name, ppd in here.items():
        if not is_ppd(name):
            continue
        for other in ("baseline", "hf_static"):
            base = here.get(other, {})
            ppd[f"speedup_decode_vs_{other}"] = _ratio(ppd.get("decode_tokens_per_s"), base.get("decode_tokens_per_s"))
            ppd[f"speedup_vs_{other}"] = _ratio(ppd.get("tokens_per_s"), base.get("tokens_per_s"))


def run(args: argparse.Namespace) -> tuple[dict, PartialRun]:
    """Every context and batch size's rows (those a cut-off run of the same settings left in ``--output`` are
    not measured again), and the record that writes them."""
    check_contexts(args.contexts, args.max_new_tokens)
    if args.samples < 1:
        raise ContextError(f"--samples must be at least 1, got {args.samples}")
    loaded = load_decoder_or_exit(args, with_prompt_tokens="ppd" in args.methods or bool(args.trees))
    decoder = loaded.decoder
    # Each method on the loaded decoder, then each --trees file on a decoder of its own.
    variants = {**{m: (decoder, m) for m in args.methods},
                **{variant_name(f): (decoder.with_trees(trees), "ppd")
                   for f, trees in tree_files(args.trees, args.tree_choice, args.lookup).items()}}
    device = decoder.device
    check_contexts(args.contexts, args.max_new_tokens, decoder.capacity, decoder.capacity_reason)
    # Each context and batch size is written once all its methods are measured.
    partial = PartialRun(args.output, run_settings(args, device, ("contexts", "batch_sizes", "output", "plot")))
    header = {"model": loaded.info.model_id, "adapter": loaded.adapter, "tree": loaded.tree,
              "max_new_tokens": args.max_new_tokens, "capture": args.capture,
              "dtype": str(decoder.dtype).removeprefix("torch."), "capacity": decoder.capacity,
              "attention": decoder.attention.value, "prompt_source": conversation_source(args.data_path)[0],
              "args": vars(args), "environment": environment(device)}
    with compile_limits():  # hf_static compiles its forward once per shape (batch size, cache length) on a GPU
        for context in args.contexts:
            prompts = long_prompts(loaded.tokenizer, context - args.max_new_tokens,
                                   max(args.batch_sizes) * args.samples, args.data_path)
            for batch in args.batch_sizes:
                if len(partial.measured(context=context, batch_size=batch)) == len(variants):
                    print(f"context {context:6d} | batch {batch:4d} | measured already in {args.output}",
                          file=sys.stderr)
                    continue
                batches = [prompts[i * batch:(i + 1) * batch] for i in range(args.samples)]
                inputs = [p for rows in batches for p in rows]
                here = []
                for name, (own, method) in variants.items():
                    row = {"context": context, "batch_size": batch, "method": name,
                           "prompt_tokens_min": min(map(len, inputs)), "prompt_tokens_max": max(map(len, inputs))}
                    try:
                        row.update(measure(loaded, method, batches, args, decoder=own))
                    except torch.cuda.OutOfMemoryError as error:
                        row.update(error=f"out of memory: {str(error).splitlines()[0]}", token_ids=None)
                    if row["error"]:
                        _free_memory(device)  # out of the except block: its traceback no longer holds tensors
                    speed = (f"{row['decode_tokens_per_s'] or 0:9.1f} decode tokens/s | {row['tokens_per_s']:9.1f} "
                             "tokens/s" if not row["error"] else "out of memory")
                    if not row["error"] and row.get("pass_ms"):
                        gaps = row["pass_ms"]
                        speed += (f" | a pass {gaps['median']:.2f} ms (mean {gaps['mean']:.2f}, slowest "
                                  f"{gaps['max']:.2f})")
                    if row.get("captured_while_timed"):
                        speed += f" | {len(row['captured_while_timed'])} graphs captured while timed"
                    print(f"context {context:6d} | batch {batch:4d} | {name:9s} | {speed}", file=sys.stderr)
                    here.append(row)
                _compare(here, list(variants))
                for row in here:
                    row.pop("token_ids", None)
                partial.add(here, header)
    rows = [r for context in args.contexts for batch in args.batch_sizes
            for r in partial.measured(context=context, batch_size=batch)]
    return {**header, "rows": rows}, partial


# ---------------------------------------------------------------------------------------------- reporting
def _cell(row: dict | None, field: str, spec: str, suffix: str = "") -> str:
    if row is None:
        return "-"
    if row.get("error"):
        return "OOM" if row["error"].startswith("out of memory") else "error"
    value = row.get(field)
    return "-" if value is None else f"{value:{spec}}{suffix}"


def _gib(row: dict) -> str:
    """The peak GiB, and in brackets its rise over what was allocated when the timed generation began (the
    prefill's and the steps' working memory, without the caches and weights already there), then the steps' own
    rise over what was allocated once the prefill had reported, where measured."""
    peak = None if row.get("error") else row.get("peak_memory_bytes")
    if peak is None:
        return _cell(row, "peak_memory_bytes", "")
    rise, steps = row.get("peak_rise_bytes"), row.get("step_rise_bytes")
    inner = [f"+{rise / 2 ** 30:.1f}"] if rise is not None else []
    inner += [f"steps +{steps / 2 ** 30:.2f}"] if steps is not None else []
    return f"{peak / 2 ** 30:.1f}" + (f" ({', '.join(inner)})" if inner else "")


def table(result: dict) -> str:
    methods = list(dict.fromkeys(r["method"] for r in result["rows"]))
    others = [m for m in ("baseline", "hf_static") if m in methods]
    ppds = [m for m in methods if is_ppd(m)]
    lines = ["| context | batch | prompt tokens | " + " | ".join(f"{m} decode tokens/s" for m in methods)
             + "".join(f" | {p} vs {m} (decode, end to end)" for p in ppds for m in others)
             + "".join(f" | {p} accept length" for p in ppds) + (" | accept length" if not ppds else "")
             + f" | identical | peak GiB ({' / '.join(methods)}) |"]
    lines.append("|---" * (len(lines[0].split("|")) - 2) + "|")
    for context, batch in dict.fromkeys((r["context"], r["batch_size"]) for r in result["rows"]):
        here = {r["method"]: r for r in result["rows"] if (r["context"], r["batch_size"]) == (context, batch)}
        any_row = next(iter(here.values()))
        cells = [str(context), str(batch), f"{any_row['prompt_tokens_min']}-{any_row['prompt_tokens_max']}"]
        cells += [_cell(here[m], "decode_tokens_per_s", ".0f") for m in methods]
        cells += [f"{_cell(here[p], f'speedup_decode_vs_{m}', '.2f', 'x')}, "
                  f"{_cell(here[p], f'speedup_vs_{m}', '.2f', 'x')}" for p in ppds for m in others]
        cells += ([_cell(here[p], "accept_length", ".2f") for p in ppds]
                  or [_cell(here.get("baseline"), "accept_length", ".2f")])
        cells.append(" / ".join(f"{m} {_cell(here[m], 'identical_to_reference', '.0%')}" for m in methods
                                if m != here[m].get("reference")) or "-")
        cells.append(" / ".join(_gib(here[m]) for m in methods))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    ppd = [r for r in result["rows"] if is_ppd(r["method"]) and r.get("speedup_decode_vs_baseline")]
    several = len({r["method"] for r in ppd}) > 1
    for method, batch in dict.fromkeys((r["method"], r["batch_size"]) for r in ppd):
        here = [r for r in ppd if (r["method"], r["batch_size"]) == (method, batch)]
        ax.plot([r["context"] for r in here], [r["speedup_decode_vs_baseline"] for r in here], marker="o",
                label=f"{method}, batch {batch}" if several else f"batch {batch}")
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=1, label="baseline")
    ax.axhline(1.5, color="tab:green", linestyle=":", linewidth=1, label="1.5x")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context length (prompt + new tokens)")
    ax.set_ylabel("decode tokens/s / baseline")
    ax.set_title(f"{result['model']}, {result['dtype']}, {result['environment']['device']}", fontsize=9)
    ax.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    try:
        with torch.no_grad():
            result, partial = run(args)
    except (ContextError, SettingsMismatch) as error:
        print(f"long_context: error: {error}", file=sys.stderr)
        return 2
    print(f"{result['model']} ({result['adapter']}, {result['tree']}) on {result['environment']['device']}, "
          f"{result['dtype']}, max_new_tokens={result['max_new_tokens']}")
    print(table(result))
    partial.finish({**result, "command": " ".join(["python -m eval.long_context", *(argv or sys.argv[1:])])})
    if args.plot:
        plot(result, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())

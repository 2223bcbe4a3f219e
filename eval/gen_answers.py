"""Answer a benchmark with one decoding method and record every answer's tokens and timing (JSONL).

Usage:
    python -m eval.gen_answers (--bench mt_bench | --question_file FILE) --method ppd --model smollm2-135m-instruct \\
        [--adapter DIR] [--tree FILE] [--temperature 0] [--top_p P] [--top_k K] [--acceptance lossless|typical] \\
        [--max_new_tokens N] [--offset S] [--limit K] [--num_runs R] --output results/answers/mt_bench-ppd.jsonl

Methods: ``ppd`` (prompt tokens + tree), ``baseline`` (the same engine, one token per step),
``hf_static`` (transformers ``generate`` with ``cache_implementation="static"``, which compiles the
decoding forward), ``hf`` (transformers ``generate``, eager) and ``pld`` (transformers prompt lookup,
``prompt_lookup_num_tokens``). MT-Bench runs both turns, the second after the model's own first answer.
``--question_file`` answers an MT-Bench-format JSONL file instead (``question_id``, ``category``, ``turns``,
optionally ``reference``; as FastChat and Spec-Bench write them; see ``eval.benchmarks``), every turn after
the model's own answers to the turns before it. Its answers are labelled with the file's name (as ``bench``)
and carry ``question_file`` and ``question_file_sha256``; every answer carries its question's ``category``.
With ``--temperature`` above 0 every method samples (top-p and top-k as given); ppd verifies its guesses
losslessly unless ``--acceptance typical`` asks for typical acceptance.

Nothing compiles or captures inside the timed region: ``ppd`` and ``baseline`` compile and capture their
steps for every attention width first (``Decoder.warmup``; the seconds are recorded as ``startup_s``),
and every method then runs ``--warmup`` untimed generations of the first prompt. ``hf_static`` also warms
up on a prompt twice as long, so that torch has made the cache length dynamic before timing (transformers
grows its static cache to the longest request seen). One JSON line per question, turn and run, appended as
it is made: a run started again with the same ``--output`` skips what is already there. It must ask for the
answers' settings (benchmark or question file and its content, method, model, adapter, tree, dtype,
temperature, max_new_tokens and device; the capture mode may change): a file of other answers is an error,
not a mix. Those that the arguments give are checked before the model loads, the adapter, tree, dtype and
device once it has.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ppd.chat import chat_input_ids, plain_input_ids
from ppd.cli import Loaded, add_adapter_args, add_engine_args, add_model_args, load_decoder_or_exit
from ppd.config import DecodeConfig
from ppd.decoder import eos_ids_of

from .benchmarks import (BENCHMARKS, DEFAULT_MAX_NEW_TOKENS, QUESTION_FILE_MAX_NEW_TOKENS, RAW_PROMPT, Question,
                         QuestionFileError, load_benchmark, load_question_file)
from .records import environment, recorded

METHODS = ("ppd", "baseline", "hf_static", "hf", "pld")
ENGINE_METHODS = ("ppd", "baseline")  # decoded by ppd's engine; the others by transformers' generate


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m eval.gen_answers", description=__doc__.split("\n")[0])
    questions = parser.add_mutually_exclusive_group(required=True)
    questions.add_argument("--bench", choices=BENCHMARKS, help="a built-in benchmark")
    questions.add_argument("--question_file", metavar="FILE",
                           help="MT-Bench-format JSONL (question_id, category, turns[, reference]), e.g. Spec-Bench's")
    parser.add_argument("--method", required=True, choices=METHODS)
    add_model_args(parser)
    add_adapter_args(parser)
    add_engine_args(parser)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top_p", type=float, default=1.0, help="nucleus mass when sampling")
    parser.add_argument("--top_k", type=int, default=0, help="sample among the k most likely tokens (0: all)")
    parser.add_argument("--acceptance", choices=["lossless", "typical"], default="lossless",
                        help="ppd, temperature > 0: lossless verification (exact samples) or typical acceptance")
    parser.add_argument("--max_new_tokens", type=int, default=None, help="default: 1024 (512 for humaneval)")
    parser.add_argument("--offset", type=int, default=0, help="skip the first S questions (for shards)")
    parser.add_argument("--limit", type=int, default=None, help="K questions only (the first K after --offset)")
    parser.add_argument("--num_runs", type=int, default=1, help="timed runs of every question and turn")
    parser.add_argument("--warmup", type=int, default=3, help="untimed generations before timing")
    parser.add_argument("--prompt_lookup_num_tokens", type=int, default=10, help="pld: tokens drafted per lookup")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", required=True, help="JSONL file (appended; existing lines are kept)")
    return parser


class ForwardCounter:
    """Counts the model's forward passes (for ``hf`` and ``pld``, whose steps transformers does not report)."""

    def __init__(self, model):
        self.count = 0
        self._handle = model.register_forward_pre_hook(self._hook)

    def _hook(self, module, args):
        self.count += 1


class Answerer:
    def __init__(self, args: argparse.Namespace, loaded: Loaded | None = None):
        """``loaded``: a model and decoder already loaded as ``args`` say (one process answering with several
        methods or settings keeps one decoder, and its compiled steps); default: load them."""
        self.args = args
        loaded = loaded or load_decoder_or_exit(args, with_prompt_tokens=args.method == "ppd")
        self.model, self.tokenizer, self.decoder = loaded.model, loaded.tokenizer, loaded.decoder
        # Only ppd reads prompt tokens and a tree: the other methods' answers name none.
        self.adapter, self.tree = (loaded.adapter, loaded.tree) if args.method == "ppd" else ("none", "none")
        self.dtype = str(self.model.dtype).removeprefix("torch.")
        self.device = self.model.get_input_embeddings().weight.device
        self.eos = sorted(eos_ids_of(self.model, self.tokenizer))
        self.counter = ForwardCounter(self.model) if args.method not in ENGINE_METHODS else None
        self.environment = environment(self.device)
        self.startup_s = 0.0

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def start(self) -> None:
        """Compile and capture ppd's steps before anything is timed."""
        if self.args.method in ENGINE_METHODS:
            start = time.perf_counter()
            self.decoder.warmup(methods=[self.args.method], capture=self.args.capture,
                                sampling=self.config(1))
            self.startup_s = time.perf_counter() - start

    def config(self, max_new_tokens: int) -> DecodeConfig:
        """The engine's settings for one answer."""
        return sampling_config(self.args, max_new_tokens, method=self.args.method, capture=self.args.capture)

    def answer(self, ids: list[int], max_new_tokens: int) -> dict:
        args = self.args
        if args.method in ENGINE_METHODS:
            out = self.decoder.generate(ids, self.config(max_new_tokens))
            return {"token_ids": out.token_ids, "steps": out.steps, "wall_time_s": out.wall_time_s,
                    "finish_reason": out.finish_reason}
        inputs = torch.tensor([ids], device=self.device)
        kwargs = {"max_new_tokens": max_new_tokens, "eos_token_id": self.eos or None,
                  "pad_token_id": self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0}
        if args.temperature > 0:
            torch.manual_seed(args.seed)
            kwargs.update(do_sample=True, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k or None)
        else:
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        if args.method == "pld":
            kwargs["prompt_lookup_num_tokens"] = args.prompt_lookup_num_tokens
        if args.method == "hf_static":
            kwargs["cache_implementation"] = "static"
        self._sync()
        self.counter.count = 0
        graphs = _compiled_graphs()
        start = time.perf_counter()
        out = self.model.generate(inputs, attention_mask=torch.ones_like(inputs), **kwargs)
        self._sync()
        wall = time.perf_counter() - start
        tokens = out[0, len(ids):].tolist()
        finish = "eos" if tokens and tokens[-1] in self.eos else "length"
        # The first forward is the prefill; every later one is a decoding step.
        return {"token_ids": tokens, "steps": max(1, self.counter.count - 1), "wall_time_s": wall,
                "finish_reason": finish, "compiled_graphs": _compiled_graphs() - graphs}


def sampling_config(args: argparse.Namespace, max_new_tokens: int, **fields) -> DecodeConfig:
    """The decoding settings of ``args`` (temperature, filters, acceptance, seed); raises ValueError."""
    return DecodeConfig(max_new_tokens=max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                        top_k=args.top_k, acceptance=args.acceptance, seed=args.seed, **fields)


def sampling_fields(args: argparse.Namespace) -> dict:
    """The sampling settings a record keeps: none when greedy (they change nothing there), and the acceptance
    rule only for ppd."""
    if args.temperature == 0:
        return {}
    fields = {"top_p": args.top_p, "top_k": args.top_k}
    if args.method == "ppd":
        fields["acceptance"] = args.acceptance
    return fields


def turn_messages(turns: list[str], answers: list[str]) -> list[dict]:
    """The conversation that asks user turn ``len(answers)``: the turns before it, each followed by the
    model's own answer text (as recorded), then that turn."""
    messages = []
    for text, answer in zip(turns, answers):
        messages += [{"role": "user", "content": text}, {"role": "assistant", "content": answer}]
    return messages + [{"role": "user", "content": turns[len(answers)]}]


def prompt_ids(tokenizer, bench: str, messages: list[dict]) -> list[int]:
    """The prompt of a turn: the chat template over the conversation, or the raw text of completion benchmarks."""
    if bench in RAW_PROMPT:
        return plain_input_ids(tokenizer, messages[-1]["content"])
    return chat_input_ids(tokenizer, messages)


def questions_of(args: argparse.Namespace) -> tuple[str, list[Question], dict]:
    """The label of the answers (the benchmark, or the question file's name), the questions, and the fields that
    name a question file in every record (none for a built-in benchmark); raises QuestionFileError."""
    if args.bench:
        return args.bench, load_benchmark(args.bench), {}
    source = load_question_file(args.question_file)
    return source.name, source.questions, {"question_file": source.name, "question_file_sha256": source.sha256}


def _compiled_graphs() -> int:
    """Graphs torch.compile has made so far in this process (a timed answer that compiles says so)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _done(path: Path) -> dict[tuple[str, int, int], dict]:
    """Records already written (a resumed run skips them; MT-Bench's second turn reuses the first answer)."""
    done = {}
    if not path.exists():
        return done
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if number < len(lines):
                raise ValueError(f"{path}:{number} is not JSON; only a last line cut short is repaired") from None
            # A run killed in the middle of writing its last line: drop that line and redo the answer.
            print(f"{path}: dropping a last line cut short", file=sys.stderr)
            path.write_text("".join(kept + "\n" for kept in lines[:-1]), encoding="utf-8")
            break
        done[(record["question_id"], record["turn"], record.get("run", 0))] = record
    return done


def _other_settings(path: Path, records, wanted: dict) -> str | None:
    """Why the answers already in ``path`` cannot be resumed with these settings, or None if they can."""
    for record in records:
        for field, value in wanted.items():
            if (found := recorded(record, field)) != value:
                return (f"{path} holds answers made with {field} {found!r}, but this run asks for {value!r}: "
                        "choose another --output or remove the file")
    return None


def main(argv: list[str] | None = None, loaded: Loaded | None = None) -> int:
    """Answer as ``argv`` says; ``loaded``: a model and decoder already loaded as those flags ask (see
    :class:`Answerer`)."""
    parser = make_parser()
    args = parser.parse_args(argv)
    if args.num_runs < 1 or args.warmup < 0 or args.offset < 0 or (args.limit is not None and args.limit < 1):
        parser.error("--num_runs and --limit must be >= 1, --warmup and --offset >= 0")
    max_new_tokens = args.max_new_tokens or (DEFAULT_MAX_NEW_TOKENS[args.bench] if args.bench
                                             else QUESTION_FILE_MAX_NEW_TOKENS)
    try:  # the decoding settings every method shares, checked before anything loads
        sampling_config(args, max_new_tokens)
    except ValueError as error:
        parser.error(str(error))
    try:
        bench, questions, source = questions_of(args)
    except QuestionFileError as error:
        print(f"gen_answers: error: {error}", file=sys.stderr)
        return 2
    # A question file is asked through the chat template, as MT-Bench is (never as raw completion prompts).
    prompt_kind = args.bench or "question_file"
    if args.offset >= len(questions):
        parser.error(f"--offset {args.offset} is past the {len(questions)} questions of {bench}")
    end = None if args.limit is None else args.offset + args.limit
    questions = questions[args.offset:end]
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    done = _done(output)
    wanted = {"bench": bench, **source, "method": args.method, "model": args.model, "temperature": args.temperature,
              "max_new_tokens": max_new_tokens, **sampling_fields(args)}
    if problem := _other_settings(output, done.values(), wanted):  # checked before the model loads
        print(f"gen_answers: error: {problem}", file=sys.stderr)
        return 2
    if all((q.question_id, turn, run) in done for q in questions for turn in range(len(q.turns))
           for run in range(args.num_runs)):
        print(f"{output}: every answer is there already", file=sys.stderr)
        return 0
    answerer = Answerer(args, loaded)
    wanted.update(adapter=answerer.adapter, tree=answerer.tree, dtype=answerer.dtype,
                  device=answerer.environment["device"])
    if problem := _other_settings(output, done.values(), wanted):
        print(f"gen_answers: error: {problem}", file=sys.stderr)
        return 2

    answerer.start()
    first = prompt_ids(answerer.tokenizer, prompt_kind, turn_messages(questions[0].turns, []))
    for _ in range(args.warmup):
        answerer.answer(first, min(max_new_tokens, 64))
    if args.method == "hf_static" and args.warmup:
        answerer.answer(first + first, max_new_tokens)

    total_turns = sum(len(q.turns) for q in questions) * args.num_runs
    new_tokens = steps = 0
    wall = 0.0
    with output.open("a", encoding="utf-8") as sink, tqdm(total=total_turns, unit="turn", desc=args.method) as bar:
        for question in questions:
            for run in range(args.num_runs):
                answers: list[str] = []
                for turn in range(len(question.turns)):
                    key = (question.question_id, turn, run)
                    if key in done:
                        record = done[key]
                    else:
                        ids = prompt_ids(answerer.tokenizer, prompt_kind, turn_messages(question.turns, answers))
                        result = answerer.answer(ids, max_new_tokens)
                        record = {
                            "bench": bench, **source, "question_id": question.question_id,
                            "category": question.category, "turn": turn, "run": run,
                            "method": args.method, "model": args.model, "adapter": answerer.adapter,
                            "tree": answerer.tree, "dtype": answerer.dtype,
                            "capture": args.capture if args.method in ENGINE_METHODS else None,
                            "packed_weights": bool(answerer.decoder.packed) if args.method in ENGINE_METHODS else None,
                            "startup_s": answerer.startup_s,
                            "temperature": args.temperature, **sampling_fields(args),
                            "max_new_tokens": max_new_tokens,
                            "prompt_tokens": len(ids), "new_tokens": len(result["token_ids"]),
                            **result,
                            "text": answerer.tokenizer.decode(result["token_ids"], skip_special_tokens=True),
                            "environment": answerer.environment,
                        }
                        sink.write(json.dumps(record) + "\n")
                        sink.flush()
                        new_tokens += record["new_tokens"]
                        steps += record["steps"]
                        wall += record["wall_time_s"]
                    answers.append(record["text"])
                    bar.update(1)
    if steps:
        print(f"{bench} / {args.method}: {new_tokens} new tokens in {wall:.1f} s = {new_tokens / wall:.1f} "
              f"tokens/s, accept length {new_tokens / steps:.2f} (this run's answers)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Make the datasets prompt tokens are trained on: truncated conversations, distillation targets, and
self-distilled conversations.

Usage (from the repository root):

    # truncated dataset: the default ShareGPT conversations, the default model's chat template
    python -m data_gen.generate --dataset_type finetune --output_path data/sharegpt_truncated

    # distillation dataset: the model's own greedy tokens and top-k log-probabilities for t+2..t+N+1
    python -m data_gen.generate --dataset_type distillation --data_path data/sharegpt_truncated \\
        --output_path data/sharegpt_distill

    # self-distilled conversations: the model answers the first --max_turns user turns of each source
    # conversation itself (greedy by default; --temperature/--top_p/--seed sample), then the same two types
    # from them; on its own greedy text, --teacher forced gives the greedy targets in one forward each
    python -m data_gen.generate --dataset_type conversations --output_path data/self_distill \\
        --max_turns 2 --max_new_tokens 512 --batch_size 64
    python -m data_gen.generate --dataset_type distillation --data_path data/self_distill --teacher forced \\
        --output_path data/self_distill_targets

    # the same work split over processes / GPUs, merged at the end (on a machine without a GPU, add
    # --multi_gpu: it is what makes accelerate start the processes with torchrun)
    accelerate launch --num_processes 2 -m data_gen.generate --dataset_type distillation ...

``--data_path`` for ``finetune`` and ``conversations`` is a ShareGPT/messages ``.json`` or ``.jsonl`` file, a
``save_to_disk`` folder (a ``conversations`` dataset of this program included) or a hub id (default: the
embedded ShareGPT file). For ``distillation`` it is a truncated dataset from this program, or any
conversation source (truncated on the fly). Records whose user turns contain an MT-Bench, Alpaca Eval,
HumanEval or GSM8K prompt are dropped and counted (``--exclude_eval_prompts``, on by default).

``conversations`` decodes with the engine's batched baseline (captured on a GPU), which at batch 128 out-ran
greedy PPD (``--decode_method ppd``, lossless, opt-in). A conversation uses at most
``--model_max_length`` tokens (prompt and reply); a prompt with no room left for ``--max_new_tokens`` is
skipped and counted. Sampling is seeded per decoding batch from (``--seed``, shard, turn, batch), so the
same command gives the same data (for the same ``--shard_size`` and ``--batch_size``).

Work is written in shards next to the output (``OUTPUT.shards/``); running the same command again after an
interruption resumes it. ``--overwrite`` replaces only a dataset (and shards) this program made; anything
else at the output path is refused. One run at a time writes an output (a lock on ``.OUTPUT.lock`` beside
it): a second is refused.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import shutil
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from ppd.config import DecodeMethod
from ppd.conversations import MalformedRecord, load_conversations, record_id, to_example, user_prompts
from ppd.dataset_info import DatasetType, PPDDatasetInfo
from ppd.models import DEFAULT_MODEL, load_model, load_tokenizer, resolve_dtype, resolve_model
from ppd.prompt_tokens import packaged_adapter
from ppd.self_distill import SelfDistillConfig, default_method, make_decoder, self_distill
from ppd.teacher import TeacherOutput, forced_teacher_topk, length_batches, shared_sequences, teacher_topk
from ppd.truncation import truncate

from .eval_prompts import SKIP_REASON as EVAL_PROMPT_REASON
from .eval_prompts import EvalPromptFilter
from .shards import (OutputPathError, SettingsMismatch, ShardStore, output_lock, recognise_dataset, recognise_shards,
                     save_dataset_atomic)

logger = logging.getLogger("data_gen")

# 50 keeps about 94-97 % of the teacher's probability mass on ShareGPT for the default model while the
# stored targets are ~1000x smaller than full-vocabulary logits (measured: see README, "Training data").
DEFAULT_TOP_K = 50


@dataclass
class DataGenArguments:
    dataset_type: DatasetType = field(metadata={"help": "finetune: truncated conversations; "
                                                        "distillation: plus the model's own top-k targets; "
                                                        "conversations: the model's own replies to the user turns"})
    output_path: str = field(metadata={"help": "folder the dataset is saved to (datasets.save_to_disk)"})
    model: str = field(default=DEFAULT_MODEL, metadata={
        "aliases": ["--model_name_or_path"], "help": "alias, Hugging Face folder or hub id of the target model"})
    data_path: str | None = field(default=None, metadata={
        "help": "conversations (.json/.jsonl/save_to_disk folder/hub id; default: embedded ShareGPT) or, for "
                "distillation, a truncated dataset made by this program"})
    num_prompt_tokens: int = field(default=3, metadata={
        "aliases": ["--num_special_tokens"], "help": "N: each example keeps N+1 tokens after the cut"})
    chat_template: str = field(default="auto", metadata={
        "help": "how conversations are rendered: auto (the model's chat template, else a plain 'User:/Assistant:' "
                "transcript for a base model), plain, none or a Jinja file"})
    model_max_length: int = field(default=2048, metadata={
        "help": "tokens of a conversation that are used (conversations: prompt and reply, at most)"})
    max_samples: int | None = field(default=None, metadata={
        "help": "use only the first K records of the source (conversations, or rows of a truncated dataset)"})
    seed: int = field(default=42, metadata={
        "help": "seed of the cut points (each record has its own stream), or of sampling for conversations"})
    cuts_per_conversation: int = field(default=1, metadata={
        "help": "distinct cut points drawn inside the same last assistant reply"})
    top_k: int = field(default=DEFAULT_TOP_K, metadata={"help": "teacher entries kept per position"})
    teacher: Literal["greedy", "forced"] = field(default="greedy", metadata={
        "help": "distillation targets: greedy (N+1 greedy steps from each cut) or forced (read with the text "
                "itself as the context, one forward per conversation; the same on self-distilled greedy text)"})
    batch_tokens: int = field(default=16384, metadata={"help": "teacher batch size in padded tokens"})
    max_batch_size: int = field(default=64, metadata={"help": "teacher batch size in rows, at most"})
    max_turns: int = field(default=2, metadata={"help": "conversations: user turns the model answers, at most"})
    max_new_tokens: int = field(default=512, metadata={"help": "conversations: tokens per reply, at most"})
    temperature: float = field(default=0.0, metadata={"help": "conversations: 0 = greedy; > 0 samples"})
    top_p: float = field(default=1.0, metadata={"help": "conversations: nucleus mass when sampling"})
    batch_size: int = field(default=64, metadata={"help": "conversations: prompts per decoding batch"})
    decode_method: Literal["ppd", "baseline"] | None = field(default=None, metadata={
        "help": "conversations: ppd (the shipped adapter; lossless when greedy) or baseline (default: ppd for "
                "greedy decoding when an adapter ships for the model, else baseline)"})
    capture: str = field(default="auto", metadata={
        "help": "conversations: how the decoder's step runs: auto (compiled graph on a GPU, compiled on a CPU) | eager | graph | "
                "compile | compiled_graph | reduce_overhead"})
    exclude_eval_prompts: bool = field(default=True, metadata={
        "help": "drop (and count) source records whose user turns contain an MT-Bench, Alpaca Eval, HumanEval "
                "or GSM8K prompt"})
    shard_size: int = field(default=512, metadata={"help": "source records per shard (the unit of resumption)"})
    dtype: str | None = field(default=None, metadata={
        "help": "dtype of the teacher or of the model answering (default: fp32 on CPU, bf16 on GPU)"})
    load_in_4bit: bool = field(default=False, metadata={"help": "NF4 teacher via bitsandbytes (GPU)"})
    overwrite: bool = field(default=False, metadata={
        "help": "replace an existing output and its shards (only ones this program made)"})
    keep_shards: bool = field(default=False, metadata={"help": "keep OUTPUT.shards/ after the merge"})

    def __post_init__(self):
        self.dataset_type = DatasetType(self.dataset_type)
        for name in ("num_prompt_tokens", "top_k", "batch_tokens", "max_batch_size", "shard_size",
                     "cuts_per_conversation", "max_turns", "max_new_tokens", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be at least 1, got {getattr(self, name)}")
        if self.model_max_length < self.num_prompt_tokens + 2:
            raise ValueError(f"--model_max_length {self.model_max_length} leaves no room for an input and "
                             f"{self.num_prompt_tokens + 1} label tokens")
        if self.max_samples is not None and self.max_samples < 1:
            raise ValueError("--max_samples must be at least 1")
        if self.load_in_4bit and self.dataset_type is not DatasetType.DISTILLATION:
            raise ValueError("--load_in_4bit only applies to the distillation teacher")
        if self.teacher not in ("greedy", "forced"):
            raise ValueError(f"--teacher must be greedy or forced, got {self.teacher!r}")
        if self.teacher != "greedy" and self.dataset_type is not DatasetType.DISTILLATION:
            raise ValueError("--teacher only applies to the distillation dataset")
        if self.dataset_type is DatasetType.CONVERSATIONS:
            if self.model_max_length <= self.max_new_tokens:
                raise ValueError(f"--model_max_length {self.model_max_length} leaves no room for a prompt and "
                                 f"--max_new_tokens {self.max_new_tokens}")
            self.self_distill_config(DecodeMethod.BASELINE, self.capture)  # temperature, top_p, capture checked

    def self_distill_config(self, method: DecodeMethod, capture: str) -> SelfDistillConfig:
        return SelfDistillConfig(max_turns=self.max_turns, max_new_tokens=self.max_new_tokens,
                                 temperature=self.temperature, top_p=self.top_p, batch_size=self.batch_size,
                                 method=method, capture=capture)


class EmptyDatasetError(RuntimeError):
    pass


def make_parser():
    from transformers import HfArgumentParser

    return HfArgumentParser(DataGenArguments, description=__doc__.split("\n\n")[0])


def _features(dataset_type: DatasetType):
    import datasets

    seq = getattr(datasets, "List", None) or datasets.Sequence
    if dataset_type is DatasetType.CONVERSATIONS:
        return datasets.Features({
            "id": datasets.Value("string"),
            "messages": [{"role": datasets.Value("string"), "content": datasets.Value("string")}],
            "reply_token_ids": seq(seq(datasets.Value("int32"))),
            "finish_reasons": seq(datasets.Value("string")),
        })
    columns = {"id": datasets.Value("string"), "input_ids": seq(datasets.Value("int32")),
               "labels": seq(datasets.Value("int32"))}
    if dataset_type is DatasetType.DISTILLATION:
        columns.update(
            teacher_token_ids=seq(datasets.Value("int32")),
            teacher_topk_ids=seq(seq(datasets.Value("int32"))),
            teacher_topk_logprobs=seq(seq(datasets.Value("float32"))),
        )
    return datasets.Features(columns)


@dataclass
class _Source:
    items: list  # conversation records, or rows of a truncated dataset
    kind: str  # "records" | "rows"
    description: str
    model_max_length: int
    seed: int
    cuts_per_conversation: int
    summary: dict | None = None  # the truncation run's summary, when the items are a truncated dataset
    eval_prompts_excluded: list[str] | None = None  # for rows: what the truncation run excluded


def _data_gen_dataset(path: Path | None):
    """``(dataset, its PPDDatasetInfo)`` when ``path`` is a dataset this program made, else ``None``."""
    if path is None or not (path / "dataset_info.json").is_file():
        return None
    import datasets

    dataset = datasets.load_from_disk(str(path))
    try:
        return dataset, PPDDatasetInfo.of(dataset)
    except (ValueError, AttributeError):  # another dataset (or a DatasetDict): an ordinary conversation source
        return None


def _open_source(args: DataGenArguments, model_id: str) -> _Source:
    path = Path(args.data_path).expanduser() if args.data_path else None
    made = _data_gen_dataset(path)
    if made is not None:
        dataset, info = made
        if info.dataset_type == DatasetType.CONVERSATIONS.value:
            if info.model != model_id:
                logger.warning("%s was self-distilled by %s; here its text trains %s", path, info.model, model_id)
            return _Source(dataset.select_columns(["id", "messages"]).to_list(), "records",
                           f"{info.source} (self-distilled by {info.model}: {path.resolve()})",
                           args.model_max_length, args.seed, args.cuts_per_conversation)
        if args.dataset_type is not DatasetType.DISTILLATION or info.dataset_type != DatasetType.FINETUNE.value:
            wanted = "a truncated dataset or conversations" if args.dataset_type is DatasetType.DISTILLATION \
                else "conversations"
            raise ValueError(f"{path} is a {info.dataset_type} dataset; {args.dataset_type.value} reads {wanted}")
        info.check_model(model_id)
        if info.num_prompt_tokens != args.num_prompt_tokens:
            raise ValueError(f"{path} was cut for {info.num_prompt_tokens} prompt tokens, not "
                             f"--num_prompt_tokens {args.num_prompt_tokens}")
        rows = dataset.select_columns(["id", "input_ids", "labels"]).to_list()
        logger.info("distilling %s: its cuts apply (max length %d, seed %d); --model_max_length, --seed and "
                    "--exclude_eval_prompts are not used", path, info.model_max_length, info.seed)
        return _Source(rows, "rows", f"{info.source} (truncated: {path.resolve()})", info.model_max_length,
                       info.seed, info.cuts_per_conversation, info.summary, info.eval_prompts_excluded)
    source = load_conversations(args.data_path)
    if source.note:
        logger.warning(source.note)
    return _Source(source.records, "records", source.description, args.model_max_length, args.seed,
                   args.cuts_per_conversation)


def _read_records(records: list, first_index: int, read, eval_filter: EvalPromptFilter | None,
                  skipped: Counter) -> list[tuple[int, str, list[dict]]]:
    """``(index, id, read(record))`` of every usable record; the others are counted in ``skipped``."""
    contaminated = eval_filter.contaminated(records) if eval_filter else [False] * len(records)
    usable = []
    for offset, (record, dropped) in enumerate(zip(records, contaminated)):
        index = first_index + offset
        try:
            messages = read(record)
        except MalformedRecord as error:
            skipped[error.reason] += 1
            continue
        if dropped:
            skipped[EVAL_PROMPT_REASON] += 1
            continue
        usable.append((index, record_id(record, index), messages))
    return usable


def _truncate_records(records: list, first_index: int, tokenizer, args: DataGenArguments, source: _Source,
                      eval_filter: EvalPromptFilter | None, skipped: Counter) -> list[dict]:
    rows = []
    for index, rid, messages in _read_records(records, first_index, to_example, eval_filter, skipped):
        # One random stream per record: the cut does not depend on sharding or process count.
        rng = np.random.default_rng([source.seed, index])
        try:
            cuts = truncate(tokenizer, messages, args.num_prompt_tokens, source.model_max_length, rng,
                            source.cuts_per_conversation)
        except MalformedRecord as error:
            skipped[error.reason] += 1
            continue
        rows.extend({"id": rid, "input_ids": c.input_ids, "labels": c.labels} for c in cuts)
    return rows


def _store_targets(rows: list[dict], order: list[int], out: TeacherOutput) -> None:
    for j, i in enumerate(order):
        rows[i]["teacher_token_ids"] = out.token_ids[j].tolist()
        rows[i]["teacher_topk_ids"] = out.topk_ids[j].tolist()
        rows[i]["teacher_topk_logprobs"] = out.topk_logprobs[j].tolist()


def _add_teacher(rows: list[dict], model, args: DataGenArguments, pad_token_id: int, progress) -> int:
    """Fill in the teacher columns; returns the number of sequences the teacher ran forwards over."""
    n = args.num_prompt_tokens
    if args.teacher == "forced":
        # The cuts of one conversation are prefixes of one sequence: one forward reads all of them.
        groups = shared_sequences([r["id"] for r in rows], [r["input_ids"] for r in rows],
                                  [r["labels"] for r in rows], n)
        for batch in length_batches([len(g.sequence) for g in groups], args.batch_tokens, args.max_batch_size):
            out = forced_teacher_topk(model, [groups[g].sequence for g in batch], [groups[g].cuts for g in batch],
                                      n, args.top_k, pad_token_id)
            order = [i for g in batch for i in groups[g].rows]
            _store_targets(rows, order, out)
            progress(len(order))
        return len(groups)
    lengths = [len(r["input_ids"]) for r in rows]
    for batch in length_batches(lengths, args.batch_tokens, args.max_batch_size):
        _store_targets(rows, batch, teacher_topk(model, [rows[i]["input_ids"] for i in batch], n, args.top_k,
                                                 pad_token_id))
        progress(len(batch))
    return len(rows)


def _self_distill_shard(records: list, first_index: int, shard: int, tokenizer, decoder, config: SelfDistillConfig,
                        args: DataGenArguments, eval_filter: EvalPromptFilter | None, skipped: Counter,
                        progress) -> tuple[list[dict], dict]:
    read = lambda record: user_prompts(record, args.max_turns)  # noqa: E731
    prompts = [(rid, messages) for _, rid, messages in _read_records(records, first_index, read, eval_filter, skipped)]
    progress(len(records) - len(prompts), 0)  # records left out before decoding
    result = self_distill(decoder, tokenizer, prompts, config, seed_key=(args.seed, shard), progress=progress)
    skipped.update(result.skipped)
    return [c.row() for c in result.conversations], {
        "replies": result.replies, "generated_tokens": result.generated_tokens,
        "decode_seconds": result.decode_seconds, "turns_dropped": dict(result.turns_dropped)}


def _shard_summary(items: int, rows: list[dict], skipped: Counter, seconds: float, teacher: bool,
                   extra: dict) -> dict:
    summary = {"items": items, "rows": len(rows), "skipped": dict(skipped), "seconds": seconds, **extra}
    if rows and "input_ids" in rows[0]:
        summary["input_tokens"] = sum(len(r["input_ids"]) for r in rows)
    if teacher and rows:
        mass = np.exp(np.array([r["teacher_topk_logprobs"] for r in rows], dtype=np.float64)).sum(-1)
        summary["topk_mass_sum"] = mass.sum(0).tolist()  # per prompt token, summed over rows
    return summary


_SUMMED = ("items", "rows", "seconds", "input_tokens", "teacher_sequences", "replies", "generated_tokens",
           "decode_seconds")


def _merge_summaries(summaries: list[dict]) -> dict:
    total = {key: sum(s.get(key, 0) for s in summaries) for key in _SUMMED
             if key in ("items", "rows", "seconds") or any(key in s for s in summaries)}
    for key in ("skipped", "turns_dropped"):
        counts: Counter = Counter()
        for s in summaries:
            counts.update(s.get(key, {}))
        if key == "skipped" or counts:
            total[key] = dict(sorted(counts.items(), key=lambda kv: -kv[1]))
    seconds = total["seconds"]
    total["rows_per_s"] = total["rows"] / seconds if seconds > 0 else None
    if "generated_tokens" in total:
        total["generated_tokens_per_s"] = total["generated_tokens"] / seconds if seconds > 0 else None
    mass = [s["topk_mass_sum"] for s in summaries if "topk_mass_sum" in s]
    if mass and total["rows"]:
        total["topk_mass_mean"] = (np.array(mass).sum(0) / total["rows"]).round(5).tolist()
    return total


def _decode_method(args: DataGenArguments, model_id: str) -> DecodeMethod:
    if args.decode_method is None:
        return default_method(model_id, args.temperature)
    method = DecodeMethod(args.decode_method)
    if method is DecodeMethod.PPD and packaged_adapter(model_id) is None:
        raise ValueError(f"--decode_method ppd needs the adapter shipped for the model, and none ships for "
                         f"{model_id}: use --decode_method baseline")
    if method is DecodeMethod.PPD and args.temperature > 0:
        logger.warning("PPD sampling accepts guesses by typical acceptance: the replies are close to, not exactly, "
                       "samples of the model (--decode_method baseline samples exactly)")
    return method


def run(args: DataGenArguments, state=None) -> PPDDatasetInfo | None:
    """Make the dataset; returns its metadata on the main process (``None`` on the others)."""
    import datasets
    from accelerate import PartialState

    # Without a GPU, processes started by `accelerate launch --multi_gpu` must be told to pair up over CPU.
    state = state or PartialState(cpu=not torch.cuda.is_available())
    datasets.disable_progress_bars()  # the run has its own progress bar
    output = Path(args.output_path)
    shards_root = output.with_name(output.name + ".shards")
    # Before any work: an output path that is a file, or holds what this program did not make, is refused.
    found_output, found_shards = recognise_dataset(output), recognise_shards(shards_root)
    if output.exists() and not args.overwrite:
        raise FileExistsError(f"{output} exists; pass --overwrite to replace it")
    if found_output:
        raise OutputPathError(f"--overwrite replaces only a dataset made by data_gen, and {output} is not one "
                              f"({found_output}): remove it yourself or choose another --output_path")
    if found_shards:
        raise OutputPathError(f"{shards_root}, where data_gen keeps the work for {output}, holds what data_gen did "
                              f"not make ({found_shards}): move it away or choose another --output_path")
    # One run per output: the main process holds the lock until the dataset is written (the others wait for it).
    with output_lock(output) if state.is_main_process else contextlib.nullcontext():
        if args.overwrite and state.is_main_process:
            shutil.rmtree(shards_root, ignore_errors=True)
        state.wait_for_everyone()
        return _run(args, state, output, shards_root)


def _run(args: DataGenArguments, state, output: Path, shards_root: Path) -> PPDDatasetInfo | None:
    import datasets
    from tqdm.auto import tqdm

    with state.main_process_first():  # the first use of an embedded model converts it once
        _, model_info = resolve_model(args.model)
    tokenizer = load_tokenizer(args.model, args.chat_template)
    template = args.chat_template if args.chat_template in ("auto", "plain", "none") else \
        f"file:{hashlib.sha256(tokenizer.chat_template.encode()).hexdigest()[:16]}"
    source = _open_source(args, model_info.model_id)
    items = source.items[: args.max_samples] if args.max_samples else source.items
    kind = args.dataset_type
    teacher = kind is DatasetType.DISTILLATION
    conversations = kind is DatasetType.CONVERSATIONS
    uses_model = teacher or conversations
    model_dtype = "nf4" if args.load_in_4bit else str(resolve_dtype(args.dtype, state.device)).removeprefix("torch.")
    method = _decode_method(args, model_info.model_id) if conversations else None
    # Compiling the step (the engine's own `auto` on a GPU) took ~2 minutes per run on an H200 and did not pay
    # back on a few hundred conversations; CUDA graphs alone capture in seconds.
    capture = ("graph" if state.device.type == "cuda" else "eager") if args.capture == "auto" else args.capture
    generation = {"method": method.value, "max_turns": args.max_turns, "max_new_tokens": args.max_new_tokens,
                  "temperature": args.temperature, "top_p": args.top_p, "batch_size": args.batch_size,
                  "dtype": model_dtype, "capture": capture,
                  "seeds": "per decoding batch, from (seed, shard, turn, batch)",
                  "shard_size": args.shard_size} if conversations else {}
    excluded = None
    eval_filter = None
    if source.kind == "records" and args.exclude_eval_prompts:
        eval_filter = EvalPromptFilter()
        excluded = eval_filter.benchmarks
    elif source.kind == "rows":
        excluded = source.eval_prompts_excluded
    settings = {"dataset_type": kind.value, "model": model_info.model_id,
                "model_revision": model_info.revision, "num_prompt_tokens": args.num_prompt_tokens,
                "model_max_length": source.model_max_length, "seed": source.seed,
                "cuts_per_conversation": source.cuts_per_conversation, "source": source.description,
                "top_k": args.top_k if teacher else None, "teacher_dtype": model_dtype if teacher else None,
                "teacher": args.teacher if teacher else None,
                "batch_tokens": args.batch_tokens if teacher else None,
                "max_batch_size": args.max_batch_size if teacher else None,
                "generation": generation or None, "eval_prompts_excluded": excluded,
                "chat_template": template if source.kind == "records" else None}
    store = ShardStore(shards_root, settings, len(items), args.shard_size)
    if state.is_main_process:
        done = store.prepare()
        logger.info("%d items in %d shards under %s (%d already done; an interrupted run resumes from there)",
                    len(items), store.num_shards, shards_root, done)
    state.wait_for_everyone()

    model = decoder = None
    owned = store.owned(state.process_index, state.num_processes)
    if uses_model and owned:
        model, _, _ = load_model(args.model, device=state.device, dtype=args.dtype,
                                 load_in_4bit=args.load_in_4bit, chat_template=args.chat_template)
    if conversations and owned:
        decoder = make_decoder(model, tokenizer, model_info, method, max_seq_len=args.model_max_length)
    pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    features = _features(kind)
    total = sum(len(store.item_range(i)) for i in owned)
    unit = "conversation" if conversations else source.kind[:-1]
    generated, started_all = 0, time.perf_counter()
    with tqdm(total=total, unit=unit, desc=f"{kind.value} [{state.process_index}]",
              disable=not state.is_local_main_process) as bar:

        def conversations_done(finished: int, new_tokens: int) -> None:
            nonlocal generated
            generated += new_tokens
            bar.update(finished)
            bar.set_postfix(tok_s=f"{generated / max(time.perf_counter() - started_all, 1e-9):.0f}", refresh=False)

        for index in owned:
            started = time.perf_counter()
            span = store.item_range(index)
            skipped: Counter = Counter()
            extra: dict = {}
            if conversations:
                rows, extra = _self_distill_shard(items[span.start: span.stop], span.start, index, tokenizer, decoder,
                                                  args.self_distill_config(method, capture), args, eval_filter,
                                                  skipped,
                                                  conversations_done)
            elif source.kind == "records":
                rows = _truncate_records(items[span.start: span.stop], span.start, tokenizer, args, source,
                                         eval_filter, skipped)
            else:
                rows = [dict(items[i]) for i in span]
            if teacher:
                # Progress in source items, advanced as teacher batches finish.
                per_row = len(span) / max(1, len(rows))
                if rows:
                    extra["teacher_sequences"] = _add_teacher(rows, model, args, pad_token_id,
                                                              lambda n: bar.update(n * per_row))
            elif not conversations:
                bar.update(len(span))
            summary = _shard_summary(len(span), rows, skipped, time.perf_counter() - started, teacher, extra)
            store.write(index, datasets.Dataset.from_list(rows, features=features) if rows else None, summary)
            bar.set_postfix(shard=f"{index}/{store.num_shards}", rows=summary["rows"],
                            **({"tok_s": f"{generated / max(time.perf_counter() - started_all, 1e-9):.0f}"}
                               if conversations else {}))
    state.wait_for_everyone()

    info = None
    if state.is_main_process:
        dataset, summaries = store.load()
        summary = _merge_summaries(summaries)
        if source.summary:
            summary["truncation"] = source.summary
        if summary["rows"] == 0:
            reasons = ", ".join(f"{n} {reason}" for reason, n in summary["skipped"].items()) or "the source is empty"
            raise EmptyDatasetError(f"no examples: {summary['items']} records read, none usable ({reasons})")
        info = PPDDatasetInfo(
            dataset_type=kind.value, model=model_info.model_id, model_revision=model_info.revision,
            num_prompt_tokens=args.num_prompt_tokens, model_max_length=source.model_max_length, seed=source.seed,
            source=source.description, cuts_per_conversation=source.cuts_per_conversation,
            top_k=args.top_k if teacher else None, teacher_dtype=settings["teacher_dtype"],
            teacher=settings["teacher"], generation=generation, eval_prompts_excluded=excluded, summary=summary,
        )
        save_dataset_atomic(info.attach(dataset), output)
        if not args.keep_shards:
            shutil.rmtree(shards_root, ignore_errors=True)
        _report(output, summary)
    state.wait_for_everyone()
    return info


def _report(output: Path, summary: dict) -> None:
    if "generated_tokens" in summary:
        lines = [f"wrote {summary['rows']} conversations ({summary['replies']} replies, {summary['generated_tokens']} "
                 f"generated tokens) from {summary['items']} records to {output}",
                 f"  {summary['seconds']:.1f} s of work, {summary['generated_tokens_per_s'] or 0:.1f} generated "
                 f"tokens/s, {summary['rows_per_s'] or 0:.2f} conversations/s per process"]
    else:
        lines = [f"wrote {summary['rows']} examples from {summary['items']} records to {output}",
                 f"  {summary['input_tokens']} input tokens; {summary['seconds']:.1f} s of work, "
                 f"{summary['rows_per_s'] or 0:.1f} examples/s per process"]
    if summary["skipped"]:
        lines.append("  skipped: " + ", ".join(f"{n} x {reason}" for reason, n in summary["skipped"].items()))
    if summary.get("turns_dropped"):
        lines.append("  later turns not answered (the conversation ends before them): "
                     + ", ".join(f"{n} x {reason}" for reason, n in summary["turns_dropped"].items()))
    if "topk_mass_mean" in summary:
        lines.append("  teacher probability mass kept by top-k, per prompt token: "
                     + " ".join(f"{m:.3f}" for m in summary["topk_mass_mean"]))
    print("\n".join(lines), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = make_parser()
    try:
        (args,) = parser.parse_args_into_dataclasses(args=argv)
    except ValueError as error:
        parser.error(str(error))
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        run(args)
    except (EmptyDatasetError, FileExistsError, FileNotFoundError, OutputPathError, SettingsMismatch,
            ValueError) as error:
        print(f"data_gen: error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

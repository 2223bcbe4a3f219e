"""Make the datasets prompt tokens are trained on: truncated conversations, and distillation targets.

Usage (from the repository root):

    # truncated dataset: the default ShareGPT conversations, the default model's chat template
    python -m data_gen.generate --dataset_type finetune --output_path data/sharegpt_truncated

    # distillation dataset: the model's own greedy tokens and top-k log-probabilities for t+2..t+N+1
    python -m data_gen.generate --dataset_type distillation --data_path data/sharegpt_truncated \\
        --output_path data/sharegpt_distill

    # the same work split over processes / GPUs, merged at the end (on a machine without a GPU, add
    # --multi_gpu: it is what makes accelerate start the processes with torchrun)
    accelerate launch --num_processes 2 -m data_gen.generate --dataset_type distillation ...

``--data_path`` for ``finetune`` is a ShareGPT/messages ``.json`` or ``.jsonl`` file, a ``save_to_disk``
folder or a hub id (default: the embedded ShareGPT file). For ``distillation`` it is a truncated dataset
from this program, or any conversation source (truncated on the fly). Work is written in shards next to
the output (``OUTPUT.shards/``); running the same command again after an interruption resumes it.
``--overwrite`` replaces only a dataset (and shards) this program made; anything else at the output path is
refused. One run at a time writes an output (a lock on ``.OUTPUT.lock`` beside it): a second is refused.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ppd.conversations import MalformedRecord, load_conversations, record_id, to_messages
from ppd.dataset_info import DatasetType, PPDDatasetInfo
from ppd.models import DEFAULT_MODEL, load_model, load_tokenizer, resolve_dtype, resolve_model
from ppd.teacher import length_batches, teacher_topk
from ppd.truncation import truncate

from .shards import (OutputPathError, SettingsMismatch, ShardStore, output_lock, recognise_dataset, recognise_shards,
                     save_dataset_atomic)

logger = logging.getLogger("data_gen")

# 50 keeps about 94-97 % of the teacher's probability mass on ShareGPT for the default model while the
# stored targets are ~1000x smaller than full-vocabulary logits (measured: see README, "Training data").
DEFAULT_TOP_K = 50


@dataclass
class DataGenArguments:
    dataset_type: DatasetType = field(metadata={"help": "finetune: truncated conversations; "
                                                        "distillation: plus the model's own top-k targets"})
    output_path: str = field(metadata={"help": "folder the dataset is saved to (datasets.save_to_disk)"})
    model: str = field(default=DEFAULT_MODEL, metadata={
        "aliases": ["--model_name_or_path"], "help": "alias, Hugging Face folder or hub id of the target model"})
    data_path: str | None = field(default=None, metadata={
        "help": "conversations (.json/.jsonl/save_to_disk folder/hub id; default: embedded ShareGPT) or, for "
                "distillation, a truncated dataset made by this program"})
    num_prompt_tokens: int = field(default=3, metadata={
        "aliases": ["--num_special_tokens"], "help": "N: each example keeps N+1 tokens after the cut"})
    model_max_length: int = field(default=2048, metadata={"help": "tokens of a conversation that are used"})
    max_samples: int | None = field(default=None, metadata={
        "help": "use only the first K records of the source (conversations, or rows of a truncated dataset)"})
    seed: int = field(default=42, metadata={"help": "seed of the cut points (each record has its own stream)"})
    cuts_per_conversation: int = field(default=1, metadata={
        "help": "distinct cut points drawn inside the same last assistant reply"})
    top_k: int = field(default=DEFAULT_TOP_K, metadata={"help": "teacher entries kept per position"})
    batch_tokens: int = field(default=16384, metadata={"help": "teacher batch size in padded tokens"})
    max_batch_size: int = field(default=64, metadata={"help": "teacher batch size in rows, at most"})
    shard_size: int = field(default=512, metadata={"help": "source records per shard (the unit of resumption)"})
    dtype: str | None = field(default=None, metadata={"help": "teacher dtype (default: fp32 on CPU, bf16 on GPU)"})
    load_in_4bit: bool = field(default=False, metadata={"help": "NF4 teacher via bitsandbytes (GPU)"})
    overwrite: bool = field(default=False, metadata={
        "help": "replace an existing output and its shards (only ones this program made)"})
    keep_shards: bool = field(default=False, metadata={"help": "keep OUTPUT.shards/ after the merge"})

    def __post_init__(self):
        self.dataset_type = DatasetType(self.dataset_type)
        for name in ("num_prompt_tokens", "top_k", "batch_tokens", "max_batch_size", "shard_size",
                     "cuts_per_conversation"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be at least 1, got {getattr(self, name)}")
        if self.model_max_length < self.num_prompt_tokens + 2:
            raise ValueError(f"--model_max_length {self.model_max_length} leaves no room for an input and "
                             f"{self.num_prompt_tokens + 1} label tokens")
        if self.max_samples is not None and self.max_samples < 1:
            raise ValueError("--max_samples must be at least 1")
        if self.load_in_4bit and self.dataset_type is not DatasetType.DISTILLATION:
            raise ValueError("--load_in_4bit only applies to the distillation teacher")


class EmptyDatasetError(RuntimeError):
    pass


def make_parser():
    from transformers import HfArgumentParser

    return HfArgumentParser(DataGenArguments, description=__doc__.split("\n\n")[0])


def _features(dataset_type: DatasetType):
    import datasets

    seq = getattr(datasets, "List", None) or datasets.Sequence
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


def _open_source(args: DataGenArguments, model_id: str) -> _Source:
    path = Path(args.data_path).expanduser() if args.data_path else None
    if args.dataset_type is DatasetType.DISTILLATION and path is not None and (path / "dataset_info.json").exists():
        import datasets

        dataset = datasets.load_from_disk(str(path))
        info = PPDDatasetInfo.of(dataset)
        if info.dataset_type != DatasetType.FINETUNE.value:
            raise ValueError(f"{path} is a {info.dataset_type} dataset; distillation reads a truncated one")
        info.check_model(model_id)
        if info.num_prompt_tokens != args.num_prompt_tokens:
            raise ValueError(f"{path} was cut for {info.num_prompt_tokens} prompt tokens, not "
                             f"--num_prompt_tokens {args.num_prompt_tokens}")
        rows = dataset.select_columns(["id", "input_ids", "labels"]).to_list()
        logger.info("distilling %s: its cuts apply (max length %d, seed %d); --model_max_length and --seed are "
                    "not used", path, info.model_max_length, info.seed)
        return _Source(rows, "rows", f"{info.source} (truncated: {path.resolve()})", info.model_max_length,
                       info.seed, info.cuts_per_conversation, info.summary)
    source = load_conversations(args.data_path)
    if source.note:
        logger.warning(source.note)
    return _Source(source.records, "records", source.description, args.model_max_length, args.seed,
                   args.cuts_per_conversation)


def _truncate_records(records: list, first_index: int, tokenizer, args: DataGenArguments, source: _Source,
                      skipped: Counter) -> list[dict]:
    rows = []
    for offset, record in enumerate(records):
        index = first_index + offset
        try:
            messages = to_messages(record)
            # One random stream per record: the cut does not depend on sharding or process count.
            rng = np.random.default_rng([source.seed, index])
            cuts = truncate(tokenizer, messages, args.num_prompt_tokens, source.model_max_length, rng,
                            source.cuts_per_conversation)
        except MalformedRecord as error:
            skipped[error.reason] += 1
            continue
        rows.extend({"id": record_id(record, index), "input_ids": c.input_ids, "labels": c.labels} for c in cuts)
    return rows


def _add_teacher(rows: list[dict], model, args: DataGenArguments, pad_token_id: int, progress) -> None:
    lengths = [len(r["input_ids"]) for r in rows]
    for batch in length_batches(lengths, args.batch_tokens, args.max_batch_size):
        out = teacher_topk(model, [rows[i]["input_ids"] for i in batch], args.num_prompt_tokens, args.top_k,
                           pad_token_id)
        for j, i in enumerate(batch):
            rows[i]["teacher_token_ids"] = out.token_ids[j].tolist()
            rows[i]["teacher_topk_ids"] = out.topk_ids[j].tolist()
            rows[i]["teacher_topk_logprobs"] = out.topk_logprobs[j].tolist()
        progress(len(batch))


def _shard_summary(items: int, rows: list[dict], skipped: Counter, seconds: float, teacher: bool) -> dict:
    summary = {"items": items, "rows": len(rows), "skipped": dict(skipped), "seconds": seconds,
               "input_tokens": sum(len(r["input_ids"]) for r in rows)}
    if teacher and rows:
        mass = np.exp(np.array([r["teacher_topk_logprobs"] for r in rows], dtype=np.float64)).sum(-1)
        summary["topk_mass_sum"] = mass.sum(0).tolist()  # per prompt token, summed over rows
    return summary


def _merge_summaries(summaries: list[dict]) -> dict:
    skipped: Counter = Counter()
    for s in summaries:
        skipped.update(s["skipped"])
    total = {key: sum(s[key] for s in summaries) for key in ("items", "rows", "seconds", "input_tokens")}
    total["skipped"] = dict(sorted(skipped.items(), key=lambda kv: -kv[1]))
    total["rows_per_s"] = total["rows"] / total["seconds"] if total["seconds"] > 0 else None
    mass = [s["topk_mass_sum"] for s in summaries if "topk_mass_sum" in s]
    if mass and total["rows"]:
        total["topk_mass_mean"] = (np.array(mass).sum(0) / total["rows"]).round(5).tolist()
    return total


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
    tokenizer = load_tokenizer(args.model)
    source = _open_source(args, model_info.model_id)
    items = source.items[: args.max_samples] if args.max_samples else source.items
    teacher = args.dataset_type is DatasetType.DISTILLATION
    teacher_dtype = "nf4" if args.load_in_4bit else str(resolve_dtype(args.dtype, state.device)).removeprefix("torch.")
    settings = {"dataset_type": args.dataset_type.value, "model": model_info.model_id,
                "model_revision": model_info.revision, "num_prompt_tokens": args.num_prompt_tokens,
                "model_max_length": source.model_max_length, "seed": source.seed,
                "cuts_per_conversation": source.cuts_per_conversation, "source": source.description,
                "top_k": args.top_k if teacher else None, "teacher_dtype": teacher_dtype if teacher else None,
                "batch_tokens": args.batch_tokens if teacher else None,
                "max_batch_size": args.max_batch_size if teacher else None}
    store = ShardStore(shards_root, settings, len(items), args.shard_size)
    if state.is_main_process:
        done = store.prepare()
        logger.info("%d items in %d shards under %s (%d already done; an interrupted run resumes from there)",
                    len(items), store.num_shards, shards_root, done)
    state.wait_for_everyone()

    model = None
    owned = store.owned(state.process_index, state.num_processes)
    if teacher and owned:
        model, _, _ = load_model(args.model, device=state.device,
                                 dtype=args.dtype, load_in_4bit=args.load_in_4bit)
    pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    features = _features(args.dataset_type)
    total = sum(len(store.item_range(i)) for i in owned)
    with tqdm(total=total, unit=source.kind[:-1], desc=f"{args.dataset_type.value} [{state.process_index}]",
              disable=not state.is_local_main_process) as bar:
        for index in owned:
            started = time.perf_counter()
            span = store.item_range(index)
            skipped: Counter = Counter()
            if source.kind == "records":
                rows = _truncate_records(items[span.start: span.stop], span.start, tokenizer, args, source, skipped)
            else:
                rows = [dict(items[i]) for i in span]
            if teacher:
                # Progress in source items, advanced as teacher batches finish.
                per_row = len(span) / max(1, len(rows))
                _add_teacher(rows, model, args, pad_token_id, lambda n: bar.update(n * per_row))
            else:
                bar.update(len(span))
            summary = _shard_summary(len(span), rows, skipped, time.perf_counter() - started, teacher)
            store.write(index, datasets.Dataset.from_list(rows, features=features) if rows else None, summary)
            bar.set_postfix(shard=f"{index}/{store.num_shards}", rows=summary["rows"])
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
            dataset_type=args.dataset_type.value, model=model_info.model_id, model_revision=model_info.revision,
            num_prompt_tokens=args.num_prompt_tokens, model_max_length=source.model_max_length, seed=source.seed,
            source=source.description, cuts_per_conversation=source.cuts_per_conversation,
            top_k=args.top_k if teacher else None, teacher_dtype=settings["teacher_dtype"], summary=summary,
        )
        save_dataset_atomic(info.attach(dataset), output)
        if not args.keep_shards:
            shutil.rmtree(shards_root, ignore_errors=True)
        _report(output, summary)
    state.wait_for_everyone()
    return info


def _report(output: Path, summary: dict) -> None:
    lines = [f"wrote {summary['rows']} examples from {summary['items']} records to {output}",
             f"  {summary['input_tokens']} input tokens; {summary['seconds']:.1f} s of work, "
             f"{summary['rows_per_s'] or 0:.1f} examples/s per process"]
    if summary["skipped"]:
        lines.append("  skipped: " + ", ".join(f"{n} x {reason}" for reason, n in summary["skipped"].items()))
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

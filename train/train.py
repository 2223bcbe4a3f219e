"""Train the prompt tokens on a dataset from ``data_gen``, with the base model frozen.

Usage (from the repository root):

    accelerate launch -m train.train --model_name_or_path smollm2-135m-instruct \\
        --dataset_path data/sharegpt_distill --output_dir runs/smollm2-ppd \\
        --num_prompt_tokens 3 --trainer_type distillation --learning_rate 1e-2 --lr_scheduler_type cosine \\
        --num_train_epochs 1 --per_device_train_batch_size 4 --gradient_accumulation_steps 4

Every ``transformers.TrainingArguments`` flag works (schedule, epochs, batch size, gradient accumulation,
``--save_steps``, ``--eval_strategy``/``--eval_steps``, ``--resume_from_checkpoint PATH|latest``,
``--report_to``). The reference implementation's flag names are accepted too: ``--num_special_tokens``,
``--virtual_tokens_per_special_token``, ``--trainer_type distillation_trainer``,
``--evaluation_strategy``, ``--model_max_length``. Without a GPU, ``accelerate launch --multi_gpu
--num_processes 2`` runs two CPU processes.

Writes to ``--output_dir``: the adapter (``ppd_config.json`` + ``prompt_tokens.safetensors``, the
decoder's format), ``checkpoint-STEP/`` folders that resume (each also holding the adapter), and
``training_log.json`` with the loss curve, held-out top-1/top-5 accuracy of each prompt token before and
after training, and the rank-accuracy table the tree builder takes.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ppd.config import AttentionType, PromptTokenConfig
from ppd.dataset_info import DatasetType, PPDDatasetInfo
from ppd.models import DEFAULT_MODEL, load_model, resolve_model
from ppd.prompt_tokens import PromptTokens
from ppd.training import Objective, PromptTokenCollator, PromptTokenModel, heldout_split

logger = logging.getLogger("train")

# Reference flags that newer TrainingArguments know under another name (warmup_steps < 1 is a ratio).
RENAMED_FLAGS = {"--evaluation_strategy": "eval_strategy", "--warmup_ratio": "warmup_steps"}


def translate_reference_flags(argv: list[str]) -> list[str]:
    from transformers import TrainingArguments

    known = {f.name for f in dataclasses.fields(TrainingArguments)}
    return [f"--{RENAMED_FLAGS[a]}" if a in RENAMED_FLAGS and a[2:] not in known else a for a in argv]


@dataclass
class ModelArguments:
    model_name_or_path: str = field(default=DEFAULT_MODEL, metadata={
        "aliases": ["--model"], "help": "alias, Hugging Face folder or hub id of the base model"})
    dtype: str | None = field(default=None, metadata={"help": "base model dtype (default: fp32 on CPU, bf16 on GPU)"})
    load_in_4bit: bool = field(default=False, metadata={"help": "NF4 base model via bitsandbytes (GPU)"})
    base_adapter: str | None = field(default=None, metadata={
        "help": "PEFT LoRA adapter merged onto the base model before training (a model that is a LoRA fine-tune)"})


@dataclass
class DataArguments:
    dataset_path: str = field(default=None, metadata={"help": "a dataset folder made by `python -m data_gen.generate`"})
    eval_size: float = field(default=0.02, metadata={
        "help": "held-out share (< 1) or count (>= 1) of examples for evaluation; 0 = none"})
    max_train_samples: int | None = field(default=None, metadata={"help": "train on the first K examples only"})
    model_max_length: int | None = field(default=None, metadata={
        "help": "drop examples whose input plus prompt tokens is longer"})

    def __post_init__(self):
        if not self.dataset_path:
            raise ValueError("--dataset_path is required (make one with `python -m data_gen.generate`)")
        if self.eval_size < 0:
            raise ValueError("--eval_size must be >= 0")


@dataclass
class PromptTokenArguments:
    num_prompt_tokens: int = field(default=3, metadata={"aliases": ["--num_special_tokens"], "help": "N"})
    num_ensemble: int = field(default=1, metadata={
        "aliases": ["--virtual_tokens_per_special_token"], "help": "V: copies of each prompt token"})
    vt_attention_type: AttentionType = field(default=AttentionType.ENSEMBLE, metadata={
        "aliases": ["--attention_type"], "help": "how prompt-token copies attend to each other"})
    trainer_type: str = field(default="distillation", metadata={
        "help": "distillation (KL to the stored teacher top-k) | cross_entropy (ground-truth tokens); "
                "distillation_trainer is accepted"})
    loss_decay: float = field(default=0.8, metadata={"help": "weight of prompt token i is decay**i"})
    init_text: str = field(default="Next 2 word", metadata={"help": "text whose embeddings initialise the tokens"})
    init_adapter: str | None = field(default=None, metadata={"help": "start from this adapter instead"})

    def __post_init__(self):
        self.vt_attention_type = AttentionType(self.vt_attention_type)
        self.objective = Objective.parse(self.trainer_type)
        if not 0 < self.loss_decay <= 1:
            raise ValueError("--loss_decay must be in (0, 1]")


def make_parser():
    from transformers import HfArgumentParser, TrainingArguments

    return HfArgumentParser((ModelArguments, DataArguments, PromptTokenArguments, TrainingArguments),
                            description=__doc__.split("\n\n")[0])


def load_dataset_for(data_args: DataArguments, pt_args: PromptTokenArguments, model_id: str, seed: int):
    """The train and held-out splits, after checking that the dataset fits the model and the objective."""
    import datasets

    path = Path(data_args.dataset_path)
    if path.suffix == ".pt" or not path.is_dir():
        raise ValueError(f"{path} is not a dataset folder: train on the output of `python -m data_gen.generate` "
                         "(torch pickles of the reference implementation are not read)")
    dataset = datasets.load_from_disk(str(path))
    info = PPDDatasetInfo.of(dataset)
    info.check_model(model_id)
    if info.num_prompt_tokens < pt_args.num_prompt_tokens:
        raise ValueError(f"{path} has targets for {info.num_prompt_tokens} prompt tokens; "
                         f"--num_prompt_tokens {pt_args.num_prompt_tokens} needs a dataset made for that many")
    if pt_args.objective is Objective.DISTILLATION and info.dataset_type != DatasetType.DISTILLATION.value:
        raise ValueError(f"{path} is a {info.dataset_type} dataset without teacher targets: make a distillation "
                         "dataset from it or pass --trainer_type cross_entropy")
    n = pt_args.num_prompt_tokens
    if n < info.num_prompt_tokens:  # train fewer prompt tokens than the data has targets for
        dataset = dataset.map(lambda row: _first_targets(row, n), desc="keeping the first targets")
    if data_args.model_max_length:
        limit = data_args.model_max_length - n * pt_args.num_ensemble
        before = len(dataset)
        dataset = dataset.filter(lambda row: len(row["input_ids"]) <= limit, desc="length filter")
        if len(dataset) < before:
            logger.info("dropped %d examples longer than --model_max_length", before - len(dataset))
    try:
        dataset, eval_dataset = heldout_split(dataset, data_args.eval_size, seed)
    except ValueError as error:
        raise ValueError(f"--eval_size {data_args.eval_size}: {error}") from None
    if data_args.max_train_samples:
        dataset = dataset.select(range(min(data_args.max_train_samples, len(dataset))))
    if len(dataset) == 0:
        raise ValueError(f"{path} has no examples left to train on")
    return dataset, eval_dataset, info


def _first_targets(row: dict, n: int) -> dict:
    out = {"labels": row["labels"][: n + 1]}
    if "teacher_token_ids" in row:
        out.update(teacher_token_ids=row["teacher_token_ids"][: n + 1], teacher_topk_ids=row["teacher_topk_ids"][:n],
                   teacher_topk_logprobs=row["teacher_topk_logprobs"][:n])
    return out


def load_base(model_args: ModelArguments, device: torch.device, gradient_checkpointing: bool):
    """The frozen base model: loaded (4-bit if asked), a LoRA adapter merged in, prepared for k-bit training."""
    model, tokenizer, info = load_model(model_args.model_name_or_path, device=device, dtype=model_args.dtype,
                                        load_in_4bit=model_args.load_in_4bit)
    if model_args.base_adapter:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, model_args.base_adapter).merge_and_unload()
        logger.info("merged the LoRA adapter %s into the base model", model_args.base_adapter)
    if model_args.load_in_4bit:
        from peft import prepare_model_for_kbit_training

        # Norms in float32 and input gradients enabled: what peft does for any k-bit training.
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=gradient_checkpointing)
    return model.requires_grad_(False).eval(), tokenizer, info


def main(argv: list[str] | None = None) -> int:
    from transformers.trainer_utils import get_last_checkpoint

    from .trainer import AdapterCheckpointCallback, PromptTokenTrainer, accuracy_metrics

    argv = translate_reference_flags(sys.argv[1:] if argv is None else list(argv))
    if not torch.cuda.is_available():
        # Without a GPU, processes started by `accelerate launch --multi_gpu` must pair up over CPU.
        os.environ.setdefault("ACCELERATE_USE_CPU", "true")
    parser = make_parser()
    try:
        model_args, data_args, pt_args, training_args = parser.parse_args_into_dataclasses(args=argv)
    except ValueError as error:
        parser.error(str(error))
    logging.basicConfig(level=logging.INFO if training_args.should_log else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        with training_args.main_process_first(desc="model conversion"):
            _, model_info = resolve_model(model_args.model_name_or_path)
        train_dataset, eval_dataset, data_info = load_dataset_for(data_args, pt_args, model_info.model_id,
                                                                  training_args.seed)
    except (ValueError, FileNotFoundError) as error:
        print(f"train: error: {error}", file=sys.stderr)
        return 1

    base, tokenizer, model_info = load_base(model_args, training_args.device, training_args.gradient_checkpointing)
    if pt_args.init_adapter:
        prompt_tokens = PromptTokens.from_pretrained(pt_args.init_adapter, base)
    else:
        config = PromptTokenConfig(
            num_prompt_tokens=pt_args.num_prompt_tokens, num_ensemble=pt_args.num_ensemble,
            attention_type=pt_args.vt_attention_type, base_model=model_info.model_id,
            base_model_revision=model_info.revision, init_text=pt_args.init_text,
            base_adapter=str(model_args.base_adapter or ""),
        )
        prompt_tokens = PromptTokens.from_text(base, tokenizer, config)
    model = PromptTokenModel(base, prompt_tokens, pt_args.objective, pt_args.loss_decay)
    trainer = PromptTokenTrainer(
        model=model, args=training_args, train_dataset=train_dataset, eval_dataset=eval_dataset,
        data_collator=PromptTokenCollator(), compute_metrics=accuracy_metrics,
        callbacks=[AdapterCheckpointCallback(prompt_tokens)],
    )
    resume = training_args.resume_from_checkpoint
    if resume in ("latest", "true", "True"):
        resume = get_last_checkpoint(training_args.output_dir)
        if resume is None:
            logger.info("no checkpoint in %s: starting from the beginning", training_args.output_dir)

    initial = trainer.evaluate(metric_key_prefix="initial") if eval_dataset is not None and not resume else {}
    started = time.perf_counter()
    result = trainer.train(resume_from_checkpoint=resume)
    train_seconds = time.perf_counter() - started
    final, ranks = {}, None
    if eval_dataset is not None:
        final = trainer.evaluate()
        ranks = trainer.rank_table(eval_dataset)

    if trainer.is_world_process_zero():
        output = Path(training_args.output_dir)
        prompt_tokens.save_pretrained(output)
        log = {
            "model": dataclasses.asdict(model_info), "prompt_tokens": prompt_tokens.config.to_dict(),
            "objective": pt_args.objective.value, "loss_decay": pt_args.loss_decay,
            "dataset": {"path": str(Path(data_args.dataset_path).resolve()), "info": json.loads(data_info.to_json()),
                        "train_examples": len(train_dataset),
                        "eval_examples": len(eval_dataset) if eval_dataset is not None else 0},
            "training_arguments": training_args.to_dict(), "world_size": training_args.world_size,
            "train_seconds": train_seconds,
            "train_metrics": result.metrics, "initial_eval": initial, "final_eval": final,
            "rank_accuracy": ranks, "log_history": trainer.state.log_history,
            "hardware": torch.cuda.get_device_name(training_args.device) if training_args.device.type == "cuda"
            else "cpu", "torch": torch.__version__,
        }
        tmp = output / ".training_log.json.tmp"
        tmp.write_text(json.dumps(log, indent=1, default=str) + "\n")
        os.replace(tmp, output / "training_log.json")
        summary = ", ".join(f"{k.removeprefix('eval_')} {v:.3f}" for k, v in final.items()
                            if k.startswith("eval_top") or k == "eval_loss")
        print(f"trained {result.global_step} steps in {train_seconds:.0f} s, final train loss "
              f"{result.training_loss:.4f}; held out: {summary or 'no evaluation set'}; adapter in {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

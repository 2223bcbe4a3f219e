"""Train the prompt tokens on a dataset from ``data_gen``, with the base model frozen.

Usage (from the repository root):

    accelerate launch -m train.train --model_name_or_path smollm2-135m-instruct \\
        --dataset_path data/sharegpt_distill --output_dir runs/smollm2-ppd \\
        --num_prompt_tokens 3 --trainer_type distillation --learning_rate 1e-2 --lr_scheduler_type cosine \\
        --num_train_epochs 1 --per_device_train_batch_size 4 --gradient_accumulation_steps 4

Every ``transformers.TrainingArguments`` flag works (schedule, epochs, batch size, gradient accumulation,
``--save_steps``, ``--eval_strategy``/``--eval_steps``, ``--resume_from_checkpoint PATH|latest``,
``--report_to``; ``--push_to_hub --hub_model_id ORG/NAME`` publishes the finished adapter with its model
card, as ``python -m train.push`` does, and nothing else of the run). The reference implementation's flag names are accepted too: ``--num_special_tokens``,
``--virtual_tokens_per_special_token``, ``--trainer_type distillation_trainer``,
``--evaluation_strategy``, ``--model_max_length``. Without a GPU, ``accelerate launch --multi_gpu
--num_processes 2`` runs two CPU processes.

Writes to ``--output_dir``: the adapter (``ppd_config.json`` + ``prompt_tokens.safetensors``, the
decoder's format), ``checkpoint-STEP/`` folders that resume (each also holding the adapter), and
``training_log.json`` with the loss curve, held-out top-1/top-5 accuracy of each prompt token before and
after training, and the rank-accuracy table the tree builder takes. A run resumed from a checkpoint writes the
same log as an uninterrupted one (timings aside): each checkpoint keeps the evaluation before training and
the loss so far.

Numeric settings that cannot train (a learning rate that is not a finite number > 0, a batch size of 0, ...)
are refused before anything is loaded. Training stops with an error at the first step whose loss or prompt
tokens are not finite; nothing non-finite is ever saved.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ppd import compile_cache
from ppd.config import AttentionType, PromptTokenConfig
from ppd.dataset_info import DatasetType, PPDDatasetInfo
from ppd.files import atomic_write_json
from ppd.models import DEFAULT_MODEL, load_model, resolve_model
from ppd.prompt_tokens import PromptTokens
from ppd.training import Objective, PackedCuts, PromptTokenCollator, PromptTokenModel, heldout_split

logger = logging.getLogger("train")

# Reference flags that newer TrainingArguments know under another name (warmup_steps < 1 is a ratio).
RENAMED_FLAGS = {"--evaluation_strategy": "eval_strategy", "--warmup_ratio": "warmup_steps"}


def translate_reference_flags(argv: list[str]) -> list[str]:
    from transformers import TrainingArguments

    known = {f.name for f in dataclasses.fields(TrainingArguments)}
    return [f"--{RENAMED_FLAGS[a]}" if a in RENAMED_FLAGS and a[2:] not in known else a for a in argv]


def _require(ok: bool, flag: str, value, requirement: str) -> None:
    if not ok:
        raise ValueError(f"--{flag} must be {requirement}, got {value}")


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
    dataset_path: list[str] = field(default=None, metadata={
        "help": "a dataset folder made by `python -m data_gen.generate`, or several: their examples are mixed"})
    eval_size: float = field(default=0.02, metadata={
        "help": "held-out share (< 1) or count (>= 1) of examples for evaluation; 0 = none"})
    max_train_samples: int | None = field(default=None, metadata={"help": "train on the first K examples only"})
    model_max_length: int | None = field(default=None, metadata={
        "help": "drop examples whose input plus prompt tokens is longer"})
    cuts_per_forward: int = field(default=0, metadata={
        "help": "cuts of one conversation trained in one forward (each with its own block of prompt tokens "
                "seeing only its own prefix); 0 = all of them, 1 = one cut per forward. A batch counts "
                "conversations: --per_device_train_batch_size 4 with 8 cuts each trains 32 examples per forward"})
    width_multiple: int | None = field(default=None, metadata={
        "help": "pad each batch's width (its longest row's tokens and prompt rows) to a multiple of this, so that "
                "kernels planned or captured per shape meet fewer shapes (default: 512 with --capture_step, else "
                "128 on a GPU, 1 on a CPU)"})
    capture_step: bool = field(default=False, metadata={
        "help": "run each step's forward and backward as a CUDA graph, one per width bucket, captured at its first "
                "batch (every batch padded to the bucket's shapes: --per_device_train_batch_size rows, the width to "
                "a multiple of --width_multiple); without CUDA the padded step runs eagerly. Not with "
                "--gradient_checkpointing, --fp16/--bf16, DeepSpeed, FSDP or a schedule-free optimizer"})
    single_pass: bool = field(default=False, metadata={
        "help": "run each forward in one pass over the real tokens and the prompt rows, back-propagating through "
                "both, instead of the default two (the real tokens without gradients first, then the prompt rows "
                "against their keys and values: the same losses and gradients, a backward over the prompt rows "
                "alone)"})
    group_by_width: bool = field(default=False, metadata={
        "help": "fill each optimizer step with conversations of like width (sorted within pools of 50 steps, the "
                "steps shuffled): less padding, and with several GPUs none waits for another's wider batch"})

    def __post_init__(self):
        if not self.dataset_path:
            raise ValueError("--dataset_path is required (make one with `python -m data_gen.generate`)")
        _require(math.isfinite(self.eval_size) and self.eval_size >= 0, "eval_size", self.eval_size,
                 "a finite number >= 0")
        for name in ("max_train_samples", "model_max_length", "width_multiple"):
            value = getattr(self, name)
            _require(value is None or value >= 1, name, value, "at least 1")
        _require(self.cuts_per_forward >= 0, "cuts_per_forward", self.cuts_per_forward, "at least 0")


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
    deep: bool = field(default=False, metadata={
        "help": "deep prompt tokens: also learn an offset to each prompt token's hidden state after every layer"})
    map_rank: int = field(default=0, metadata={
        "help": "with --deep: also learn, per layer and prompt token, a low-rank map of its hidden state of this "
                "rank (0: offsets only)"})
    map_learning_rate: float | None = field(default=None, metadata={
        "help": "learning rate of the low-rank maps (default: --learning_rate); follows the same schedule"})
    init_adapter: str | None = field(default=None, metadata={"help": "start from this adapter instead"})

    def __post_init__(self):
        self.vt_attention_type = AttentionType(self.vt_attention_type)
        self.objective = Objective.parse(self.trainer_type)
        for name in ("num_prompt_tokens", "num_ensemble"):
            _require(getattr(self, name) >= 1, name, getattr(self, name), "at least 1")
        _require(0 < self.loss_decay <= 1, "loss_decay", self.loss_decay, "in (0, 1]")  # False for NaN too
        _require(self.map_rank >= 0, "map_rank", self.map_rank, "at least 0")
        if self.map_rank and not self.deep:
            raise ValueError("--map_rank needs --deep (the maps act where the per-layer offsets do)")
        if self.map_learning_rate is not None:
            _require(math.isfinite(self.map_learning_rate) and self.map_learning_rate > 0, "map_learning_rate",
                     self.map_learning_rate, "a finite number > 0")


def check_training_arguments(args) -> None:
    """Refuse the ``TrainingArguments`` that cannot train, before anything is loaded: numbers that would fail
    inside the optimizer after the model load (a NaN or negative learning rate) or train to NaN (inf), and one
    process that sees several GPUs."""
    def positive(value) -> bool:
        return math.isfinite(value) and value > 0

    def non_negative(value) -> bool:
        return math.isfinite(value) and value >= 0

    _require(positive(args.learning_rate), "learning_rate", args.learning_rate, "a finite number > 0")
    if args.max_steps <= 0:  # otherwise --max_steps decides and the epochs are not used
        _require(positive(args.num_train_epochs), "num_train_epochs", args.num_train_epochs,
                 "a finite number > 0 (or pass --max_steps)")
    for name in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps"):
        _require(getattr(args, name) >= 1, name, getattr(args, name), "at least 1")
    for name in ("weight_decay", "max_grad_norm", "warmup_steps", "adam_epsilon"):
        _require(non_negative(getattr(args, name)), name, getattr(args, name), "a finite number >= 0")
    for name in ("adam_beta1", "adam_beta2"):
        _require(0 <= getattr(args, name) < 1, name, getattr(args, name), "in [0, 1)")
    for name, strategy in (("logging_steps", args.logging_strategy), ("save_steps", args.save_strategy),
                           ("eval_steps", args.eval_strategy)):
        value = getattr(args, name)
        if strategy == "steps" and value is not None:
            _require(positive(value), name, value, "a finite number > 0")
    if args.torch_compile and args.gradient_checkpointing:
        raise ValueError("--torch_compile and --gradient_checkpointing cannot be combined here: choose one")
    if args.n_gpu > 1:  # the Trainer would split each batch over them with nn.DataParallel, for which neither the
        # deep prompt tokens' layer hooks nor the packed batches are made; one process per GPU is the way
        raise ValueError(f"this one process sees {args.n_gpu} GPUs: start one process per GPU (accelerate launch "
                         f"--multi_gpu --num_processes {args.n_gpu} -m train.train ...) or make one GPU visible "
                         f"(CUDA_VISIBLE_DEVICES=0)")


def make_parser():
    from transformers import HfArgumentParser, TrainingArguments

    return HfArgumentParser((ModelArguments, DataArguments, PromptTokenArguments, TrainingArguments),
                            description=__doc__.split("\n\n")[0])


def load_dataset_for(data_args: DataArguments, pt_args: PromptTokenArguments, model_id: str, seed: int):
    """The train and held-out splits, after checking that the dataset fits the model and the objective."""
    import datasets

    parts, infos = [], []
    for name in data_args.dataset_path:
        path = Path(name)
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
        parts.append(dataset)
        infos.append(info)
    # Datasets made for more prompt tokens than trained keep all their targets; the collator reads the first ones.
    dataset = parts[0] if len(parts) == 1 else _mix(parts, data_args.dataset_path)
    n = pt_args.num_prompt_tokens
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
        raise ValueError(f"{' + '.join(data_args.dataset_path)} has no examples left to train on")
    per_forward = data_args.cuts_per_forward or None
    return (PackedCuts(dataset, per_forward), PackedCuts(eval_dataset, per_forward) if eval_dataset is not None
            else None, infos)


def _mix(parts: list, names: list[str]):
    """The examples of several datasets in one (their columns must agree: the same kind of targets and top-k)."""
    import datasets

    shapes = {tuple(sorted(d.column_names)) for d in parts}
    widths = {len(d[0]["teacher_topk_ids"][0]) for d in parts if "teacher_topk_ids" in d.column_names}
    if len(shapes) > 1 or len(widths) > 1:
        raise ValueError(f"{', '.join(names)} cannot be mixed: their columns or teacher top-k differ "
                         "(make them with the same --dataset_type and --top_k)")
    try:
        return datasets.concatenate_datasets(parts)
    except ValueError as error:
        raise ValueError(f"{', '.join(names)} cannot be mixed: {error}") from None


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


def new_prompt_tokens(pt_args: PromptTokenArguments, model_args: ModelArguments, base, tokenizer,
                      model_info) -> PromptTokens:
    """Fresh prompt tokens as the flags describe them, initialised from ``--init_text``."""
    config = PromptTokenConfig(
        num_prompt_tokens=pt_args.num_prompt_tokens, num_ensemble=pt_args.num_ensemble,
        attention_type=pt_args.vt_attention_type, base_model=model_info.model_id,
        base_model_revision=model_info.revision, init_text=pt_args.init_text, deep=pt_args.deep,
        map_rank=pt_args.map_rank, base_adapter=str(model_args.base_adapter or ""),
    )
    return PromptTokens.from_text(base, tokenizer, config)


def compile_if_asked(model: PromptTokenModel, args) -> bool:
    """``--torch_compile``: compile the frozen base model's decoder layers (``PromptTokenModel.compile_base``, with
    ``--torch_compile_backend`` / ``--torch_compile_mode``) instead of letting the Trainer compile the whole module
    (its host-side input building included), and switch the Trainer's own compile off. True if compiled."""
    if not args.torch_compile:
        return False
    model.compile_base(args.torch_compile_backend, args.torch_compile_mode)
    args.torch_compile, args.torch_compile_backend, args.torch_compile_mode = False, None, None
    compile_cache.load()  # PPD_COMPILE_CACHE: layers another run compiled (ppd/compile_cache.py)
    return True


def check_capture_step(data_args: DataArguments, args) -> None:
    """Refuse what ``--capture_step`` cannot run with: it replaces the Trainer's forward and backward, so it does
    none of what they add around the model (autocast and loss scaling, DeepSpeed's or FSDP's engines, a
    schedule-free optimizer's mode switch), and it keeps every activation of the graph."""
    if not data_args.capture_step:
        return
    optim = str(getattr(args.optim, "value", args.optim))  # (an enum of transformers')
    clashes = [flag for flag, on in (("--gradient_checkpointing", args.gradient_checkpointing), ("--fp16", args.fp16),
                                     ("--bf16", args.bf16), ("--deepspeed", args.deepspeed), ("--fsdp", args.fsdp),
                                     (f"--optim {optim}", optim.startswith("schedule_free"))) if on]
    if clashes:
        raise ValueError(f"--capture_step cannot be combined with {', '.join(clashes)} (the captured step runs the "
                         "forward and backward itself, without mixed-precision autocast, loss scaling, DeepSpeed, "
                         "FSDP or a schedule-free optimizer's switch, and keeps its activations); the base model "
                         "already runs in --dtype")


def keep_host_ahead(args) -> None:
    """Settings under which a step never waits for the device, so the host prepares and queues step k + 1 while
    the device runs step k (a training step is otherwise bound by the host: results/train/profile/).

    The Trainer's nan/inf logging filter reads every micro-batch's loss at once: off, as the trainer's own checks
    stop the run at a non-finite loss (a step later); batches go to the device from pinned memory without waiting."""
    args.logging_nan_inf_filter = False
    if args.dataloader_pin_memory:
        args.accelerator_config.non_blocking = True


def main(argv: list[str] | None = None) -> int:
    from transformers.trainer_utils import get_last_checkpoint

    from .trainer import NonFiniteError, PromptTokenTrainer, check_finite

    argv = translate_reference_flags(sys.argv[1:] if argv is None else list(argv))
    if not torch.cuda.is_available():
        # Without a GPU, processes started by `accelerate launch --multi_gpu` must pair up over CPU.
        os.environ.setdefault("ACCELERATE_USE_CPU", "true")
    parser = make_parser()
    try:
        model_args, data_args, pt_args, training_args = parser.parse_args_into_dataclasses(args=argv)
        check_training_arguments(training_args)
        check_capture_step(data_args, training_args)
    except ValueError as error:
        # One line, exit status 2 as argparse's own errors (parser.error would print the whole usage first:
        # hundreds of TrainingArguments flags).
        parser.exit(2, f"train: error: {error}\n")
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

    # --push_to_hub publishes the finished adapter only (train.push), not the Trainer's checkpoints and logs.
    push_to = (training_args.hub_model_id or Path(training_args.output_dir).name) if training_args.push_to_hub else None
    training_args.push_to_hub = False
    if training_args.ddp_find_unused_parameters is None:
        # Every prompt-token value takes part in every forward: no per-step search of the autograd graph for
        # unused ones (the Trainer's default for a model that is not a PreTrainedModel).
        training_args.ddp_find_unused_parameters = False
    keep_host_ahead(training_args)
    base, tokenizer, model_info = load_base(model_args, training_args.device, training_args.gradient_checkpointing)
    if pt_args.init_adapter:
        try:
            prompt_tokens = PromptTokens.from_pretrained(pt_args.init_adapter, base)
            check_finite(prompt_tokens, f"--init_adapter {pt_args.init_adapter}")
        except (ValueError, NonFiniteError) as error:
            print(f"train: error: {error}", file=sys.stderr)
            return 1
    else:
        prompt_tokens = new_prompt_tokens(pt_args, model_args, base, tokenizer, model_info)
    model = PromptTokenModel(base, prompt_tokens, pt_args.objective, pt_args.loss_decay)
    model.width_multiple = data_args.width_multiple or (512 if data_args.capture_step else model.width_multiple)
    model.two_pass = not data_args.single_pass
    compiled = compile_if_asked(model, training_args)
    trainer = PromptTokenTrainer(
        model=model, args=training_args, train_dataset=train_dataset, eval_dataset=eval_dataset,
        data_collator=PromptTokenCollator(num_prompt_tokens=pt_args.num_prompt_tokens),
        map_learning_rate=pt_args.map_learning_rate, capture_step=data_args.capture_step,
        group_by_width=data_args.group_by_width,
    )
    resume = training_args.resume_from_checkpoint
    if resume in ("latest", "true", "True"):
        resume = get_last_checkpoint(training_args.output_dir)
        if resume is None:
            logger.info("no checkpoint in %s: starting from the beginning", training_args.output_dir)

    if resume:
        trainer.restore_record(resume)  # the evaluation before training and the loss of the earlier steps
    elif eval_dataset is not None:
        trainer.initial_eval = trainer.evaluate(metric_key_prefix="initial")
    started = time.perf_counter()
    try:
        result = trainer.train(resume_from_checkpoint=resume)
    except NonFiniteError as error:
        print(f"train: error: {error}", file=sys.stderr)
        return 1
    train_seconds = time.perf_counter() - started
    if compiled and trainer.is_world_process_zero():
        compile_cache.save()  # what this run compiled, for the next run (one process's: they compile alike)
    cuts_trained = trainer.total_cuts_trained()
    captured = trainer.captured_summary()
    final, ranks = {}, None
    if eval_dataset is not None:
        final = trainer.evaluate()
        ranks = trainer.last_rank_accuracy

    if trainer.is_world_process_zero():
        output = Path(training_args.output_dir)
        try:
            check_finite(prompt_tokens, f"saving {output}")  # the trainer stops first; a last guard before writing
        except NonFiniteError as error:
            print(f"train: error: {error}", file=sys.stderr)
            return 1
        prompt_tokens.save_pretrained(output)
        log = {
            "model": dataclasses.asdict(model_info), "prompt_tokens": prompt_tokens.config.to_dict(),
            "objective": pt_args.objective.value, "loss_decay": pt_args.loss_decay,
            "dataset": {"path": [str(Path(p).resolve()) for p in data_args.dataset_path],
                        "info": [json.loads(i.to_json()) for i in data_info],
                        "train_examples": train_dataset.num_cuts, "train_sequences": len(train_dataset),
                        "eval_examples": eval_dataset.num_cuts if eval_dataset is not None else 0,
                        "cuts_per_forward": data_args.cuts_per_forward},
            "training_arguments": training_args.to_dict(), "world_size": training_args.world_size,
            "train_seconds": train_seconds, "compiled_base": compiled,
            "captured_step": captured,  # every process's replays: their device time and widths
            # this call of train() (a resumed run counts the steps after the checkpoint)
            "throughput": {"examples": cuts_trained, "seconds": train_seconds,
                           "examples_per_s": cuts_trained / train_seconds if train_seconds > 0 else None,
                           # this process's time blocked reading values back: near 0, the host bounds the speed
                           "host_waited_s": round(trainer.checks.waited, 3),
                           "step_seconds": trainer.step_seconds()},
            "train_metrics": result.metrics, "initial_eval": trainer.initial_eval, "final_eval": final,
            "rank_accuracy": ranks, "log_history": trainer.state.log_history,
            "hardware": torch.cuda.get_device_name(training_args.device) if training_args.device.type == "cuda"
            else "cpu", "torch": torch.__version__,
        }
        atomic_write_json(output / "training_log.json", log, default=str)
        summary = ", ".join(f"{k.removeprefix('eval_')} {v:.3f}" for k, v in final.items()
                            if k.startswith("eval_top") or k == "eval_loss")
        print(f"trained {result.global_step} steps ({cuts_trained} examples, {cuts_trained / max(train_seconds, 1e-9):.1f}/s) in "
              f"{train_seconds:.0f} s, final train loss "
              f"{result.metrics['train_loss']:.4f}; held out: {summary or 'no evaluation set'}; adapter in {output}")
        if push_to is not None:
            from ppd.hub import push_adapter

            try:
                push_adapter(output, push_to, token=training_args.hub_token,
                             private=training_args.hub_private_repo)
            except (OSError, ValueError) as error:
                print(f"train: error: the adapter is saved in {output} but pushing it to {push_to} failed: {error}",
                      file=sys.stderr)
                return 1
            print(f"pushed the adapter to {push_to}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

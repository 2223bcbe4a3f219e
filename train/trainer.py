"""``transformers.Trainer`` for prompt tokens: held-out top-k accuracy, adapters beside every checkpoint.

Evaluation reports the held-out loss (the mean over cuts) and, for each prompt token, how often the
teacher's greedy token (the ground-truth token for a dataset without a teacher) is the student's top-1 and
in its top-5; the full rank table is kept for building trees. Each process measures its own share of the
held-out sequences and the sums are added up, so one process and several report the same figures.

Each checkpoint folder also holds the adapter in the decoder's format, so any checkpoint can be decoded
with directly.

Training stops with ``NonFiniteError`` at the first non-finite loss or prompt-token value, and every save
checks the prompt tokens first: an adapter or checkpoint never holds NaN or inf. A step's values are read one
step late (:class:`LaggedChecks`): reading them at once would make the host wait for the device at every step.
Each checkpoint also keeps the run's record (``ppd_training_record.json``: the evaluation before training and the
summed loss of the steps so far), so a resumed run reports what an uninterrupted one would.

``--capture_step`` runs each micro-batch's forward and backward through ``ppd.captured_training`` (CUDA graphs)
instead of the Trainer's own ``compute_loss`` and backward; everything after the gradients is the Trainer's.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
import statistics
import time
from pathlib import Path

import torch
from transformers import Trainer, TrainerCallback

from ppd.captured_training import CapturedTrainingStep
from ppd.downloads import Download
from ppd.prompt_tokens import PromptTokens, count_non_finite
from ppd.files import atomic_write_json
from ppd.training import HeldOutTally, tally_held_out
from ppd.uploads import upload
from ppd.width_sampler import WidthGroupedSampler

logger = logging.getLogger("train")

EVAL_TOP_K = 10  # ranks kept per prompt token at evaluation (a tree's top-K rarely goes further)
RECORD_FILE = "ppd_training_record.json"


class NonFiniteError(RuntimeError):
    """The loss or the prompt tokens became NaN or inf."""


def check_finite(prompt_tokens: PromptTokens, when: str) -> None:
    """Raise ``NonFiniteError`` if any prompt-token value is NaN or inf; ``when`` opens the message."""
    bad = count_non_finite(prompt_tokens)
    if bad:
        total = sum(t.numel() for t in prompt_tokens.tensors().values())
        raise NonFiniteError(f"{when}: {bad} of {total} prompt-token values are not finite (NaN or inf); "
                             "nothing non-finite was saved (lower --learning_rate; earlier checkpoints are intact)")


class LaggedChecks:
    """The finiteness checks of a training run, each read from the device one step after it was queued.

    ``queue`` takes a device scalar (a micro-batch's loss, or the count of non-finite prompt-token values after an
    optimizer step) without reading it; ``settle`` reads every queued value but the latest ``keep``, which the
    device computed a step ago: the host waits for little and the device never runs dry. So training stops one
    micro-batch after the step that went wrong (before anything is saved: every save settles all first).

    Each value is a :class:`~ppd.downloads.Download`, whose read waits for that value's copy alone (``value.item()``
    would wait for everything queued on the stream by then: the next step's replay included, after which the device
    idles while the host prepares the step after it).
    """

    def __init__(self):
        self.pending: list[tuple[str, int, Download]] = []  # (kind, step, value)
        self.loss_sum = 0.0  # the settled losses, summed
        self.waited = 0.0  # seconds the host spent reading them: waiting for the device (~0: the host is the bound)

    def queue(self, kind: str, step: int, value: torch.Tensor) -> None:
        self.pending.append((kind, step, Download(value)))

    def settle(self, prompt_tokens: PromptTokens, keep: int = 0) -> None:
        """Read all but the latest ``keep`` values; raise ``NonFiniteError`` at the first that is not finite."""
        ready, self.pending = self.pending[: len(self.pending) - keep], self.pending[len(self.pending) - keep:]
        for kind, step, value in ready:
            started = time.perf_counter()
            number = value.wait().item()
            self.waited += time.perf_counter() - started
            if kind == "loss":
                if not math.isfinite(number):
                    raise NonFiniteError(f"step {step}: the training loss is {number}; stopped, nothing non-finite "
                                         "was saved (lower --learning_rate, or check the dataset for NaN/inf targets)")
                self.loss_sum += number
            elif number:
                total = sum(t.numel() for t in prompt_tokens.tensors().values())
                raise NonFiniteError(f"step {step}: {int(number)} of {total} prompt-token values are not finite "
                                     "(NaN or inf); nothing non-finite was saved (lower --learning_rate; earlier "
                                     "checkpoints are intact)")


class PromptTokenTrainer(Trainer):
    def __init__(self, *args, map_learning_rate: float | None = None, capture_step: bool = False,
                 group_by_width: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.group_by_width = group_by_width  # each optimizer step's conversations of like width (WidthGroupedSampler)
        self.map_learning_rate = map_learning_rate  # the low-rank maps' own learning rate (None: the others')
        # --capture_step: each micro-batch's forward and backward replayed from a CUDA graph (made at the first step)
        self.capture_step = capture_step
        self.captured: CapturedTrainingStep | None = None
        self.prompt_tokens: PromptTokens = self.model.prompt_tokens
        self.initial_eval: dict = {}  # the held-out evaluation before the first step
        # This process's training loss summed over the steps before a resumed checkpoint (None: resumed from a
        # checkpoint without a record, so only Trainer's own mean is known); run_loss() adds this call's steps.
        self.loss_sum: float | None = 0.0
        self.checks = LaggedChecks()  # this call's losses and token checks, read a step late
        self.cuts_trained = 0  # examples (cuts) this process trained on in this call of train()
        self.step_ends: list[float] = []  # host clock at the end of each optimizer step of this call of train()
        self.last_rank_accuracy: list[list[float]] | None = None  # [N][K] of the latest evaluate()
        self.add_callback(_GuardAndRecord(self))

    def create_optimizer(self, *args, **kwargs):
        """Trainer's optimizer, with the low-rank maps of deep prompt tokens moved into a group of their own at
        ``map_learning_rate`` (the scheduler, made after this, scales every group alike)."""
        optimizer = super().create_optimizer(*args, **kwargs)
        maps = [p for p in (self.prompt_tokens.map_down, self.prompt_tokens.map_up) if p is not None]
        if self.map_learning_rate is None or not maps or any(optimizer.state.values()):
            return optimizer
        ids = {id(p) for p in maps}
        template = None
        for group in optimizer.param_groups:
            if any(id(p) in ids for p in group["params"]):
                template = group
            group["params"] = [p for p in group["params"] if id(p) not in ids]
        optimizer.param_groups = [g for g in optimizer.param_groups if g["params"]]
        optimizer.add_param_group({**{k: v for k, v in template.items() if k != "params"}, "params": maps,
                                   "lr": self.map_learning_rate})
        return optimizer

    def _get_train_sampler(self, *args, **kwargs):
        """With ``group_by_width``, a :class:`WidthGroupedSampler` over the packed rows' widths, its steps as large
        as an optimizer step over every process; otherwise Trainer's own."""
        if not self.group_by_width:
            return super()._get_train_sampler(*args, **kwargs)
        config, args = self.prompt_tokens.config, self.args
        step_size = args.per_device_train_batch_size * args.world_size * args.gradient_accumulation_steps
        seed = args.data_seed if args.data_seed is not None else args.seed
        return WidthGroupedSampler(self.train_dataset.row_widths(config.num_rows), step_size, seed)

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """The micro-batches of one optimizer step, and the number of cuts in them, summed over processes when
        the Trainer averages across devices (its default): the loss divides by it (``PromptTokenModel.forward``).
        (Trainer's own count is of label tokens: N + 1 per cut, none in a dataset without labels.)"""
        batch_samples = list(itertools.islice(epoch_iterator, num_batches))  # (fewer at the end of an epoch)
        local = sum(int(b["cut_lengths"].numel()) for b in batch_samples)
        self.cuts_trained += local
        cuts = upload(local, device)
        if self.args.world_size > 1 and self.args.average_tokens_across_devices:
            cuts = self.accelerator.reduce(cuts, reduction="sum")
        return batch_samples, cuts

    def training_step(self, model, inputs, num_items_in_batch=None, *args, **kwargs):
        if self.capture_step:
            loss = self.captured_training_step(inputs, num_items_in_batch)
        else:
            loss = super().training_step(model, inputs, num_items_in_batch, *args, **kwargs)
        # This micro-batch's forward and backward are queued: read what came before it, not its own loss.
        self.checks.queue("loss", self.state.global_step + 1, loss)
        self.checks.settle(self.prompt_tokens, keep=1)
        return loss

    def captured_training_step(self, inputs: dict, num_items_in_batch) -> torch.Tensor:
        """The micro-batch's forward and backward by :class:`CapturedTrainingStep`: its gradients added into
        ``.grad`` and, at the last micro-batch of an optimizer step, summed across processes (DDP's backward hooks,
        which would, do not run). The loss returned is the one the eager step returns."""
        core = self.accelerator.unwrap_model(self.model)
        if self.captured is None:
            dataset = self.train_dataset
            per_row = max(len(group) for group in dataset.groups)
            self.captured = CapturedTrainingStep(core, self.args.per_device_train_batch_size, per_row,
                                                 core.width_multiple)
            self.captured.prepare(self.data_collator([dataset[0]]), dataset.row_widths(self.captured.rows_per_cut))
        divisor = num_items_in_batch if num_items_in_batch is not None else inputs["cut_lengths"].numel()
        loss = self.captured.step(inputs, divisor)
        if self.args.world_size > 1:
            # Each process's loss is its share of the step's (the divisor counts every process's cuts): the sum of
            # the gradients is the step's. Without that count each divides by its own cuts, and DDP would average.
            shared = self.args.average_tokens_across_devices
            if self.accelerator.sync_gradients:
                buffer = self.captured.grad_buffer()  # every .grad in one tensor: one all-reduce
                for grad in [buffer] if buffer is not None else [p.grad for p in self.captured.params]:
                    torch.distributed.all_reduce(grad)
                    if not shared:
                        grad.div_(self.args.world_size)
            if shared:
                loss = loss * self.args.world_size  # as compute_loss scales it (each process's share of the sum)
        return loss

    def captured_summary(self) -> dict | None:
        """The captured step's record, with every process's replays (all of them call this; None when no step
        was captured): ``replay_seconds`` [process] the graphs' device time, ``gap_seconds`` and ``median_gap``
        [process] the device time between consecutive replays (in all, and the median gap) and ``replays``
        [process][width] the micro-batches at each width (``widths``: those the dataset's rows need, alike on every
        process)."""
        if self.captured is None:
            return None
        widths = sorted(set(self.captured.buckets) | set(self.captured.replays))  # (the buckets: alike everywhere)
        gaps = self.captured.gap_seconds() or [0.0]
        mine = [self.captured.replay_seconds(), sum(gaps), statistics.median_high(gaps)]
        mine += [self.captured.replays[w] for w in widths]
        every = self.accelerator.gather(torch.tensor([mine], dtype=torch.float64, device=self.args.device)).tolist()
        return {"micro_batches": self.captured.steps, "width_multiple": self.captured.width_multiple,
                "widths": widths, "replay_seconds": [round(row[0], 3) for row in every],
                # device time between consecutive replays: in all, and the median gap
                "gap_seconds": [round(row[1], 3) for row in every], "median_gap": [round(row[2], 6) for row in every],
                "replays": [[int(n) for n in row[3:]] for row in every],
                "captures": [{"width": w, "seconds": round(t, 3)} for w, t in self.captured.captures]}

    def step_seconds(self) -> dict | None:
        """The median and 90th percentile of the time between consecutive optimizer steps: once the host runs
        ahead, the device's time per step, apart from what a run pays once (captures, compilation, an epoch's
        loader start), which sits in the tail. None before two steps."""
        gaps = sorted(b - a for a, b in zip(self.step_ends, self.step_ends[1:]))
        if not gaps:
            return None
        return {"median": round(statistics.median_high(gaps), 5), "p90": round(gaps[int(0.9 * (len(gaps) - 1))], 5),
                "steps": len(gaps)}

    def settle_checks(self) -> None:
        """Read every queued check (before a save, an evaluation or the run's summary)."""
        self.checks.settle(self.prompt_tokens)

    def run_loss(self) -> float | None:
        """This process's training loss summed over the steps so far, those before a resumed checkpoint included
        (None: resumed from a checkpoint without a record)."""
        self.settle_checks()
        return None if self.loss_sum is None else self.loss_sum + self.checks.loss_sum

    def total_cuts_trained(self) -> int:
        """Examples (cuts) trained on by every process together in this call of train() (all of them call this)."""
        count = torch.tensor(self.cuts_trained, dtype=torch.float64, device=self.args.device)
        return int(self.accelerator.reduce(count, reduction="sum"))

    def run_loss_sum(self) -> float:
        """The summed training loss of the run so far, averaged over processes (all of them call this)."""
        total = torch.tensor(self.run_loss(), dtype=torch.float64, device=self.args.device)
        return float(self.accelerator.reduce(total, reduction="mean"))

    def log(self, logs: dict, *args, **kwargs) -> None:
        if "train_loss" in logs and self.loss_sum is not None:
            # The end of train(): Trainer's mean covers only the steps of this call, not those before a resume.
            logs["train_loss"] = self.run_loss_sum() / max(self.state.global_step, 1)
        super().log(logs, *args, **kwargs)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        self.settle_checks()  # a step that went wrong is reported as such, before the save's own check
        check_finite(self.prompt_tokens, f"saving {output_dir or self.args.output_dir}")
        super().save_model(output_dir, _internal_call)

    def restore_record(self, checkpoint: str | os.PathLike) -> None:
        """Take the initial evaluation and the loss so far from a checkpoint this trainer saved."""
        path = Path(checkpoint) / RECORD_FILE
        if not path.exists():
            logger.warning("%s has no %s (an older checkpoint): the log will hold no initial evaluation, and "
                           "its train_loss covers the resumed steps only", checkpoint, RECORD_FILE)
            self.initial_eval, self.loss_sum = {}, None
            return
        record = json.loads(path.read_text())
        self.initial_eval, self.loss_sum = record["initial_eval"], record["loss_sum"]

    def held_out(self, dataset) -> HeldOutTally:
        """The tally over ``dataset``, summed over processes: each takes every world_size-th sequence, so no
        sequence counts twice (Trainer's loop pads the last batch with repeats) and no per-batch outputs of
        differing size are gathered (under packed cuts a batch's cut count differs between processes, and
        NCCL stalls on an all-gather of unequal sizes)."""
        args = self.args
        share = torch.utils.data.Subset(dataset, range(args.process_index, len(dataset), args.world_size))
        loader = torch.utils.data.DataLoader(share, batch_size=args.per_device_eval_batch_size,
                                             collate_fn=self.data_collator, num_workers=args.dataloader_num_workers)
        core = self.accelerator.unwrap_model(self.model)
        self.callback_handler.eval_dataloader = loader  # the progress bar's length

        def batches():
            for batch in loader:
                yield self._prepare_inputs(batch)
                self.control = self.callback_handler.on_prediction_step(args, self.state, self.control)

        tally = tally_held_out(core, batches(), EVAL_TOP_K)
        if args.world_size > 1:
            total = self.accelerator.reduce(tally.as_tensor().to(args.device), reduction="sum")
            tally = HeldOutTally.from_tensor(total, tuple(tally.hits.shape))
        return tally

    def predict(self, *args, **kwargs):
        """Not for prompt tokens: Trainer's prediction loop gathers per-batch outputs whose size differs between
        processes under packed cuts (NCCL then stalls) and scales the loss for training."""
        raise NotImplementedError("PromptTokenTrainer has no predict(): use evaluate() (held-out loss and rank "
                                  "accuracy) or `python -m eval.accuracy`")

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """Held-out loss and top-1/top-5 accuracy of each prompt token (every process calls this); the rank
        table stays in ``last_rank_accuracy``."""
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if dataset is None:
            raise ValueError("evaluation needs held-out data: train with --eval_size > 0")
        if isinstance(dataset, dict):  # several named evaluation sets, as Trainer takes them
            return {key: value for name, part in dataset.items()
                    for key, value in self.evaluate(part, ignore_keys, f"{metric_key_prefix}_{name}").items()}
        self.settle_checks()
        started = time.perf_counter()
        tally = self.held_out(dataset)
        self.last_rank_accuracy = tally.rank_accuracy().tolist()
        metrics = tally.metrics(metric_key_prefix)
        metrics[f"{metric_key_prefix}_runtime"] = round(time.perf_counter() - started, 4)
        metrics[f"{metric_key_prefix}_examples"] = tally.cuts
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics


class _GuardAndRecord(TrainerCallback):
    """Checks the prompt tokens after every optimizer step; writes the adapter and the run's record into each
    ``checkpoint-STEP`` folder (main process only)."""

    def __init__(self, trainer: PromptTokenTrainer):
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        self.trainer.step_ends.append(time.perf_counter())
        # This step's optimizer update is queued: count its non-finite values on the device, read a step later
        # (every save reads it first).
        self.trainer.checks.queue("tokens", state.global_step, count_non_finite(self.trainer.prompt_tokens, read=False))
        return control

    def on_train_end(self, args, state, control, **kwargs):
        self.trainer.settle_checks()
        return control

    def on_save(self, args, state, control, **kwargs):
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        self.trainer.settle_checks()
        check_finite(self.trainer.prompt_tokens, f"saving {folder}")
        loss_sum = self.trainer.run_loss_sum() if self.trainer.loss_sum is not None else None  # every process
        if state.is_world_process_zero:
            self.trainer.prompt_tokens.save_pretrained(folder)
            if loss_sum is not None:
                record = {"global_step": state.global_step, "initial_eval": self.trainer.initial_eval,
                          "loss_sum": loss_sum}
                atomic_write_json(folder / RECORD_FILE, record, sort_keys=True)
        return control

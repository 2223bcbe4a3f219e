"""Training the prompt tokens: the frozen base model and the trainable table behind one ``nn.Module``.

``PromptTokenModel`` registers only the prompt tokens as a submodule. The base model is held beside the
module tree, so the optimizer, DDP, ``.to()`` and checkpoints see the N x V table alone: a checkpoint is
a few kilobytes, nothing tries to move a 4-bit base, and the base cannot be trained by accident.
Gradients still flow through the frozen base into the prompt-token embeddings.

An example is a *cut*: the tokens before it, and targets for what follows. Cuts of the same conversation
share their prefix, so a batch row may carry several: one sequence and one block of prompt tokens per cut,
each block seeing only the tokens before its own cut (``prefill.plan_prefill(..., cuts=...)``). The loss
of a cut is the same whether it trains alone or packed with others; one forward then trains them all.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from dataclasses import dataclass
from enum import Enum

import pyarrow.compute as pc
import torch
from torch import nn

from .attention import plan_free_sdpa
from .deep_prompts import LayerOffsets, add_to_output, decoder_layers, deep_weights, hooks_for
from .losses import cross_entropy_loss, distillation_loss
from .prefill import PrefillPlan, average_copies, plan_prefill, prefill_inputs
from .prompt_tokens import TENSOR_NAME, PromptTokens
from .two_pass import keep_parts, layer_parts, two_pass_logits

logger = logging.getLogger(__name__)


class Objective(str, Enum):
    DISTILLATION = "distillation"  # KL to the teacher's stored top-k
    CROSS_ENTROPY = "cross_entropy"  # cross-entropy on the ground-truth tokens

    @classmethod
    def parse(cls, name: str) -> "Objective":
        # The reference implementation's trainer names keep its users' commands working.
        aliases = {"distillation_trainer": cls.DISTILLATION, "param_efficient_fine_tuner": cls.CROSS_ENTROPY}
        if name in aliases:
            return aliases[name]
        try:
            return cls(name)
        except ValueError:
            raise ValueError(f"unknown trainer type {name!r}; choose distillation or cross_entropy") from None


def _compiled_while_training(compiled, eager, hooks: LayerOffsets | None, index: int, *args, **kwargs):
    """Decoder layer ``index``'s forward after ``PromptTokenModel.compile_base``: with gradients on, compiled
    together with the deep prompt tokens' change to its output (their ``hooks`` then stand aside), and in the
    first pass of a two-pass forward (``ppd.two_pass``) compiled too; else eager."""
    parts = layer_parts(index, kwargs)
    if not torch.is_grad_enabled() and not any(part.recording for part in parts.values()):
        return eager(*args, **kwargs)
    inputs = hooks.layer_inputs(index) if hooks is not None and hooks.rows is not None else None
    output = compiled(eager, inputs, *args, **{**kwargs, **parts})
    keep_parts(index, kwargs, parts)
    return output


def _layer_and_offsets(forward, inputs: tuple | None, *args, **kwargs):
    """What ``compile_base`` compiles: a layer's ``forward``, then the deep prompt tokens' change to its output
    (``inputs``: ``LayerOffsets.layer_inputs``, tensors only, so that every layer shares the compiled graph)."""
    output = forward(*args, **kwargs)
    return output if inputs is None else add_to_output(output, inputs)


class PromptTokenModel(nn.Module):
    def __init__(self, base_model, prompt_tokens: PromptTokens, objective: Objective = Objective.DISTILLATION,
                 decay: float = 0.8):
        super().__init__()
        prompt_tokens.check_compatible(base_model)
        self.prompt_tokens = prompt_tokens
        object.__setattr__(self, "base_model", base_model.requires_grad_(False).eval())  # not a submodule
        self.objective = Objective(objective)
        self.decay = decay
        # Deep prompt tokens: hooks on the base model's layers add the offsets at the prompt rows of each forward.
        self.layer_offsets = hooks_for(base_model, prompt_tokens)
        self.checkpointing = False
        # A batch's width is rounded up to a multiple of this on a GPU, so that cuDNN's attention, which builds
        # an execution plan for every new shape (~0.5 s for a forward and backward on an H200), meets a few
        # dozen shapes in a run instead of a new one nearly every step (results/train/profile/).
        self.width_multiple = 128 if next(base_model.parameters()).device.type == "cuda" else 1
        self.plan_free_attention = False  # True: attention only by kernels without per-shape plans (not cuDNN)
        self.compiled = False  # see compile_base
        # The forward in two passes (``ppd.two_pass``: the real tokens without gradients, then the prompt rows);
        # False: one pass over both. Models whose pieces ppd cannot run apart, and gradient checkpointing, fall back
        # to one pass.
        self.two_pass = True
        self._pieces = None  # the base model's pieces for two passes (``LanguageModel``), made on first use

    def compile_base(self, backend: str | None = None, mode: str | None = None) -> None:
        """Run the frozen base model's decoder layers compiled from now on whenever gradients are on (training
        steps; evaluation, without them, runs the layers as they are).

        Each layer's forward is compiled, not the whole model: the layers share their code and their shapes, and
        their weights are the graph's inputs, so one compilation, every size symbolic, serves every layer and
        every batch width (a batch of one row, as torch specialises a size of one, compiles once more). Compiling
        the whole model instead traces every layer one after another: 82 s against 3 s for the default model on
        a 2-core CPU, 4-4.5 minutes at each new batch size on an H200's host (``results/train/profile/``). The
        deep prompt tokens' change to each layer's output is compiled with the layer (its tensors are the graph's
        inputs too), so Inductor fuses it with the layer's own kernels instead of launching its operations one by
        one between them; the embeddings, the final norm and the head run eagerly around the compiled
        layers; the prompt-token inputs are built on the host each step."""
        if self.compiled:
            return
        compiled = torch.compile(_layer_and_offsets, dynamic=True, backend=backend or "inductor", mode=mode)
        for index, layer in enumerate(decoder_layers(self.base_model)):
            layer.forward = functools.partial(_compiled_while_training, compiled, layer.forward, self.layer_offsets,
                                              index)
        if self.layer_offsets is not None:
            self.layer_offsets.in_compiled_layers = True
        self.compiled = True

    def gradient_checkpointing_enable(self, **kwargs) -> None:
        """Called by ``Trainer`` for ``--gradient_checkpointing``: recompute the base model's activations
        (``kwargs`` pass through: their names differ between transformers versions)."""
        self.base_model.gradient_checkpointing_enable(**kwargs)
        self.checkpointing = True
        # transformers recomputes activations only in training mode: switch to it with dropout switched off,
        # so the frozen base still computes exactly what it computes at inference.
        self.base_model.train()
        for module in self.base_model.modules():
            if isinstance(module, nn.Dropout):
                module.p = 0.0
            if isinstance(getattr(module, "attention_dropout", None), float):
                module.attention_dropout = 0.0

    def prompt_logits(self, input_ids: torch.Tensor, lengths: torch.Tensor, cut_lengths: torch.Tensor | None = None,
                      cut_rows: torch.Tensor | None = None, host: "HostCuts | None" = None) -> torch.Tensor:
        """Logits [C, N, vocab] (float32, copies averaged) of the prompt tokens of every cut.

        Without ``cut_lengths`` each row is one cut at its end (``C = B``); with them, cut ``i`` reads the first
        ``cut_lengths[i]`` tokens of batch row ``cut_rows[i]`` (the cuts of a row in increasing row order).
        ``host``, the same batch as host lists (:class:`PromptTokenCollator` adds it), spares reading the tensors
        back from the device, which would wait for every kernel queued before.
        """
        config = self.prompt_tokens.config
        host = host or HostCuts.read_back(input_ids, lengths, cut_lengths, cut_rows)
        plan = plan_prefill(host.sequences, config.num_prompt_tokens, config.num_ensemble, host.cuts,
                            self.width_multiple)
        return self.plan_logits(plan.upload(self.prompt_tokens.embeddings.device))

    def plan_logits(self, plan: PrefillPlan, tensors: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """:meth:`prompt_logits` of a plan already on the device: device work alone (a captured step runs this).
        ``tensors``: stand-ins for the prompt tokens' tensors (by ``PromptTokens.tensors`` names) to read instead."""
        config = self.prompt_tokens.config
        table = self.prompt_tokens() if tensors is None else tensors[TENSOR_NAME]
        # (transformers drops the cache of a forward whose layers recompute their activations: one pass then)
        pieces = self.pieces() if self.two_pass and not self.checkpointing else None
        with plan_free_sdpa() if self.plan_free_attention else contextlib.nullcontext():
            if pieces is not None:
                deep = None if self.layer_offsets is None else deep_weights(
                    self.prompt_tokens, pieces.embed.weight.dtype, tensors=tensors)
                logits = two_pass_logits(pieces, self.layer_offsets, deep, plan, table, config.num_prompt_tokens,
                                         config.num_ensemble, config.attention_type)
            else:
                inputs = prefill_inputs(self.base_model, plan, table, config.num_prompt_tokens, config.num_ensemble,
                                        config.attention_type)
                if self.layer_offsets is not None:
                    # (cast to the forward's dtype once, not in every layer's hook)
                    self.layer_offsets.set(inputs.prompt_rows, deep_weights(self.prompt_tokens, inputs.embeds.dtype,
                                                                            tensors=tensors))
                out = self.base_model(inputs_embeds=inputs.embeds, attention_mask=inputs.mask,
                                      position_ids=inputs.positions, use_cache=False, logits_to_keep=inputs.keep)
                logits = average_copies(inputs.rows(out.logits)[:, 1:], config.num_prompt_tokens,
                                        config.num_ensemble)
        if self.layer_offsets is not None and not self.checkpointing:  # a checkpointed backward recomputes it
            self.layer_offsets.set(None, None)
        return logits

    def pieces(self):
        """The base model's pieces (``decoding.step.LanguageModel``) for the two-pass forward, or None where ppd
        cannot run them apart (``UnsupportedModelError``: this model trains in one pass)."""
        if self._pieces is None:
            from .decoding.step import LanguageModel
            from .decoding.support import UnsupportedModelError

            if self.layer_offsets is not None:
                self.layer_offsets.set(None, None)  # (left set by a checkpointed forward) the probe's forward adds none
            try:
                self._pieces = LanguageModel.of(self.base_model)
            except UnsupportedModelError as err:
                logger.warning("training in one pass: %s", err)
                self._pieces = False
        return self._pieces or None

    def batch_logits(self, batch: dict) -> torch.Tensor:
        """:meth:`prompt_logits` of a batch from :class:`PromptTokenCollator`."""
        device = self.prompt_tokens.embeddings.device
        return self.prompt_logits(batch["input_ids"].to(device), batch["lengths"], batch.get("cut_lengths"),
                                  batch.get("cut_rows"), batch.get("host"))

    def loss(self, logits: torch.Tensor, labels=None, teacher_topk_ids=None, teacher_topk_logprobs=None,
             per_example: bool = False):
        """The batch mean of the cuts' losses (``per_example``: the [C] losses themselves)."""
        if self.objective is Objective.DISTILLATION:
            if teacher_topk_ids is None or teacher_topk_logprobs is None:
                raise ValueError("distillation needs a dataset with teacher_topk_ids and teacher_topk_logprobs "
                                 "(`python -m data_gen.generate --dataset_type distillation`)")
            losses = distillation_loss(logits, teacher_topk_ids, teacher_topk_logprobs, self.decay, reduce=False)
        else:
            losses = cross_entropy_loss(logits, labels[:, 1:], self.decay, reduce=False)
        return losses if per_example else losses.mean()

    # transformers' Trainer passes ``num_items_in_batch`` to a model that says it takes it.
    accepts_loss_kwargs = True

    def forward(self, input_ids, lengths, cut_lengths=None, cut_rows=None, labels=None, teacher_token_ids=None,
                teacher_topk_ids=None, teacher_topk_logprobs=None, num_items_in_batch=None, host=None) -> dict:
        """``loss``: the mean of the cuts' losses, or, with ``num_items_in_batch`` (the cuts of the whole optimizer
        step: every micro-batch of it, and under the Trainer's default ``average_tokens_across_devices`` every
        process), their sum divided by that count, so that gradient accumulation and several processes weigh
        every cut alike however many cuts each batch holds."""
        logits = self.prompt_logits(input_ids, lengths, cut_lengths, cut_rows, host)
        losses = self.loss(logits, labels, teacher_topk_ids, teacher_topk_logprobs, per_example=True)
        loss = losses.mean() if num_items_in_batch is None else losses.sum() / num_items_in_batch
        return {"loss": loss, "logits": logits}


class HostCuts:
    """A batch's sequences and the cut points of each, as host lists: what a forward's layout is built from.

    The collator adds it to every batch beside the tensors (which the Trainer moves to the device; this it passes
    through as it is), so a training step never reads its batch back from the device. Each read would wait for
    every kernel queued before it, and the host could not prepare step k + 1 while the device runs step k.
    (A plain class: DDP and accelerate copy dataclasses and tuples field by field.)
    """

    __slots__ = ("sequences", "cuts")

    def __init__(self, sequences: list[list[int]], cuts: list[list[int]]):
        self.sequences, self.cuts = sequences, cuts

    @classmethod
    def read_back(cls, input_ids: torch.Tensor, lengths: torch.Tensor, cut_lengths: torch.Tensor | None = None,
                  cut_rows: torch.Tensor | None = None) -> "HostCuts":
        """The same from a batch's tensors (waits for the device where they are on one)."""
        sequences = [row[:n].tolist() for row, n in zip(input_ids, lengths.tolist())]
        if cut_lengths is None:
            return cls(sequences, [[len(x)] for x in sequences])
        cuts = [[] for _ in sequences]
        for row, cut in zip(cut_rows.tolist(), cut_lengths.tolist()):
            cuts[row].append(cut)
        return cls(sequences, cuts)


TARGET_COLUMNS = ("labels", "teacher_token_ids", "teacher_topk_ids", "teacher_topk_logprobs")


@dataclass
class PromptTokenCollator:
    """Pads ``input_ids`` (with their lengths) and stacks the fixed-size target columns of every cut.

    A feature is one cut (a dataset row) or, from :class:`PackedCuts`, one sequence with its ``cut_lengths``
    and a list of targets per column; either way the batch has ``cut_lengths`` and ``cut_rows`` [C] and targets
    [C, ...], and ``host``, the sequences and cuts again as host lists (:class:`HostCuts`).
    """

    num_prompt_tokens: int | None = None  # targets kept: the first N (a dataset may carry more)
    columns: tuple[str, ...] = TARGET_COLUMNS

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        lengths = [len(f["input_ids"]) for f in features]
        input_ids = torch.zeros(len(features), max(lengths), dtype=torch.long)
        cut_lengths, cut_rows = [], []
        host = HostCuts([], [])
        for row, feature in enumerate(features):
            input_ids[row, : lengths[row]] = torch.as_tensor(feature["input_ids"], dtype=torch.long)
            cuts = list(feature.get("cut_lengths", [lengths[row]]))
            cut_lengths.extend(cuts)
            cut_rows.extend([row] * len(cuts))
            host.sequences.append(list(feature["input_ids"]))
            host.cuts.append(cuts)
        batch = {"input_ids": input_ids, "lengths": torch.tensor(lengths), "cut_lengths": torch.tensor(cut_lengths),
                 "cut_rows": torch.tensor(cut_rows), "host": host}
        for column in self.columns:
            if column in features[0]:
                dtype = torch.float32 if column == "teacher_topk_logprobs" else torch.long
                values = [v for f in features for v in (f[column] if "cut_lengths" in f else [f[column]])]
                if self.num_prompt_tokens is not None:  # the root's label, then one target per prompt token
                    keep = self.num_prompt_tokens + (column in ("labels", "teacher_token_ids"))
                    values = [v[:keep] for v in values]
                batch[column] = torch.tensor(values, dtype=dtype)
        return batch


class PackedCuts(torch.utils.data.Dataset):
    """The cuts of a dataset grouped by conversation: item g is one sequence with up to ``per_forward`` cuts.

    ``data_gen`` writes the cuts of a conversation as consecutive rows with the same ``id``, each input a
    prefix of the same tokens; an item holds the longest input, the cut points of every row (their input
    lengths) and their targets, so :class:`PromptTokenModel` trains them in one forward. ``per_forward = 1``
    gives one cut per item, as training without packing does.
    """

    def __init__(self, dataset, per_forward: int | None = None):
        if per_forward is not None and per_forward < 1:
            raise ValueError(f"cuts per forward must be at least 1, got {per_forward}")
        self.dataset = dataset
        self.columns = [c for c in TARGET_COLUMNS if c in dataset.column_names]
        ids = column_values(dataset, "id") if "id" in dataset.column_names else list(range(len(dataset)))
        self.groups: list[range] = []
        start = 0
        for i in range(1, len(ids) + 1):
            if i == len(ids) or ids[i] != ids[start] or (per_forward and i - start == per_forward):
                self.groups.append(range(start, i))
                start = i

    @property
    def num_cuts(self) -> int:
        return len(self.dataset)

    def __len__(self) -> int:
        return len(self.groups)

    def row_widths(self, rows_per_cut: int) -> list[int]:
        """Each item's slots in a packed forward (``attention.packed_width`` of it alone): its sequence and a block
        of ``rows_per_cut`` prompt rows per cut. Read from the Arrow lengths, without decoding a row."""
        lengths = pc.list_value_length(self.dataset.with_format("arrow")["input_ids"]).to_numpy()
        return [int(lengths[g.start: g.stop].max()) + len(g) * rows_per_cut for g in self.groups]

    def __getitem__(self, index: int) -> dict:
        rows = self.dataset[self.groups[index].start: self.groups[index].stop]
        inputs = rows["input_ids"]
        longest = max(range(len(inputs)), key=lambda i: len(inputs[i]))
        sequence = list(inputs[longest])
        for ids in inputs:
            if list(ids) != sequence[: len(ids)]:
                raise ValueError(f"rows {self.groups[index].start}..{self.groups[index].stop - 1} share the id "
                                 f"{rows['id'][0]!r} but their inputs are not prefixes of one sequence: they cannot be "
                                 "packed (train with --cuts_per_forward 1)")
        # (``cut_lengths`` is also the model's argument name: Trainer drops item keys the model does not take.)
        item = {"input_ids": sequence, "cut_lengths": [len(ids) for ids in inputs]}
        item.update({column: rows[column] for column in self.columns})
        return item


def accuracy_targets(batch: dict) -> torch.Tensor:
    """[B, N] the tokens the prompt tokens should predict: the teacher's greedy ones when stored, else the
    ground truth (a truncated dataset)."""
    source = batch.get("teacher_token_ids")
    if source is None:
        source = batch["labels"]
    return source[:, 1:]


@dataclass
class HeldOutTally:
    """Sums over held-out cuts, added up batch by batch and, in a multi-process run, over processes.

    ``hits[n, r]`` counts the cuts whose target sits at rank r of prompt token n's top-K; ``loss_sum`` adds
    the cuts' own losses. Sums rather than per-batch outputs: every process may see a different number of
    cuts (packed cuts), and a sum over disjoint shares is the same whatever the batching or process count.
    """

    hits: torch.Tensor  # [N, K] float64
    cuts: int = 0
    loss_sum: float = 0.0  # 0 when the losses were not computed

    def as_tensor(self) -> torch.Tensor:
        """One float64 vector (for a cross-process sum): hits, then cuts, then the loss sum."""
        return torch.cat([self.hits.flatten(), self.hits.new_tensor([self.cuts, self.loss_sum])])

    @classmethod
    def from_tensor(cls, values: torch.Tensor, shape: tuple[int, int]) -> "HeldOutTally":
        values = values.double().cpu()
        return cls(values[:-2].reshape(shape), int(values[-2]), float(values[-1]))

    def rank_accuracy(self) -> torch.Tensor:
        """[N, K]: the share of cuts whose target is at rank r of prompt token n's top-K. Row n is what the
        tree builder takes as ``accuracy[n]``; its cumulative sum is the top-r accuracy."""
        return self.hits / max(self.cuts, 1)

    def metrics(self, prefix: str) -> dict[str, float]:
        """``{prefix}_loss`` (the mean over cuts) and each prompt token's top-1 and top-5 accuracy."""
        cumulative = self.rank_accuracy().cumsum(-1)
        metrics = {f"{prefix}_loss": self.loss_sum / max(self.cuts, 1)}
        for n in range(cumulative.shape[0]):
            metrics[f"{prefix}_top1_token{n + 1}"] = round(float(cumulative[n, 0]), 5)
            metrics[f"{prefix}_top5_token{n + 1}"] = round(float(cumulative[n, min(4, cumulative.shape[1] - 1)]), 5)
        return metrics


@torch.no_grad()
def tally_held_out(model: PromptTokenModel, batches, top_k: int, with_loss: bool = True) -> HeldOutTally:
    """The ranks of each cut's targets (:func:`accuracy_targets`) in the prompt tokens' top-``top_k``, and the
    summed loss (``with_loss``), over ``batches`` from :class:`PromptTokenCollator`."""
    n = model.prompt_tokens.config.num_prompt_tokens
    tally = HeldOutTally(torch.zeros(n, top_k, dtype=torch.float64))
    for batch in batches:
        logits = model.batch_logits(batch)
        targets = accuracy_targets(batch).to(logits.device)
        hits = logits.topk(top_k, dim=-1).indices == targets[..., None]  # [C, N, K]
        tally.hits += hits.sum(0).double().cpu()
        tally.cuts += hits.shape[0]
        if with_loss:
            losses = model.loss(logits, batch.get("labels"), batch.get("teacher_topk_ids"),
                                batch.get("teacher_topk_logprobs"), per_example=True)
            tally.loss_sum += float(losses.double().sum())
    return tally


def column_values(dataset, name: str) -> list:
    """One column of a ``datasets.Dataset`` as a list, read as one Arrow array. (``dataset[name]`` is a lazy
    column in datasets >= 4: each index or iteration step formats one row, minutes for a 200k-row dataset.)"""
    return dataset.with_format("arrow")[name].to_pylist()


def heldout_split(dataset, eval_size: float, seed: int):
    """``(train, held_out)``: conversations held out for evaluation, chosen by a seeded hash of their ``id``.

    Training, ``eval.accuracy`` and ``eval.replay`` call this with the same arguments, so measurements are
    made on conversations the prompt tokens never saw. A conversation is held out when the hash of
    ``(seed, id)`` falls below ``eval_size`` (a share, < 1), or is among the ``eval_size`` lowest (a count,
    >= 1): every cut of a conversation goes to the same side, and a dataset of cuts and the dataset of the
    conversations they were cut from (the same ids) hold out the same conversations. Both splits keep the
    rows' order. ``held_out`` is ``None`` for ``eval_size == 0``; a dataset without ``id`` is split by rows.
    """
    if not eval_size:
        return dataset, None
    if "id" not in dataset.column_names:
        count = int(eval_size) if eval_size >= 1 else max(1, round(eval_size * len(dataset)))
        if count >= len(dataset):
            raise ValueError(f"holding out {count} examples leaves nothing to train on ({len(dataset)} examples)")
        split = dataset.train_test_split(test_size=count, seed=seed)
        return split["train"], split["test"]
    ids = column_values(dataset, "id")
    score = {i: _id_hash(seed, i) for i in dict.fromkeys(ids)}
    if eval_size >= 1:
        if int(eval_size) >= len(score):
            raise ValueError(f"holding out {int(eval_size)} conversations leaves nothing to train on "
                             f"({len(score)} conversations)")
        held = set(sorted(score, key=score.get)[: int(eval_size)])
    else:
        held = {i for i, h in score.items() if h < eval_size} or {min(score, key=score.get)}
        if len(held) == len(score):
            raise ValueError(f"--eval_size {eval_size} holds out all {len(score)} conversations")
    is_held = [i in held for i in ids]
    return (dataset.select([r for r, h in enumerate(is_held) if not h]),
            dataset.select([r for r, h in enumerate(is_held) if h]))


def _id_hash(seed: int, conversation_id) -> float:
    """A number in [0, 1) fixed by the seed and the id alone."""
    import hashlib

    digest = hashlib.sha256(f"{seed}\0{conversation_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2 ** 64

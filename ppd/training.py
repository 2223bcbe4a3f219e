"""Training the prompt tokens: the frozen base model and the trainable table behind one ``nn.Module``.

``PromptTokenModel`` registers only the prompt tokens as a submodule. The base model is held beside the
module tree, so the optimizer, DDP, ``.to()`` and checkpoints see the N x V table alone: a checkpoint is
a few kilobytes, nothing tries to move a 4-bit base, and the base cannot be trained by accident.
Gradients still flow through the frozen base into the prompt-token embeddings.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch
from torch import nn

from .losses import cross_entropy_loss, distillation_loss
from .prefill import average_copies, build_prefill
from .prompt_tokens import PromptTokens


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


class PromptTokenModel(nn.Module):
    def __init__(self, base_model, prompt_tokens: PromptTokens, objective: Objective = Objective.DISTILLATION,
                 decay: float = 0.8):
        super().__init__()
        prompt_tokens.check_compatible(base_model)
        self.prompt_tokens = prompt_tokens
        object.__setattr__(self, "base_model", base_model.requires_grad_(False).eval())  # not a submodule
        self.objective = Objective(objective)
        self.decay = decay

    def gradient_checkpointing_enable(self, **kwargs) -> None:
        """Called by ``Trainer`` for ``--gradient_checkpointing``: recompute the base model's activations
        (``kwargs`` pass through: their names differ between transformers versions)."""
        self.base_model.gradient_checkpointing_enable(**kwargs)
        # transformers recomputes activations only in training mode: switch to it with dropout switched off,
        # so the frozen base still computes exactly what it computes at inference.
        self.base_model.train()
        for module in self.base_model.modules():
            if isinstance(module, nn.Dropout):
                module.p = 0.0
            if isinstance(getattr(module, "attention_dropout", None), float):
                module.attention_dropout = 0.0

    def prompt_logits(self, input_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Logits [B, N, vocab] (float32, copies averaged) of each row's prompt tokens after its input."""
        config = self.prompt_tokens.config
        batch = [row[:n].tolist() for row, n in zip(input_ids, lengths.tolist())]
        inputs = build_prefill(self.base_model, batch, self.prompt_tokens(), config.num_prompt_tokens,
                               config.num_ensemble, config.attention_type)
        out = self.base_model(inputs_embeds=inputs.embeds, attention_mask=inputs.mask, position_ids=inputs.positions,
                              use_cache=False, logits_to_keep=inputs.keep)
        return average_copies(inputs.rows(out.logits)[:, 1:], config.num_prompt_tokens, config.num_ensemble)

    def loss(self, logits: torch.Tensor, labels=None, teacher_topk_ids=None, teacher_topk_logprobs=None):
        if self.objective is Objective.DISTILLATION:
            if teacher_topk_ids is None or teacher_topk_logprobs is None:
                raise ValueError("distillation needs a dataset with teacher_topk_ids and teacher_topk_logprobs "
                                 "(`python -m data_gen.generate --dataset_type distillation`)")
            return distillation_loss(logits, teacher_topk_ids, teacher_topk_logprobs, self.decay)
        return cross_entropy_loss(logits, labels[:, 1:], self.decay)

    def forward(self, input_ids, lengths, labels=None, teacher_token_ids=None, teacher_topk_ids=None,
                teacher_topk_logprobs=None) -> dict:
        logits = self.prompt_logits(input_ids, lengths)
        return {"loss": self.loss(logits, labels, teacher_topk_ids, teacher_topk_logprobs), "logits": logits}


@dataclass
class PromptTokenCollator:
    """Pads ``input_ids`` (with their lengths) and stacks the fixed-size target columns."""

    columns: tuple[str, ...] = ("labels", "teacher_token_ids", "teacher_topk_ids", "teacher_topk_logprobs")

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        lengths = [len(f["input_ids"]) for f in features]
        input_ids = torch.zeros(len(features), max(lengths), dtype=torch.long)
        for row, feature in enumerate(features):
            input_ids[row, : lengths[row]] = torch.as_tensor(feature["input_ids"], dtype=torch.long)
        batch = {"input_ids": input_ids, "lengths": torch.tensor(lengths)}
        for column in self.columns:
            if column in features[0]:
                dtype = torch.float32 if column == "teacher_topk_logprobs" else torch.long
                batch[column] = torch.tensor([f[column] for f in features], dtype=dtype)
        return batch


def accuracy_targets(batch: dict) -> torch.Tensor:
    """[B, N] the tokens the prompt tokens should predict: the teacher's greedy ones when stored, else the
    ground truth (a truncated dataset)."""
    source = batch.get("teacher_token_ids")
    if source is None:
        source = batch["labels"]
    return source[:, 1:]


def rank_accuracy(top_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """[N, K]: the share of examples whose target is at rank r of prompt token k's top-K.

    ``top_ids`` [E, N, K] (most likely first), ``targets`` [E, N]. Row k is what the tree builder takes
    as ``accuracy[k]``; its cumulative sum is the top-r accuracy.
    """
    hits = (top_ids == targets[..., None]).float()  # [E, N, K]
    return hits.mean(0)


def heldout_split(dataset, eval_size: float, seed: int):
    """``(train, held_out)``: ``eval_size`` examples (a share if < 1) held out by a seeded shuffle.

    Training and ``eval.accuracy`` call this with the same arguments, so accuracies are measured on
    examples the prompt tokens never saw. ``held_out`` is ``None`` for ``eval_size == 0``.
    """
    if not eval_size:
        return dataset, None
    count = int(eval_size) if eval_size >= 1 else max(1, round(eval_size * len(dataset)))
    if count >= len(dataset):
        raise ValueError(f"holding out {count} examples leaves nothing to train on ({len(dataset)} examples)")
    split = dataset.train_test_split(test_size=count, seed=seed)
    return split["train"], split["test"]

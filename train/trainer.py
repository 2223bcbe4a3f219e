"""``transformers.Trainer`` for prompt tokens: held-out top-k accuracy, adapters beside every checkpoint.

Evaluation reports, for each prompt token, how often the teacher's greedy token (the ground-truth token
for a dataset without a teacher) is the student's top-1 and in its top-5; the full rank table is kept
for building trees. Each checkpoint folder also holds the adapter in the decoder's format, so any
checkpoint can be decoded with directly.
"""

from __future__ import annotations

import torch
from transformers import Trainer, TrainerCallback

from ppd.prompt_tokens import PromptTokens
from ppd.training import accuracy_targets, rank_accuracy

EVAL_TOP_K = 10  # ranks kept per prompt token at evaluation (a tree's top-K rarely goes further)


def accuracy_metrics(prediction) -> dict:
    """``compute_metrics`` for ``Trainer``: top-1 and top-5 accuracy of each prompt token."""
    table = rank_accuracy(torch.as_tensor(prediction.predictions), torch.as_tensor(prediction.label_ids))
    cumulative = table.cumsum(-1)
    metrics = {}
    for k in range(table.shape[0]):
        metrics[f"top1_token{k + 1}"] = round(float(cumulative[k, 0]), 5)
        metrics[f"top5_token{k + 1}"] = round(float(cumulative[k, min(4, table.shape[1] - 1)]), 5)
    return metrics


class PromptTokenTrainer(Trainer):
    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = self._prepare_inputs(inputs)
        core = self.accelerator.unwrap_model(model)
        with torch.no_grad():
            logits = core.prompt_logits(inputs["input_ids"], inputs["lengths"])
            loss = core.loss(logits, inputs.get("labels"), inputs.get("teacher_topk_ids"),
                             inputs.get("teacher_topk_logprobs")).detach()
        if prediction_loss_only:
            return loss, None, None
        return loss, logits.topk(EVAL_TOP_K, dim=-1).indices, accuracy_targets(inputs)

    def rank_table(self, dataset) -> list[list[float]]:
        """[N][K] rank accuracy on ``dataset`` (for the tree builder), computed like the metrics above."""
        output = self.predict(dataset, metric_key_prefix="ranks")
        return rank_accuracy(torch.as_tensor(output.predictions), torch.as_tensor(output.label_ids)).tolist()


class AdapterCheckpointCallback(TrainerCallback):
    """Writes the decoder-format adapter into each ``checkpoint-STEP`` folder (main process only)."""

    def __init__(self, prompt_tokens: PromptTokens):
        self.prompt_tokens = prompt_tokens

    def on_save(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            self.prompt_tokens.save_pretrained(f"{args.output_dir}/checkpoint-{state.global_step}")
        return control

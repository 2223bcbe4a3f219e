"""What a ppd training dataset records about itself: the model it was tokenised for, N, k, length, seed, source.

Fields added after the first datasets were written have defaults, so older datasets still load.

The record travels inside the ``datasets`` dataset (``DatasetInfo.description``, as JSON), so that
``save_to_disk`` / ``load_from_disk`` keep it and a trainer can refuse a dataset made for another model.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from enum import Enum

FORMAT_VERSION = 1


class DatasetType(str, Enum):
    FINETUNE = "finetune"  # truncated conversations: input_ids + labels
    DISTILLATION = "distillation"  # plus the teacher's greedy tokens and top-k log-probabilities
    CONVERSATIONS = "conversations"  # self-distilled: the model's own replies to the source's user turns


@dataclass
class PPDDatasetInfo:
    dataset_type: str
    model: str  # model id the tokens belong to (ModelInfo.model_id)
    model_revision: str
    num_prompt_tokens: int
    model_max_length: int
    seed: int
    source: str  # where the conversations came from
    cuts_per_conversation: int = 1
    top_k: int | None = None  # distillation only
    teacher_dtype: str | None = None  # distillation only, e.g. "float32" or "nf4"
    teacher: str | None = None  # distillation only: "greedy" | "forced" (None: made before forced existed, greedy)
    generation: dict = field(default_factory=dict)  # conversations only: decoding method, sampling, limits, dtype
    # Evaluation sets whose prompts records were checked for and dropped (None: not checked).
    eval_prompts_excluded: list[str] | None = None
    summary: dict = field(default_factory=dict)  # counts, skipped records by reason, timings
    format_version: int = FORMAT_VERSION

    def __post_init__(self):
        self.dataset_type = DatasetType(self.dataset_type).value

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    def attach(self, dataset):
        """Store this record in ``dataset.info`` (kept by ``save_to_disk``); returns the dataset."""
        dataset.info.description = self.to_json()
        return dataset

    @classmethod
    def of(cls, dataset) -> "PPDDatasetInfo":
        """Read the record from a dataset made by ``data_gen``; a clear error for any other dataset."""
        try:
            raw = json.loads(dataset.info.description or "")
        except json.JSONDecodeError:
            raw = None
        if not isinstance(raw, dict) or "dataset_type" not in raw:
            raise ValueError("this dataset was not made by `python -m data_gen.generate` "
                             "(its info carries no ppd metadata)")
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in raw.items() if k in known})

    def check_model(self, model_id: str) -> None:
        if self.model != model_id:
            raise ValueError(f"the dataset was tokenised for {self.model}, not {model_id}: "
                             "its token ids mean nothing to this model; regenerate it for this model")

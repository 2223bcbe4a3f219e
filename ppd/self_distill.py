"""Self-distilled conversations: the model writes its own reply to every user turn of a conversation.

A conversation keeps the system messages before its first user turn and its first ``max_turns`` user
turns (``ppd.conversations.user_prompts``); the model answers turn 1, then turn 2 with its own first reply
in the context (the chat template renders the conversation so far with ``add_generation_prompt=True``),
and so on. A whole set of conversations is decoded turn by turn in batches: turn 1 of all of them, then
turn 2 of those that have one, each turn's prompts sorted by length so that a batch pads little.

Greedy decoding with ``method="ppd"`` gives the baseline's tokens (PPD greedy is lossless; exactly so in
float32) in fewer forward passes. Sampling (``temperature > 0``) is seeded per batch: the decoder draws
row ``b`` of a request from a stream derived from the request's seed and ``b``, and each batch's seed is
derived from ``seed_key`` (the caller's seed and shard), the turn and the batch's position, so the same
conversations with the same settings give the same text. PPD samples losslessly: its text is an exact
sample of the model, the very text the baseline writes with the same seed.

A conversation whose first prompt leaves no room for ``max_new_tokens`` in the decoder's cache, or whose
first reply is empty, is skipped and counted; a later turn in that case ends the conversation before it
(counted apart). A reply's ``token_ids`` are the model's tokens without the final EOS; its text is their
decoding without special tokens.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from .chat import chat_input_ids
from .config import CaptureMode, DecodeConfig, DecodeMethod
from .decoder import Decoder, eos_ids_of
from .models import ModelInfo
from .prompt_tokens import PromptTokens, packaged_adapter
from .tree import TreeSet

logger = logging.getLogger(__name__)

NO_ROOM = "prompt leaves no room for max_new_tokens"
EMPTY_REPLY = "empty reply"
TEMPLATE_ERROR = "chat template rejects the conversation"


@dataclass
class SelfDistillConfig:
    max_turns: int = field(default=2, metadata={"help": "user turns answered per conversation, at most"})
    max_new_tokens: int = field(default=512, metadata={"help": "tokens per reply, at most"})
    temperature: float = field(default=0.0, metadata={"help": "0 = greedy; > 0 samples"})
    top_p: float = field(default=1.0, metadata={"help": "nucleus mass when sampling"})
    batch_size: int = field(default=64, metadata={"help": "rows per decoding batch"})
    method: DecodeMethod = field(default=DecodeMethod.BASELINE, metadata={"help": "ppd | baseline"})
    capture: CaptureMode = field(default=CaptureMode.AUTO, metadata={"help": "how the decoder's step runs"})

    def __post_init__(self):
        self.method = DecodeMethod(self.method)
        self.capture = CaptureMode(self.capture)
        for name in ("max_turns", "max_new_tokens", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        self.decode_config(0)  # temperature and top_p are checked where DecodeConfig checks them

    def decode_config(self, seed: int) -> DecodeConfig:
        return DecodeConfig(method=self.method, max_new_tokens=self.max_new_tokens, temperature=self.temperature,
                            top_p=self.top_p, seed=seed, capture=self.capture)


@dataclass
class DistilledConversation:
    id: str
    messages: list[dict]  # the kept system/user messages and the model's replies, in order
    reply_token_ids: list[list[int]] = field(default_factory=list)  # per reply, EOS excluded
    finish_reasons: list[str] = field(default_factory=list)  # per reply: eos | length | max_length

    def row(self) -> dict:
        return {"id": self.id, "messages": self.messages, "reply_token_ids": self.reply_token_ids,
                "finish_reasons": self.finish_reasons}


@dataclass
class SelfDistillResult:
    conversations: list[DistilledConversation]  # in input order, skipped ones left out
    skipped: Counter  # conversations left out, by reason
    turns_dropped: Counter  # later turns not answered (the conversation ends before them), by reason
    generated_tokens: int = 0  # EOS tokens included: every token the decoder produced
    decode_seconds: float = 0.0

    @property
    def replies(self) -> int:
        return sum(len(c.reply_token_ids) for c in self.conversations)


def default_method(model_id: str, temperature: float) -> DecodeMethod:
    """The baseline: at the batch sizes self-distillation runs (32-256 rows) it out-ran greedy PPD on an H200
    (5,971 against 4,524 generated tokens/s at batch 128, bf16): extra tree rows cost more than they save once
    the batch fills the GPU. ``--decode_method ppd`` stays available (lossless when greedy)."""
    return DecodeMethod.BASELINE


def make_decoder(model, tokenizer, info: ModelInfo, method: DecodeMethod | str, max_seq_len: int | None) -> Decoder:
    """A decoder for ``method``: ``ppd`` uses the adapter shipped for the model and its tree set for this
    device and dtype (the packaged default tree set otherwise)."""
    prompt_tokens = trees = None
    if DecodeMethod(method) is DecodeMethod.PPD:
        shipped = packaged_adapter(info.model_id)
        if shipped is None:
            raise ValueError(f"no adapter ships for {info.model_id}, so it cannot decode with method ppd; "
                             "use the baseline method")
        prompt_tokens = PromptTokens.from_pretrained(shipped, model)
        weight = model.get_input_embeddings().weight
        trees = TreeSet.for_adapter(shipped, weight.device.type, str(weight.dtype).removeprefix("torch."))
    return Decoder(model, prompt_tokens, trees, eos_token_ids=eos_ids_of(model, tokenizer), max_seq_len=max_seq_len)


def batch_seed(seed_key: Sequence[int], turn: int, batch: int) -> int:
    """The sampling seed of one decoding batch, derived from ``seed_key``, the turn and the batch index."""
    return int(np.random.SeedSequence([*seed_key, turn, batch]).generate_state(1)[0])


def self_distill(decoder: Decoder, tokenizer, prompts: Sequence[tuple[str, list[dict]]], config: SelfDistillConfig,
                 seed_key: Sequence[int] = (0,), progress: Callable[[int, int], None] | None = None
                 ) -> SelfDistillResult:
    """Let the model answer the user turns of ``prompts`` (``(id, messages)`` pairs, messages as
    :func:`ppd.conversations.user_prompts` returns them). ``progress(conversations_finished, new_tokens)`` is
    called after every batch."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("self-distillation renders conversations with a chat template, and this tokenizer has "
                         "none (loaded with --chat_template none): use --chat_template auto|plain|FILE.jinja")
    eos = decoder.eos_token_ids
    room = decoder.capacity - config.max_new_tokens
    turns = [[m for m in messages if m["role"] == "user"][: config.max_turns] for _, messages in prompts]
    history = [[m for m in messages if m["role"] == "system"] for _, messages in prompts]
    replies: list[list[list[int]]] = [[] for _ in prompts]
    reasons: list[list[str]] = [[] for _ in prompts]
    result = SelfDistillResult([], Counter(), Counter())
    alive = [True] * len(prompts)
    done = 0  # conversations finished since the last progress report

    def end(index: int, turn: int, reason: str) -> None:
        nonlocal done
        alive[index] = False
        done += 1
        (result.skipped if turn == 0 else result.turns_dropped)[reason] += 1

    for index, user_turns in enumerate(turns):
        if not user_turns:
            end(index, 0, "no user turn")
    for turn in range(config.max_turns):
        rows: list[tuple[int, list[int]]] = []
        for index in range(len(prompts)):
            if not alive[index] or turn >= len(turns[index]):
                continue
            try:
                ids = chat_input_ids(tokenizer, history[index] + [turns[index][turn]])
            except Exception:  # jinja raises its own exception types for conversations a template rejects
                end(index, turn, TEMPLATE_ERROR)
                continue
            if len(ids) > room:
                end(index, turn, NO_ROOM)
                continue
            rows.append((index, ids))
        rows.sort(key=lambda row: (len(row[1]), row[0]))
        for number, start in enumerate(range(0, len(rows), config.batch_size)):
            batch = rows[start: start + config.batch_size]
            started = time.perf_counter()
            outputs = decoder.generate([ids for _, ids in batch],
                                       config.decode_config(batch_seed(seed_key, turn, number)))
            result.decode_seconds += time.perf_counter() - started
            new_tokens = 0
            for (index, _), output in zip(batch, outputs):
                tokens = list(output.token_ids)
                new_tokens += len(tokens)
                if output.finish_reason == "eos" and tokens and tokens[-1] in eos:
                    tokens.pop()
                text = tokenizer.decode(tokens, skip_special_tokens=True)
                if not text.strip():
                    end(index, turn, EMPTY_REPLY)
                    continue
                history[index] += [turns[index][turn], {"role": "assistant", "content": text}]
                replies[index].append(tokens)
                reasons[index].append(output.finish_reason)
                if turn + 1 == len(turns[index]):
                    done += 1
            result.generated_tokens += new_tokens
            if progress is not None:
                progress(done, new_tokens)
                done = 0
    if progress is not None and done:
        progress(done, 0)
    result.conversations = [DistilledConversation(prompts[i][0], history[i], replies[i], reasons[i])
                            for i in range(len(prompts)) if replies[i]]
    return result

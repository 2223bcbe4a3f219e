"""Writing files so that a reader never sees half of one: a temporary file beside it, then a rename."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path


def atomic_write(path: str | os.PathLike, write: Callable[[str], None]) -> None:
    """Call ``write(tmp)`` on a temporary path beside ``path`` (parents created), then rename it to ``path``;
    on any failure the temporary file is removed and ``path`` is left as it was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write(path, lambda tmp: Path(tmp).write_text(text))


def atomic_write_json(path: str | os.PathLike, data, sort_keys: bool = False, default=None) -> None:
    """``data`` as indented JSON with a final newline."""
    atomic_write_text(path, json.dumps(data, indent=1, sort_keys=sort_keys, default=default) + "\n")


def check_format_version(data: dict, current: int, what: str) -> None:
    """Refuse a file written by a newer ppd (``format_version`` above ``current``)."""
    version = data.get("format_version", current)
    if version > current:
        raise ValueError(f"{what} format {version} is newer than this ppd understands ({current})")


def load_json_file(path: str | os.PathLike, parse: Callable[[dict], object], what: str):
    """``parse(data)`` of the JSON object in ``path``; a file that is not JSON, not an object, or lacks what
    ``parse`` reads raises ``ValueError`` naming the file and ``what`` it should have been."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from err
    if not isinstance(data, dict):
        raise ValueError(f"{path} is not {what}: it holds a JSON {type(data).__name__}, not an object")
    try:
        return parse(data)
    except (KeyError, TypeError, AttributeError) as err:
        raise ValueError(f"{path} is not {what}: missing or malformed {err}") from err

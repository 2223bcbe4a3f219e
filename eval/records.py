"""What every benchmark record carries: the hardware and software it ran on, the run settings read back from
it, and an atomic JSON write."""

from __future__ import annotations

import os
import platform
from pathlib import Path

import torch

from ppd.files import atomic_write_json


def environment(device: torch.device) -> dict:
    """Device name, thread count and library versions of a measurement."""
    import transformers

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    return {"device": name, "threads": torch.get_num_threads(), "torch": torch.__version__,
            "transformers": transformers.__version__}


UNKNOWN = "unknown"  # a setting that a record of an earlier run does not carry


def recorded(record: dict, field: str):
    """``record``'s value of a run setting (``device`` is read from its environment), or ``UNKNOWN``."""
    value = (record.get("environment") or {}).get("device") if field == "device" else record.get(field)
    return UNKNOWN if value is None else value


def write_json(path: str | os.PathLike, record: dict) -> None:
    """Write ``record`` to ``path`` (parents created) through a temporary file, so a reader never sees half."""
    atomic_write_json(path, record)


def write_summary(output_dir: str | os.PathLike, summary: dict, table: str) -> None:
    """A benchmark's summary as ``summary.json`` and its markdown table as ``summary.md`` in ``output_dir``; the
    table is printed too."""
    write_json(Path(output_dir) / "summary.json", summary)
    (Path(output_dir) / "summary.md").write_text(table + "\n", encoding="utf-8")
    print(table)

"""What every benchmark record carries: the hardware and software it ran on, the run settings read back from
it, an atomic JSON write, and the rows of a run cut off, kept so that the same command finishes it."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path

import torch

from ppd.files import atomic_write_json


def environment(device: torch.device) -> dict:
    """Device name, thread count and library versions of a measurement, the attention layout a dense tree step of a
    grouped-query model runs there (``tree_attention``: what ``PPD_GROUPED_SDPA`` resolves to on the device), and
    the ``PPD_*`` switches it ran under where any is set (``ppd_switches``: ``PPD_RUN_AHEAD``,
    ``PPD_PREFILL_GRAPHS``, ...), so that two files of the same command measured two ways say which is which."""
    import transformers

    from ppd.decoding import grouped_attention

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    found = {"device": name, "threads": torch.get_num_threads(), "torch": torch.__version__,
             "transformers": transformers.__version__, "tree_attention": grouped_attention.layout(device)}
    switches = {key: value for key, value in sorted(os.environ.items()) if key.startswith("PPD_")}
    if switches:
        found["ppd_switches"] = switches
    return found


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


def run_settings(args, device: torch.device, varying: tuple[str, ...]) -> dict:
    """What a benchmark's rows depend on: its flags except ``varying`` (those a cut-off run may change when
    it is finished: the grid it walks, where it writes), and the device and library versions."""
    return {**{k: v for k, v in vars(args).items() if k not in varying}, **environment(device)}


class SettingsMismatch(ValueError):
    """An output file holds a cut-off run of other settings (the program says so in one line, exit status 2)."""


class PartialRun:
    """A benchmark's rows written to its JSON output after every group of measurements, marked
    ``"complete": false`` until the run ends: a run cut off (a time limit, a machine taken back) keeps what
    it measured, and the same command run again measures only what is missing. A group (say, one batch size
    with every method) is always measured within one process, so the ratios inside it are of the same run.

    ``settings`` are what every row depends on (the flags, the device, torch and transformers): a cut-off
    file of other settings is refused with :class:`SettingsMismatch`, naming the first difference; a complete
    file is measured again from the start (the command's usual overwrite)."""

    def __init__(self, path: str | os.PathLike | None, settings: dict):
        self.path = None if path is None else Path(path)
        self.settings = json.loads(json.dumps(settings))  # as the file will hold it (tuples become lists)
        self.rows: list[dict] = []
        if self.path is None or not self.path.exists():
            return
        try:
            earlier = json.loads(self.path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise SettingsMismatch(f"{self.path} is not a JSON record of this benchmark ({err}): choose another "
                                   "--output or remove the file") from None
        if not isinstance(earlier, dict) or earlier.get("complete") is not False:
            return
        held = earlier.get("settings", {})
        for field, value in self.settings.items():
            if held.get(field, UNKNOWN) != value:
                raise SettingsMismatch(f"{self.path} holds a run cut off with {field} {held.get(field, UNKNOWN)!r}, "
                                       f"but this run asks for {value!r}: run it with the same settings to finish "
                                       "it, or choose another --output or remove the file")
        self.rows = list(earlier.get("rows", []))

    def measured(self, **match) -> list[dict]:
        """Rows already recorded whose fields equal ``match``."""
        return [row for row in self.rows if all(row.get(k) == v for k, v in match.items())]

    def add(self, rows: list[dict], record: dict | None = None) -> None:
        """Record one group's ``rows`` (and write the file, still marked cut off, with ``record``'s fields)."""
        self.rows.extend(rows)
        if self.path is not None:
            write_json(self.path, {**(record or {}), "settings": self.settings, "rows": self.rows, "complete": False})

    def finish(self, record: dict) -> None:
        """Write the whole run, ``record`` (its rows among its fields) and the settings, marked complete."""
        if self.path is not None:
            write_json(self.path, {**record, "settings": self.settings, "complete": True})

"""Resumable, sharded dataset writing shared by every process of a run.

The input is cut into fixed shards of ``shard_size`` items; process ``p`` of ``P`` owns shards
``p, p + P, ...``. Each finished shard is written with ``save_to_disk`` into a temporary folder that is
then renamed, so a shard folder either exists complete or not at all. A run started again with the same
settings skips the shards that exist; the settings are kept in ``run.json`` and a mismatch is an error,
not a silent mix. The main process concatenates the shards in order into the final dataset, written the
same way. The result does not depend on how many processes ran or how often the run was interrupted.

Nothing this program did not write is ever deleted: an existing output or shard folder is replaced only when
it is recognisably data_gen's own (``recognise_dataset``, ``recognise_shards``). One run at a time writes an
output: ``output_lock`` holds an exclusive ``flock`` on ``.OUTPUT.lock`` beside it (the kernel drops it when
the process dies, so a killed run never blocks the next one).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

from ppd.files import atomic_write_text

SUMMARY_FILE = "ppd_shard_summary.json"
SETTINGS_FILE = "run.json"
# What `save_to_disk` writes, plus the cache files `datasets` adds beside them when the dataset is mapped later
# (training does).
DATASET_ENTRIES = re.compile(r"dataset_info\.json|state\.json|data-\d{5}-of-\d{5}\.arrow|cache-.+\.arrow")
# run.json (and its temporary), shard folders and their staging folders.
SHARDS_ENTRIES = re.compile(r"\.?run\.json(\.tmp)?|shard-\d{5}-of-\d{5}|\.shard-\d{5}-of-\d{5}-.+")


class SettingsMismatch(RuntimeError):
    pass


class OutputPathError(RuntimeError):
    """The output path holds something data_gen did not make, or another run is writing it."""


def recognise_dataset(folder: Path) -> str | None:
    """``None`` if ``folder`` is missing, empty or a dataset data_gen saved; otherwise what makes it something else."""
    found = _listing(folder)
    if not found:
        return None
    other = [name for name in found if not DATASET_ENTRIES.fullmatch(name.rstrip("/"))]
    if other:
        return "it holds " + _names(other)
    try:
        description = json.loads((folder / "dataset_info.json").read_text()).get("description") or ""
        if "dataset_type" in json.loads(description):
            return None
    except (OSError, ValueError, AttributeError, TypeError):
        pass
    return "a dataset without ppd metadata (not made by data_gen)"


def recognise_shards(folder: Path) -> str | None:
    """``None`` if ``folder`` is missing, empty or a shard folder of data_gen; otherwise what else it holds."""
    other = [name for name in _listing(folder) if not SHARDS_ENTRIES.fullmatch(name.rstrip("/"))]
    return "it holds " + _names(other) if other else None


def _listing(folder: Path) -> list[str]:
    if folder.is_symlink() or (folder.exists() and not folder.is_dir()):
        raise OutputPathError(f"{folder} is {'a symbolic link' if folder.is_symlink() else 'a file'}, not a folder "
                              "data_gen made: choose another --output_path")
    if not folder.exists():
        return []
    return sorted(p.name + ("/" if p.is_dir() else "") for p in folder.iterdir())


def _names(names: list[str], limit: int = 5) -> str:
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def lock_path(output: str | os.PathLike) -> Path:
    output = Path(output)
    return output.with_name(f".{output.name}.lock")


@contextlib.contextmanager
def output_lock(output: str | os.PathLike):
    """Hold the exclusive lock of ``output`` for the ``with`` block; ``OutputPathError`` at once if another run
    holds it. The lock file stays (empty but for the holder's pid): only the lock on it means anything."""
    path = lock_path(output)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "?"
            raise OutputPathError(f"{Path(output)} is being written by another data_gen run (process {holder}, "
                                  f"lock {path}): wait for it to finish, or choose another --output_path") from None
        handle.truncate(0)
        handle.write(f"{os.getpid()}\n")
        handle.flush()
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


class ShardStore:
    def __init__(self, root: str | os.PathLike, settings: dict, num_items: int, shard_size: int):
        self.root = Path(root)
        self.settings = {**settings, "num_items": num_items, "shard_size": shard_size}
        self.num_items = num_items
        self.shard_size = shard_size
        self.num_shards = max(1, -(-num_items // shard_size))

    def prepare(self) -> int:
        """Create the shard folder or check an existing one; returns how many shards are already done.

        Call on the main process only, before the others start.
        """
        self.root.mkdir(parents=True, exist_ok=True)
        settings_path = self.root / SETTINGS_FILE
        if settings_path.exists():
            previous = json.loads(settings_path.read_text())
            changed = sorted(k for k in set(previous) | set(self.settings) if previous.get(k) != self.settings.get(k))
            if changed:
                details = ", ".join(f"{k}: {previous.get(k)!r} -> {self.settings.get(k)!r}" for k in changed)
                raise SettingsMismatch(f"{self.root} holds shards of a run with other settings ({details}); "
                                       "start again with --overwrite, or restore the original settings")
        else:
            atomic_write_text(settings_path, json.dumps(self.settings, indent=1, sort_keys=True))
        return sum(self.is_done(i) for i in range(self.num_shards))

    def item_range(self, index: int) -> range:
        return range(index * self.shard_size, min(self.num_items, (index + 1) * self.shard_size))

    def owned(self, process_index: int, num_processes: int) -> list[int]:
        return [i for i in range(process_index, self.num_shards, num_processes) if not self.is_done(i)]

    def path(self, index: int) -> Path:
        return self.root / f"shard-{index:05d}-of-{self.num_shards:05d}"

    def is_done(self, index: int) -> bool:
        return self.path(index).is_dir()

    def write(self, index: int, dataset, summary: dict) -> None:
        """Write shard ``index``: ``dataset`` (``None`` when the shard produced no rows) and its summary."""
        staging = Path(tempfile.mkdtemp(prefix=f".{self.path(index).name}-", dir=self.root))
        try:
            if dataset is not None:  # an empty shard is a summary only (datasets cannot read back an empty one)
                dataset.save_to_disk(str(staging))
            (staging / SUMMARY_FILE).write_text(json.dumps(summary, sort_keys=True))
            staging.rename(self.path(index))
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    def load(self):
        """All shards in order as one dataset (``None`` if all are empty), plus their summaries."""
        import datasets

        missing = [i for i in range(self.num_shards) if not self.is_done(i)]
        if missing:
            raise RuntimeError(f"shards {missing[:5]}{'...' if len(missing) > 5 else ''} of {self.root} are "
                               "missing: a process failed; run the same command again to finish them")
        summaries = [json.loads((self.path(i) / SUMMARY_FILE).read_text()) for i in range(self.num_shards)]
        parts = [datasets.load_from_disk(str(self.path(i))) for i in range(self.num_shards)
                 if (self.path(i) / "dataset_info.json").exists()]
        return (datasets.concatenate_datasets(parts) if parts else None), summaries


def save_dataset_atomic(dataset, output_path: str | os.PathLike) -> None:
    """``save_to_disk`` into a sibling folder, then rename over ``output_path`` (only over a dataset of data_gen)."""
    output = Path(output_path)
    found = recognise_dataset(output)
    if found:
        raise OutputPathError(f"{output} is not a dataset made by data_gen ({found}); refusing to replace it")
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output.name}-", dir=output.parent))
    try:
        dataset.save_to_disk(str(staging))  # writes fresh files, even for a dataset memory-mapped from shards
        if output.exists():
            shutil.rmtree(output)
        staging.rename(output)
    finally:
        shutil.rmtree(staging, ignore_errors=True)




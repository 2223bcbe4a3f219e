"""Resumable, sharded dataset writing shared by every process of a run.

The input is cut into fixed shards of ``shard_size`` items; process ``p`` of ``P`` owns shards
``p, p + P, ...``. Each finished shard is written with ``save_to_disk`` into a temporary folder that is
then renamed, so a shard folder either exists complete or not at all. A run started again with the same
settings skips the shards that exist; the settings are kept in ``run.json`` and a mismatch is an error,
not a silent mix. The main process concatenates the shards in order into the final dataset, written the
same way. The result does not depend on how many processes ran or how often the run was interrupted.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

SUMMARY_FILE = "ppd_shard_summary.json"
SETTINGS_FILE = "run.json"


class SettingsMismatch(RuntimeError):
    pass


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
            _write_text_atomic(settings_path, json.dumps(self.settings, indent=1, sort_keys=True))
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
    """``save_to_disk`` into a sibling folder, then rename over ``output_path``."""
    output = Path(output_path)
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output.name}-", dir=output.parent))
    try:
        dataset.save_to_disk(str(staging))  # writes fresh files, even for a dataset memory-mapped from shards
        if output.exists():
            shutil.rmtree(output)
        staging.rename(output)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)

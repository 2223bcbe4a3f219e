"""Compiled steps kept across processes and machines: ``PPD_COMPILE_CACHE=<folder>``.

A decoder's warm-up compiles its steps with ``torch.compile``; on a fresh GPU machine that took 110-190 s per
step variant (the tree step at batch 1, the tree step for every larger batch, ...), minutes before a server
answers its first request. Inductor keeps what it compiled in a cache folder on that machine only. With
``PPD_COMPILE_CACHE`` set, :meth:`ppd.decoder.Decoder.warmup` first hands torch every artifact file in the
folder (``torch.compiler.load_cache_artifacts``: compiled graphs and kernels, which later compilations of the
same graphs then find instead of compiling), and afterwards writes what this process compiled as one more file
(``torch.compiler.save_cache_artifacts``), named by its contents, so no process overwrites another's artifacts
(a process whose warm-ups compile several times writes a file each time). Copy the folder to another
machine of the same GPU, torch and Triton versions and its warm-ups compile nothing that the folder holds; an
artifact of other versions is simply not found (torch checks its keys), never used wrongly. Dynamo still traces
each step (seconds).
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

import torch

from .files import atomic_write

ENV = "PPD_COMPILE_CACHE"
SUFFIX = ".torch-artifacts"

logger = logging.getLogger(__name__)
_loaded: set[str] = set()  # files this process has handed to torch already
_compiled_at_save = 0  # compilations this process had made when it last wrote a file


def _compilations() -> int:
    """Graphs this process has compiled so far rather than found in a cache (torch's own counters)."""
    from torch._dynamo.utils import counters

    return counters["inductor"]["fxgraph_cache_miss"] + counters["aot_autograd"]["autograd_cache_miss"]


def folder() -> Path | None:
    """The folder ``PPD_COMPILE_CACHE`` names, or None where it is unset or empty."""
    found = os.environ.get(ENV, "").strip()
    return Path(found).expanduser() if found else None


def load() -> int:
    """Hand torch every artifact file of the folder not handed yet; returns how many. A file torch cannot read
    (cut short, another torch's format) is skipped with a warning: compiling again is always correct."""
    where = folder()
    if where is None or not where.is_dir():
        return 0
    count = 0
    for path in sorted(where.glob(f"*{SUFFIX}")):
        if path.name in _loaded:
            continue
        _loaded.add(path.name)
        try:
            found = torch.compiler.load_cache_artifacts(path.read_bytes())
            problem = None if found is not None else "torch could not read it"
        except Exception as error:  # noqa: BLE001 - any unreadable file only costs a compilation
            problem = f"{type(error).__name__}: {error}"
        if problem is None:
            count += 1
        else:
            logger.warning("%s: not loaded (%s); the steps it held compile again", path, problem)
    return count


def save() -> Path | None:
    """Where this process has compiled something since it last wrote, write its artifacts (what it compiled and
    what it found in the cache) as one file named by its contents; returns the file, or None where there is
    nothing new to write or no folder."""
    global _compiled_at_save
    where = folder()
    if where is None or _compilations() == _compiled_at_save:
        return None
    saved = torch.compiler.save_cache_artifacts()
    if saved is None or not saved[0]:
        return None
    _compiled_at_save = _compilations()
    data = saved[0]
    path = where / f"{hashlib.sha256(data).hexdigest()[:20]}{SUFFIX}"
    if not path.exists():
        atomic_write(path, lambda tmp: Path(tmp).write_bytes(data))
    _loaded.add(path.name)
    # Each file is kept: a later one's bytes repeat the earlier ones', but torch (2.13) reads back only the last
    # group of each kind of artifact in a file, so an earlier file is the only one that gives its artifacts.
    return path


__all__ = ["ENV", "SUFFIX", "folder", "load", "save"]

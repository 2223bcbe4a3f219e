"""Keeping Python's cyclic garbage collector out of a serving loop's way.

Loading a model and compiling and capturing its steps leaves millions of long-lived Python objects (modules,
FX graphs, guards, graph pools). A full collection walks every one of them while it holds the interpreter:
on an H100 one such pass stopped the server's batcher for 568 ms in the middle of a 4-second load level
(``results/deep_gpu/h100/v31/``), and the ppd lane, which happened to be running, lost 16 % of its throughput.

``freeze_heap`` moves everything alive into the collector's permanent generation once the warm-up is done (as
serving engines do after their graph captures), so later collections walk only what serving allocates; the first
engine of a process to start freezes, the last to stop thaws.
``thaw_heap`` undoes it when serving ends, so that a process that goes on (a benchmark that builds one
batcher after another) can collect the cycles the closed engine leaves behind. ``CollectionWatch`` logs any
collection that still takes long, naming its generation and duration.
"""

from __future__ import annotations

import gc
import logging
import re
import threading
import time

logger = logging.getLogger(__name__)

SLOW_COLLECTION_MS = 20.0  # a collection longer than this is logged: about ten steps of a small model at batch 1
# The warning a slow collection logs, and how a reader of the log (``eval.load``, of a server's) finds its length.
SLOW_COLLECTION_MESSAGE = ("a garbage collection of generation %d held the interpreter for %.0f ms "
                           "(%d objects collected)")
SLOW_COLLECTION_LINE = re.compile(r"a garbage collection of generation \d held the interpreter for (\d+) ms")

_lock = threading.Lock()
_freezes = 0  # engines serving from a frozen heap: the last one to stop thaws it


def freeze_heap() -> int:
    """Collect once, then freeze every object alive, unless an engine already serves from a frozen heap (then
    this one's later objects stay with the collector: freezing again would also freeze whatever a finished piece
    of work left unreachable meanwhile, for as long as the first engine serves). Returns the objects the
    permanent generation holds."""
    global _freezes
    with _lock:
        if _freezes == 0:
            gc.collect()
            gc.freeze()
        _freezes += 1
        return gc.get_freeze_count()


def slow_collections_in(text: str) -> dict:
    """The slow collections a log's ``text`` reports: how many, and the longest in milliseconds (0 if none)."""
    lengths = [int(m.group(1)) for m in SLOW_COLLECTION_LINE.finditer(text)]
    return {"count": len(lengths), "longest_ms": max(lengths, default=0)}


def thaw_heap() -> None:
    """Undo one :func:`freeze_heap`; the last one returns the frozen objects to the collector and collects once,
    so that cycles which became garbage while frozen (a closed engine's among them) are freed now, not at a full
    pass that may come much later."""
    global _freezes
    with _lock:
        if _freezes == 0:
            return
        _freezes -= 1
        if _freezes == 0:
            gc.unfreeze()
            gc.collect()


class CollectionWatch:
    """While started, logs a warning for each garbage collection longer than ``slow_ms`` and counts them
    (``slow``, ``longest_ms``; :meth:`summary` gives them as :func:`slow_collections_in` reads them from a log).
    Where several watch one process (a benchmark's batchers, one each), each counts for itself and the one
    started first logs, so that a collection is logged once."""

    def __init__(self, slow_ms: float = SLOW_COLLECTION_MS):
        self.slow_ms = slow_ms
        self.slow = 0
        self.longest_ms = 0.0
        self._began: dict[int, float] = {}  # per thread: a collection runs in the thread that triggered it

    def __call__(self, phase: str, info: dict) -> None:
        now = time.perf_counter()
        thread = threading.get_ident()
        if phase == "start":
            self._began[thread] = now
            return
        began = self._began.pop(thread, None)
        if began is None:
            return
        ms = (now - began) * 1e3
        self.longest_ms = max(self.longest_ms, ms)
        if ms > self.slow_ms:
            self.slow += 1
            if self is next(c for c in gc.callbacks if isinstance(c, CollectionWatch)):
                logger.warning(SLOW_COLLECTION_MESSAGE, info.get("generation", -1), ms, info.get("collected", 0))

    def summary(self) -> dict:
        """How many collections were slow and the longest collection in milliseconds."""
        return {"count": self.slow, "longest_ms": round(self.longest_ms, 1)}

    def start(self) -> "CollectionWatch":
        if self not in gc.callbacks:
            gc.callbacks.append(self)
        return self

    def stop(self) -> None:
        if self in gc.callbacks:
            gc.callbacks.remove(self)

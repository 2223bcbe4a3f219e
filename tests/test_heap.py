"""The serving loop's heap: frozen while a batcher runs, thawed after, and slow collections logged."""

import gc
import logging
import weakref

import pytest

from ppd import DecodeConfig, Decoder
from ppd.serving import BatcherConfig, ContinuousBatcher, heap
from ppd.serving.heap import CollectionWatch, freeze_heap, slow_collections_in, thaw_heap
from tests.conftest import random_prompt_tokens, random_tree_set, tiny_model


@pytest.fixture
def unfrozen(monkeypatch):
    """A heap no engine holds frozen: an earlier test's batcher that was never closed (as an app's, which serves
    until the process ends) keeps its freeze; restored after the test."""
    monkeypatch.setattr(heap, "_freezes", 0)
    gc.unfreeze()


class Node:
    def __init__(self):
        self.other = self


def test_frozen_objects_stay_until_the_last_thaw_and_their_cycles_are_collected_after(unfrozen):
    first = Node()
    ref = weakref.ref(first)
    frozen = freeze_heap()
    later = [Node() for _ in range(100)]
    # A second engine in the same process freezes nothing more (the count may drop: frozen objects still die
    # by reference counting).
    assert 0 < freeze_heap() < frozen + len(later)
    del first  # a cycle that became garbage while frozen: no collection frees it
    gc.collect()
    assert ref() is not None
    thaw_heap()
    assert gc.get_freeze_count() > 0, "one engine still serves: the heap stays frozen"
    thaw_heap()
    assert gc.get_freeze_count() == 0 and ref() is None  # collected by the last thaw
    thaw_heap()  # one more thaw than freezes changes nothing
    assert gc.get_freeze_count() == 0 and len(later) == 100


def test_a_slow_collection_is_logged_and_counted(caplog):
    watch = CollectionWatch(slow_ms=-1.0).start()  # every collection counts as slow
    try:
        with caplog.at_level(logging.WARNING, logger="ppd.serving.heap"):
            gc.collect()
    finally:
        watch.stop()
    assert watch.slow >= 1 and watch.longest_ms >= 0.0
    assert "garbage collection of generation 2" in caplog.text
    found = slow_collections_in("server started\n" + caplog.text)  # as eval.load reads a server's log
    summary = watch.summary()
    assert found["count"] == summary["count"] and 0 <= found["longest_ms"] <= summary["longest_ms"] + 1
    assert slow_collections_in("no collection here") == {"count": 0, "longest_ms": 0}
    seen = watch.slow
    gc.collect()
    assert watch.slow == seen, "a stopped watch counts nothing"


def test_watches_of_one_process_each_count_a_collection_and_log_it_once(caplog):
    first, second = CollectionWatch(slow_ms=-1.0).start(), CollectionWatch(slow_ms=-1.0).start()
    try:
        with caplog.at_level(logging.WARNING, logger="ppd.serving.heap"):
            gc.collect()
        logged = slow_collections_in(caplog.text)["count"]
        assert logged >= 1 and first.slow == second.slow == logged
        first.stop()  # the watch left logs now
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="ppd.serving.heap"):
            gc.collect()
        assert slow_collections_in(caplog.text)["count"] == second.slow - logged >= 1
    finally:
        first.stop()
        second.stop()


def test_a_running_batcher_serves_from_a_frozen_heap_and_thaws_it_when_closed(unfrozen):
    model = tiny_model(seed=3)
    decoder = Decoder(model, random_prompt_tokens(model, 3, 1, seed=3), random_tree_set(seed=7, size=12))
    for freeze in (True, False):
        with ContinuousBatcher(decoder, BatcherConfig(max_batch=2, freeze_heap=freeze)) as batcher:
            assert (gc.get_freeze_count() > 0) is freeze
            alone = decoder.generate([1, 2, 3], DecodeConfig(max_new_tokens=6))
            assert batcher.submit([1, 2, 3], DecodeConfig(max_new_tokens=6)).result(timeout=60).token_ids \
                == alone.token_ids
        assert gc.get_freeze_count() == 0
        assert not any(isinstance(c, CollectionWatch) for c in gc.callbacks)

"""A request's stream read from an event loop: chunks pushed from the batcher's thread arrive in order, and a
reader that falls behind gets every chunk that has arrived in one read."""

from __future__ import annotations

import asyncio
import threading

import pytest

from ppd.serving.stream import EngineClosedError, Stream


def pushed_from_a_thread(stream: Stream, chunks: list[tuple[list[int], str | None]], started: threading.Event):
    """Push ``chunks`` from another thread, as the batcher does, once ``started`` is set."""
    def push():
        started.wait(10)
        for tokens, finish in chunks:
            stream._push(tokens, len(tokens) - 1, finish, counts_as_step=True)
    thread = threading.Thread(target=push)
    thread.start()
    return thread


def test_a_reader_behind_gets_every_chunk_that_has_arrived_at_once():
    chunks = [([1, 2], None), ([3], None), ([4, 5, 6], None), ([7], "length")]

    async def main():
        stream = Stream(0, prompt_tokens=5, method="ppd")
        started = threading.Event()
        thread = pushed_from_a_thread(stream, chunks, started)
        started.set()
        await asyncio.to_thread(thread.join)  # every chunk is queued before the first read
        await asyncio.sleep(0)  # the loop runs the deliveries the thread scheduled
        return [[(c.tokens, c.finish_reason) for c in batch] async for batch in stream.batches()], stream

    batches, stream = asyncio.run(main())
    assert batches == [chunks]
    assert stream.completion.token_ids == [1, 2, 3, 4, 5, 6, 7] and stream.completion.finish_reason == "length"


def test_a_reader_that_keeps_up_gets_one_chunk_a_read_and_async_for_gives_the_chunks():
    chunks = [([1], None), ([2, 3], None), ([4], "eos")]

    async def read(batched: bool):
        stream = Stream(0, prompt_tokens=1, method="ppd")
        read_one = [threading.Event() for _ in chunks]

        def push():  # the next chunk only once the reader has taken the last
            for (tokens, finish), taken in zip(chunks, read_one):
                stream._push(tokens, 0, finish, counts_as_step=True)
                taken.wait(10)

        thread = threading.Thread(target=push)
        thread.start()
        out = []
        async for item in stream.batches() if batched else stream:
            out.append([(c.tokens, c.finish_reason) for c in item] if batched else (item.tokens, item.finish_reason))
            read_one[len(out) - 1].set()
        await asyncio.to_thread(thread.join)
        return out

    assert asyncio.run(read(True)) == [[c] for c in chunks]
    assert asyncio.run(read(False)) == chunks


def test_an_error_ends_the_batches_with_it():
    async def main():
        stream = Stream(0, prompt_tokens=1, method="baseline")
        stream._push([9], 0, None, counts_as_step=True)
        stream._finish("cancelled", error=EngineClosedError("closed"))
        await asyncio.sleep(0)
        got = []
        with pytest.raises(EngineClosedError):
            async for batch in stream.batches():
                got.append([c.tokens for c in batch])
        return got

    assert asyncio.run(main()) == [[[9]]]

"""The handle of one request in a continuous batch: its tokens as they come, its result, its cancellation.

The batcher's thread calls :meth:`Stream._push` after every step the request took part in; consumers read
either from a thread (``for chunk in stream``) or from an asyncio task (``async for chunk in stream``, or
``stream.batches()`` for every chunk that has arrived at once); each stream is read by one consumer.
``cancel()`` asks the batcher to drop the request at the next step boundary (a client that went away): its row
is freed and the other requests go on.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

from ..decoder import GenerationOutput


class QueueFullError(RuntimeError):
    """The batcher's waiting queue is full: the request was not accepted (a server answers 429)."""


class EngineClosedError(RuntimeError):
    """The batcher was closed before or while the request ran."""


@dataclass
class Chunk:
    """The tokens one forward pass gave a request (the prefill's first token included)."""

    tokens: list[int]
    guessed: int  # how many leading tokens were accepted PPD guesses
    finish_reason: str | None = None  # on the last chunk: "eos" | "length" | "max_length" | "cancelled"


@dataclass
class Completion(GenerationOutput):
    """What a finished request produced (``wall_time_s`` counts from submission), and its queueing."""

    prompt_tokens: int = 0
    method: str = "ppd"  # "ppd" | "baseline"
    queued_s: float = 0.0  # waiting before its prefill
    first_token_s: float = 0.0


_DONE = object()


class Stream:
    def __init__(self, request_id: int, prompt_tokens: int, method: str):
        self.id = request_id
        self.created = time.perf_counter()
        self.completion: Completion | None = None
        self.error: BaseException | None = None
        self._tokens: list[int] = []
        self._step_tokens: list[int] = []
        self._prompt_tokens = prompt_tokens
        self._method = method
        self._started: float | None = None
        self._first: float | None = None
        self._cancelled = threading.Event()
        self._done = threading.Event()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._async_queue: asyncio.Queue | None = None
        try:  # submitted from an event loop: deliver there without a thread per waiting consumer
            self._loop = asyncio.get_running_loop()
            self._async_queue = asyncio.Queue()
        except RuntimeError:
            pass

    # ------------------------------------------------------------------ consumers
    @property
    def done(self) -> bool:
        return self._done.is_set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def cancel(self) -> None:
        """Drop the request at the next step boundary; a finished request is left as it is."""
        self._cancelled.set()

    def __iter__(self) -> Iterator[Chunk]:
        if self._async_queue is not None:
            raise RuntimeError("this stream was submitted from an event loop: read it with `async for`")
        while True:
            item = self._queue.get()
            if item is _DONE:
                break
            yield item
        if self.error is not None:
            raise self.error

    async def __aiter__(self) -> AsyncIterator[Chunk]:
        async for batch in self.batches():
            for chunk in batch:
                yield chunk

    async def batches(self) -> AsyncIterator[list[Chunk]]:
        """The chunks as ``async for`` gives them, each time all that have arrived by the time the consumer reads
        (at least one): a consumer that falls behind the steps, as a server's event loop does under many
        clients, then handles several steps' chunks at once instead of paying its per-chunk work for each."""
        if self._async_queue is None:
            raise RuntimeError("this stream was submitted outside an event loop: read it with `for`")
        done = False
        while not done:
            batch, item = [], await self._async_queue.get()
            while True:
                if item is _DONE:
                    done = True
                    break
                batch.append(item)
                try:
                    item = self._async_queue.get_nowait()
                except asyncio.QueueEmpty:
                    break
            if batch:
                yield batch
        if self.error is not None:
            raise self.error

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the request has ended (finished, or dropped after :meth:`cancel`); False on timeout."""
        return self._done.wait(timeout)

    def result(self, timeout: float | None = None) -> Completion:
        """Block until the request ends; its completion (raises what ended it abnormally)."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.id} did not finish within {timeout} s")
        if self.error is not None:
            raise self.error
        return self.completion

    # ------------------------------------------------------------------ the batcher's side
    def _deliver(self, item) -> None:
        if self._async_queue is not None:
            try:
                self._loop.call_soon_threadsafe(self._async_queue.put_nowait, item)
            except RuntimeError:  # the consumer's event loop is closed: nobody is reading any more
                self._cancelled.set()
        else:
            self._queue.put(item)

    def _started_now(self) -> None:
        self._started = time.perf_counter()

    def _push(self, tokens: list[int], guessed: int, finish_reason: str | None, counts_as_step: bool) -> None:
        now = time.perf_counter()
        if tokens and self._first is None:
            self._first = now
        if counts_as_step:
            self._step_tokens.append(len(tokens))
        self._tokens.extend(tokens)
        if tokens or finish_reason:
            self._deliver(Chunk(list(tokens), guessed, finish_reason))
        if finish_reason is not None:
            self._finish(finish_reason, now)

    def _end_cancelled(self) -> None:
        """End a request its reader cancelled: a last chunk, with no tokens, that says so."""
        self._push([], 0, "cancelled", counts_as_step=False)

    def _finish(self, reason: str, now: float | None = None, error: BaseException | None = None) -> None:
        if self._done.is_set():
            return
        now = now or time.perf_counter()
        started = self._started or now
        self.completion = Completion(
            token_ids=self._tokens, steps=len(self._step_tokens), finish_reason=reason,
            wall_time_s=now - self.created, step_tokens=self._step_tokens, prompt_tokens=self._prompt_tokens,
            method=self._method, queued_s=started - self.created, first_token_s=(self._first or now) - self.created)
        self.error = error
        self._done.set()
        self._deliver(_DONE)

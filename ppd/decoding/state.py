"""Persistent device buffers of one batch bucket: the KV cache and everything a step reads and writes.

A :class:`DecodeState` is allocated once per batch-size bucket and reused by every request that fits it;
:meth:`DecodeState.reset` prepares it for a new request in place, so buffer addresses never change and
captured graphs stay valid. The step reads and updates these tensors in place; the host reads back only
``report`` once per step.

Per batch row b (a bucket may hold padding rows, which start finished):

- ``lengths[b]``: committed cache entries; ``root[b]``: the next token, not yet in the cache;
  ``guesses[b]``: top-K guesses [N, K] of the prompt tokens attached to the last accepted node, and
  ``guess_log_probs[b]`` their log-probabilities;
  ``key[b]``: how many of them exist (the depth key of the next tree).
- ``generated[b]`` / ``limit[b]``: tokens emitted so far and allowed; ``reason[b]``: why the row stopped
  (:data:`RUNNING`, :data:`EOS`, :data:`LENGTH`, :data:`MAX_LENGTH`), ``limit_reason[b]`` the reason its
  limit stands for.
- ``report[b]``: what the last step did, ``[count, accepted, reason, length, tokens...]``.
- ``history[b]``: the row's text by position (the prompt, the committed tokens, the root), kept only for a
  decoder with a prompt-lookup chain (``ppd.decoding.lookup``; else ``None``).
- ``eos[b]``: the row's EOS ids (-1 padded); ``seed[b]``, ``temperature[b]``, ``top_k[b]``, ``top_p[b]``,
  ``typical[b]`` with the typical-acceptance bounds, and ``greedy[b]``: the row's own sampling settings, so
  that requests with different settings can share a batch (a greedy row in a sampled step still takes the
  argmax). Row b draws the random numbers of its i-th output token from ``(seed[b], i)``, with i read from
  ``generated[b]`` (see ``ppd.acceptance``).

:meth:`DecodeState.rows` is a view of a range of rows sharing the buffers (a continuous batch runs a step
over its first rows, and prefills a joining request into its own row).
"""

from __future__ import annotations

import torch

from ..config import DecodeConfig
from ..uploads import upload_into
from .kv_cache import KVBuffer

RUNNING, EOS, LENGTH, MAX_LENGTH = 0, 1, 2, 3
REASONS = {EOS: "eos", LENGTH: "length", MAX_LENGTH: "max_length"}
REPORT_HEAD = 4  # count, accepted guesses, reason, length; then the emitted tokens


class DecodeState:
    def __init__(self, num_layers: int, batch_size: int, capacity: int, num_prompt_tokens: int, top_k: int,
                 max_emit: int, num_eos: int, device: torch.device, reserved: int | None = None,
                 spare_slots: int = 0, history: bool = False):
        self.batch_size = batch_size
        self.capacity = capacity
        self.device = device
        # Cache slots allocated: grows to capacity (plus spare slots never attended, see KVBuffer).
        self.kv = KVBuffer(num_layers, batch_size, capacity, reserved, spare_slots)

        def longs(*shape):
            return torch.zeros(*shape, dtype=torch.long, device=device)

        B = batch_size
        self.lengths = longs(B)
        self.root = longs(B)
        self.guesses = longs(B, max(num_prompt_tokens, 1), max(top_k, 1))
        self.guess_log_probs = torch.zeros(B, max(num_prompt_tokens, 1), max(top_k, 1), device=device)
        self.key = longs(B)
        self.generated = longs(B)
        self.limit = longs(B)
        self.reason = longs(B)
        self.limit_reason = longs(B)
        self.eos = torch.full((B, max(num_eos, 1)), -1, dtype=torch.long, device=device)
        self.report = longs(B, REPORT_HEAD + max_emit)
        # Sampling: per-row seeds and settings (see ``ppd.acceptance``).
        self.seed = longs(B)
        self.temperature = torch.ones(B, device=device)
        self.top_k = longs(B)
        self.top_p = torch.ones(B, device=device)
        self.typical = torch.zeros(B, dtype=torch.bool, device=device)
        self.posterior_threshold = torch.zeros(B, device=device)
        self.posterior_alpha = torch.zeros(B, device=device)
        self.greedy = torch.ones(B, dtype=torch.bool, device=device)
        # Slot numbers 0..capacity-1; a step attends over a prefix of them (its width).
        self.slot_ids = torch.arange(capacity, device=device)
        # Room for every position a row's text reaches: the cache's slots, then one step's tokens past the last.
        self.history = longs(B, capacity + max_emit + 1) if history else None
        self._views: dict[tuple, list[torch.Tensor]] = {}  # per row, its views (see ``copy_row_from``)
        # One row's worth of each buffer ``vacate`` writes, holding its padding value (see ``PADDING``).
        self._padding = [torch.full_like(getattr(self, name)[0], value) for name, value in self.PADDING]

    # Every per-row buffer except the KV cache.
    ROW_BUFFERS = ("lengths", "root", "guesses", "guess_log_probs", "key", "generated", "limit", "reason",
                   "limit_reason", "eos", "report", "seed", "temperature", "top_k", "top_p", "typical",
                   "posterior_threshold", "posterior_alpha", "greedy")

    def row_names(self) -> tuple[str, ...]:
        """Every per-row buffer of this state: :data:`ROW_BUFFERS`, and the history where it is kept."""
        return self.ROW_BUFFERS + (() if self.history is None else ("history",))

    def row_tensors(self) -> list[torch.Tensor]:
        return [getattr(self, name) for name in self.row_names()]

    def rows(self, start: int, stop: int) -> "DecodeState":
        """A state of rows ``[start, stop)`` that shares this one's buffers (writes go through)."""
        view = object.__new__(DecodeState)
        view.__dict__.update(self.__dict__)
        for name in self.row_names():
            setattr(view, name, getattr(self, name)[start:stop])
        view.batch_size = stop - start
        view.kv = self.kv.rows(start, stop)
        view._views = {}
        return view

    def move_row(self, src: int, dst: int, length: int) -> None:
        """Copy row ``src`` (its first ``length`` cache slots and every per-row buffer) into row ``dst``."""
        self.copy_row_from(self, src, dst, length)

    def copy_row_from(self, source: "DecodeState", src: int, dst: int, length: int) -> None:
        """Copy row ``src`` of ``source`` (a state of the same decoder: its first ``length`` cache slots and every
        per-row buffer) into row ``dst`` of this one.

        On a GPU, where both caches have the same slots, each layer's whole row is copied (its slots past
        ``length`` are stale and never attended) and the copies are grouped by dtype into one foreach copy each: a
        row is ~80 tensors (60 of cache for the default model), and copying them one by one cost 1.5-1.8 ms of
        host time an admission on an H200 (``results/deep_gpu/h200/v23/``), for microseconds of device work."""
        mine_kv, theirs_kv = self.kv.buffers(), source.kv.buffers()
        whole = self.device.type == "cuda" and all(a.shape[2] == b.shape[2] for a, b in zip(mine_kv, theirs_kv))
        if not whole:
            for mine, theirs in zip(self.row_tensors(), source.row_tensors()):
                mine[dst] = theirs[src]
            for mine, theirs in zip(mine_kv, theirs_kv):
                mine[dst, :, :length] = theirs[src, :, :length]
            return
        groups: dict[torch.dtype, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        for mine, theirs in zip(self._row_views(dst), source._row_views(src)):
            into, out_of = groups.setdefault(mine.dtype, ([], []))
            into.append(mine)
            out_of.append(theirs)
        for into, out_of in groups.values():
            torch._foreach_copy_(into, out_of)

    def _row_views(self, row: int) -> list[torch.Tensor]:
        """Row ``row`` of every per-row buffer and of every layer's keys and values, made once per row (and again
        if the cache's buffers change)."""
        buffers = self.kv.buffers()
        key = (row, tuple(b.data_ptr() for b in buffers[:1]), len(buffers))
        found = self._views.get(key)
        if found is None:
            found = self._views[key] = [t[row] for t in self.row_tensors()] + [b[row] for b in buffers]
        return found

    # What a padding row holds in the buffers :meth:`vacate` writes.
    PADDING = (("reason", LENGTH), ("lengths", 0), ("generated", 0), ("limit", 1), ("key", 0), ("report", 0))

    def vacate(self, row: int) -> None:
        """Make ``row`` inert padding: finished, empty, with a valid tree key.

        One foreach copy from padding values made once (on a GPU one kernel, where writing each buffer's element
        from a Python number costs an allocation and two kernels, twelve launches a finished request)."""
        torch._foreach_copy_([getattr(self, name)[row] for name, _ in self.PADDING], self._padding)

    def small_tensors(self) -> list[torch.Tensor]:
        """Every buffer a step changes except the KV cache, whose changes past ``lengths`` are stale anyway."""
        return [self.lengths, self.root, self.guesses, self.guess_log_probs, self.key, self.generated, self.reason,
                self.report]

    def snapshot(self) -> list[torch.Tensor]:
        return [t.clone() for t in self.small_tensors()]

    def restore(self, saved: list[torch.Tensor]) -> None:
        for t, s in zip(self.small_tensors(), saved):
            t.copy_(s)

    def reset(self, rows: int, limits: list[int], limit_reasons: list[int], eos: list[int],
              sampling: DecodeConfig) -> None:
        """Prepare for a request of ``rows`` real rows (the rest of the bucket is padding, finished at once),
        sampled as ``sampling`` says (its seed, temperature, filters and acceptance)."""
        B = self.batch_size
        pad = B - rows

        # (uploaded without waiting for the device: a request joining a running batch is reset while it steps)
        upload_into(self.limit, list(limits) + [1] * pad)
        upload_into(self.limit_reason, list(limit_reasons) + [LENGTH] * pad)
        upload_into(self.reason, [RUNNING] * rows + [LENGTH] * pad)
        self.generated.zero_()
        self.lengths.zero_()
        self.key.zero_()
        self.report.zero_()
        eos_ids = sorted(eos)[: self.eos.shape[1]]
        upload_into(self.eos, [eos_ids + [-1] * (self.eos.shape[1] - len(eos_ids))] * B)
        # One seed per row, derived from the request's seed so that rows draw independent numbers.
        seed = sampling.seed if sampling.seed is not None else 0
        upload_into(self.seed, [(seed * 1_000_003 + b * 7_919) % (1 << 31) for b in range(B)])
        for buffer, value in ((self.temperature, max(sampling.temperature, 1e-6)), (self.top_k, sampling.top_k),
                              (self.top_p, sampling.top_p), (self.typical, sampling.typical),
                              (self.posterior_threshold, sampling.posterior_threshold),
                              (self.posterior_alpha, sampling.posterior_alpha), (self.greedy, sampling.greedy)):
            buffer.fill_(value)


class StatePool:
    """The decoder's states by batch bucket, allocated on first use and reused by later requests.

    A request leases a state for as long as it runs; a second request running at the same time (two
    interleaved streams) gets a state of its own, so requests never share a cache.
    """

    def __init__(self, make):
        self._make = make  # batch size -> DecodeState
        self._free: dict[int, list[DecodeState]] = {}
        self.allocated: list[DecodeState] = []

    def acquire(self, batch_size: int) -> DecodeState:
        free = self._free.setdefault(batch_size, [])
        if free:
            return free.pop()
        state = self._make(batch_size)
        self.allocated.append(state)
        return state

    def release(self, state: DecodeState) -> None:
        self._free.setdefault(state.batch_size, []).append(state)

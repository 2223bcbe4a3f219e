"""A preallocated key/value cache that the decoder writes and compacts in place.

transformers' attention layers call ``past_key_values.update(key, value, layer_idx)`` and attend over
whatever it returns. This cache decides where new entries go itself: before each forward the decoder
calls :meth:`KVCache.prepare` with the slot of every new row (``[B, T]``, per batch row) and how many
slots attention should see. Buffers are allocated once (``[B, H, capacity, D]`` per layer, on the first
update, so any head count or head size works) and never reallocated, so their addresses stay fixed for
CUDA-graph capture.

After a tree step only the accepted tokens are kept: :meth:`KVCache.compact` moves their entries down to
the end of each row's committed prefix, in place. Entries past a row's committed length are stale and
the decoder's masks never let attention see them.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


class _KVLayer(CacheLayerMixin):
    """One layer's buffers; positions come from the owning :class:`KVCache`."""

    is_compileable = True
    is_sliding = False

    def __init__(self, owner: "KVCache"):
        super().__init__()
        self.owner = owner

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, heads = key_states.shape[:2]
        cap = self.owner.capacity
        self.keys = key_states.new_zeros(batch, heads, cap, key_states.shape[-1])
        self.values = value_states.new_zeros(batch, heads, cap, value_states.shape[-1])
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        slots = self.owner.write_slots  # [B, T]
        if slots is None:
            raise RuntimeError("KVCache.prepare() must be called before each forward")
        self.keys.scatter_(2, _expand(slots, self.keys), key_states)
        self.values.scatter_(2, _expand(slots, self.values), value_states)
        n = self.owner.attend_len
        return self.keys[:, :, :n], self.values[:, :, :n]

    def get_mask_sizes(self, query_length: int, *args, **kwargs) -> tuple[int, int]:
        return self.owner.attend_len, 0

    def get_seq_length(self) -> int:
        return self.owner.attend_len

    def get_max_length(self) -> int:
        return self.owner.capacity

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy slots ``src`` to slots ``dst`` (both [B, M]) in every batch row; reads happen before writes."""
        if not self.is_initialized:
            return
        for buf in (self.keys, self.values):
            moved = buf.gather(2, _expand(src, buf))
            buf.scatter_(2, _expand(dst, buf), moved)


def _expand(slots: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
    """[B, M] slot indices -> [B, H, M, D] index for gather/scatter along the sequence axis of ``buf``."""
    b, h, _, d = buf.shape
    return slots[:, None, :, None].expand(b, h, slots.shape[1], d)


class KVCache(Cache):
    """Per-layer ``[B, H, capacity, D]`` buffers plus per-row committed lengths (``lengths``: long [B])."""

    def __init__(self, num_layers: int, batch_size: int, capacity: int, device: torch.device | str):
        self.capacity = capacity
        self.write_slots: torch.Tensor | None = None
        self.attend_len = 0
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)
        super().__init__(layers=[_KVLayer(self) for _ in range(num_layers)])

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]

    def prepare(self, write_slots: torch.Tensor, attend_len: int) -> None:
        """Say where the next forward's T rows go (long [B, T]) and how many slots attention sees."""
        if attend_len > self.capacity:
            raise ValueError(f"attend_len {attend_len} exceeds the cache capacity {self.capacity}")
        self.write_slots = write_slots
        self.attend_len = attend_len

    def compact(self, src: torch.Tensor, count: torch.Tensor) -> None:
        """Keep, per row b, the entries at slots ``src[b, :count[b]]`` as the next committed ones.

        ``src`` is long [B, M] (padding beyond ``count`` may hold any in-range slot); entries land at
        ``lengths[b] + [0, M)`` and ``lengths`` grows by ``count``. Copies past ``count`` only touch stale
        slots, which keeps every shape fixed. M must not exceed the rows of the last forward, which were
        written at ``lengths[b] + [0, T)``, so every destination is a slot that forward already used.
        """
        dst = self.lengths[:, None] + torch.arange(src.shape[1], device=src.device)[None, :]
        for layer in self.layers:
            layer.move(src, dst)
        self.lengths += count

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.attend_len

    def get_mask_sizes(self, *args, **kwargs) -> tuple[int, int]:
        return self.attend_len, 0

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return self.capacity

"""The decoder-owned key/value cache: per-layer buffers written at given slots, compacted in place.

``KVBuffer`` holds one keys and one values tensor per layer, ``[B, heads, slots, head_dim]`` each (each
layer's keys and values with the head count and size that layer writes). They are allocated in the first
forward; a new request only resets the per-row lengths that the decoder keeps beside them. A buffer may
start with fewer slots than its ``capacity`` and grow (doubling, contents copied) as the host asks for
more before a forward (:meth:`KVBuffer.reserve`), so that a decoder sized for a long context window holds
memory for the lengths it actually decodes; steps captured in CUDA graphs reserve the whole capacity
first, and the buffers' addresses stay fixed from then on.

Every buffer is a tensor of its own rather than a view into one tensor of all layers, and every write is
an indexed assignment (``buffer[rows, :, slots] = ...``, an ``index_put_``). One tensor would make the
compaction a single gather and scatter, but ``torch.compile`` turns an in-place write into a view of a
larger input into copies of that whole input (measured on an H100: the compiled step ran 2.5x slower
than the eager one, ``results/core/dev/``), and it does not update in place a ``scatter_`` into an input
either: it copies the buffer, scatters into the copy and copies it back, every step. ``index_put_`` it
does update in place.

``CacheView`` is what transformers' attention layers see (``past_key_values``): each layer's
``update(key, value, layer_idx)`` scatters the new rows to the slots the decoder chose (``slots``,
long ``[B, T]``, per batch row) and returns the first ``width`` slots of that layer. Slots past a row's
committed length hold stale entries; the decoder's masks never let attention see them.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn
from transformers.cache_utils import Cache


def cache_keyword(model: nn.Module) -> str:
    """The keyword ``model``'s forward takes its KV cache by: ``cache`` where transformers renamed it (5.24 warns
    on ``past_key_values`` and 5.40 drops it), else ``past_key_values`` (earlier releases, remote code)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def returned_cache(output) -> Cache | None:
    """The KV cache a transformers forward returned, under either name (see :func:`cache_keyword`)."""
    cache = getattr(output, "cache", None)
    return cache if cache is not None else getattr(output, "past_key_values", None)


GROWTH_UNIT = 128  # a grown buffer's slot count is a multiple of this (or the capacity)


class KVBuffer:
    """Keys and values of every layer; empty lists until the first write. ``reserved`` slots (at most
    ``capacity``, all of it by default) are allocated, or will be by the first write, and ``spare`` slots past
    them that no forward attends. A spare slot keeps every width a step attends over below the buffer's size:
    under torch 2.11 a compiled step that slices the whole buffer (width equal to its size) is a graph of its
    own, and on an H200 the last capture width compiled the one-row and tree steps a second time (68 s and
    120 s). FlexAttention steps, which attend over the whole buffer by design, take none."""

    def __init__(self, num_layers: int, batch_size: int, capacity: int, reserved: int | None = None,
                 spare: int = 0):
        self.num_layers = num_layers
        self.batch_size = batch_size
        self.capacity = capacity
        self.reserved = capacity if reserved is None else max(1, min(reserved, capacity))
        self.spare = spare
        self.keys: list[torch.Tensor] = []  # per layer [B, H, S, D]
        self.values: list[torch.Tensor] = []

    @property
    def allocated(self) -> bool:
        return len(self.keys) > 0

    def allocate(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Allocate every layer like the first layer's new ``keys`` and ``values`` [b, H, T, D] (any head count
        and head size, each its own: multi-head latent attention's keys are wider than its values)."""
        self.keys = [self._like(keys) for _ in range(self.num_layers)]
        self.values = [self._like(values) for _ in range(self.num_layers)]

    def fit(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Reshape ``layer``'s buffers for its new ``keys`` and ``values`` where their heads differ from the
        first layer's (Gemma 4's full-attention layers have wider heads than its sliding ones). Only the first
        forward, which writes every layer, meets such a layer: the addresses stay fixed after it."""
        for buffers, new in ((self.keys, keys), (self.values, values)):
            if buffers[layer].shape[1] != new.shape[1] or buffers[layer].shape[3] != new.shape[3]:
                buffers[layer] = self._like(new)

    def _like(self, new: torch.Tensor) -> torch.Tensor:
        return new.new_zeros(self.batch_size, new.shape[1], self.reserved + self.spare, new.shape[3])

    def reserve(self, slots: int) -> None:
        """Have at least ``slots`` slots (at most the capacity) allocated: grow every buffer to the larger of
        ``slots`` and twice its size, rounded up to :data:`GROWTH_UNIT`, copying what it holds. Host side
        only, before a forward: a compiled step sees the grown buffers as inputs of a new size, and a captured
        graph must be captured after its state reserved the whole capacity."""
        slots = min(slots, self.capacity)
        if slots <= self.reserved:
            return
        grown = min(self.capacity, -(-max(slots, 2 * self.reserved) // GROWTH_UNIT) * GROWTH_UNIT)
        for buffers in (self.keys, self.values):
            for layer, old in enumerate(buffers):
                new = old.new_zeros(old.shape[0], old.shape[1], grown + self.spare, old.shape[3])
                new[:, :, : old.shape[2]] = old
                buffers[layer] = new
        self.reserved = grown

    def buffers(self) -> list[torch.Tensor]:
        return self.keys + self.values

    def view(self, slots: torch.Tensor, width: int, rows: int | None = None) -> "CacheView":
        """A cache for one forward: its ``T`` new rows go to ``slots`` [b, T]; attention sees ``width`` slots.
        ``rows`` limits it to the first batch rows (a prefill of fewer prompts than the buffer holds)."""
        return CacheView(self, slots, width, rows)

    def rows(self, start: int, stop: int) -> "KVBuffer":
        """The cache of rows ``[start, stop)``, sharing this buffer's memory (allocating it if needed)."""
        return KVRows(self, start, stop)

    def compact(self, src: torch.Tensor, lengths: torch.Tensor) -> None:
        """Move slots ``src`` [B, M] of every row to ``lengths[b] + [0, M)``, in every layer.

        Reads happen before writes. The destinations past a row's accepted count only receive stale
        entries, which keeps every shape fixed.
        """
        dst = lengths[:, None] + torch.arange(src.shape[1], device=src.device)[None, :]
        rows = torch.arange(src.shape[0], device=src.device)[:, None]
        for buffer in self.buffers():
            buffer[rows, :, dst] = buffer[rows, :, src]  # [B, M, H, D] read, then written


class KVRows(KVBuffer):
    """A range of another buffer's rows: its keys and values are slices of the parent's, made when first read
    after the parent allocated or grew (so the view may be made before), and the same slice objects after.

    A compiled step must receive those slices, not take them: a slice taken inside the compiled function
    makes the parent's whole buffer the graph's input, and Inductor then writes the step's new keys and
    values into a copy of the slice and copies it back, every layer, every step (on an H200 a continuous
    batch's one-row PPD step took 3.1 ms in a 64-row state against 2.0 ms in a one-row state). So inside a
    compiled function the slices made by the last eager read are returned as they are; the step runner reads
    them before it calls the compiled step."""

    def __init__(self, parent: KVBuffer, start: int, stop: int):  # noqa: super() not called: no own buffers
        self.parent, self.start, self.stop = parent, start, stop
        self.num_layers, self.capacity, self.batch_size = parent.num_layers, parent.capacity, stop - start
        self.spare = parent.spare
        self._slices: dict[str, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}

    def _rows_of(self, name: str) -> list[torch.Tensor]:
        if torch.compiler.is_compiling():
            return self._slices[name][1]
        source = getattr(self.parent, name)
        made = self._slices.get(name)
        if made is None or len(made[0]) != len(source) or any(a is not b for a, b in zip(made[0], source)):
            made = (list(source), [t[self.start: self.stop] for t in source])
            self._slices[name] = made
        return made[1]

    @property
    def reserved(self) -> int:
        return self.parent.reserved

    def reserve(self, slots: int) -> None:
        self.parent.reserve(slots)

    @property
    def keys(self) -> list[torch.Tensor]:
        return self._rows_of("keys")

    @property
    def values(self) -> list[torch.Tensor]:
        return self._rows_of("values")

    @property
    def allocated(self) -> bool:
        return self.parent.allocated

    def allocate(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.parent.allocate(keys, values)

    def fit(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        if not torch.compiler.is_compiling():  # the first (eager) forward fits every layer; a compiled one
            self.parent.fit(layer, keys, values)  # must not read the parent's buffers


class CacheView(Cache):
    """``past_key_values`` for one forward over a :class:`KVBuffer`."""

    def __init__(self, buffer: KVBuffer, slots: torch.Tensor, width: int, rows: int | None = None):
        super().__init__(layers=[])
        self.buffer = buffer
        self.slots = slots  # long [b, T]
        self.width = width
        self.rows = rows

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if not self.buffer.allocated:
            self.buffer.allocate(key_states, value_states)
        self.buffer.fit(layer_idx, key_states, value_states)
        keys, values = self.buffer.keys[layer_idx], self.buffer.values[layer_idx]  # [B, H, S, D]
        if self.rows is not None:
            keys, values = keys[: self.rows], values[: self.rows]
        rows = torch.arange(self.slots.shape[0], device=self.slots.device)[:, None]
        keys[rows, :, self.slots] = key_states.transpose(1, 2)  # [b, T, H, D] at (row, slot)
        values[rows, :, self.slots] = value_states.transpose(1, 2)
        return keys[:, :, : self.width], values[:, :, : self.width]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.width

    def get_mask_sizes(self, *args, **kwargs) -> tuple[int, int]:
        return self.width, 0

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return self.buffer.capacity

    def __len__(self) -> int:
        return self.buffer.num_layers

"""A tree step's attention over a long cache, split along the keys (flash-decoding for a tree of rows).

A dense tree step gives each layer's attention its query rows ``[B, Hq, T, D]``, the cache's keys and values
``[B, Hkv, W, D]`` and a float mask ``[B, 1, T, W]``. Attention kernels built for prefills walk the whole cache in
one program per head and tile of query rows: with a tree's few rows and a cache of 8K slots that is a handful of
programs on a GPU of 132 processors, each reading 8K keys one block after another (on an H200 a 16-row tree step
took 5.5 ms at 8K against 2.4 ms at 1K). This kernel gives the work the cache's width instead:

* the query heads that share a key head are folded into rows of that head (row ``g * T + t`` is row ``t`` of query
  head ``h * G + g``), so each key head's keys and values are read once for all of its query heads;
* the cache's slots are cut into pieces, one program per (piece, batch row and key head, tile of folded rows),
  each keeping a running maximum and sum (the online softmax) and writing its piece's result and log-sum-exp in
  float32;
* the pieces are merged by their log-sum-exp, which gives the softmax over the whole width.

Scores, the softmax and the merge run in float32 (the weights are rounded to the values' dtype before their product
with the values, as flash attention does; float32 inputs are multiplied in full precision, not TF32) and the mask is
added to each score as the model's own SDPA adds it, so the result is SDPA's up to rounding. A tree step of a model
without sliding windows hands the kernel its rows' cache lengths and the tree's own mask ``[B, 1, T, T]`` instead of
the ``[B, 1, T, W]`` one (``LanguageModel.compact_mask``): every slot below a row's length is seen, the tree's slots
as its mask says, and the pieces stop reading at the tree's last slot, so the step's mask takes O(T^2 B) memory, not
O(T W B), and the cache's unused tail is never read. Written in Triton; on a CPU the same kernel runs through
Triton's interpreter (for the tests only: it is slow). ``PPD_GROUPED_SDPA=split`` selects it for dense tree steps
(:mod:`ppd.decoding.grouped_attention`).
"""

from __future__ import annotations

import functools
import importlib.util
import math
import os

import torch

BLOCK_M = 64  # folded query rows a program holds
BLOCK_N = 64  # cache slots a program reads at a time
MIN_PIECE = 256  # slots per piece the piece count aims at, at least (see piece_count)
HAS_TRITON = importlib.util.find_spec("triton") is not None  # it comes with PyTorch's CUDA builds
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # Triton's interpreter, on CPU tensors (the tests)


def runs_on(tensor: torch.Tensor) -> bool:
    """Whether the kernel can take ``tensor``: on a CUDA GPU with Triton, or on a CPU under Triton's interpreter.
    Reads module constants only (a compiled step's trace guards on them as constants)."""
    return runs_on_device(tensor.device)


def runs_on_device(device: torch.device) -> bool:
    """:func:`runs_on` for tensors on ``device``."""
    return HAS_TRITON and (device.type == "cuda" or INTERPRETED)


def _kernel(device: torch.device):
    from . import split_kernel

    if device.type != "cuda" and type(split_kernel.kernel).__name__ != "InterpretedFunction":
        raise RuntimeError("split attention runs on a CUDA GPU (or, for tests, on a CPU under Triton's interpreter: "
                           "TRITON_INTERPRET=1 set before Triton is imported)")
    return split_kernel.kernel


@functools.lru_cache(maxsize=None)
def _processors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _round_up(n: int, unit: int) -> int:
    return -(-n // unit) * unit


def piece_count(programs: int, width: int, processors: int) -> int:
    """Pieces to cut ``width`` slots into so that ``programs`` tiles (batch rows x key heads x row tiles) become
    about two programs per processor, no more pieces than ``width / MIN_PIECE`` rounded up (the pieces are then
    evened out, so one may hold fewer than :data:`MIN_PIECE` slots)."""
    wanted = max(1, math.ceil(2 * processors / programs))
    return max(1, min(wanted, math.ceil(width / MIN_PIECE)))


def split_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                    scale: float, pieces: int = 0, lengths: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of ``query`` [B, Hq, T, D] over ``key`` and ``value`` [B, Hkv, W, D] (Hkv dividing Hq) with the
    additive float ``mask`` [B, 1, T, W]; returns [B, Hq, T, D] in the query's dtype. With ``lengths`` [B] the mask
    is the tree's own [B, 1, T, T] instead: row b's slots below ``lengths[b]`` are seen by every row, slot
    ``lengths[b] + j`` as the mask's column ``j`` says, and slots past the tree are never read (the step's
    memory for its mask is then O(T^2 B), not O(T W B)). ``pieces``: how many pieces to cut the width into (0: by
    the GPU's processor count, or a CPU's threads). One operator (``torch.ops.ppd.split_attention``) to
    torch.compile and CUDA graphs."""
    batch, heads, rows, dim = query.shape
    key_heads, width = key.shape[1], key.shape[2]
    columns = rows if lengths is not None else width
    if (heads % key_heads or value.shape[:3] != key.shape[:3] or value.shape[3] != dim or key.shape[3] != dim
            or mask.shape != (batch, 1, rows, columns) or mask.dtype == torch.bool
            or (lengths is not None and lengths.shape != (batch,))):
        raise ValueError(f"split attention takes query [B, Hq, T, D], key and value [B, Hkv, W, D] and a float "
                         f"mask [B, 1, T, W] (or, with lengths [B], [B, 1, T, T]); got {tuple(query.shape)}, "
                         f"{tuple(key.shape)}, {tuple(value.shape)}, {tuple(mask.shape)} {mask.dtype}"
                         + ("" if lengths is None else f", lengths {tuple(lengths.shape)}"))
    for name, tensor in (("query", query), ("key", key), ("value", value), ("mask", mask)):
        if tensor.stride(-1) != 1:
            raise ValueError(f"split attention needs the {name}'s last dimension contiguous")
    return torch.ops.ppd.split_attention(query, key, value, mask, lengths, float(scale), pieces)


@torch.library.custom_op("ppd::split_attention", mutates_args=(),
                         schema="(Tensor query, Tensor key, Tensor value, Tensor mask, Tensor? lengths, float scale, "
                                "int pieces) -> Tensor")
def _operator(query, key, value, mask, lengths, scale, pieces):
    batch, heads, rows, dim = query.shape
    key_heads, width = key.shape[1], key.shape[2]
    group = heads // key_heads
    folded = group * rows
    tiles = -(-folded // BLOCK_M)
    if pieces <= 0:
        processors = _processors(query.device.index or 0) if query.is_cuda else torch.get_num_threads()
        pieces = piece_count(batch * key_heads * tiles, width, processors)
    piece = _round_up(-(-width // pieces), BLOCK_N)  # slots per piece
    pieces = -(-width // piece)
    out = torch.empty(pieces, batch, key_heads, folded, dim, device=query.device, dtype=torch.float32)
    lse = torch.empty(pieces, batch, key_heads, folded, device=query.device, dtype=torch.float32)
    tree = lengths is not None
    _kernel(query.device)[(pieces, batch * key_heads, tiles)](
        query, key, value, mask, lengths if tree else lse, out, lse,
        query.stride(0), query.stride(1), query.stride(2), key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2), mask.stride(0), mask.stride(2),
        out.stride(0), out.stride(1), out.stride(2), out.stride(3), lse.stride(0), lse.stride(1), lse.stride(2),
        rows, folded, width, piece, scale,
        GROUP=group, KEY_HEADS=key_heads, HEAD_DIM=dim, BLOCK_D=max(16, 1 << (dim - 1).bit_length()),
        BM=BLOCK_M, BN=BLOCK_N, TREE=tree, PRECISION="ieee" if query.dtype == torch.float32 else "tf32")
    if pieces == 1:
        merged = out[0]
    else:
        weights = torch.softmax(lse, dim=0)  # each piece's share of the whole softmax's sum (an empty piece: 0)
        merged = (out * weights[..., None]).sum(0)
    return merged.view(batch, key_heads, group, rows, dim).reshape(batch, heads, rows, dim).to(query.dtype)


@_operator.register_fake
def _(query, key, value, mask, lengths, scale, pieces):
    return torch.empty_like(query, memory_format=torch.contiguous_format)


__all__ = ["BLOCK_M", "BLOCK_N", "HAS_TRITON", "INTERPRETED", "MIN_PIECE", "piece_count", "runs_on", "runs_on_device",
           "split_attention"]

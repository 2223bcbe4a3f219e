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
* the pieces are merged by their log-sum-exp, which gives the softmax over the whole width: a second kernel reads
  every piece of a few rows at once and writes the result in the query's dtype, laid out as ``[B, T, Hq, D]`` (where
  one piece spans the width, the first kernel writes the result itself).

Scores, the softmax and the merge run in float32 (the weights are rounded to the values' dtype before their product
with the values, as flash attention does; float32 inputs are multiplied in full precision, not TF32) and the mask is
added to each score as the model's own SDPA adds it, so the result is SDPA's up to rounding. With
``PPD_SPLIT_MASK=tree`` (the default), a tree step of a model without sliding windows hands the kernel its rows'
cache lengths and the tree's own mask ``[B, 1, T, T]`` instead of the ``[B, 1, T, W]`` one
(``LanguageModel.compact_mask``): every slot below a row's length is seen (in a loop of its own, with no mask read),
the tree's slots as its mask says, and nothing past the tree's last slot is read, so the step's mask takes O(T^2 B)
memory, not O(T W B), and the cache's unused tail is never read. There each batch row's own slots, not the width,
are shared out among the pieces: a captured step's width is the next power of two above the longest row, and pieces
cut from the width left most of a short row's work to the first piece and the others empty (on an H100 one piece
instead of two, the last one mostly empty at 300 tokens of context, made a batch-16 tree step 7 % faster,
results/deep_gpu/h100/v29/). How the cache is cut and walked
(:class:`SplitTuning`) was chosen by ``results/deep_gpu/split_sweep.py``. Written in Triton; on a CPU the same kernel
runs through Triton's interpreter (for the tests only: it is slow). Dense tree steps on a CUDA GPU run it by default
(``PPD_GROUPED_SDPA=auto`` or ``split``; :mod:`ppd.decoding.grouped_attention`).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import math
import os

import torch

MERGE_ELEMENTS = 8192  # values a merging program holds, at most: its pieces x rows x head size (padded)
HAS_TRITON = importlib.util.find_spec("triton") is not None  # it comes with PyTorch's CUDA builds
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # Triton's interpreter, on CPU tensors (the tests)


@dataclasses.dataclass(frozen=True)
class SplitTuning:
    """How the kernel cuts and walks the cache. ``per_processor``: programs per GPU processor the piece count aims
    at; ``min_piece``: slots a piece holds at least (before the pieces are evened out); ``block_n``: slots a
    program reads at a time; ``block_m``: folded query rows a program holds; ``warps`` and ``stages``: Triton's
    launch options for the pieces' kernel; ``fused_merge``: 1 to have the last piece of each tile merge the pieces
    (counted with an atomic) instead of a merging kernel launched after them, 0 for the kernel.
    ``PPD_SPLIT_TUNING`` overrides fields by name, e.g. ``per_processor=4,block_n=32``."""

    # Fastest at each of five shapes with the tree's own mask on an H200 once the pieces fill whole waves
    # (results/deep_gpu/h200/v15d/; block_m 32 and 128 were slower everywhere, v15b/)
    per_processor: int = 2
    min_piece: int = 256
    block_n: int = 64
    block_m: int = 64
    warps: int = 4
    stages: int = 3
    fused_merge: int = 0  # not timed yet: results/deep_gpu/h100/v31/job.sh's sweep times it

    def __post_init__(self):
        for name in ("per_processor", "min_piece", "block_n", "block_m", "warps", "stages"):
            if getattr(self, name) < 1:
                raise ValueError(f"PPD_SPLIT_TUNING: {name} must be at least 1, got {getattr(self, name)}")
        for name, least in (("block_n", 16), ("block_m", 16), ("warps", 1)):  # blocks are sides of the products
            value = getattr(self, name)
            if value < least or value & (value - 1):
                raise ValueError(f"PPD_SPLIT_TUNING: {name} must be a power of two of at least {least}, got {value}")
        if self.fused_merge not in (0, 1):
            raise ValueError(f"PPD_SPLIT_TUNING: fused_merge must be 0 or 1, got {self.fused_merge}")

    @classmethod
    def parse(cls, text: str) -> "SplitTuning":
        """Fields from ``name=value`` pairs separated by commas; an unknown name, a value that is no positive
        integer, or one the kernel cannot launch with (see ``__post_init__``) raises."""
        fields = {f.name for f in dataclasses.fields(cls)}
        values = {}
        for pair in filter(None, (part.strip() for part in text.split(","))):
            name, _, value = (part.strip() for part in pair.partition("="))
            if name not in fields or not value.isdigit():
                raise ValueError(f"PPD_SPLIT_TUNING: {pair!r} is not one of {sorted(fields)} set to a whole "
                                 f"number")
            values[name] = int(value)
        return cls(**values)

    def text(self) -> str:
        """The ``PPD_SPLIT_TUNING`` string that gives this tuning."""
        return ",".join(f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self))


TUNING = SplitTuning.parse(os.environ.get("PPD_SPLIT_TUNING", ""))  # read once: a compiled step's constants


def runs_on(tensor: torch.Tensor) -> bool:
    """Whether the kernel can take ``tensor``: on a CUDA GPU with Triton, or on a CPU under Triton's interpreter.
    Reads module constants only (a compiled step's trace guards on them as constants)."""
    return runs_on_device(tensor.device)


def runs_on_device(device: torch.device) -> bool:
    """:func:`runs_on` for tensors on ``device``."""
    return HAS_TRITON and (device.type == "cuda" or INTERPRETED)


def _kernels(device: torch.device):
    """The module of the kernels (:mod:`ppd.decoding.split_kernel`), where they can run on ``device``."""
    from . import split_kernel

    if device.type != "cuda" and type(split_kernel.kernel).__name__ != "InterpretedFunction":
        raise RuntimeError("split attention runs on a CUDA GPU (or, for tests, on a CPU under Triton's interpreter: "
                           "TRITON_INTERPRET=1 set before Triton is imported)")
    return split_kernel


@functools.lru_cache(maxsize=None)
def _processors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _round_up(n: int, unit: int) -> int:
    return -(-n // unit) * unit


def piece_count(programs: int, width: int, processors: int, per_processor: int, min_piece: int) -> int:
    """Pieces to cut ``width`` slots into so that ``programs`` tiles (batch rows x key heads x row tiles) become at
    most ``per_processor`` programs per processor (rounded down: on an H200 a few programs past a whole wave made
    a batch-16 step's kernel 36% slower), no more pieces than ``width / min_piece`` rounded up (the pieces are then
    evened out, so one may hold fewer slots); the two as :class:`SplitTuning` names them."""
    wanted = max(1, per_processor * processors // programs)  # whole waves: a few programs more would start a wave
    return max(1, min(wanted, math.ceil(width / min_piece)))


def split_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                    scale: float, pieces: int = 0, lengths: torch.Tensor | None = None,
                    tuning: SplitTuning | None = None) -> torch.Tensor:
    """Attention of ``query`` [B, Hq, T, D] over ``key`` and ``value`` [B, Hkv, W, D] (Hkv dividing Hq) with the
    additive float ``mask`` [B, 1, T, W]; returns [B, Hq, T, D] in the query's dtype. With ``lengths`` [B] the mask
    is the tree's own [B, 1, T, T] instead: row b's slots below ``lengths[b]`` are seen by every row, slot
    ``lengths[b] + j`` as the mask's column ``j`` says, and slots past the tree are never read (the step's
    memory for its mask is then O(T^2 B), not O(T W B)). ``pieces``: how many pieces to cut the width into (0: by
    the GPU's processor count, or a CPU's threads, and ``tuning``, :data:`TUNING` where not given). The result's
    memory is laid out as [B, T, Hq, D] (the layout attention hands the output projection). One operator
    (``torch.ops.ppd.split_attention``) to torch.compile and CUDA graphs."""
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
    tuning = TUNING if tuning is None else tuning
    return torch.ops.ppd.split_attention(query, key, value, mask, lengths, float(scale), pieces, tuning.per_processor,
                                         tuning.min_piece, tuning.block_n, tuning.block_m, tuning.warps, tuning.stages,
                                         tuning.fused_merge)


_COUNTERS: dict[tuple, list[torch.Tensor]] = {}


def _counters(device: torch.device, count: int) -> torch.Tensor:
    """At least ``count`` int32 counters on ``device``, zero, kept for every later call on the current stream (the
    fused merge's: each launch leaves them at zero again). A stream has its own, so that kernels running side by
    side never share one. Where a call needs more than the stream's latest, a larger set is made and the smaller
    ones are kept too: a captured graph may still point at them (one made while a graph was captured comes from that
    graph's memory pool and stays allocated while held here)."""
    stream = torch.cuda.current_stream(device).stream_id if device.type == "cuda" else 0
    made = _COUNTERS.setdefault((device, stream), [])
    if not made or made[-1].numel() < count:
        made.append(torch.zeros(max(count, 1024), device=device, dtype=torch.int32))
    return made[-1]


def _result(query: torch.Tensor) -> torch.Tensor:
    """An empty [B, Hq, T, D] laid out as [B, T, Hq, D], in the query's dtype."""
    batch, heads, rows, dim = query.shape
    return torch.empty(batch, rows, heads, dim, device=query.device, dtype=query.dtype).transpose(1, 2)


@torch.library.custom_op("ppd::split_attention", mutates_args=(),
                         schema="(Tensor query, Tensor key, Tensor value, Tensor mask, Tensor? lengths, float scale, "
                                "int pieces, int per_processor, int min_piece, int block_n, int block_m, int warps, "
                                "int stages, int fused_merge) "
                                "-> Tensor")
def _operator(query, key, value, mask, lengths, scale, pieces, per_processor, min_piece, block_n, block_m, warps,
              stages, fused_merge):
    batch, heads, rows, dim = query.shape
    key_heads, width = key.shape[1], key.shape[2]
    group = heads // key_heads
    folded = group * rows
    tiles = -(-folded // block_m)
    if pieces <= 0:
        processors = _processors(query.device.index or 0) if query.is_cuda else torch.get_num_threads()
        pieces = piece_count(batch * key_heads * tiles, width, processors, per_processor, min_piece)
    block_d = max(16, 1 << (dim - 1).bit_length())
    pieces = min(pieces, max(2, MERGE_ELEMENTS // block_d))  # a merging program holds every piece of a row
    piece = _round_up(-(-width // pieces), block_n)  # slots per piece
    pieces = -(-width // piece)
    whole = pieces == 1  # the one piece writes the result itself
    fused = bool(fused_merge) and not whole
    out = torch.empty(pieces, batch, key_heads, folded, dim, device=query.device, dtype=torch.float32)
    lse = torch.empty(pieces, batch, key_heads, folded, device=query.device, dtype=torch.float32)
    result = _result(query)
    tree = lengths is not None
    kernels = _kernels(query.device)
    counters = _counters(query.device, batch * key_heads * tiles) if fused else lse
    kernels.kernel[(pieces, batch * key_heads, tiles)](
        query, key, value, mask, lengths if tree else lse, out, lse, result, counters,
        query.stride(0), query.stride(1), query.stride(2), key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2), mask.stride(0), mask.stride(2),
        out.stride(0), out.stride(1), out.stride(2), out.stride(3), lse.stride(0), lse.stride(1), lse.stride(2),
        result.stride(0), result.stride(1), result.stride(2),
        rows, folded, width, piece, scale,
        GROUP=group, KEY_HEADS=key_heads, HEAD_DIM=dim, BLOCK_D=block_d, BM=block_m, BN=block_n, TREE=tree,
        WHOLE=whole, FUSED=fused, PRECISION="ieee" if query.dtype == torch.float32 else "tf32", num_warps=warps,
        num_stages=stages)
    if not whole and not fused:
        spread = max(2, 1 << (pieces - 1).bit_length())  # the pieces, rounded up to a power of two
        fit = max(1, MERGE_ELEMENTS // (spread * block_d))  # rows whose pieces a merging program can hold
        merged_rows = min(64, 1 << (fit.bit_length() - 1))  # a power of two
        kernels.merge_kernel[(batch * key_heads, -(-folded // merged_rows))](
            out, lse, result, out.stride(0), out.stride(1), out.stride(2), out.stride(3),
            lse.stride(0), lse.stride(1), lse.stride(2), result.stride(0), result.stride(1), result.stride(2),
            rows, folded, pieces, GROUP=group, KEY_HEADS=key_heads, HEAD_DIM=dim, BLOCK_D=block_d, BP=spread,
            BR=merged_rows)
    return result


@_operator.register_fake
def _(query, key, value, mask, lengths, scale, pieces, per_processor, min_piece, block_n, block_m, warps, stages,
      fused_merge):
    return _result(query)


__all__ = ["HAS_TRITON", "INTERPRETED", "MERGE_ELEMENTS", "SplitTuning", "TUNING", "piece_count", "runs_on",
           "runs_on_device", "split_attention"]

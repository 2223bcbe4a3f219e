"""Linear layers with weights pre-packed for the few row counts a decoder's steps run (CPU, float32, MKL).

On a CPU a decoding step multiplies a handful of rows (1 for the baseline, a tree's T rows for PPD) by
every weight matrix, so the step streams the whole model from memory each time. MKL's plain single-precision
GEMM handles 1 or 2 rows well but slows down sharply from about 4 rows, long before the arithmetic costs
anything (measured on 2 Xeon cores, all 30 layers of the default model: 27 ms at 1 row, 54 ms at 4 rows,
107 ms at 16). A weight packed once with ``cblas_sgemm_pack`` for a given row count runs in 27-36 ms at every
count up to 16: a small tree then costs almost what one row costs, which is what makes PPD pay on a CPU.

The packed product is a custom operator (``ppd::packed_linear``), so that ``torch.compile`` calls it as it is
(Inductor's own lowering of MKL's operator only accepts the packs it makes itself, when freezing a model).

A pack serves exactly one row count (MKL packs for an ``m x n x k`` problem), so :class:`PackedLinear` keeps one
pack per row count it was asked for and runs every other count (the prefill, the one-row baseline) with the
original weight, bit for bit as :class:`torch.nn.Linear` does. Packed products differ from the plain ones by
float rounding only (the sum runs in another order), like any two GEMM kernels.

Packs are not small: MKL pads them, so each row count holds about 1.4x the float32 weights resident (770 MB
for the default model's 538 MB of linear weights) and takes 0.3-0.5 s to pack. :func:`ensure_packed` keeps at
most :data:`MAX_ROW_COUNTS` counts per model and unpacks the least recently used one to make room, so a
server whose batch size wanders, or a benchmark over many batch sizes and trees, does not grow without end.
"""

from __future__ import annotations

import itertools

import torch
from torch import nn


# Defined with a plain ``torch.library.Library`` rather than ``torch.library.custom_op``: the latter's Python
# wrapper costs about 55 us a call here, 11 ms a step over a model's 211 linear layers; this costs about 16.
_LIBRARY = torch.library.Library("ppd", "DEF")
_LIBRARY.define("packed_linear(Tensor x, Tensor packed, Tensor weight, Tensor? bias, int rows) -> Tensor")


def _packed_linear(x: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   rows: int) -> torch.Tensor:
    """``x @ weight.T + bias`` for ``x`` of ``rows`` rows (any leading shape), with ``packed`` packed for them."""
    return torch.ops.mkl._mkl_linear(x, packed, weight, bias, rows)


_LIBRARY.impl("packed_linear", _packed_linear, "CompositeExplicitAutograd")


@torch.library.register_fake("ppd::packed_linear", lib=_LIBRARY)
def _(x, packed, weight, bias, rows):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def packing_available(weight: torch.Tensor) -> bool:
    """Whether this torch build can pack ``weight``: a float32 CPU tensor and MKL's packed GEMM compiled in."""
    return (weight.device.type == "cpu" and weight.dtype == torch.float32 and torch.backends.mkl.is_available()
            and hasattr(torch.ops.mkl, "_mkl_linear"))


class PackedLinear(nn.Module):
    """A :class:`torch.nn.Linear` that multiplies ``rows`` rows with a weight packed for that count.

    It holds the wrapped layer's own ``weight`` and ``bias`` parameters under the same names, so the model's
    state dict, tied weights and anything else reading them are unchanged; the packs are plain attributes
    (derived data, never saved).
    """

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.packs: dict[int, torch.Tensor] = {}
        self.last_used: dict[int, int] = {}  # row count -> tick of its last step (kept by ``ensure_packed``)

    def pack(self, rows: int) -> None:
        """Pack the weight for products of ``rows`` rows (once per count)."""
        if rows not in self.packs:
            with torch.no_grad():
                self.packs[rows] = torch.ops.mkl._mkl_reorder_linear_weight(self.weight.detach(), rows)

    def unpack(self, rows: int) -> None:
        """Drop the pack for ``rows`` rows (products of that count then use the plain weight)."""
        self.packs.pop(rows, None)
        self.last_used.pop(rows, None)

    def unpack_all(self) -> None:
        """Drop every pack (every product then uses the plain weight)."""
        self.packs.clear()
        self.last_used.clear()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        packed = self.packs.get(rows)
        if packed is None or torch.is_grad_enabled():
            return nn.functional.linear(x, self.weight, self.bias)
        return torch.ops.ppd.packed_linear(x, packed, self.weight, self.bias, rows)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed_rows={sorted(self.packs)}"


MAX_ROW_COUNTS = 4  # packed row counts kept per model (each costs about 1.4x its float32 linear weights)
_TICKS = itertools.count()


def ensure_packed(layers: list[PackedLinear], rows: int, limit: int = MAX_ROW_COUNTS) -> None:
    """Have every layer of ``layers`` (one model's, as :func:`pack_linears` returns them) packed for ``rows``
    rows. Where ``limit`` counts are packed already, the one whose last step is oldest is unpacked first. Use
    is recorded on the last layer only: the layers are always packed and unpacked together."""
    if not layers:
        return
    last = layers[-1]
    if rows not in last.packs:
        while len(last.packs) >= limit:
            oldest = min(last.packs, key=lambda count: last.last_used.get(count, -1))
            for layer in layers:
                layer.unpack(oldest)
        for layer in layers:  # in order, so the last layer has the count only once every layer has it
            layer.pack(rows)
    last.last_used[rows] = next(_TICKS)


def pack_linears(model: nn.Module) -> list[PackedLinear]:
    """Wrap every plain :class:`torch.nn.Linear` of ``model`` (the LM head included; not a subclass, which has
    a forward of its own) in a :class:`PackedLinear`, in place, and return them all; layers wrapped by an
    earlier call are returned as they are. Returns an empty list, changing nothing, where packing is not
    available (not a float32 CPU model, or no MKL); layers wrapped before the model moved to another dtype or
    device drop their packs and run the plain product."""
    found: list[PackedLinear] = []
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, PackedLinear):
                if packing_available(child.weight):
                    found.append(child)
                else:
                    child.unpack_all()
            elif type(child) is nn.Linear and packing_available(child.weight):  # e.g. not an MoE router
                wrapped = PackedLinear(child)
                setattr(module, name, wrapped)
                found.append(wrapped)
    return found

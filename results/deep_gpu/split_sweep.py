"""The split kernel's tunings, timed: which cut of the cache and which launch options make a tree step's attention
cheapest on this GPU.

For each shape (batch, tree rows, context), each way of masking and each
:class:`ppd.decoding.split_attention.SplitTuning` of a grid, 30 calls of ``torch.ops.ppd.split_attention`` (one per
layer of the default model: 9 query heads over 3 key heads of 64, bf16), each over its own layer's cache, are
captured in one CUDA graph and replayed; beside them SDPA with ``enable_gqa`` for one row (the baseline's step) at
the same context. The ways of masking: ``tree``, the tree's own mask ``[B, 1, T, T]`` and the rows' lengths (a
tree step of a model without sliding windows), and ``width``, a mask over the whole width ``[B, 1, T, W]``.
Writes every time as JSON, prints the fastest tunings, and writes the tuning that is fastest on average over the
shapes (each shape's time against that shape's best) with the tree's mask, or the only way timed, as the
``PPD_SPLIT_TUNING`` text to ``--best``.

    PYTHONPATH=. python results/deep_gpu/split_sweep.py --output sweep.json --best best_tuning.txt
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F

from ppd.decoding.split_attention import SplitTuning, split_attention
from results.deep_gpu.attention_feed import DIM, HEADS, KEY_HEADS, LAYERS, replay_us

WAYS = ("tree", "width")
SHAPES = [(1, 130, 8000), (1, 65, 8000), (1, 17, 8000), (16, 17, 8000), (1, 130, 1000)]  # batch, rows, context


def parse_shape(text: str) -> tuple[int, int, int, int | None]:
    """``B,T,C`` or ``B,T,C,W``: batch, tree rows, context and, where given, the captured width the cache is cut
    to (a power of two above the longest row in a served batch; then the rows' lengths spread over C/2 .. 3C/2,
    at most W - T, as a batch of mixed prompts does; without W every row holds C and the width is C + T + 256)."""
    parts = [int(p) for p in text.split(",")]
    if len(parts) not in (3, 4) or min(parts) < 1 or (len(parts) == 4 and parts[3] < parts[1] + 1):
        raise argparse.ArgumentTypeError(f"a shape is B,T,C or B,T,C,W (W above T), got {text!r}")
    return (*parts, None) if len(parts) == 3 else tuple(parts)


def _inputs(batch: int, rows: int, context: int, width: int | None = None):
    dev, dt = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    capacity = context + rows + 256 if width is None else width
    q = torch.randn(batch, HEADS, rows, DIM, device=dev, dtype=dt, generator=g)
    caches = [(torch.randn(batch, KEY_HEADS, capacity, DIM, device=dev, dtype=dt, generator=g),
               torch.randn(batch, KEY_HEADS, capacity, DIM, device=dev, dtype=dt, generator=g)) for _ in range(LAYERS)]
    tree = torch.ones(rows, rows, device=dev, dtype=torch.bool).tril()
    mask = torch.zeros(batch, 1, rows, rows, device=dev, dtype=dt).masked_fill(~tree, torch.finfo(dt).min)
    if width is None:
        lengths = torch.full((batch,), context, device=dev, dtype=torch.long)
    else:
        spread = torch.linspace(context / 2, context * 3 / 2, batch, device=dev) if batch > 1 else torch.full(
            (1,), float(context), device=dev)
        lengths = spread.long().clamp(1, capacity - rows)
    wide = torch.full((batch, 1, rows, capacity), torch.finfo(dt).min, device=dev, dtype=dt)
    for b, length in enumerate(lengths.tolist()):
        wide[b, :, :, :length] = 0
        wide[b, :, :, length:length + rows] = mask[b]
    return q, caches, mask, lengths, wide


def time_split(inputs, way: str, tuning: SplitTuning, repeats: int) -> float:
    q, caches, mask, lengths, wide = inputs

    def call():
        for keys, values in caches:
            if way == "tree":
                split_attention(q, keys, values, mask, DIM ** -0.5, lengths=lengths, tuning=tuning)
            else:
                split_attention(q, keys, values, wide, DIM ** -0.5, tuning=tuning)

    return replay_us(call, repeats)[0]


def time_one_row(batch: int, context: int, repeats: int) -> float:
    q, caches, *_ = _inputs(batch, 1, context)

    def call():
        for keys, values in caches:
            F.scaled_dot_product_attention(q, keys[:, :, :context + 1], values[:, :, :context + 1], enable_gqa=True)

    return replay_us(call, repeats)[0]


def check(inputs, tuning: SplitTuning | None = None) -> tuple[float, float]:
    """A tuning's (default: the default one's) largest differences from SDPA, with the tree's mask and with the
    width's, over three calls each (a sweep of a wrong kernel would be worthless, and a tuning whose pieces merge
    themselves would show a race in their hand-over as a difference)."""
    q, caches, mask, lengths, wide = inputs
    keys, values = caches[0]
    want = F.scaled_dot_product_attention(q, keys, values, attn_mask=wide, enable_gqa=True).float()
    worst = [0.0, 0.0]
    for _ in range(3):
        tree = split_attention(q, keys, values, mask, DIM ** -0.5, lengths=lengths, tuning=tuning)
        width = split_attention(q, keys, values, wide, DIM ** -0.5, tuning=tuning)
        worst = [max(worst[0], float((tree.float() - want).abs().max())),
                 max(worst[1], float((width.float() - want).abs().max()))]
    return worst[0], worst[1]


def grid() -> list[SplitTuning]:
    # The eighteenth session's first sweep (one loop for the prefix and the tree) over per_processor 1-8, min_piece
    # 128-256, block_n 32-128, warps 4-8 and stages 1-3 found block_n 64, 4 warps and 3 stages fastest at every
    # shape (h200/v14/split_sweep_first.json), its second 3 stages over 2 (h200/v14b/split_sweep.json); the
    # nineteenth session's, this grid, 64 folded rows a program over 32 and 128 at every shape
    # (h200/v15b/split_sweep_block_m.json).
    return [SplitTuning(per_processor=p, min_piece=m, block_n=64, block_m=bm, warps=w, stages=3)
            for p, m, (bm, w) in itertools.product((2, 4), (128, 256), ((32, 4), (64, 4), (128, 4), (128, 8)))]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--ways", nargs="+", default=list(WAYS), choices=WAYS, help="ways of masking to time")
    parser.add_argument("--output", default=None, help="JSON file of every time")
    parser.add_argument("--best", default=None, help="text file the best tuning's PPD_SPLIT_TUNING is written to")
    parser.add_argument("--shapes", nargs="+", type=parse_shape, default=None,
                        help="shapes B,T,C or B,T,C,W to time instead of the default ones (see parse_shape)")
    parser.add_argument("--tunings", nargs="+", default=None,
                        help="PPD_SPLIT_TUNING texts to time instead of the grid (the default tuning is always timed)")
    args = parser.parse_args(argv)
    tunings = grid() if args.tunings is None else [SplitTuning.parse(text) for text in args.tunings]
    tunings += [SplitTuning()] if SplitTuning() not in tunings else []
    times: dict[tuple, dict[str, dict[str, float]]] = {}
    one_row = {}
    for batch, rows, context, width in args.shapes or [(*shape, None) for shape in SHAPES]:
        one_row[(batch, context)] = time_one_row(batch, context, args.repeats)
        inputs = _inputs(batch, rows, context, width)
        where = f"batch {batch:2d} rows {rows:3d} context {context:5d}" + (f" width {width}" if width else "")
        correct = []  # the tunings that give SDPA's result here, each checked once for both ways
        for tuning in tunings:
            try:
                differences = check(inputs, tuning)
            except Exception as error:  # a launch the GPU refuses (too much shared memory): skip it, say so
                print(f"{tuning.text()} at {where}: {type(error).__name__}: {str(error)[:200]}")
                continue
            if tuning == SplitTuning():
                print(f"{where}: largest difference from SDPA (tree's mask, width's mask) %.4f, %.4f" % differences,
                      flush=True)
            if max(differences) > 0.05:  # bf16 rounding stays far below this
                print(f"{tuning.text()} at {where}: largest difference from SDPA %.4f, %.4f: not timed" % differences,
                      flush=True)
            else:
                correct.append(tuning)
        shape = times.setdefault((batch, rows, context, width), {})
        for way in args.ways:
            row = shape.setdefault(way, {})
            for tuning in correct:
                try:
                    row[tuning.text()] = time_split(inputs, way, tuning, args.repeats)
                except Exception as error:  # a launch the GPU refuses (too much shared memory): skip it, say so
                    print(f"{tuning.text()} {way} at {where}: "
                          f"{type(error).__name__}: {str(error)[:200]}")
            default = row.get(SplitTuning().text(), float("nan"))
            fastest = sorted(row.items(), key=lambda item: item[1])[:2]
            print(f"{where} {way:5s} mask: one row "
                  f"{one_row[(batch, context)]:7.1f} us, default {default:7.1f} us, fastest "
                  + "; ".join(f"{t} {us:.1f}" for t, us in fastest), flush=True)
    scored = "tree" if "tree" in args.ways else args.ways[0]  # the way the best tuning is picked for
    rows_of = [shape[scored] for shape in times.values()]
    common = set.intersection(*(set(row) for row in rows_of))
    score = {t: sum(row[t] / min(row.values()) for row in rows_of) / len(rows_of) for t in common}
    best = min(score, key=score.get)
    print(f"best on average with the {scored}'s mask: {best} ({score[best]:.3f} of each shape's fastest; default "
          f"{score.get(SplitTuning().text(), float('nan')):.3f})")
    for (batch, rows, context, width), shape in times.items():
        print(f"  batch {batch:2d} rows {rows:3d} context {context:5d} width {width or '-'}: best-on-average "
              + ", ".join(f"{way}'s mask {shape[way].get(best, float('nan')):7.1f} us" for way in args.ways))
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "layers": LAYERS,
                       "shapes": [{"batch": b, "rows": r, "context": c, "width": w, "one_row_us": one_row[(b, c)],
                                   "us": shape} for (b, r, c, w), shape in times.items()],
                       "score": score, "best": best}, f, indent=1)
    if args.best:
        with open(args.best, "w") as f:
            f.write(best + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

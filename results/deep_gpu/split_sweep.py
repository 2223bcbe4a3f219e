"""The split kernel's tunings, timed: which cut of the cache and which launch options make a tree step's attention
cheapest on this GPU.

For each shape (batch, tree rows, context) and each :class:`ppd.decoding.split_attention.SplitTuning` of a grid,
30 calls of ``torch.ops.ppd.split_attention`` (one per layer of the default model: 9 query heads over 3 key heads
of 64, bf16), each over its own layer's cache, with the tree's own mask and the rows' lengths as a tree step hands
them, are captured in one CUDA graph and replayed; beside them SDPA with ``enable_gqa`` for one row (the
baseline's step) at the same context. Writes every time as JSON, prints a table of the fastest tunings, and writes
the tuning that is fastest on average over the shapes (each shape's time against that shape's best) as the
``PPD_SPLIT_TUNING`` text to ``--best``.

    python results/deep_gpu/split_sweep.py --output sweep.json --best best_tuning.txt
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F

from ppd.decoding.split_attention import SplitTuning, split_attention

LAYERS, HEADS, KEY_HEADS, DIM = 30, 9, 3, 64
SHAPES = [(1, 130, 8000), (1, 65, 8000), (1, 17, 8000), (16, 17, 8000), (1, 130, 1000)]  # batch, rows, context


def _timed(call, repeats: int) -> float:
    """Microseconds a replay of ``call`` captured in a CUDA graph takes."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / repeats


def _inputs(batch: int, rows: int, context: int):
    dev, dt = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    capacity = context + rows + 256
    q = torch.randn(batch, HEADS, rows, DIM, device=dev, dtype=dt, generator=g)
    caches = [(torch.randn(batch, KEY_HEADS, capacity, DIM, device=dev, dtype=dt, generator=g),
               torch.randn(batch, KEY_HEADS, capacity, DIM, device=dev, dtype=dt, generator=g)) for _ in range(LAYERS)]
    tree = torch.ones(rows, rows, device=dev, dtype=torch.bool).tril()
    mask = torch.zeros(batch, 1, rows, rows, device=dev, dtype=dt).masked_fill(~tree, torch.finfo(dt).min)
    lengths = torch.full((batch,), context, device=dev, dtype=torch.long)
    return q, caches, mask, lengths


def time_split(inputs, tuning: SplitTuning, repeats: int) -> float:
    q, caches, mask, lengths = inputs

    def call():
        for keys, values in caches:
            split_attention(q, keys, values, mask, DIM ** -0.5, lengths=lengths, tuning=tuning)

    return _timed(call, repeats)


def time_one_row(batch: int, context: int, repeats: int) -> float:
    q, caches, _, _ = _inputs(batch, 1, context)

    def call():
        for keys, values in caches:
            F.scaled_dot_product_attention(q, keys[:, :, :context + 1], values[:, :, :context + 1], enable_gqa=True)

    return _timed(call, repeats)


def check(inputs) -> float:
    """The default tuning's largest difference from SDPA over the same slots (a sweep of a wrong kernel would be
    worthless)."""
    q, caches, mask, lengths = inputs
    keys, values = caches[0]
    context, rows = int(lengths[0]), q.shape[2]
    full = torch.zeros(q.shape[0], 1, rows, context + rows, device=q.device, dtype=q.dtype)
    full[..., context:] = mask[:, :, :, :]
    want = F.scaled_dot_product_attention(q, keys[:, :, :context + rows], values[:, :, :context + rows],
                                          attn_mask=full, enable_gqa=True)
    got = split_attention(q, keys, values, mask, DIM ** -0.5, lengths=lengths)
    return float((got.float() - want.float()).abs().max())


def grid() -> list[SplitTuning]:
    return [SplitTuning(per_processor=p, min_piece=m, block_n=n, warps=w, stages=s)
            for p, m, n, w, s in itertools.product((1, 2, 4, 8), (128, 256), (32, 64, 128), (4, 8), (1, 2, 3))
            if m >= n]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--output", default=None, help="JSON file of every time")
    parser.add_argument("--best", default=None, help="text file the best tuning's PPD_SPLIT_TUNING is written to")
    args = parser.parse_args(argv)
    tunings = grid()
    times: dict[tuple, dict[str, float]] = {}
    one_row = {}
    for batch, rows, context in SHAPES:
        one_row[(batch, context)] = time_one_row(batch, context, args.repeats)
        row = times.setdefault((batch, rows, context), {})
        inputs = _inputs(batch, rows, context)
        print(f"batch {batch} rows {rows} context {context}: largest difference from SDPA {check(inputs):.4f}",
              flush=True)
        for tuning in tunings:
            try:
                row[tuning.text()] = time_split(inputs, tuning, args.repeats)
            except Exception as error:  # a launch the GPU refuses (too much shared memory): skip it, say so
                print(f"{tuning.text()} at {batch, rows, context}: {type(error).__name__}: {str(error)[:200]}")
        default = row.get(SplitTuning().text(), float("nan"))
        fastest = sorted(row.items(), key=lambda item: item[1])[:3]
        print(f"batch {batch:2d} rows {rows:3d} context {context:5d}: one row {one_row[(batch, context)]:7.1f} us, "
              f"default {default:7.1f} us, fastest " + "; ".join(f"{t} {us:.1f}" for t, us in fastest), flush=True)
    common = set.intersection(*(set(row) for row in times.values()))
    score = {t: sum(row[t] / min(row.values()) for row in times.values()) / len(times) for t in common}
    best = min(score, key=score.get)
    print(f"best on average: {best} ({score[best]:.3f} of each shape's fastest; default "
          f"{score.get(SplitTuning().text(), float('nan')):.3f})")
    for (batch, rows, context), row in times.items():
        print(f"  batch {batch:2d} rows {rows:3d} context {context:5d}: best-on-average {row[best]:7.1f} us")
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "layers": LAYERS,
                       "shapes": [{"batch": b, "rows": r, "context": c, "one_row_us": one_row[(b, c)], "us": row}
                                  for (b, r, c), row in times.items()],
                       "score": score, "best": best}, f, indent=1)
    if args.best:
        with open(args.best, "w") as f:
            f.write(best + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

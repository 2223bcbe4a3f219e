"""What the output head's product costs by the number of rows it multiplies, and ways to lay the rows out for it.

A diagnostic for the batch-16 profile of the twenty-third session (`h200/v18/profile_b16.json`): a tree step's node
logits (16 batch rows x 4-5 nodes of the 16-row tree, 80 rows) took one cuBLAS call of 170 us with a 512x8 tile,
while the step's 48 prompt rows took 17 us with a 384x48 tile and the one-row step's 16 rows 17 us with 384x16.
With 8 rows a tile, the 56 MB head weight [49152, 576] is read again for every 8 rows. At batch 4 the same call
took 51 us (20 rows, a 192x8 tile). This times the product ``hidden [R, H] @ head.T`` alone, replayed from a CUDA
graph (as a captured step runs it), for row counts R a step meets, in these layouts:

- ``linear``: ``F.linear(hidden, head)`` (what the step runs);
- ``pad16`` / ``pad64``: the rows padded with zeros up to a multiple of 16 / 64, the padding's logits dropped;
- ``chunks16`` / ``chunks48``: the rows in pieces of at most 16 / 48, one product each, concatenated;
- ``transposed``: ``head @ hidden.T``, transposed back (a view; the other orientation for cuBLAS's heuristics);
- ``compiled``: ``torch.compile`` of ``F.linear`` with Inductor's GEMM autotuning (``max_autotune_gemm``), which
  weighs Triton templates against the vendor kernel for each shape.

Every layout's logits are checked against ``linear``'s. Writes a JSON record and prints a table (us per product).

    python results/deep_gpu/head_gemm.py --rows 1 4 5 16 20 48 64 80 96 128 208 272 288 512 1040 \\
        --output results/deep_gpu/h200/vNN/head_gemm.json
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F

LAYOUTS = ("linear", "pad16", "pad64", "chunks16", "chunks48", "transposed", "compiled")


def padded(hidden: torch.Tensor, head: torch.Tensor, multiple: int) -> torch.Tensor:
    rows = hidden.shape[0]
    extra = -rows % multiple
    return F.linear(F.pad(hidden, (0, 0, 0, extra)), head)[:rows]


def chunked(hidden: torch.Tensor, head: torch.Tensor, size: int) -> torch.Tensor:
    return torch.cat([F.linear(piece, head) for piece in hidden.split(size)])


def transposed(hidden: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
    return torch.mm(head, hidden.t()).t()


def function(layout: str):
    """The product of ``layout`` as a function of (hidden, head)."""
    if layout == "linear":
        return F.linear
    if layout.startswith("pad"):
        return lambda h, w: padded(h, w, int(layout[3:]))
    if layout.startswith("chunks"):
        return lambda h, w: chunked(h, w, int(layout[6:]))
    if layout == "transposed":
        return transposed
    if layout == "compiled":
        return torch.compile(F.linear, dynamic=False, options={"max_autotune_gemm": True})
    raise ValueError(f"unknown layout {layout!r}; choose from {', '.join(LAYOUTS)}")


def time_us(run, hidden, head, repeats: int) -> float:
    """Microseconds a product takes, replayed from a CUDA graph of ``repeats`` products (on a CPU: eager)."""
    for _ in range(3):
        run(hidden, head)
    if hidden.device.type != "cuda":
        import time

        start = time.perf_counter()
        for _ in range(repeats):
            run(hidden, head)
        return (time.perf_counter() - start) / repeats * 1e6
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeats):
            run(hidden, head)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (5 * repeats)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 4, 5, 16, 20, 48, 64, 80, 96, 128, 208, 272, 288,
                                                                512, 1040])
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUTS)
    parser.add_argument("--hidden", type=int, default=576, help="the head's input width (the default model's)")
    parser.add_argument("--vocab", type=int, default=49152, help="the head's rows (the default model's vocabulary)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=20, help="products per timed graph")
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    g = torch.Generator(device=device).manual_seed(0)
    head = torch.randn(args.vocab, args.hidden, device=device, dtype=dtype, generator=g) * args.hidden ** -0.5
    functions = {layout: function(layout) for layout in args.layouts}
    results = []
    for rows in args.rows:
        hidden = torch.randn(rows, args.hidden, device=device, dtype=dtype, generator=g)
        want = F.linear(hidden, head).float()
        row = {"rows": rows}
        for layout, run in functions.items():
            got = run(hidden, head).float()
            error = (got - want).abs().max().item()
            if error > 0.05 * want.abs().max().item():
                raise SystemExit(f"{layout} at {rows} rows differs from linear by {error}")
            row[layout] = round(time_us(run, hidden, head, args.repeats), 2)
        results.append(row)
        print(f"{rows:5d} rows | " + " | ".join(f"{k} {row[k]:8.1f}" for k in functions), flush=True)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    record = {"device": name, "torch": torch.__version__, "dtype": args.dtype, "hidden": args.hidden,
              "vocab": args.vocab, "command": "python " + " ".join(sys.argv), "us_per_product": results}
    table = ["| rows | " + " | ".join(functions) + " |", "|---" * (len(functions) + 1) + "|"]
    table += ["| " + " | ".join(str(r[k]) for k in ["rows", *functions]) + " |" for r in results]
    print("\n".join(table))
    if args.output:
        from ppd.files import atomic_write_json

        atomic_write_json(args.output, record)


if __name__ == "__main__":
    main()

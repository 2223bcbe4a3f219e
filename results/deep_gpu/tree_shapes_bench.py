"""What symbolic tree sizes cost a compiled step's layers on a GPU, apart from the rest of the step.

Usage (a CUDA machine; torch alone, no model):
    python results/deep_gpu/tree_shapes_bench.py --output tree_shapes_bench.json

A tree step's rows are the root, the candidates and the prompt rows, laid side by side (``1 + C + P``). This builds
that input from three tensors, then runs the default model's shapes through ``--layers`` layers of what a decoder
layer does around its attention with deep prompt tokens' merged maps: an RMS norm, the query, key and value
projections, the output projection of the queries (a stand-in for attention's result), a residual, a second
norm, the gated MLP, a residual and the merged maps' product. It compiles that function twice, once with the
batch, C and P symbolic (``maybe_mark_dynamic``, what ppd's compiled step did on CUDA until ``PPD_TREE_SHAPES``)
and once with C and P constants and the batch symbolic (``mark_static``, the default on CUDA since), captures each
in a CUDA graph and times replays with CUDA events. Prints and writes the microseconds a replay and the kernels a
replay launches for each.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--candidates", type=int, default=24, help="C: the 32-row tree's 16 candidates, 8 chain nodes")
    parser.add_argument("--prompt_rows", type=int, default=15, help="P (1 + C + P = 40 rows a batch row)")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--replays", type=int, default=200)
    parser.add_argument("--output", default=None)
    return parser


def norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    h = x.float()
    return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype)


def layers(root, candidates, prompts, weights):
    x = torch.cat([root, candidates, prompts], dim=1)
    for w in weights:
        h = norm(x, w["norm1"])
        q = F.linear(h, w["q"])
        k, v = F.linear(h, w["k"]), F.linear(h, w["v"])
        x = x + F.linear(q + k.repeat(1, 1, 3) * v.repeat(1, 1, 3), w["o"])
        h = norm(x, w["norm2"])
        x = x + F.linear(F.silu(F.linear(h, w["gate"])) * F.linear(h, w["up"]), w["down"])
        x = x + (x @ w["maps"])[..., : x.shape[-1]]
    return x


def timed(batch: int, c: int, p: int, weights, symbolic: bool, replays: int) -> dict:
    torch._dynamo.reset()
    device, dtype, hidden = "cuda", torch.bfloat16, weights[0]["q"].shape[1]
    root = torch.randn(batch, 1, hidden, device=device, dtype=dtype)
    candidates = torch.randn(batch, c, hidden, device=device, dtype=dtype)
    prompts = torch.randn(batch, p, hidden, device=device, dtype=dtype)
    for tensor in (root, candidates, prompts):
        torch._dynamo.maybe_mark_dynamic(tensor, 0)
    mark = torch._dynamo.maybe_mark_dynamic if symbolic else torch._dynamo.mark_static
    mark(candidates, 1)
    mark(prompts, 1)
    compiled = torch.compile(layers, fullgraph=True)
    for _ in range(3):
        compiled(root, candidates, prompts, weights)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = compiled(root, candidates, prompts, weights)
    for _ in range(20):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profiler:
        graph.replay()
        torch.cuda.synchronize()
    kernels = [e for e in profiler.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    eager = layers(root, candidates, prompts, weights)
    return {"symbolic": symbolic, "us_per_replay": 1000 * start.elapsed_time(end) / replays,
            "kernels_per_replay": len(kernels),
            "device_us_per_replay": sum(e.time_range.elapsed_us() for e in kernels),
            "max_abs_diff_vs_eager": float((out - eager).abs().max())}


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    hidden, inter, kv = 576, 1536, 192  # the default model's sizes (SmolLM2-135M), 3 prompt-table rows of maps

    def w(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16) * 0.02

    weights = [{"norm1": w(hidden) + 1, "norm2": w(hidden) + 1, "q": w(hidden, hidden), "k": w(kv, hidden),
                "v": w(kv, hidden), "o": w(hidden, hidden), "gate": w(inter, hidden), "up": w(inter, hidden),
                "down": w(hidden, inter), "maps": w(hidden, 3 * hidden)} for _ in range(args.layers)]
    with torch.no_grad():
        results = [timed(args.batch_size, args.candidates, args.prompt_rows, weights, symbolic, args.replays)
                   for symbolic in (True, False, True, False)]
    print("| tree sizes | us a replay | kernels | device us |\n|---|---|---|---|")
    for r in results:
        print(f"| {'symbolic' if r['symbolic'] else 'constant'} | {r['us_per_replay']:.1f} | "
              f"{r['kernels_per_replay']} | {r['device_us_per_replay']:.1f} |")
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "args": vars(args),
                       "command": " ".join(["python results/deep_gpu/tree_shapes_bench.py", *(argv or sys.argv[1:])]),
                       "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

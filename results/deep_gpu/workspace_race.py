"""Do two CUDA graphs replayed at once on two streams disturb each other's matrix products when they were captured on
the same capture stream?

On torch 2.11, cuBLAS's workspace is kept per handle and stream, and ``torch.cuda.graph`` captures every graph on
one default stream unless told otherwise (pytorch/pytorch#193402), so every graph captured that way writes its
split-K partial sums to one workspace. ppd's batcher replays a joining request's prefill graph on a side stream
while the running rows' step graph replays on the main one (``ppd/serving/batcher.py``); ``h100/v34`` saw a joined
request decode wrongly with four staging rows there. This checks the mechanism alone, with the default model's
product shapes (hidden 576, key/value 192, MLP 1536): graph A holds a prefill's products (128 rows), graph B a
batch-16 tree step's (640 rows), each the products of 30 layers. Each is replayed alone once for its reference,
then both at once, on two streams, ``--rounds`` times; a round whose outputs differ from the references in any
bit counts. Two cases: both graphs captured on torch's default capture stream (as before ``ab890a7``), and each on
a capture stream of its own (as ``ppd/decoding/prefill_graphs.py`` captures prefills since). Writes JSON.

    python results/deep_gpu/workspace_race.py --rounds 200 --output workspace_race.json
"""

from __future__ import annotations

import argparse
import json

import torch

LAYER = ((576, 576), (576, 192), (576, 192), (576, 576), (576, 1536), (576, 1536), (1536, 576))  # (in, out)


def products(rows: int, layers: int, seed: int) -> tuple[list, list]:
    """Inputs and weights of ``layers`` layers' products over ``rows`` rows (bf16, on the GPU)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    pairs = []
    for _ in range(layers):
        for n_in, n_out in LAYER:
            x = torch.randn(rows, n_in, device="cuda", dtype=torch.bfloat16, generator=gen)
            w = torch.randn(n_in, n_out, device="cuda", dtype=torch.bfloat16, generator=gen) / n_in ** 0.5
            pairs.append((x, w))
    return pairs


def capture(pairs, stream: torch.cuda.Stream | None) -> tuple[torch.cuda.CUDAGraph, list[torch.Tensor]]:
    """The graph of every product of ``pairs``, warmed up and captured on ``stream`` (None: torch's default capture
    stream, warmed up on a side stream first, as ppd did)."""
    warm = stream if stream is not None else torch.cuda.Stream()
    warm.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warm):
        for x, w in pairs:
            x @ w
    torch.cuda.current_stream().wait_stream(warm)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=torch.cuda.graph_pool_handle(), stream=stream):
        outputs = [x @ w for x, w in pairs]
    torch.cuda.synchronize()
    return graph, outputs


def race(own_streams: bool, rounds: int, layers: int) -> dict:
    a_pairs, b_pairs = products(128, layers, 1), products(640, layers, 2)
    a, a_out = capture(a_pairs, torch.cuda.Stream() if own_streams else None)
    b, b_out = capture(b_pairs, torch.cuda.Stream() if own_streams else None)
    a.replay()
    torch.cuda.synchronize()
    a_ref = [t.clone() for t in a_out]
    b.replay()
    torch.cuda.synchronize()
    b_ref = [t.clone() for t in b_out]
    side_a, side_b = torch.cuda.Stream(), torch.cuda.Stream()
    bad, worst = 0, 0.0
    for _ in range(rounds):
        for side, graph in ((side_a, a), (side_b, b)):
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                graph.replay()
        torch.cuda.current_stream().wait_stream(side_a)
        torch.cuda.current_stream().wait_stream(side_b)
        torch.cuda.synchronize()
        diffs = [(o.float() - r.float()).abs().max().item() for o, r in zip(a_out + b_out, a_ref + b_ref)]
        if max(diffs) > 0:
            bad += 1
            worst = max(worst, max(diffs))
    return {"capture": "a stream of its own per graph" if own_streams else "torch's default capture stream",
            "rounds": rounds, "rounds_differing": bad, "largest_difference": worst}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("this needs a CUDA GPU")
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "cases": [race(own, args.rounds, args.layers) for own in (False, True)]}
    for case in results["cases"]:
        print(f"{case['capture']}: {case['rounds_differing']} of {case['rounds']} rounds differ "
              f"(largest difference {case['largest_difference']:.4g})")
    if args.output:
        with open(args.output, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

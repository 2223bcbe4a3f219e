"""What a dense tree step's attention costs per layer, by how the keys and values reach the kernel.

A diagnostic for the batch-16 profile (`h200/v7/step_profile_b16.json`), where the fused kernels that feed
cuDNN's attention took 0.83 ms per step for a tree against 0.30 ms for one row at the same width. Times,
for 30 layers of the default model's shape (9 query heads over 3 key heads of 64), the part of a layer
between the projections and the output projection: rotary embedding, the new keys and values written into
a cache at each row's slots, then attention over ``width`` slots with ppd's float mask, compiled and
captured in one CUDA graph (as ``--capture compiled_graph`` runs a step), three ways:

- ``repeat``: transformers' SDPA function, which repeats each key head for its query heads when a mask is
  given (what the dense step runs today);
- ``gqa``: SDPA over the unrepeated cache with ``enable_gqa=True``;
- ``folded``: the query heads that share a key head folded into its query rows, the mask repeated for them
  once per step (not per layer), SDPA over the unrepeated cache with equal head counts;
- ``matmul``: ppd's ``PPD_GROUPED_SDPA=matmul`` function (the folded rows as two batched matrix products
  around a float32 softmax);
- ``split``: ppd's ``PPD_GROUPED_SDPA=split`` function (its Triton kernel over pieces of the cache,
  ``ppd.decoding.split_attention``).

    python results/deep_gpu/attention_feed.py --batch_sizes 1 16 64 --rows 1 17 64 --output feed.json
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from ppd.decoding.grouped_attention import grouped_sdpa

LAYERS, HEADS, KEY_HEADS, DIM = 30, 9, 3, 64
GROUP = HEADS // KEY_HEADS


def rotate(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


class Module:  # what transformers' attention function reads from the layer
    is_causal = False
    training = False
    num_key_value_groups = GROUP


def layers(way: str, q, k, v, cos, sin, keys, values, slots, mask, width):
    """q [B, Hq, T, D], k and v [B, Hkv, T, D] (the same for every layer: only the cost matters)."""
    batch, _, rows, _ = q.shape
    index = torch.arange(batch, device=q.device)[:, None]
    if way == "folded":
        mask = mask.repeat_interleave(GROUP, dim=2)  # [B, 1, T * group, W]: row t * group + j is row t
    out = []
    for layer in range(LAYERS):
        qr, kr = rotate(q, cos, sin), rotate(k, cos, sin)
        keys[layer][index, :, slots] = kr.transpose(1, 2)
        values[layer][index, :, slots] = v.transpose(1, 2)
        kw, vw = keys[layer][:, :, :width], values[layer][:, :, :width]
        if way == "repeat":
            o, _ = sdpa_attention_forward(Module(), qr, kw, vw, mask, scaling=DIM ** -0.5)
        elif way in ("matmul", "split"):
            o, _ = grouped_sdpa(Module(), qr, kw, vw, mask, scaling=DIM ** -0.5, layout=way)
        elif way == "gqa":
            o = F.scaled_dot_product_attention(qr, kw, vw, attn_mask=mask, enable_gqa=True).transpose(1, 2)
        else:
            folded = qr.view(batch, KEY_HEADS, GROUP, rows, DIM).transpose(2, 3).reshape(batch, KEY_HEADS, rows * GROUP, DIM)
            o = F.scaled_dot_product_attention(folded, kw, vw, attn_mask=mask)
            o = o.view(batch, KEY_HEADS, rows, GROUP, DIM).permute(0, 2, 1, 3, 4).reshape(batch, rows, HEADS, DIM)
        out.append(o.reshape(batch, rows, HEADS * DIM))
    return torch.stack(out).sum(0)


def time_way(way: str, batch: int, rows: int, width: int, context: int, capacity: int, repeats: int) -> dict:
    dev, dt = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(batch, HEADS, rows, DIM, device=dev, dtype=dt, generator=g)
    k = torch.randn(batch, KEY_HEADS, rows, DIM, device=dev, dtype=dt, generator=g)
    v = torch.randn(batch, KEY_HEADS, rows, DIM, device=dev, dtype=dt, generator=g)
    cos = torch.randn(batch, 1, rows, DIM, device=dev, dtype=dt, generator=g)
    sin = torch.randn(batch, 1, rows, DIM, device=dev, dtype=dt, generator=g)
    keys = [torch.randn(batch, KEY_HEADS, capacity, DIM, device=dev, dtype=dt, generator=g) for _ in range(LAYERS)]
    values = [torch.randn(batch, KEY_HEADS, capacity, DIM, device=dev, dtype=dt, generator=g) for _ in range(LAYERS)]
    slots = (context + torch.arange(rows, device=dev))[None].expand(batch, rows).contiguous()
    seen = torch.arange(width, device=dev)[None, :] < context  # the prefix, then a causal block
    allowed = torch.cat([seen.expand(rows, width)[:, :context],
                         torch.ones(rows, rows, device=dev, dtype=torch.bool).tril(),
                         torch.zeros(rows, width - context - rows, device=dev, dtype=torch.bool)], 1)
    mask = torch.zeros(batch, 1, rows, width, device=dev, dtype=dt).masked_fill(~allowed, torch.finfo(dt).min)
    torch._dynamo.reset()  # one compilation per configuration, none reused
    step = torch.compile(lambda *a: layers(way, *a, width), fullgraph=True, dynamic=False)
    args = (q, k, v, cos, sin, keys, values, slots, mask)
    us, result = replay_us(lambda: step(*args), repeats)
    return {"way": way, "batch": batch, "rows": rows, "width": width, "us_per_step": us,
            "checksum": float(result.float().abs().mean())}


def replay_us(call, repeats: int) -> tuple[float, object]:
    """Microseconds a replay of ``call`` captured in a CUDA graph takes (after three runs on a side stream, which
    compile what it compiles, and five untimed replays), and what the captured call returned."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = call()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(5):
        graph.replay()
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / repeats, result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch_sizes", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 17, 64])
    p.add_argument("--ways", nargs="+", default=["repeat", "gqa", "folded", "matmul"])
    p.add_argument("--context", type=int, default=300)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--capacity", type=int, default=1025)
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--output", default=None)
    args = p.parse_args(argv)
    found = []
    for batch in args.batch_sizes:
        for rows in args.rows:
            line = [f"batch {batch:3d} rows {rows:3d}"]
            for way in args.ways:
                try:
                    r = time_way(way, batch, rows, args.width, args.context, args.capacity, args.repeats)
                except Exception as e:  # a backend that refuses a shape: say so and go on
                    r = {"way": way, "batch": batch, "rows": rows, "error": f"{type(e).__name__}: {e}"[:300]}
                found.append(r)
                line.append(f"{way} {r.get('us_per_step', float('nan')):8.1f} us")
            print("  ".join(line), flush=True)
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"torch": torch.__version__, "device": torch.cuda.get_device_name(), "args": vars(args),
                       "results": found}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

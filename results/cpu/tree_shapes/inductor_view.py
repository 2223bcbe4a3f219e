"""Where symbolic tree sizes make Inductor copy a tree step's hidden states (CPU; torch alone, no model).

Usage:
    python results/cpu/tree_shapes/inductor_view.py > results/cpu/tree_shapes/inductor_view.txt

A tree step's rows are the root, the candidates and the prompt rows side by side, ``1 + C + P``. This compiles an RMS
norm feeding two matrix products over such rows, with C and P symbolic (as ppd's compiled step kept them before
``PPD_TREE_SHAPES``), constant, or replaced by one symbolic row count, and prints the calls of Inductor's generated
code: with ``1 + C + P`` symbolic the first product reads a copy of the normed rows (a buffer of its own, written by
an extra loop), the second a view; with constants, or one symbol, both read views.
"""

import re

import torch
from torch._inductor.utils import run_and_get_code


def norm(x, w):
    h = x.float()
    return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype)


def from_parts(root, candidates, prompts, w, w1, w2):
    y = norm(torch.cat([root, candidates, prompts], dim=1), w)
    return torch.nn.functional.linear(y, w1), torch.nn.functional.linear(y, w2)


def whole(x, w, w1, w2):
    y = norm(x, w)
    return torch.nn.functional.linear(y, w1), torch.nn.functional.linear(y, w2)


def calls(fn, *args) -> list[str]:
    torch._dynamo.reset()
    _, codes = run_and_get_code(torch.compile(fn, fullgraph=True), *args)
    body = codes[-1][codes[-1].index("def call("):]
    return [line.strip() for line in body.splitlines() if re.search(r"extern_kernels\.mm\(|cpp_fused\w*\(", line)]


def main() -> None:
    batch, hidden = 4, 64
    w, w1, w2 = torch.randn(hidden), torch.randn(32, hidden), torch.randn(16, hidden)
    for case in ("1 + C + P symbolic", "1 + C + P constant", "one symbolic row count"):
        if case == "one symbolic row count":
            x = torch.randn(batch, 13, hidden)
            torch._dynamo.maybe_mark_dynamic(x, 0)
            torch._dynamo.maybe_mark_dynamic(x, 1)
            found = calls(whole, x, w, w1, w2)
        else:
            parts = torch.randn(batch, 1, hidden), torch.randn(batch, 7, hidden), torch.randn(batch, 5, hidden)
            for part in parts:
                torch._dynamo.maybe_mark_dynamic(part, 0)
            if case.endswith("symbolic"):
                torch._dynamo.maybe_mark_dynamic(parts[1], 1)
                torch._dynamo.maybe_mark_dynamic(parts[2], 1)
            found = calls(from_parts, *parts, w, w1, w2)
        print(f"## {case}")
        for line in found:
            print("   ", line[:170])


if __name__ == "__main__":
    main()

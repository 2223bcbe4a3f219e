"""Training steps of like-width items: a sampler that cuts the padding of packed batches.

A packed batch is as wide as its widest row (a conversation and the blocks of prompt rows of its cuts), and a
captured step as wide as that row's bucket. Drawn at random, a batch of 8 conversations is mostly padding for the
short ones; with several processes each step also waits for the process whose batch is widest.

:class:`WidthGroupedSampler` shuffles the items, takes them a pool of ``pool_steps`` optimizer steps at a time,
sorts each pool by width, cuts it into steps of ``step_size`` items and then shuffles the steps of the whole epoch:
a step holds items of like width, and as accelerate deals a step's per-device batches out to the processes in turn,
every process of a step gets a batch of like width. The steps depend only on the step's size (per-device batch x
processes x gradient accumulation), the seed and the epoch, so one process of 8 and two of 4 train the same steps,
and a resumed run sees the order an uninterrupted one does.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

POOL_STEPS = 50  # optimizer steps sorted together: wider pools group tighter, narrower ones mix the epoch more


class WidthGroupedSampler(torch.utils.data.Sampler[int]):
    """Every item once an epoch, in steps of ``step_size`` items of like ``widths`` (the items' own widths, e.g.
    ``PackedCuts.row_widths``), the steps in random order; the epoch's one short step, if any, comes last."""

    def __init__(self, widths: Sequence[int], step_size: int, seed: int = 0, pool_steps: int = POOL_STEPS):
        if step_size < 1 or pool_steps < 1:
            raise ValueError(f"a width-grouped sampler needs a step size and a pool of at least 1, got {step_size} "
                             f"and {pool_steps}")
        self.widths, self.step_size, self.seed, self.pool_steps = list(widths), step_size, seed, pool_steps
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Called by the Trainer (through accelerate) at the start of each epoch: each epoch has its own order."""
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.widths)

    def steps(self) -> list[list[int]]:
        """This epoch's steps, in the order they are trained."""
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        order = torch.randperm(len(self.widths), generator=generator).tolist()
        pool = self.step_size * self.pool_steps
        full, short = [], []
        for start in range(0, len(order), pool):
            ranked = sorted(order[start: start + pool], key=lambda i: self.widths[i], reverse=True)
            for first in range(0, len(ranked), self.step_size):
                step = ranked[first: first + self.step_size]
                (full if len(step) == self.step_size else short).append(step)
        return [full[k] for k in torch.randperm(len(full), generator=generator).tolist()] + short

    def __iter__(self) -> Iterator[int]:
        for step in self.steps():
            yield from step

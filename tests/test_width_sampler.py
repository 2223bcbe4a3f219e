"""WidthGroupedSampler: every item once an epoch, in steps of like width, the same steps for any split of a step."""

import random

import pytest

from ppd.width_sampler import WidthGroupedSampler


def widths_of(count: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(100, 2600) for _ in range(count)]


def padded_slots(widths: list[int], steps: list[list[int]]) -> int:
    """Slots a step spends on padding: each item padded to the step's widest."""
    return sum(max(widths[i] for i in step) * len(step) - sum(widths[i] for i in step) for step in steps)


@pytest.mark.parametrize("count, step_size, pool_steps", [(1000, 8, 50), (1003, 8, 50), (37, 4, 3), (5, 8, 50)])
def test_every_item_comes_once_an_epoch_and_only_the_last_step_is_short(count, step_size, pool_steps):
    sampler = WidthGroupedSampler(widths_of(count), step_size, seed=3, pool_steps=pool_steps)
    for epoch in range(3):
        sampler.set_epoch(epoch)
        order = list(sampler)
        assert sorted(order) == list(range(count)) and len(sampler) == count
        sizes = [len(step) for step in sampler.steps()]
        assert sizes[:-1] == [step_size] * (len(sizes) - 1) and 0 < sizes[-1] <= step_size
        assert order == [i for step in sampler.steps() for i in step]


def test_the_order_depends_on_the_seed_and_the_epoch_only():
    widths = widths_of(500)
    first, again = WidthGroupedSampler(widths, 8, seed=1), WidthGroupedSampler(widths, 8, seed=1)
    assert list(first) == list(again)
    first.set_epoch(1)
    assert list(first) != list(again)
    again.set_epoch(1)
    assert list(first) == list(again)
    assert list(WidthGroupedSampler(widths, 8, seed=2)) != list(WidthGroupedSampler(widths, 8, seed=1))


def test_a_pool_is_cut_into_steps_from_its_widest_items_to_its_narrowest():
    widths = widths_of(400)
    sampler = WidthGroupedSampler(widths, 8, seed=0, pool_steps=50)  # one pool: the whole epoch
    steps = sorted(sampler.steps(), key=lambda step: -max(widths[i] for i in step))
    ranked = [widths[i] for step in steps for i in step]
    assert ranked == sorted(widths, reverse=True)
    # and the steps themselves come in random order, not widest first
    trained = [max(widths[i] for i in step) for step in sampler.steps()]
    assert trained != sorted(trained, reverse=True)


def test_grouped_steps_pad_far_less_than_random_ones():
    widths = widths_of(2747)
    grouped = WidthGroupedSampler(widths, 8, seed=0).steps()
    order = list(range(len(widths)))
    random.Random(0).shuffle(order)
    drawn = [order[i: i + 8] for i in range(0, len(order), 8)]
    assert padded_slots(widths, grouped) < 0.1 * padded_slots(widths, drawn)


def test_two_processes_split_each_step_into_batches_of_like_width():
    # accelerate deals the per-device batches of a step out to the processes in turn: each step's two halves
    widths = widths_of(2000)
    for step in WidthGroupedSampler(widths, 8, seed=0).steps():
        halves = [max(widths[i] for i in step[:4]), max(widths[i] for i in step[4:])]
        assert halves[0] - halves[1] < 200  # of a 100..2600 range


def test_impossible_sizes_are_refused():
    with pytest.raises(ValueError, match="step size and a pool of at least 1, got 0 and 50"):
        WidthGroupedSampler([1, 2], 0)

"""Sampling on the device: the counter-based generator and the Gumbel-max sampler against exact probabilities."""

import torch

from ppd.acceptance import filtered_log_probs, sample_tokens, uniform

CHI2_9_DOF_P001 = 27.88  # chi-square critical value, 9 degrees of freedom, false-alarm rate 0.001


def test_uniform_numbers_are_uniform_independent_and_seeded():
    seed, draws = torch.tensor([1, 2, 1]), torch.tensor([0, 0, 1])
    u = uniform(seed, draws, 50_000)
    assert 0 < u.min() and u.max() < 1
    counts = torch.histc(u[0], 10, 0, 1)
    expected = u.shape[1] / 10
    assert ((counts - expected) ** 2 / expected).sum() < CHI2_9_DOF_P001
    assert abs(torch.corrcoef(torch.stack([u[0, :-1], u[0, 1:]]))[0, 1]) < 0.02  # neighbours unrelated
    assert abs(torch.corrcoef(torch.stack([u[0], u[1]]))[0, 1]) < 0.02  # other seed, other stream
    assert abs(torch.corrcoef(torch.stack([u[0], u[2]]))[0, 1]) < 0.02  # next draw, other numbers
    assert torch.equal(u, uniform(seed, draws, 50_000))


def test_gumbel_max_sampling_follows_the_softmax_and_the_nucleus():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(10, generator=generator) * 1.5
    n = 20_000
    rows = logits[None].expand(n, -1)
    seeds, draws = torch.full((n,), 7), torch.arange(n)  # one draw per row of one stream
    tokens = sample_tokens(rows, torch.tensor([0.8]), None, None, seeds, draws)
    expected = torch.softmax(logits / 0.8, -1) * n
    counts = torch.bincount(tokens, minlength=10).float()
    assert ((counts - expected) ** 2 / expected).sum() < CHI2_9_DOF_P001
    nucleus = filtered_log_probs(logits[None], torch.tensor([1.0]), None, torch.tensor([0.7]))[0].isfinite()
    kept = sample_tokens(rows, torch.tensor([1.0]), None, torch.tensor([0.7]), seeds, draws)
    assert set(kept.unique().tolist()) <= set(nucleus.nonzero().flatten().tolist())

"""Trees chosen per step from the guesses' confidence: the best paths equal exhaustive search, the decoder stays
lossless (greedy == transformers' greedy, eager and compiled), and replay gives the decoder's steps."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
import torch

from ppd import DecodeConfig, Decoder, TreeSet
from ppd.decoding.confident import DEPTH_TIE, ConfidentTables, best_paths
from ppd.replay import guess_top, match_paths, replay
from ppd.training import PromptTokenModel
from ppd.tree import CandidateChoice

from .conftest import TINY_VOCAB, random_prompt_tokens, random_tree_set, tiny_model
from .test_decoder import hf_greedy


def exhaustive(log_probs: torch.Tensor, key: int, slots: int, ranks: int) -> list[tuple[int, ...]]:
    """The ``slots`` best rank paths of depth <= ``key`` by every path's penalised sum, best first."""
    scored = []
    for depth in range(1, key + 1):
        for path in itertools.product(range(ranks), repeat=depth):
            total = sum(float(log_probs[level, rank]) for level, rank in enumerate(path))
            scored.append((total - DEPTH_TIE * depth, path))
    scored.sort(key=lambda item: -item[0])
    return [path for _, path in scored[:slots]]


@pytest.mark.parametrize("N,K,ranks,slots", [(3, 6, 6, 12), (3, 8, 5, 40), (2, 4, 4, 20), (1, 3, 3, 5)])
def test_best_paths_are_the_exhaustive_best_and_closed_under_prefixes(N, K, ranks, slots):
    generator = torch.Generator().manual_seed(N * 100 + slots)
    log_probs = torch.randn(6, N, K, generator=generator).mul(2).log_softmax(-1).sort(-1, descending=True).values
    keys = torch.tensor([N, 1, N, max(N - 1, 1), N, 1])
    score, depth, rank, parent = best_paths(log_probs, keys, slots, ranks)
    for b in range(log_probs.shape[0]):
        found: list[tuple[int, ...]] = []
        for i in range(slots):
            if score[b, i] == float("-inf"):
                break
            assert parent[b, i] < i  # a parent comes first
            found.append((found[parent[b, i]] if parent[b, i] >= 0 else ()) + (int(rank[b, i]),))
            assert len(found[-1]) == depth[b, i]
        best = exhaustive(log_probs[b], int(keys[b]), slots, ranks)
        assert found == best
        assert (score[b, len(found):] == float("-inf")).all()  # fewer paths than slots: empty slots last


def confident_set(seed: int, size: int = 12) -> TreeSet:
    return random_tree_set(seed, top_k=6, size=size).chosen(CandidateChoice.CONFIDENT)


def test_confident_tree_sets_round_trip_and_refuse_unknown_choices(tmp_path):
    trees = confident_set(0)
    trees.save(tmp_path / "t.json")
    assert TreeSet.load(tmp_path / "t.json") == trees and trees.confident
    assert not random_tree_set(0).confident  # fixed unless said otherwise, also in files written before
    data = trees.to_json()
    data["choice"] = "greedy"
    with pytest.raises(ValueError, match="choice must be one of"):
        TreeSet.from_json(data)


@pytest.mark.parametrize("V,deep", [(1, False), (2, True)])
def test_greedy_with_confident_trees_is_transformers_greedy(V, deep):
    model = tiny_model(seed=4)
    prompt_tokens = random_prompt_tokens(model, n=3, v=V, seed=4, deep=deep, rank=2 if deep else 0)
    rng = random.Random(4)
    prompts = [[rng.randrange(TINY_VOCAB) for _ in range(rng.randint(1, 30))] for _ in range(4)]
    for seed in range(2):
        decoder = Decoder(model, prompt_tokens, confident_set(seed), max_seq_len=160)
        assert isinstance(decoder.tables, ConfidentTables)
        outputs = decoder.generate(prompts, DecodeConfig(max_new_tokens=40, stop_on_eos=False))
        for prompt, out in zip(prompts, outputs):
            assert out.token_ids == hf_greedy(model, prompt, 40)
        assert sum(o.new_tokens - o.steps for o in outputs) > 4 * 3  # guesses were accepted
        single = [decoder.generate(p, DecodeConfig(max_new_tokens=40, stop_on_eos=False)) for p in prompts]
        assert [o.steps for o in single] == [o.steps for o in outputs]  # a row's trees do not depend on its batch


def test_compiled_confident_step_equals_the_eager_one_greedy_and_sampled():
    torch._dynamo.reset()
    model = tiny_model(seed=5)
    decoder = Decoder(model, random_prompt_tokens(model, n=3, v=1, seed=5), confident_set(5, size=14),
                      max_seq_len=160)
    prompts = [[3, 9, 17], [21, 4, 12, 8, 1, 2, 3]]
    for settings in (dict(), dict(temperature=0.8, top_p=0.9, seed=3)):
        eager = decoder.generate(prompts, DecodeConfig(max_new_tokens=30, stop_on_eos=False, **settings))
        compiled = decoder.generate(prompts, DecodeConfig(max_new_tokens=30, stop_on_eos=False, capture="compile",
                                                          **settings))
        assert [(o.token_ids, o.steps) for o in compiled] == [(o.token_ids, o.steps) for o in eager]


def test_replay_gives_the_decoders_steps_with_confident_trees():
    model = tiny_model()
    prompt_tokens = random_prompt_tokens(model, n=3, v=1, seed=7)
    scorer = PromptTokenModel(model, prompt_tokens)
    rng = random.Random(7)
    prompts = [[rng.randrange(TINY_VOCAB) for _ in range(rng.randint(1, 12))] for _ in range(3)]
    for seed in range(3):
        trees = confident_set(seed)
        outputs = Decoder(model, prompt_tokens, trees).generate(prompts, max_new_tokens=40)
        sequences = [p + o.token_ids for p, o in zip(prompts, outputs)]
        guesses = guess_top(scorer, sequences, [len(p) for p in prompts], trees.top_k)
        for (ids, log_probs), s, p, o in zip(guesses, sequences, prompts, outputs):
            paths = match_paths(ids, s, len(p))
            assert replay(trees, paths, len(o.token_ids), log_probs) == (o.new_tokens, o.steps)
            fixed = replay(trees.chosen(CandidateChoice.FIXED), paths, len(o.token_ids))
            assert fixed[0] == o.new_tokens
        with pytest.raises(ValueError, match="log-probabilities"):
            replay(trees, [()] * 3, 4)
    assert np.isfinite(guesses[0][1]).all()


@pytest.mark.parametrize("arch,ensemble", [("llama", 1), ("qwen2", 2)])
def test_sampled_with_confident_trees_writes_the_baselines_text_for_the_same_seed(arch, ensemble):
    """Lossless sampling draws every token with the numbers the baseline draws it with, whichever tree a step
    verifies: with trees chosen per step too, the same text token for token."""
    model = tiny_model(arch, seed=25)
    decoder = Decoder(model, random_prompt_tokens(model, 3, ensemble, seed=25), confident_set(25, size=14))
    prompts = [[1, 2, 3], [5, 4, 3, 2, 1, 0, 7, 6]]
    guessed = 0
    for seed in range(3):
        config = dict(temperature=0.9, top_p=0.95, seed=seed, max_new_tokens=40, stop_on_eos=False)
        ppd = decoder.generate(prompts, DecodeConfig(method="ppd", **config))
        baseline = decoder.generate(prompts, DecodeConfig(method="baseline", **config))
        assert [o.token_ids for o in ppd] == [o.token_ids for o in baseline]
        guessed += sum(o.new_tokens - o.steps for o in ppd)
    assert guessed > 3 * 2 + 12  # guesses were accepted (each answer's first token comes from the prefill)


def test_the_real_model_writes_its_greedy_text_with_confident_trees():
    """`--tree_choice confident` on the real default model and its shipped trees: the baseline's tokens."""
    from .test_generate_cli import json_by_method, run

    records = json_by_method("--prompt", "List three uses of a paperclip.", "--max_new_tokens", "48",
                             "--capture", "eager", ppd_args=("--tree_choice", "confident"))
    assert records["ppd"]["token_ids"] == records["baseline"]["token_ids"]
    assert records["ppd"]["accept_length"] > 1.3
    proc = run("--model", "smollm2-135m-instruct", "--prompt", "Hi", "--tree_choice", "widest")
    assert proc.returncode == 2 and "--tree_choice: invalid choice" in proc.stderr

"""Replay == decoding: the steps that greedy PPD takes with a tree set, computed from known answers alone;
measured path counts and the trees built from them."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from ppd import Decoder, TreeSet, eos_ids_of
from ppd.chat import chat_input_ids
from ppd.prompt_tokens import PromptTokens, packaged_adapter
from ppd.replay import PathStats, guess_ranks, guess_top, match_paths, replay
from ppd.training import PromptTokenModel
from ppd.tree_builder import IndependentPaths, build_tree_set, expected_tokens_per_step

from .conftest import TINY_VOCAB, random_prompt_tokens, random_tree_set, tiny_model

EOS = 5


def all_paths(model: PromptTokenModel, prompts, outputs, top_k: int, **limits) -> list[list[tuple[int, ...]]]:
    """The match paths of every answer."""
    sequences = [p + o.token_ids for p, o in zip(prompts, outputs)]
    guesses = guess_ranks(model, sequences, [len(p) for p in prompts], top_k, **limits)
    return [match_paths(g, s, len(p)) for g, s, p in zip(guesses, sequences, prompts)]


def replayed(trees: TreeSet, paths, outputs) -> list[tuple[int, int]]:
    return [replay(trees, p, len(o.token_ids)) for p, o in zip(paths, outputs)]


def decoded(outputs) -> list[tuple[int, int]]:
    return [(o.new_tokens, o.steps) for o in outputs]


@pytest.mark.parametrize("V,deep,rank", [(1, False, 0), (2, False, 0), (1, True, 0), (2, True, 0), (2, True, 2)])
def test_replay_gives_the_decoders_steps_on_tiny_models(V, deep, rank):
    model = tiny_model()
    prompt_tokens = random_prompt_tokens(model, n=3, v=V, seed=V, deep=deep, rank=rank)
    scorer = PromptTokenModel(model, prompt_tokens)
    reasons, guessed = set(), 0
    for seed in range(3):
        trees = random_tree_set(seed, top_k=6, size=14)
        decoder = Decoder(model, prompt_tokens, trees, eos_token_ids={EOS})
        rng = random.Random(seed)
        prompts = [[rng.randrange(TINY_VOCAB) for _ in range(rng.randint(1, 12))] for _ in range(3)]
        outputs = decoder.generate(prompts, max_new_tokens=40)
        # Small forwards, so that answers are split over several and several share one.
        paths = all_paths(scorer, prompts, outputs, trees.top_k, max_cuts_per_forward=16, max_slots_per_forward=160)
        assert replayed(trees, paths, outputs) == decoded(outputs)
        reasons |= {o.finish_reason for o in outputs}
        guessed += sum(o.new_tokens - 1 - o.steps for o in outputs)
    assert reasons == {"eos", "length"} and guessed > 20


def test_guess_ranks_do_not_depend_on_how_cuts_are_packed():
    model = tiny_model(seed=1)
    scorer = PromptTokenModel(model, random_prompt_tokens(model, n=3, v=2, seed=3))
    rng = random.Random(0)
    sequences = [[rng.randrange(TINY_VOCAB) for _ in range(rng.randint(3, 50))] for _ in range(5)]
    starts = [rng.randint(1, len(s)) for s in sequences]  # one with no position at all
    starts[0] = len(sequences[0])
    done = []
    whole = guess_ranks(scorer, sequences, starts, 8, progress=done.append)
    assert sum(done) == len(sequences)
    for cuts, slots in [(1, 1), (7, 64), (40, 10_000)]:
        split = guess_ranks(scorer, sequences, starts, 8, max_cuts_per_forward=cuts, max_slots_per_forward=slots)
        for a, b, s, t in zip(whole, split, sequences, starts):
            assert a.shape == b.shape == (len(s) - t, 3, 8)
            assert np.array_equal(a, b)
    # With the log-probabilities: the same ids, each its prompt token's log-softmax at that cut.
    top = guess_top(scorer, sequences, starts, 8, max_cuts_per_forward=7, max_slots_per_forward=64)
    for (ids, log_probs), expected in zip(top, whole):
        assert np.array_equal(ids, expected) and log_probs.dtype == np.float32
        assert (np.diff(log_probs, axis=-1) <= 0).all() and (np.exp(log_probs).sum(-1) <= 1 + 1e-5).all()
    b = next(i for i, (s, t) in enumerate(zip(sequences, starts)) if t < len(s))
    t = starts[b]
    with torch.no_grad():
        logits = scorer.prompt_logits(torch.tensor([sequences[b][:t]]), torch.tensor([t]), torch.tensor([t]),
                                      torch.tensor([0]))[0]  # [N, vocab] at cut t
    direct = logits.log_softmax(-1).gather(-1, torch.as_tensor(top[b][0][0]))
    assert np.allclose(top[b][1][0], direct.numpy(), rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def shipped(real_model):
    model, tokenizer, info = real_model
    adapter = packaged_adapter(info.model_id)
    return PromptTokens.from_pretrained(adapter, model), adapter


def test_replay_gives_the_decoders_steps_on_the_default_model(real_model, shipped):
    model, tokenizer, _ = real_model
    prompt_tokens, adapter = shipped
    small = TreeSet.load(adapter / "tree_cpu.json")
    bigger = build_tree_set(small.metadata["accuracy"], 32)
    prompts = [chat_input_ids(tokenizer, [{"role": "user", "content": text}])
               for text in ("Name three primary colours.", "Count from one to ten in words.")]
    scorer = PromptTokenModel(model, prompt_tokens)
    paths = texts = None
    for trees in (small, bigger):
        decoder = Decoder(model, prompt_tokens, trees, eos_token_ids=eos_ids_of(model, tokenizer))
        outputs = decoder.generate(prompts, max_new_tokens=48)
        # Greedy PPD gives the same text whatever the tree: one packed forward per answer serves both.
        texts = texts or [o.token_ids for o in outputs]
        assert [o.token_ids for o in outputs] == texts
        paths = paths or all_paths(scorer, prompts, outputs, trees.top_k)
        assert replayed(trees, paths, outputs) == decoded(outputs)
        assert sum(o.new_tokens for o in outputs) > 1.3 * sum(o.steps for o in outputs)


def test_path_stats_count_prefixes_of_match_paths(tmp_path):
    stats = PathStats(3, 3)
    stats.add([(0, 1), (0,), (), (1, 0, 2), (0, 1, 0)])
    assert stats.positions == 5
    assert dict(stats.counts) == {(0,): 3, (0, 1): 2, (0, 1, 0): 1, (1,): 1, (1, 0): 1, (1, 0, 2): 1}
    assert stats.prob(()) == 1 and stats.prob((0,)) == pytest.approx(0.6) and stats.prob((2,)) == 0
    assert stats.stop_prob((0,), 2) == pytest.approx((3 - 0 - 2) / 5)
    assert stats.reach(2) == pytest.approx([0.8, 0.6, 0.2])
    expected = [[0.6, 0.2, 0], [0.25, 0.5, 0], [1 / 3, 0, 1 / 3]]
    assert [row == pytest.approx(want) for row, want in zip(stats.rank_accuracy(), expected)] == [True] * 3
    stats.save(tmp_path / "path_stats.json")
    again = PathStats.load(tmp_path / "path_stats.json")
    assert again == stats
    with pytest.raises(ValueError, match="outside top-3"):
        stats.add([(3,)])
    data = json.loads((tmp_path / "path_stats.json").read_text())
    data["paths"][-1]["count"] = 9
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="more often than its parent"):
        PathStats.load(tmp_path / "bad.json")


def _stats_of(chance, n_prompt: int, top_k: int, positions: int) -> PathStats:
    """Path stats whose counts are ``positions * chance(path)``, from the match paths that give them."""
    paths = [()]
    for depth in range(n_prompt):
        paths += [p + (r,) for p in paths if len(p) == depth for r in range(top_k)]
    count = {p: round(positions * chance(p)) for p in paths}
    stats = PathStats(n_prompt, top_k)
    for path in paths:
        ends_here = count[path] - sum(count.get(path + (r,), 0) for r in range(top_k))
        stats.add([path] * ends_here)
    assert stats.positions == positions
    return stats


def test_measured_builder_matches_the_marginal_one_when_paths_factorize():
    accuracy = [[0.5, 0.25, 0.125, 0.0625], [0.5, 0.125, 0.125, 0.0], [0.25, 0.25, 0.0, 0.0]]  # exact in binary
    independent = IndependentPaths(accuracy)
    stats = _stats_of(independent.prob, 3, 4, 1 << 12)
    assert stats.rank_accuracy() == accuracy
    for budget, V in [(6, 1), (20, 1), (40, 2), (90, 1)]:
        assert build_tree_set(stats, budget, V).trees == build_tree_set(accuracy, budget, V).trees


def test_measured_builder_follows_joint_acceptance():
    # Guess 2 is right only after guess 1 was right at rank 1: the per-depth table cannot tell.
    def chance(path):
        table = {(): 1.0, (0,): 0.5, (1,): 0.25, (1, 0): 0.25, (1, 0, 0): 0.125}
        return table.get(path, 0.0)

    stats = _stats_of(chance, 3, 3, 64)
    measured = build_tree_set(stats, 8)
    marginal = build_tree_set(stats.rank_accuracy(), 8)
    tree, other = measured.trees[3], marginal.trees[3]
    assert (1, 0) in tree.paths and (0, 0) not in tree.paths and (0, 0) in other.paths
    assert expected_tokens_per_step(tree, stats) > expected_tokens_per_step(other, stats)


def test_measured_trees_load_and_decode_losslessly(tmp_path):
    model = tiny_model(seed=2)
    prompt_tokens = random_prompt_tokens(model, n=3, v=1, seed=4)
    scorer = PromptTokenModel(model, prompt_tokens)
    rng = random.Random(1)
    prompts = [[rng.randrange(TINY_VOCAB) for _ in range(rng.randint(2, 10))] for _ in range(4)]
    first = random_tree_set(0, top_k=6, size=10)
    outputs = Decoder(model, prompt_tokens, first).generate(prompts, max_new_tokens=32)
    stats = PathStats(3, 6)
    for paths in all_paths(scorer, prompts, outputs, 6):
        stats.add(paths)
    build_tree_set(stats, 24).save(tmp_path / "tree.json")
    trees = TreeSet.load(tmp_path / "tree.json")
    assert trees.metadata["path_positions"] == stats.positions and any(t.paths for t in trees.trees.values())
    decoder = Decoder(model, prompt_tokens, trees)
    ppd = decoder.generate(prompts, max_new_tokens=32)
    base = decoder.generate(prompts, max_new_tokens=32, method="baseline")
    assert [o.token_ids for o in ppd] == [o.token_ids for o in base] == [o.token_ids for o in outputs]
    assert replayed(trees, all_paths(scorer, prompts, ppd, trees.top_k), ppd) == decoded(ppd)


def test_replay_cli_on_answers_it_made(tmp_path, real_model):
    from eval import build_trees, gen_answers
    from eval import replay as replay_cli

    tree = packaged_adapter(real_model[2].model_id) / "tree_cpu.json"
    answers = tmp_path / "answers.jsonl"
    assert gen_answers.main(["--bench", "mt_bench", "--method", "ppd", "--tree", str(tree), "--limit", "1",
                             "--max_new_tokens", "16", "--warmup", "0", "--device", "cpu",
                             "--output", str(answers)]) == 0
    records = [json.loads(line) for line in answers.read_text().splitlines()]
    out, paths = tmp_path / "replay.json", tmp_path / "path_stats.json"
    assert replay_cli.main(["--answers", str(answers), "--trees", str(tree), "--device", "cpu",
                            "--paths_output", str(paths), "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    row = result["trees"][0]
    assert result["answers"] == len(records) == 2 and row["tree"] == str(tree) and row["rows"] > 1
    # The answers were decoded with this tree set in float32 on this device: replay counts their steps.
    assert row["steps"] == sum(r["steps"] for r in records)
    assert row["new_tokens"] == sum(r["new_tokens"] for r in records)
    assert row["accept_length"] == pytest.approx(row["new_tokens"] / row["steps"])
    assert {"device", "torch"} <= set(result["environment"])
    stats = PathStats.load(paths)
    assert stats.positions == row["new_tokens"]  # one cut per answer token
    assert build_trees.main(["--paths", str(paths), "--budgets", "8", "--output_dir", str(tmp_path / "trees")]) == 0
    assert TreeSet.load(tmp_path / "trees" / "tree_8.json").metadata["budget"] == 8

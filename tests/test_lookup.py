"""Prompt lookup beside the tree: the device lookup finds what a plain search finds, the chain's rows are laid out
as a tree's, and decoding with it stays exact (greedy, sampled, batched, continuous, compiled, the real model)."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
import torch

from ppd import DecodeConfig, Decoder, Tree, TreeSet
from ppd.chat import chat_input_ids
from ppd.adapter import AdapterFiles
from ppd.decoding import lookup
from ppd.decoding.tables import TreeTables
from ppd.replay import lookup_chain
from ppd.serving import BatcherConfig, ContinuousBatcher
from ppd.tree import CandidateChoice
from tests.conftest import random_prompt_tokens, random_tree_set, tiny_model
from tests.test_decoder import hf_greedy
from tests.test_engine import _compiled_variants
from tests.test_lossless_sampling import SAMPLES, VOCAB, check, exact_joint, sample_counts


def test_the_device_lookup_finds_what_a_plain_search_finds():
    """``propose`` (fixed shapes, on the device) against the plain search that replay uses."""
    rng = random.Random(0)
    width, nodes = 64, 5
    texts = [[rng.randrange(vocab) for _ in range(rng.randint(1, width - 1))]
             for vocab in (2, 3, 5, 40) for _ in range(30)] + [[7], [7, 7], [1, 2], [1, 2, 1], [4, 4, 4, 4]]
    history = torch.full((len(texts), width), -5, dtype=torch.long)  # what lies past a row's text is never read
    for b, text in enumerate(texts):
        history[b, : len(text)] = torch.tensor(text)
    lengths = torch.tensor([len(t) - 1 for t in texts])  # the root is the text's last token
    tokens, valid = lookup.propose(history, lengths, nodes)
    found = 0
    for b, text in enumerate(texts):
        want = lookup_chain(text, nodes)
        assert valid[b].tolist() == [i < len(want) for i in range(nodes)], text
        assert tokens[b, : len(want)].tolist() == want, text
        found += bool(want)
    assert 0 < found < len(texts)


def test_steps_record_the_text_the_lookup_reads():
    history = torch.zeros(2, 12, dtype=torch.long)
    lookup.start(history, [[5, 6, 7], [8]], torch.tensor([9, 3]))
    assert history[0, :4].tolist() == [5, 6, 7, 9] and history[1, :2].tolist() == [8, 3]
    # Row 0 accepted two candidates (then its new root); row 1 has stopped and keeps its text.
    lookup.record(history, torch.tensor([3, 1]), torch.tensor([[1, 2, 4], [6, 6, 6]]), torch.tensor([True, False]))
    assert history[0, :7].tolist() == [5, 6, 7, 9, 1, 2, 4] and history[1, :4].tolist() == [8, 3, 0, 0]


def test_the_chain_is_laid_out_beside_each_tree_and_key_zero_is_the_root_alone():
    trees = TreeSet(2, 3, {1: Tree(((0,), (1,)), (1, 2), 2), 2: Tree(((0,), (0, 0)), (2, 1), 2)}, lookup=4)
    tables = TreeTables.build(trees, 1, "ensemble")
    assert (tables.lookup, tables.num_candidates) == (4, 6) and tables.chain_node.tolist() == [-1, -1, 0, 1, 2, 3]
    assert tables.most_emitted == 5 and tables.depth == 4 and tables.max_offset == 4
    chain = list(range(3, 7))
    for key in range(3):
        assert tables.candidate_index[key, 2:].tolist() == [2 * 3 + i for i in range(4)]  # past the guesses
        assert tables.parent_row[key, 2:].tolist() == [0, 3, 4, 5]
        assert tables.position_offset[key, chain].tolist() == [1, 2, 3, 4]
        assert tables.node_prompt_count[key, chain].tolist() == [0] * 4
        assert tables.retrieve_indices[key, -1].tolist() == [0, *chain]
        sees = tables.allowed[key][chain][:, : 1 + 6]
        assert sees[:, [0, *chain]].tolist() == [[True] + [j <= i for j in range(4)] for i in range(4)]
        assert not sees[:, 1:3].any()  # nor the guessed candidates
    assert not tables.is_candidate[0, :2].any() and int(tables.node_prompt_count[0, 0]) == 2  # key 0: root, N rows


def test_tree_sets_keep_their_lookup_and_refuse_what_is_not_built(tmp_path):
    trees = random_tree_set(seed=1).with_lookup(6)
    trees.save(tmp_path / "t.json")
    loaded = TreeSet.load(tmp_path / "t.json")
    assert loaded.lookup == 6 and loaded.identity() == trees.identity() != random_tree_set(seed=1).identity()
    assert "lookup" not in random_tree_set(seed=1).to_json()  # files without a chain are written as before
    with pytest.raises(ValueError, match="lookup chain must have"):
        trees.with_lookup(-1)
    with pytest.raises(ValueError, match="beside fixed trees only"):
        trees.chosen(CandidateChoice.CONFIDENT)


def _repeating_prompts(seed: int, count: int) -> list[list[int]]:
    """Prompts that repeat a phrase, as quoted names and code do: where lookup finds the continuation."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        phrase = [rng.randrange(24) for _ in range(rng.randint(3, 8))]
        prompts.append([rng.randrange(24) for _ in range(rng.randint(0, 5))] + phrase * rng.randint(1, 3)
                       + phrase[: rng.randint(0, len(phrase))])
    return prompts


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_with_lookup_is_the_models_greedy_text_alone_and_in_a_batch(arch):
    model = tiny_model(arch, seed=31)
    tokens, trees = random_prompt_tokens(model, 3, 2, seed=31), random_tree_set(seed=31, size=6)
    plain, chained = (Decoder(model, tokens, t, max_seq_len=256) for t in (trees, trees.with_lookup(6)))
    prompts = _repeating_prompts(31, 6)
    config = DecodeConfig(max_new_tokens=50, stop_on_eos=False)
    batch = chained.generate(prompts, config)
    steps = {"plain": 0, "chained": 0}
    for prompt, out in zip(prompts, batch):
        want = hf_greedy(model, prompt, 50)
        alone = chained.generate(prompt, config)
        assert alone.token_ids == want and out.token_ids == want
        steps["chained"] += alone.steps
        steps["plain"] += plain.generate(prompt, config).steps
    assert steps["chained"] < 0.8 * steps["plain"], steps  # the chain was accepted


def test_compiled_step_with_lookup_equals_the_eager_step():
    torch._dynamo.reset()
    model = tiny_model(seed=32)
    # (unpacked weights, as on a GPU: MKL's packed weights serve one row count, so a CPU float32 step compiles per
    # tree size whatever the layout)
    decoder = Decoder(model, random_prompt_tokens(model, 3, 1, seed=32), random_tree_set(seed=32, size=8).with_lookup(5),
                      max_seq_len=200, packed_weights=False)
    prompts = _repeating_prompts(32, 3)
    config = DecodeConfig(max_new_tokens=40, stop_on_eos=False)  # (sampled: below, on the GPU)
    eager = decoder.generate(prompts, config)
    compiled = decoder.generate(prompts, dataclasses.replace(config, capture="compile"))
    assert [(o.token_ids, o.steps) for o in compiled] == [(o.token_ids, o.steps) for o in eager]
    # Another tree set, whose chain starts at another row, runs the same compiled step (the one-row step is not
    # compiled: the prompts end far from the context window).
    variants = _compiled_variants()
    other = decoder.with_trees(random_tree_set(seed=36, size=14).with_lookup(5))
    assert [o.token_ids for o in other.generate(prompts, dataclasses.replace(config, capture="compile"))] == \
        [o.token_ids for o in eager]
    assert _compiled_variants() == variants


def test_continuous_batching_with_lookup_decodes_what_requests_decode_alone():
    model = tiny_model(seed=33)
    decoder = Decoder(model, random_prompt_tokens(model, 3, 1, seed=33), random_tree_set(seed=33, size=8).with_lookup(4),
                      eos_token_ids=[5])
    prompts = _repeating_prompts(33, 7)
    with ContinuousBatcher(decoder, BatcherConfig(max_batch=3)) as batcher:
        streams = [batcher.submit(p, DecodeConfig(max_new_tokens=30 + i)) for i, p in enumerate(prompts)]
        results = [s.result(timeout=120) for s in streams]
    for i, (prompt, result) in enumerate(zip(prompts, results)):
        alone = decoder.generate(prompt, DecodeConfig(max_new_tokens=30 + i))
        assert (result.token_ids, result.steps) == (alone.token_ids, alone.steps)


def narrow_tree_set(n_prompt: int = 3, top_k: int = VOCAB) -> TreeSet:
    """One guess a level (the top rank), so that most of what a step accepts past it comes from the chain."""
    trees = {key: Tree(tuple((0,) * d for d in range(1, key + 1)), (1,) * key, n_prompt) for key in range(1, n_prompt + 1)}
    return TreeSet(n_prompt, top_k, trees)


def test_sampling_with_lookup_draws_the_models_distribution_and_the_baselines_text():
    model = tiny_model("llama", vocab=VOCAB, seed=34)
    decoder = Decoder(model, random_prompt_tokens(model, 3, 1, seed=34), narrow_tree_set().with_lookup(4))
    prompt = [3, 1, 4, 1, 5, 3, 1, 4, 1, 5, 3, 1]
    exact = exact_joint(model, prompt, 3, temperature=1.0, top_k=0, top_p=1.0)
    counts = sample_counts(decoder, [prompt], 3, range(8), SAMPLES // 8, method="ppd", temperature=1.0)[0]
    check({"ppd with lookup": counts}, exact, checks=3)
    config = dict(temperature=0.9, top_p=0.95, max_new_tokens=40, stop_on_eos=False)
    accepted = {"tree": 0, "tree and chain": 0}
    without = decoder.with_trees(narrow_tree_set())
    for seed in range(3):
        ppd = decoder.generate(prompt, DecodeConfig(method="ppd", seed=seed, **config))
        base = decoder.generate(prompt, DecodeConfig(method="baseline", seed=seed, **config))
        assert ppd.token_ids == base.token_ids
        accepted["tree and chain"] += ppd.new_tokens - ppd.steps
        tree = without.generate(prompt, DecodeConfig(method="ppd", seed=seed, **config))
        accepted["tree"] += tree.new_tokens - tree.steps
    assert accepted["tree and chain"] > 1.5 * accepted["tree"], accepted  # the chain's nodes were accepted


def test_the_default_model_with_lookup_writes_its_greedy_answer(real_model):
    model, tokenizer, info = real_model
    decoder = Decoder(model, AdapterFiles.default_for(model, tokenizer, info).prompt_tokens, max_seq_len=1024)
    chained = decoder.with_trees(decoder.trees.with_lookup(8))
    question = ("Here is a function:\n\ndef area(width, height):\n    return width * height\n\n"
                "Rewrite it with type hints and a docstring, keeping the names width and height.")
    ids = chat_input_ids(tokenizer, [{"role": "user", "content": question}])
    config = DecodeConfig(max_new_tokens=120, stop_on_eos=False)
    base = decoder.generate(ids, DecodeConfig(method="baseline", max_new_tokens=120, stop_on_eos=False))
    plain, looked = decoder.generate(ids, config), chained.generate(ids, config)
    assert looked.token_ids == base.token_ids == plain.token_ids
    assert looked.steps < plain.steps, (looked.steps, plain.steps)
    print(np.round([plain.accept_length, looked.accept_length], 3))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("mode", ["graph", "compiled_graph"])
def test_captured_step_with_lookup_equals_the_eager_step_on_the_gpu(mode, monkeypatch):
    from ppd.decoding.graphs import PREFILL_GRAPHS_ENV

    monkeypatch.setenv(PREFILL_GRAPHS_ENV, "0")  # the exact eager prefill: the steps alone are compared
    model = tiny_model(seed=35).cuda()
    decoder = Decoder(model, random_prompt_tokens(model, 3, 2, seed=35), random_tree_set(seed=35, size=10).with_lookup(6),
                      max_seq_len=300)
    prompts = _repeating_prompts(35, 5)
    for config in (dict(), dict(temperature=0.8, top_p=0.9, seed=5)):
        outs = {capture: [(o.token_ids, o.steps) for o in decoder.generate(
            prompts, DecodeConfig(max_new_tokens=40, stop_on_eos=False, capture=capture, **config))]
            for capture in (mode, "eager")}
        if not config or mode == "graph":  # (compiled sampling may round a near-tie otherwise)
            assert outs[mode] == outs["eager"]
    greedy = decoder.generate(prompts, DecodeConfig(max_new_tokens=40, stop_on_eos=False, capture=mode))
    assert [o.token_ids for o in greedy] == [hf_greedy(model, p, 40) for p in prompts]


def test_replay_gives_the_decoders_steps_with_a_lookup_chain():
    from ppd.replay import guess_ranks, match_paths, replay
    from ppd.training import PromptTokenModel

    model = tiny_model(seed=37)
    tokens = random_prompt_tokens(model, 3, 1, seed=37)
    scorer = PromptTokenModel(model, tokens)
    prompts = _repeating_prompts(37, 6)
    for seed, L in ((37, 4), (38, 8)):
        trees = random_tree_set(seed=seed, size=8).with_lookup(L)
        decoder = Decoder(model, tokens, trees, eos_token_ids=[5])
        outputs = decoder.generate(prompts, DecodeConfig(max_new_tokens=40))
        sequences = [p + o.token_ids for p, o in zip(prompts, outputs)]
        ranks = guess_ranks(scorer, sequences, [len(p) for p in prompts], trees.top_k)
        paths = [match_paths(g, s, len(p)) for g, s, p in zip(ranks, sequences, prompts)]
        assert [replay(trees, m, len(o.token_ids), text=(p, o.token_ids)) for m, p, o in zip(paths, prompts, outputs)] \
            == [(o.new_tokens, o.steps) for o in outputs]
    with pytest.raises(ValueError, match="pass the prompt and answer ids"):
        replay(trees, paths[0], len(outputs[0].token_ids))


def test_prompt_lookup_alone_decodes_the_greedy_text_and_replays_its_steps():
    """Trees of the root alone (its prompt rows, no guessed candidate) beside a chain: prompt lookup in the engine
    (``results/lookup/trees/lookup_only_8.json`` for the default model). Greedy text as the model's, alone and in a
    batch, fewer steps than tokens where the text repeats, and replay gives the decoder's steps."""
    from ppd.replay import guess_ranks, match_paths, replay
    from ppd.training import PromptTokenModel

    model = tiny_model(seed=41)
    tokens = random_prompt_tokens(model, 3, 1, seed=41)
    trees = TreeSet(3, 4, {k: Tree((), (), 3) for k in (1, 2, 3)}, lookup=5)
    decoder = Decoder(model, tokens, trees, max_seq_len=256)
    assert decoder.tables.num_candidates == 5  # the chain's nodes alone
    prompts = _repeating_prompts(41, 5)
    config = DecodeConfig(max_new_tokens=40, stop_on_eos=False)
    outputs = decoder.generate(prompts, config)
    for prompt, out in zip(prompts, outputs):
        assert out.token_ids == hf_greedy(model, prompt, 40) == decoder.generate(prompt, config).token_ids
    assert sum(o.steps for o in outputs) < 0.8 * 40 * len(prompts)
    sequences = [p + o.token_ids for p, o in zip(prompts, outputs)]
    ranks = guess_ranks(PromptTokenModel(model, tokens), sequences, [len(p) for p in prompts], trees.top_k)
    paths = [match_paths(g, q, len(p)) for g, q, p in zip(ranks, sequences, prompts)]
    assert [replay(trees, m, len(o.token_ids), text=(p, o.token_ids)) for m, p, o in zip(paths, prompts, outputs)] \
        == [(o.new_tokens, o.steps) for o in outputs]


def test_the_generate_command_takes_a_lookup_chain_and_refuses_one_beside_confident_trees():
    from tests.test_generate_cli import json_by_method, run

    records = json_by_method("--prompt", "Repeat after me three times: red, green, blue.", "--max_new_tokens", "40",
                             "--capture", "eager", ppd_args=("--lookup", "8"))
    assert records["ppd"]["token_ids"] == records["baseline"]["token_ids"]
    proc = run("--model", "smollm2-135m-instruct", "--prompt", "Hi", "--lookup", "8", "--tree_choice", "confident")
    assert proc.returncode == 2 and "beside fixed trees only" in proc.stderr, proc.stderr

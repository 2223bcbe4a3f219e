"""Lossless sampling: the text ppd samples has the model's own distribution.

The reference is exact: the joint distribution of the first sampled tokens, enumerated by running the model
on every prefix. Samples are compared with it by their total-variation distance (TV); a Monte Carlo null
(multinomial samples of the same size drawn from the exact distribution) turns each distance into a p-value,
and a test function fails when any of its p-values is below ``ALPHA`` divided by the number of its checks
(Bonferroni), so its false-alarm rate is at most ``ALPHA``. Seeds are fixed, so the outcome is too.
"""

from __future__ import annotations


import numpy as np
import pytest
import torch

from ppd import DecodeConfig, Decoder, Tree, TreeSet, eos_ids_of
from ppd.acceptance import walk_tree
from ppd.chat import chat_input_ids, plain_input_ids
from ppd.adapter import AdapterFiles
from tests.conftest import random_prompt_tokens, tiny_model

ALPHA = 1e-3  # false-alarm rate of each test function
NULL_DRAWS = 20_000
SAMPLES = 2_000
VOCAB = 8


def reference_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """float64 next-token probabilities after temperature, top-k then top-p, written out token by token."""
    probs = torch.softmax(logits.double() / temperature, -1)
    order = probs.argsort(descending=True).tolist()
    kept = order[:top_k] if top_k else order
    mass = probs[kept].sum()
    nucleus, before = [], 0.0
    for token in kept:
        if before >= top_p and top_p < 1.0:
            break
        nucleus.append(token)
        before += (probs[token] / mass).item()
    out = torch.zeros_like(probs)
    out[nucleus] = probs[nucleus]
    return out / out.sum()


def exact_joint(model, prompt: list[int], length: int, **sampling) -> dict[tuple[int, ...], float]:
    """P(first ``length`` sampled tokens), by enumerating every prefix the sampler can reach."""
    joint = {(): 1.0}
    for _ in range(length):
        prefixes = list(joint)
        ids = torch.tensor([prompt + list(p) for p in prefixes])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[:, -1]
        following = {}
        for prefix, row in zip(prefixes, logits):
            probs = reference_probs(row, **sampling)
            for token in probs.nonzero().flatten().tolist():
                following[prefix + (token,)] = joint[prefix] * probs[token].item()
        joint = following
    return joint


def sample_counts(decoder: Decoder, prompts: list[list[int]], length: int, seeds: range, rows: int,
                  **config) -> list[dict[tuple[int, ...], int]]:
    """Counts of the first ``length`` tokens per prompt, from ``rows`` copies of each prompt in one batch per
    seed (each row draws its own numbers)."""
    counts = [dict() for _ in prompts]
    for seed in seeds:
        batch = [p for p in prompts for _ in range(rows)]
        outputs = decoder.generate(batch, DecodeConfig(max_new_tokens=length, stop_on_eos=False, seed=seed,
                                                       **config))
        for i, out in enumerate(outputs):
            key = tuple(out.token_ids)
            assert len(key) == length
            counts[i // rows][key] = counts[i // rows].get(key, 0) + 1
    return counts


def p_values(counts: dict[tuple, int], exact: dict[tuple, float], rng: np.random.Generator) -> dict[str, float]:
    """Monte Carlo p-values of the TV distance of the joint and of each position's marginal."""
    outcomes = sorted(set(exact) | set(counts))
    probs = np.array([exact.get(o, 0.0) for o in outcomes])
    observed = np.array([counts.get(o, 0) for o in outcomes], dtype=float)
    n = int(observed.sum())
    length = len(outcomes[0])
    # Each statistic reads cells of outcomes: the joint (every outcome its own cell), or one position's
    # token (a 0/1 matrix from outcomes to tokens).
    groupings = {"joint": None}
    for position in range(1, length):
        tokens = sorted({o[position] for o in outcomes})
        groupings[f"token {position + 1}"] = np.array([[o[position] == t for t in tokens] for o in outcomes], float)

    def tv(counts: np.ndarray, grouping) -> np.ndarray:
        cells, expected = (counts, probs) if grouping is None else (counts @ grouping, probs @ grouping)
        return 0.5 * np.abs(cells / n - expected).sum(-1)

    stats = {name: tv(observed, g) for name, g in groupings.items()}
    exceed = dict.fromkeys(groupings, 0)
    cells = len(outcomes)
    for start in range(0, NULL_DRAWS, 1_000):
        chunk = min(1_000, NULL_DRAWS - start)
        draws = rng.choice(cells, size=(chunk, n), p=probs / probs.sum())  # a multinomial sample per row
        draws += np.arange(chunk)[:, None] * cells
        null = np.bincount(draws.ravel(), minlength=chunk * cells).reshape(chunk, cells).astype(float)
        for name, g in groupings.items():
            exceed[name] += int((tv(null, g) >= stats[name] - 1e-12).sum())
    return {name: (1 + exceed[name]) / (1 + NULL_DRAWS) for name in groupings}


def wide_tree_set(vocab: int, attached: int = 2, n_prompt: int = 3) -> TreeSet:
    """Every token at depths 1 and 2, then a few at depth 3: at least two guesses are accepted at every step
    whose key is 2 or more. Every node carries ``attached`` prompt tokens (2: the next key is 2 again; 1: a
    smaller forward, for samples of a single step)."""
    paths = [(r,) for r in range(vocab)] + [(r, s) for r in range(vocab) for s in range(vocab)] + \
            [(r, s, t) for r in range(2) for s in range(2) for t in range(2)]
    trees = {}
    for key in range(1, n_prompt + 1):
        kept = tuple(p for p in paths if len(p) <= key)
        trees[key] = Tree(kept, (attached,) * len(kept), n_prompt)
    return TreeSet(n_prompt, vocab, trees)


def check(samples: dict[str, dict], exact: dict, checks: int) -> dict[str, dict[str, float]]:
    rng = np.random.default_rng(0)
    found = {name: p_values(counts, exact, rng) for name, counts in samples.items()}
    for name, values in found.items():
        assert min(values.values()) >= ALPHA / checks, f"{name}: {values}"
    return found


@pytest.fixture(scope="module")
def wide_decoder():
    model = tiny_model("llama", vocab=VOCAB, seed=21)
    return Decoder(model, random_prompt_tokens(model, 3, 1, seed=21), wide_tree_set(VOCAB))


def test_ppd_samples_the_models_joint_distribution_and_typical_acceptance_does_not(wide_decoder):
    """The first 3 tokens: the prefill draws one, the first tree step two (the root's and a candidate's)."""
    model = wide_decoder.model
    decoder = wide_decoder.with_trees(wide_tree_set(VOCAB, attached=1))
    prompt = [3, 1, 4, 1, 5]
    exact = exact_joint(model, prompt, 3, temperature=1.0, top_k=0, top_p=1.0)
    assert abs(sum(exact.values()) - 1) < 1e-9
    rows = SAMPLES // 8
    settings = dict(temperature=1.0)
    ppd = sample_counts(decoder, [prompt], 3, range(8), rows, method="ppd", **settings)[0]
    baseline = sample_counts(decoder, [prompt], 3, range(100, 108), rows, method="baseline", **settings)[0]
    typical = sample_counts(decoder, [prompt], 3, range(8), rows, method="ppd", acceptance="typical",
                            **settings)[0]
    rng = np.random.default_rng(0)
    found = check({"ppd": ppd, "baseline": baseline}, exact, checks=2 * 3)
    # The same test tells typical acceptance apart: it does not sample from the model.
    assert min(p_values(typical, exact, rng).values()) < ALPHA / 6
    # The trees were used: ppd emitted more than one token in most of its steps.
    out = wide_decoder.generate(prompt, DecodeConfig(temperature=1.0, seed=1, max_new_tokens=60, stop_on_eos=False))
    assert out.accept_length > 2.5, out.step_tokens
    print(found)


def test_ppd_samples_the_filtered_distribution_in_a_batch_of_prompts():
    """top-k and top-p, V > 1, two prompts of different lengths sharing every batch."""
    model = tiny_model("qwen2", vocab=VOCAB, seed=22)
    decoder = Decoder(model, random_prompt_tokens(model, 3, 2, seed=22), wide_tree_set(VOCAB, attached=1))
    prompts = [[2, 7, 1, 6], [5, 5, 4, 3, 2, 1, 6]]
    settings = dict(temperature=0.7, top_k=4, top_p=0.8)
    samples = sample_counts(decoder, prompts, 3, range(8), SAMPLES // 8, method="ppd", **settings)
    for prompt, counts in zip(prompts, samples):
        exact = exact_joint(model, prompt, 3, **settings)
        assert set(counts) <= set(exact), "a token outside the top-k/top-p set was emitted"
        check({"ppd": counts}, exact, checks=2 * 3)


@pytest.mark.parametrize("arch,ensemble,top_k,top_p", [("llama", 1, 0, 1.0), ("qwen2", 2, 5, 0.9),
                                                        ("mistral", 3, 0, 0.85)])
def test_ppd_samples_the_baselines_text_for_the_same_seed(arch, ensemble, top_k, top_p):
    """Every token is drawn with the numbers the baseline draws it with: the same text, token for token."""
    model = tiny_model(arch, vocab=VOCAB, seed=23)
    decoder = Decoder(model, random_prompt_tokens(model, 3, ensemble, seed=23), wide_tree_set(VOCAB))
    prompts = [[1, 2, 3], [5, 4, 3, 2, 1, 0, 7, 6]]
    for seed in range(3):
        config = dict(temperature=0.9, top_k=top_k, top_p=top_p, seed=seed, max_new_tokens=48, stop_on_eos=False)
        ppd = decoder.generate(prompts, DecodeConfig(method="ppd", **config))
        baseline = decoder.generate(prompts, DecodeConfig(method="baseline", **config))
        assert [o.token_ids for o in ppd] == [o.token_ids for o in baseline]
        assert sum(o.new_tokens for o in ppd) > 1.5 * sum(o.steps for o in ppd)  # guesses were accepted


def test_a_low_temperature_samples_the_greedy_text(wide_decoder):
    for method in ("ppd", "baseline"):
        greedy = wide_decoder.generate([6, 2, 7], DecodeConfig(method=method, max_new_tokens=40, stop_on_eos=False))
        cold = wide_decoder.generate([6, 2, 7], DecodeConfig(method=method, temperature=1e-4, seed=4,
                                                             max_new_tokens=40, stop_on_eos=False))
        assert cold.token_ids == greedy.token_ids


def test_the_walk_takes_the_drawn_child_and_never_a_padded_candidate():
    # Root (row 0) with children rows 1 (token 5) and 2 (token 7); row 3 (token 7) is a child of row 2;
    # row 4 is padding that carries token 3 under the root.
    tokens = torch.tensor([[0, 5, 7, 7, 3]] * 3)
    parent = torch.tensor([[0, 0, 2, 0]] * 3)
    real = torch.tensor([[True, True, True, False]] * 3)
    logits = torch.zeros(3, 5, 10)
    draws = iter([torch.tensor([7, 5, 3]), torch.tensor([7, 1, 1]), torch.tensor([2, 2, 2])])
    path, accepted, token = walk_tree(logits, tokens, parent, real, 2, lambda _, depth: next(draws))
    # Row 0: 7 (row 2), then 7 (row 3), then 2 drawn after it. Row 1: 5 (row 1), whose children are none:
    # 1 is the next root. Row 2: 3 matches only the padding: nothing accepted, 3 is the next root.
    assert accepted.tolist() == [2, 1, 0]
    assert token.tolist() == [2, 1, 3]
    assert path.tolist() == [[0, 2, 3], [0, 1, 1], [0, 0, 0]]


def test_the_real_model_samples_its_own_first_tokens(real_model):
    """The shipped prompt tokens on the default model: the first 3 tokens (the first tree step verifies
    candidates) against enumeration, with a small tree that keeps the sampling cheap on a CPU; then, with
    the shipped tree, the baseline's text for the same seed."""
    model, tokenizer, info = real_model
    prompt_tokens = AdapterFiles.default_for(model, tokenizer, info).prompt_tokens
    decoder = Decoder(model, prompt_tokens, eos_token_ids=eos_ids_of(model, tokenizer), max_seq_len=256)
    small = Tree(((0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)), (1,) * 7, 3)
    sampler = decoder.with_trees(TreeSet(3, 3, {1: Tree(((0,), (1,), (2,)), (1,) * 3, 3),
                                                2: Tree(small.paths[:6], (1,) * 6, 3), 3: small}))
    prompts = [plain_input_ids(tokenizer, text) for text in ("The capital of France is", "My favourite fruit is")]
    settings = dict(temperature=1.0, top_k=3)
    # 300 samples a prompt, in batches of 100 rows: batches of 300 took this process to 8.4 GiB (12.5 GiB in the
    # suite), 100 rows to 4.2 GiB, in less time (74 s against 95 s alone)
    samples = sample_counts(sampler, prompts, 3, range(6), 50, method="ppd", **settings)
    for prompt, counts in zip(prompts, samples):
        check({"ppd": counts}, exact_joint(model, prompt, 3, top_p=1.0, **settings), checks=2 * 3)
    chats = [chat_input_ids(tokenizer, [{"role": "user", "content": text}])
             for text in ("Name a colour.", "Write a haiku about rain.")]
    config = dict(temperature=0.7, top_p=0.9, seed=11, max_new_tokens=48)
    ppd = decoder.generate(chats, DecodeConfig(method="ppd", **config))
    baseline = decoder.generate(chats, DecodeConfig(method="baseline", **config))
    assert [o.token_ids for o in ppd] == [o.token_ids for o in baseline]
    assert sum(o.new_tokens for o in ppd) > 1.2 * sum(o.steps for o in ppd)  # the shipped tree's guesses were kept


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("mode", ["graph", "compiled_graph"])
def test_captured_lossless_sampling_writes_the_eager_baselines_text_on_the_gpu(mode):
    model = tiny_model("qwen2", vocab=VOCAB, seed=24).cuda()
    decoder = Decoder(model, random_prompt_tokens(model, 3, 2, seed=24), wide_tree_set(VOCAB))
    prompts = [[1, 2, 3], [5, 4, 3, 2, 1, 0, 7, 6]]
    config = dict(temperature=0.8, top_k=5, top_p=0.9, seed=3, max_new_tokens=40, stop_on_eos=False)
    eager = decoder.generate(prompts, DecodeConfig(method="baseline", capture="eager", **config))
    for method in ("ppd", "baseline"):
        captured = decoder.generate(prompts, DecodeConfig(method=method, capture=mode, **config))
        assert [o.token_ids for o in captured] == [o.token_ids for o in eager], method

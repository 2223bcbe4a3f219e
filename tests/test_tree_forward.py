"""The gold-standard equivalence: one tree forward gives, for every row, the logits that a plain forward
over that row's own root-to-node path (and its attached prompt tokens) gives."""

import pytest
import torch

from ppd import DecodeConfig, Decoder
from ppd.attention import prefill_layout, to_additive
from ppd.decoding.loop import prefill
from ppd.decoding.step import StepKind, generate_candidates, tree_decoding
from tests.conftest import random_prompt_tokens, random_tree_set, tiny_model


def sequential_logits(model, prompt_tokens, tokens: list[int], n_attached: int) -> torch.Tensor:
    """Logits of ``tokens`` followed by the first ``n_attached`` prompt tokens, without any cache."""
    V = prompt_tokens.num_ensemble
    allowed, positions = prefill_layout([len(tokens)], n_attached, V, prompt_tokens.config.attention_type)
    embeds = model.get_input_embeddings()(torch.tensor([tokens]))
    embeds = torch.cat([embeds, prompt_tokens.embeddings[: n_attached * V][None]], dim=1)
    out = model(inputs_embeds=embeds, attention_mask=to_additive(allowed[:, None], embeds.dtype),
                position_ids=positions)
    return out.logits[0]


def tree_step_rows(decoder, prompt: list[int], width: int | None = None):
    """For every key of the decoder's tree set, prefill ``prompt`` and run one tree step (reading the
    decoder's own device tables, attending over ``width`` slots: default the whole cache). Yields, per
    row of that step, ``(logits of the step's rows [T, vocab], row, tokens of the row's root-to-node path
    after the prompt, its attached prompt-token count, the rows of those prompt tokens)``."""
    tables, V = decoder.tables, decoder.prompt_tokens.num_ensemble
    state = decoder.states.acquire(1)
    with torch.no_grad():
        for key in range(1, tables.num_prompt_tokens + 1):
            state.reset(1, [64], [2], [], DecodeConfig())
            prefill(decoder, [prompt], state, True, StepKind(tree=True))
            state.key.fill_(key)
            rows = generate_candidates(decoder.lm, tables, decoder.prompt_embeds(), state)
            slots = state.slot_ids[: width or state.capacity]
            state.kv.reserve(slots.shape[0])  # as the decoder's step runner does before a step
            with decoder.lm.stepping():
                logits = decoder.lm.logits(tree_decoding(decoder.lm, state, rows, slots))[0]
            paths = [()] + sorted(decoder.trees.trees[key].paths, key=lambda p: (len(p), p))
            row_of = {p: r for r, p in enumerate(paths)}
            node_tokens = rows.node_tokens[0].tolist()
            for row, path in enumerate(paths):
                tokens = prompt + [node_tokens[row_of[path[:j]]] for j in range(len(path) + 1)]
                n = int(tables.node_prompt_count[key, row])
                yield logits, row, tokens, n, tables.node_prompt_rows[key, row, : n * V].tolist()


@pytest.mark.parametrize("arch,V,attention,seed,wide", [
    ("llama", 1, "ensemble", 0, False), ("llama", 2, "ensemble", 1, True), ("llama", 2, "decoder", 2, False),
    ("llama", 3, "encoder", 3, False), ("qwen2", 2, "ensemble", 4, True), ("mistral", 1, "ensemble", 5, False),
])
def test_tree_forward_equals_per_path_forward(arch, V, attention, seed, wide):
    """Every key's tree, padded to the tree set's common shape, read from the decoder's own device tables;
    ``wide`` attends over the whole cache (stale and unused slots hidden by the mask alone)."""
    model = tiny_model(arch, seed=seed)
    pt = random_prompt_tokens(model, n=3, v=V, attention=attention, seed=seed)
    decoder = Decoder(model, pt, random_tree_set(seed, size=10))
    prompt = [(7 * i + seed) % model.config.vocab_size for i in range(9)]
    width = None if wide else len(prompt) + decoder.tables.num_rows
    for logits, row, tokens, n, prompt_rows in tree_step_rows(decoder, prompt, width):
        ref = sequential_logits(model, pt, tokens, n)
        torch.testing.assert_close(logits[row], ref[len(tokens) - 1], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(logits[prompt_rows], ref[len(tokens):], rtol=1e-4, atol=1e-4)

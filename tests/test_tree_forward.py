"""The gold-standard equivalence: one tree forward gives, for every row, the logits that a plain forward
over that row's own root-to-node path (and its attached prompt tokens) gives."""

import pytest
import torch

from ppd import DecodeConfig, Decoder
from ppd.attention import prefill_layout, to_additive
from ppd.kv_cache import KVCache
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


@pytest.mark.parametrize("arch,V,attention,seed", [
    ("llama", 1, "ensemble", 0), ("llama", 2, "ensemble", 1), ("llama", 2, "decoder", 2),
    ("llama", 3, "encoder", 3), ("qwen2", 2, "ensemble", 4), ("mistral", 1, "ensemble", 5),
])
def test_tree_forward_equals_per_path_forward(arch, V, attention, seed):
    model = tiny_model(arch, seed=seed)
    pt = random_prompt_tokens(model, n=3, v=V, attention=attention, seed=seed)
    trees = random_tree_set(seed, size=10)
    decoder = Decoder(model, pt, trees)
    prompt = [(7 * i + seed) % model.config.vocab_size for i in range(9)]
    config = DecodeConfig()
    with torch.inference_mode():
        for key in range(1, 4):
            cache = KVCache(model.config.num_hidden_layers, 1, 128, "cpu")
            root, guesses = decoder._prefill([prompt], cache, 3, config, None)
            buffers = decoder.tree_buffers(key)
            nodes = decoder._generate_candidates(buffers, key, root, guesses)
            logits = decoder._tree_decoding(buffers, nodes, cache, len(prompt) + buffers.num_rows)[0]

            tree = trees.trees[key]
            order = sorted(range(len(tree.paths)), key=lambda i: (len(tree.paths[i]), tree.paths[i]))
            paths = [()] + [tree.paths[i] for i in order]
            row_of = {p: r for r, p in enumerate(paths)}
            node_tokens = nodes[0].tolist()
            for row, path in enumerate(paths):
                tokens = prompt + [node_tokens[row_of[path[:j]]] for j in range(len(path) + 1)]
                n = int(buffers.node_prompt_count[row])
                ref = sequential_logits(model, pt, tokens, n)
                torch.testing.assert_close(logits[row], ref[len(tokens) - 1], rtol=1e-4, atol=1e-4)
                prompt_rows = buffers.node_prompt_rows[row, : n * V].tolist()
                torch.testing.assert_close(logits[prompt_rows], ref[len(tokens):], rtol=1e-4, atol=1e-4)

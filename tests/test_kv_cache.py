import torch
from transformers import DynamicCache

from ppd.attention import step_mask, to_additive
from ppd.kv_cache import KVCache
from tests.conftest import tiny_model


def _write(cache, layer, values, slots):
    cache.prepare(slots, int(slots.max()) + 1)
    return cache.update(values, values.clone(), layer)


def test_compaction_moves_accepted_entries_per_row():
    cache = KVCache(num_layers=1, batch_size=2, capacity=10, device="cpu")
    # [B=2, H=1, T=4, D=1] with entry value = 10 * row + slot
    values = torch.tensor([[0.0, 1, 2, 3], [10, 11, 12, 13]])[:, None, :, None]
    _write(cache, 0, values, torch.arange(4).expand(2, 4))
    cache.lengths[:] = torch.tensor([1, 2])
    # A 4-row "tree" was written at lengths + [0, 4) in a later step:
    tree = torch.tensor([[100.0, 101, 102, 103], [200, 201, 202, 203]])[:, None, :, None]
    _write(cache, 0, tree, cache.lengths[:, None] + torch.arange(4))
    # Row 0 keeps tree rows 0, 2 (count 2); row 1 keeps row 0 only (count 1; the rest is padding).
    src = cache.lengths[:, None] + torch.tensor([[0, 2, 3], [0, 0, 0]])
    cache.compact(src, torch.tensor([2, 1]))
    assert cache.lengths.tolist() == [3, 3]
    keys = cache.layers[0].keys[:, 0, :, 0]
    assert keys[0, :3].tolist() == [0, 100, 102]
    assert keys[1, :3].tolist() == [10, 11, 200]
    assert torch.equal(cache.layers[0].values, cache.layers[0].keys)


def test_update_returns_only_attended_slots():
    cache = KVCache(num_layers=2, batch_size=1, capacity=16, device="cpu")
    k = torch.randn(1, 2, 3, 4)
    cache.prepare(torch.tensor([[5, 6, 7]]), 8)
    keys, values = cache.update(k, k, 1)
    assert keys.shape == (1, 2, 8, 4)
    assert torch.equal(keys[:, :, 5:8], k)


def test_compacted_cache_equals_a_fresh_forward():
    """Write a tree with a rejected branch, keep the accepted path: the cache must hold exactly the K/V
    of a plain forward over the committed tokens."""
    model = tiny_model()
    prefix = torch.tensor([[3, 1, 4, 1, 5]])
    L = prefix.shape[1]
    cache = KVCache(model.config.num_hidden_layers, 1, 32, "cpu")
    cache.prepare(torch.arange(L)[None], L)
    causal = torch.tril(torch.ones(L, L, dtype=torch.bool))
    model(input_ids=prefix, attention_mask=to_additive(causal[None, None], torch.float32),
          position_ids=torch.arange(L)[None], past_key_values=cache, use_cache=True)
    cache.lengths[:] = L
    # Tree rows: 0 = token 9 (root), 1 = token 2 (child of root, rejected), 2 = token 6 (child of root),
    # 3 = token 7 (child of row 2). Keep the path 0 -> 2 -> 3.
    tokens = torch.tensor([[9, 2, 6, 7]])
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    offsets = torch.tensor([0, 1, 1, 2])
    cache.prepare(cache.lengths[:, None] + torch.arange(4), L + 4)
    model(input_ids=tokens, attention_mask=step_mask(tree, cache.lengths, L + 4, torch.float32),
          position_ids=cache.lengths[:, None] + offsets, past_key_values=cache, use_cache=True)
    cache.compact(cache.lengths[:, None] + torch.tensor([[0, 2, 3]]), torch.tensor([3]))

    committed = torch.cat([prefix, torch.tensor([[9, 6, 7]])], dim=1)
    fresh = DynamicCache(config=model.config)
    model(input_ids=committed, past_key_values=fresh, use_cache=True)
    n = committed.shape[1]
    assert cache.lengths.item() == n
    for layer, ref in zip(cache.layers, fresh.layers):
        torch.testing.assert_close(layer.keys[:, :, :n], ref.keys, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(layer.values[:, :, :n], ref.values, rtol=1e-5, atol=1e-5)

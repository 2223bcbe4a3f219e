import warnings

import torch
from torch import nn
from transformers import DynamicCache

from ppd.attention import step_mask, to_additive
from ppd.decoding.kv_cache import KVBuffer, cache_keyword, returned_cache
from tests.conftest import tiny_model


def _write(buffer, layer, values, slots, rows=None):
    return buffer.view(slots, int(slots.max()) + 1, rows).update(values, values.clone() + 0.5, layer)


def test_the_cache_goes_by_the_keyword_the_installed_transformers_names_without_a_deprecation():
    class Old(nn.Module):
        def forward(self, input_ids=None, past_key_values=None, use_cache=None):
            return input_ids

    assert cache_keyword(Old()) == "past_key_values"
    model = tiny_model("llama", seed=4)
    keyword = cache_keyword(model)
    assert keyword == cache_keyword(model.base_model) and keyword in ("cache", "past_key_values")
    ids = torch.tensor([[1, 2, 3]])
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        first = model(input_ids=ids, use_cache=True, **{keyword: DynamicCache()})
        cache = returned_cache(first)
        assert cache is not None and cache.get_seq_length() == 3
        again = model(input_ids=torch.tensor([[4]]), use_cache=True, **{keyword: cache})
    assert returned_cache(again).get_seq_length() == 4


def test_a_buffer_grows_on_request_keeping_its_entries_and_its_row_views():
    buffer = KVBuffer(num_layers=2, batch_size=3, capacity=1000, reserved=100)
    lower = buffer.rows(1, 3)
    values = torch.arange(3 * 5, dtype=torch.float32).view(3, 1, 5, 1)
    for layer in range(2):
        _write(buffer, layer, values + layer, torch.arange(5).expand(3, 5))
    assert buffer.keys[0].shape == (3, 1, 100, 1)
    buffer.reserve(90)  # already held: nothing moves
    kept = buffer.keys[0]
    lower.reserve(150)  # through a view of some rows: the whole buffer grows, to twice its size
    assert buffer.reserved == lower.reserved == 256 and buffer.keys[0] is not kept
    for layer in range(2):
        assert buffer.keys[layer].shape == buffer.values[layer].shape == (3, 1, 256, 1)
        assert torch.equal(buffer.keys[layer][:, :, :5], values + layer)
        assert torch.equal(buffer.values[layer][:, :, :5], values + layer + 0.5)
        assert not buffer.keys[layer][:, :, 5:].any()
    assert torch.equal(lower.keys[1], buffer.keys[1][1:3])
    buffer.reserve(5000)  # never past the capacity
    assert buffer.reserved == 1000 and buffer.keys[0].shape[2] == 1000
    assert KVBuffer(num_layers=1, batch_size=1, capacity=64).reserved == 64  # all of it by default


def test_spare_slots_keep_every_attended_width_below_the_buffers_size():
    """A step attends over at most ``reserved`` slots; the spare ones past them are allocated, kept through
    growth and never handed to attention, so no width is ever the whole buffer."""
    buffer = KVBuffer(num_layers=1, batch_size=2, capacity=300, reserved=128, spare=1)
    values = torch.arange(2 * 4, dtype=torch.float32).view(2, 1, 4, 1)
    keys, _ = buffer.view(torch.arange(4).expand(2, 4), 128).update(values, values + 0.5, 0)
    assert buffer.keys[0].shape == (2, 1, 129, 1) and keys.shape[2] == 128
    buffer.reserve(300)
    assert buffer.reserved == 300 and buffer.keys[0].shape[2] == buffer.values[0].shape[2] == 301
    assert torch.equal(buffer.keys[0][:, :, :4], values) and buffer.rows(0, 1).spare == 1
    keys, _ = buffer.view(torch.arange(4, 8).expand(2, 4), 300).update(values, values + 0.5, 0)
    assert keys.shape[2] == 300 < buffer.keys[0].shape[2]


def test_compaction_moves_accepted_entries_of_every_layer_per_row():
    buffer = KVBuffer(num_layers=2, batch_size=2, capacity=10)
    # [B=2, H=1, T=4, D=1] with entry value = 10 * row + slot
    values = torch.tensor([[0.0, 1, 2, 3], [10, 11, 12, 13]])[:, None, :, None]
    for layer in range(2):
        _write(buffer, layer, values + 1000 * layer, torch.arange(4).expand(2, 4))
    lengths = torch.tensor([1, 2])
    # A 4-row "tree" was written at lengths + [0, 4) in a later step:
    tree = torch.tensor([[100.0, 101, 102, 103], [200, 201, 202, 203]])[:, None, :, None]
    for layer in range(2):
        _write(buffer, layer, tree + 1000 * layer, lengths[:, None] + torch.arange(4))
    # Row 0 keeps tree rows 0, 2 (count 2); row 1 keeps row 0 only (the rest is padding).
    buffer.compact(lengths[:, None] + torch.tensor([[0, 2, 3], [0, 0, 0]]), lengths)
    for layer in range(2):
        keys = buffer.keys[layer][:, 0, :, 0] - 1000 * layer
        assert keys[0, :3].tolist() == [0, 100, 102]
        assert keys[1, :3].tolist() == [10, 11, 200]
        assert torch.equal(buffer.values[layer][:, :, :3], buffer.keys[layer][:, :, :3] + 0.5)


def test_update_returns_only_attended_slots_and_may_use_fewer_rows():
    buffer = KVBuffer(num_layers=2, batch_size=3, capacity=16)
    k = torch.randn(1, 2, 3, 4)
    keys, values = buffer.view(torch.tensor([[5, 6, 7]]), 8, rows=1).update(k, k, 1)
    assert keys.shape == (1, 2, 8, 4) and len(buffer.keys) == 2 and buffer.keys[1].shape == (3, 2, 16, 4)
    assert torch.equal(keys[:, :, 5:8], k) and torch.equal(buffer.keys[1][:1, :, 5:8], k)
    assert all(t[1:].abs().sum() == 0 for t in buffer.buffers())  # the other batch rows are untouched


def test_compacted_cache_equals_a_fresh_forward():
    """Write a tree with a rejected branch, keep the accepted path: the cache must hold exactly the K/V
    of a plain forward over the committed tokens."""
    model = tiny_model()
    prefix = torch.tensor([[3, 1, 4, 1, 5]])
    L = prefix.shape[1]
    buffer = KVBuffer(model.config.num_hidden_layers, 1, 32)
    causal = torch.tril(torch.ones(L, L, dtype=torch.bool))
    model(input_ids=prefix, attention_mask=to_additive(causal[None, None], torch.float32),
          position_ids=torch.arange(L)[None], past_key_values=buffer.view(torch.arange(L)[None], L), use_cache=True)
    lengths = torch.tensor([L])
    # Tree rows: 0 = token 9 (root), 1 = token 2 (child of root, rejected), 2 = token 6 (child of root),
    # 3 = token 7 (child of row 2). Keep the path 0 -> 2 -> 3.
    tokens = torch.tensor([[9, 2, 6, 7]])
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    offsets = torch.tensor([0, 1, 1, 2])
    model(input_ids=tokens, attention_mask=step_mask(tree, lengths, torch.arange(L + 4), torch.float32),
          position_ids=lengths[:, None] + offsets,
          past_key_values=buffer.view(lengths[:, None] + torch.arange(4), L + 4), use_cache=True)
    buffer.compact(lengths[:, None] + torch.tensor([[0, 2, 3]]), lengths)

    committed = torch.cat([prefix, torch.tensor([[9, 6, 7]])], dim=1)
    fresh = DynamicCache(config=model.config)
    model(input_ids=committed, past_key_values=fresh, use_cache=True)
    n = committed.shape[1]
    for layer, ref in enumerate(fresh.layers):
        torch.testing.assert_close(buffer.keys[layer][:, :, :n], ref.keys, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(buffer.values[layer][:, :, :n], ref.values, rtol=1e-5, atol=1e-5)

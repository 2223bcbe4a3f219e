"""FlexAttention tree steps (``ppd.decoding.tree_attention``): the block mask made from lengths sees exactly
what the dense step mask sees, touches a bounded number of partial blocks however long the cache, and a
step through it gives the per-path forward's logits and the baseline's greedy tokens, with prompts far
longer than the tree, batches of different lengths, sliding windows and soft-capped attention."""

import random

import pytest
import torch

from ppd import DecodeConfig, Decoder, eos_ids_of
from ppd.adapter import AdapterFiles
from ppd.attention import step_mask
from ppd.decoding.support import UnsupportedModelError
from ppd.decoding.tree_attention import BLOCK, NAME, active, tree_block_mask, visible
from tests.conftest import random_prompt_tokens, random_tree_set, tiny_model
from tests.test_decoder import assert_captured_equals_eager_and_generate, hf_greedy
from tests.test_sliding_window import assert_tree_rows_equal_own_forward

ARCHS = [("llama", None), ("qwen2", 40), ("mistral", 40), ("gemma2", 40)]  # gemma2: soft-capped scores
LONG = 600  # prompt tokens: many key blocks, many windows, far more than any tree's rows


def random_tree_inputs(seed: int, batch: int, rows: int):
    generator = torch.Generator().manual_seed(seed)
    allowed = (torch.rand(batch, rows, rows, generator=generator) < 0.5) | torch.eye(rows, dtype=torch.bool)
    offsets = torch.randint(0, min(rows, 6), (batch, rows), generator=generator)
    offsets[:, 0] = 0
    return allowed, offsets


@pytest.mark.parametrize("window", [None, 100, 300])
@pytest.mark.parametrize("rows", [1, 5, 130])
@pytest.mark.parametrize("width,group", [(900, 1), (1024, 1), (900, 3)])
def test_the_block_mask_sees_what_the_dense_step_mask_sees(window, rows, width, group):
    """Rows of different lengths (empty, mid-block, on a block edge, at the end of the width), one tree per
    batch row, more than one block of query rows (130), widths on and off the block size; with ``group``
    query heads folded into the rows, each tree row's visibility ``group`` times over."""
    lengths = torch.tensor([0, 250, 2 * BLOCK, width - rows])
    allowed, offsets = random_tree_inputs(rows, lengths.shape[0], rows)
    block_mask = tree_block_mask(allowed, lengths, offsets, width, window, group)
    want = step_mask(allowed, lengths, torch.arange(width), torch.float32, offsets, window)[:, 0] == 0
    assert torch.equal(visible(block_mask)[:, 0], want.repeat_interleave(group, dim=1))
    # No block is both full and partial.
    for b in range(lengths.shape[0]):
        full = set(block_mask.full_kv_indices[b, 0, 0, : block_mask.full_kv_num_blocks[b, 0, 0]].tolist())
        part = set(block_mask.kv_indices[b, 0, 0, : block_mask.kv_num_blocks[b, 0, 0]].tolist())
        assert not full & part


@pytest.mark.parametrize("window", [None, 100, 300])
@pytest.mark.parametrize("rows,group", [(5, 1), (50, 3)])
@pytest.mark.parametrize("chunks", [2, 4])
def test_a_split_block_mask_sees_in_its_pieces_what_the_dense_step_mask_sees(window, rows, group, chunks):
    """Split into pieces, head ``k * chunks + s`` sees in piece s (its slots counted from the piece's start)
    what the dense mask shows there, for every key head k."""
    width, key_heads = 2048, 2
    lengths = torch.tensor([0, 250, 2 * BLOCK, 1000, width - rows])
    allowed, offsets = random_tree_inputs(rows + chunks, lengths.shape[0], rows)
    block_mask = tree_block_mask(allowed, lengths, offsets, width, window, group, chunks, key_heads)
    want = (step_mask(allowed, lengths, torch.arange(width), torch.float32, offsets, window)[:, 0] == 0
            ).repeat_interleave(group, dim=1)
    seen = visible(block_mask)  # [B, key heads * chunks, rows * group, width / chunks]
    assert seen.shape[1] == key_heads * chunks
    for k in range(key_heads):
        assert torch.equal(torch.cat([seen[:, k * chunks + s] for s in range(chunks)], dim=-1), want)
    with pytest.raises(ValueError, match="does not split"):
        tree_block_mask(allowed, lengths, offsets, 900, window, group, chunks, key_heads)


def test_a_split_step_is_chosen_only_where_the_kernel_would_not_split_the_keys_itself(monkeypatch):
    from ppd.decoding import tree_attention

    cuda = torch.device("cuda")
    monkeypatch.setattr(tree_attention, "_multiprocessors", lambda device: 132)
    assert tree_attention.kv_chunks(1, 3, 48, 8704, cuda) == 1  # decoding kernel: it splits the keys itself
    chunks = tree_attention.kv_chunks(1, 3, 192, 8704, cuda)  # 6 programs unsplit
    assert chunks > 1 and 8704 % (chunks * BLOCK) == 0 and 8704 // chunks >= tree_attention.MIN_CHUNK
    assert tree_attention.kv_chunks(64, 3, 192, 8704, cuda) == 1  # 384 programs fill the GPU already
    assert tree_attention.kv_chunks(16, 3, 192, 8704, cuda) == 1  # 96: measured slower split than whole
    assert tree_attention.kv_chunks(1, 3, 192, 8704, torch.device("cpu")) == 1
    monkeypatch.setenv("PPD_FLEX_SPLIT", "off")
    assert tree_attention.kv_chunks(1, 3, 192, 8704, cuda) == 1
    monkeypatch.setenv("PPD_FLEX_SPLIT", "always")
    assert tree_attention.kv_chunks(1, 3, 48, 8704, cuda) > 1
    monkeypatch.setenv("PPD_FLEX_SPLIT", "sometimes")
    with pytest.raises(ValueError, match="PPD_FLEX_SPLIT"):
        tree_attention.kv_chunks(1, 3, 48, 8704, cuda)


def split_in(monkeypatch, chunks: int) -> list[int]:
    """Make every FlexAttention tree step attend over the whole buffer, as a captured one does, split into
    ``chunks`` pieces (a CPU never would); returns the list of the split steps' widths, filled as they run."""
    from ppd.decoding import loop, tree_attention

    split: list[int] = []

    def kv_chunks(batch, heads, rows, width, device):
        assert width % (chunks * BLOCK) == 0
        if chunks > 1:
            split.append(width)
        return chunks

    monkeypatch.setattr(tree_attention, "kv_chunks", kv_chunks)
    monkeypatch.setattr(loop, "whole_width", lambda decoder, mode: decoder.lm.flex)
    return split


@pytest.mark.parametrize("window", [None, 200])
def test_partial_blocks_do_not_grow_with_the_cache(window):
    """Only the tree's blocks (and a window's edge) need the mask function, at any cache length; the blocks
    read at all end at the tree, whatever the width."""
    rows, width = 40, 8192
    allowed, offsets = random_tree_inputs(3, 1, rows)
    bound = 2 * (-(-rows // BLOCK) + 1)
    for length in range(0, width - rows, 97):
        block_mask = tree_block_mask(allowed, torch.tensor([length]), offsets, width, window)
        partial = int(block_mask.kv_num_blocks.max())
        read = partial + int(block_mask.full_kv_num_blocks.max())
        assert partial <= bound
        assert read <= -(-(length + rows) // BLOCK)


@pytest.mark.parametrize("chunks", [1, 2])
@pytest.mark.parametrize("arch,window", ARCHS)
def test_flex_tree_forward_equals_per_path_forward_on_a_long_prompt(arch, window, chunks, monkeypatch):
    """Every node row of a FlexAttention tree step equals the model's own forward over its root-to-node path
    after a prompt of :data:`LONG` tokens, and every prompt row the prefill of that path; attending over the
    whole cache, stale slots hidden by the block mask; in one piece, or split into two merged by their
    log-sum-exp."""
    split = split_in(monkeypatch, chunks)
    model = tiny_model(arch, window=window, seed=5, max_positions=1024)
    pt = random_prompt_tokens(model, n=3, v=2, seed=5)
    decoder = Decoder(model, pt, random_tree_set(5, size=12), attention="flex")
    assert decoder.attention.value == "flex"
    assert_tree_rows_equal_own_forward(decoder, [(7 * i + 3) % model.config.vocab_size for i in range(LONG)])
    assert bool(split) == (chunks > 1)


@pytest.mark.parametrize("chunks", [1, 3])
@pytest.mark.parametrize("arch,window", ARCHS)
def test_flex_decoding_equals_dense_and_generate_with_prompts_of_different_lengths(arch, window, chunks,
                                                                                    monkeypatch):
    split = split_in(monkeypatch, chunks)
    model = tiny_model(arch, window=window, seed=9, max_positions=1024)
    vocab = model.config.vocab_size
    rng = random.Random(arch)
    pt, trees = random_prompt_tokens(model, 3, 2, seed=9), random_tree_set(9, size=14)
    flex = Decoder(model, pt, trees, attention="flex")
    dense = Decoder(model, pt, trees, attention="dense")
    prompts = [[rng.randrange(vocab) for _ in range(length)] for length in (LONG, 170, 3)]
    config = dict(max_new_tokens=40, stop_on_eos=False)
    ppd = flex.generate(prompts, DecodeConfig(method="ppd", **config))
    base = flex.generate(prompts, DecodeConfig(method="baseline", **config))
    ref = dense.generate(prompts, DecodeConfig(method="ppd", **config))
    for prompt, a, b, c in zip(prompts, ppd, base, ref):
        assert a.token_ids == b.token_ids == c.token_ids == hf_greedy(model, prompt, 40)
    assert sum(o.steps for o in ppd) < sum(o.steps for o in base)  # guesses were accepted
    assert bool(split) == (chunks > 1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention's kernels compile on CUDA only")
@pytest.mark.parametrize("capture,split", [("compile", "auto"), ("compiled_graph", "auto"), ("graph", "auto"),
                                           ("compiled_graph", "always")])
def test_a_captured_flex_step_equals_the_eager_one(capture, split, monkeypatch):
    """The compiled and captured step runs FlexAttention's own kernel, block tables and all, over the whole
    buffer (with ``split`` = ``always``, split into pieces merged by their log-sum-exp); the eager step (the
    written-out reference on the same tables) and transformers agree."""
    from transformers import MistralConfig, MistralForCausalLM

    monkeypatch.setenv("PPD_FLEX_SPLIT", split)

    torch.manual_seed(13)  # FlexAttention's GPU kernels want heads of at least 16 dimensions
    config = MistralConfig(vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                           sliding_window=40)
    model = MistralForCausalLM(config).eval().requires_grad_(False).cuda()
    decoder = Decoder(model, random_prompt_tokens(model, 3, 1, seed=13), random_tree_set(13, size=10),
                      attention="flex")
    rng = random.Random(13)  # a vocabulary and prompts where greedy ties, which kernels break apart, are unlikely
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (300, 90, 7, 2)]
    assert_captured_equals_eager_and_generate(decoder, model, prompts, capture)


def test_flex_on_a_cpu_runs_eagerly_only():
    model = tiny_model("llama", seed=3)
    decoder = Decoder(model, random_prompt_tokens(model), random_tree_set(3), attention="flex")
    with pytest.raises(ValueError, match="run eagerly only.*'eager' or attention 'dense'"):
        decoder.generate([1, 2, 3], DecodeConfig(max_new_tokens=4, capture="compile"))


def test_the_models_own_attention_comes_back_after_a_step():
    model = tiny_model("llama", seed=1)
    own = model.config._attn_implementation
    with pytest.raises(RuntimeError, match="inside"):
        with active(model.config):
            assert model.config._attn_implementation == NAME
            raise RuntimeError("inside")
    assert model.config._attn_implementation == own
    decoder = Decoder(model, random_prompt_tokens(model), random_tree_set(1), attention="flex")
    decoder.generate([1, 2, 3], DecodeConfig(max_new_tokens=8))
    assert model.config._attn_implementation == own


def test_auto_is_dense_on_a_cpu_and_flex_is_refused_where_the_model_cannot_run_it(monkeypatch):
    model = tiny_model("llama", seed=2)
    assert Decoder(model).attention.value == "dense"

    import ppd.decoding.support as support

    def no_flex(module, query, key, value, attention_mask, **kwargs):
        raise NotImplementedError("attention sinks")

    monkeypatch.setattr(support, "_flex_checked", support.weakref.WeakKeyDictionary())
    monkeypatch.setattr("ppd.decoding.tree_attention.tree_attention", no_flex)
    with pytest.raises(UnsupportedModelError, match="attention 'flex' is not available.*attention sinks"):
        Decoder(model, attention="flex")


@pytest.fixture(scope="module")
def long_real_prompt(real_model):
    """A real conversation of more than 3,000 tokens: consecutive ShareGPT turns, then a question."""
    from ppd.chat import chat_input_ids
    from ppd.conversations import load_conversations, to_messages

    _, tokenizer, _ = real_model
    history: list[dict] = []
    for record in load_conversations().records:
        try:
            messages = to_messages(record)
        except ValueError:
            continue
        history += messages[: len(messages) // 2 * 2]
        ids = chat_input_ids(tokenizer, history + [{"role": "user", "content": "Summarise our conversation."}])
        if len(ids) > 3000:
            return ids
    raise AssertionError("the conversations are shorter than 3,000 tokens in all")


@pytest.fixture(scope="module")
def long_real_greedy(real_model, long_real_prompt):
    """transformers' own greedy continuation of ``long_real_prompt``, 32 tokens: made once for the tests below."""
    return hf_greedy(real_model[0], long_real_prompt, 32)


def test_real_model_ppd_equals_baseline_on_a_prompt_of_3000_tokens(real_model, long_real_prompt, long_real_greedy):
    model, tokenizer, info = real_model
    assert len(long_real_prompt) > 3000
    prompt_tokens = AdapterFiles.default_for(model, tokenizer, info).prompt_tokens
    decoder = Decoder(model, prompt_tokens, eos_token_ids=eos_ids_of(model, tokenizer), attention="flex")
    assert decoder.attention.value == "flex"
    config = dict(max_new_tokens=32, stop_on_eos=False)
    ppd = decoder.generate(long_real_prompt, DecodeConfig(method="ppd", **config))
    base = decoder.generate(long_real_prompt, DecodeConfig(method="baseline", **config))
    assert ppd.token_ids == base.token_ids == long_real_greedy
    assert ppd.steps < base.steps


def test_real_model_with_a_lookup_chain_equals_greedy_on_a_prompt_of_3000_tokens(real_model, long_real_prompt,
                                                                                  long_real_greedy):
    """The chain at long context: each row's lookup reads a history of the whole 3,000-token conversation, and the
    step attends through FlexAttention's block mask; the greedy text stays transformers' own."""
    model, tokenizer, info = real_model
    prompt_tokens = AdapterFiles.default_for(model, tokenizer, info).prompt_tokens
    plain = Decoder(model, prompt_tokens, eos_token_ids=eos_ids_of(model, tokenizer), attention="flex")
    chained = plain.with_trees(plain.trees.with_lookup(8))
    config = dict(max_new_tokens=32, stop_on_eos=False)
    ppd = chained.generate(long_real_prompt, DecodeConfig(method="ppd", **config))
    assert chained.tables.lookup == 8 and chained.attention.value == "flex"
    assert ppd.token_ids == long_real_greedy
    assert ppd.steps < 32


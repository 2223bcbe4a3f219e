"""The tree step's split attention (``ppd.decoding.split_attention``, ``PPD_GROUPED_SDPA=split``): its Triton
kernel gives SDPA's result over any number of pieces of the cache, and a dense step through it gives the same
logits and greedy tokens as without it, with prompts far longer than the tree.

On a CPU the kernel runs under Triton's interpreter, which must be switched on before Triton is first imported:
each case runs in a Python process of its own (float32 and float16: the interpreter mishandles bfloat16, which
the GPU test covers)."""

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[1]
LONG = 600  # prompt tokens: a cache of several pieces


def _reference(q, k, v, mask, scale):
    return torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask.float(),
                                                            scale=scale, enable_gqa=True)


def _case_kernel():
    from ppd.decoding.split_attention import SplitTuning, split_attention

    g = torch.Generator().manual_seed(0)
    shapes = [  # batch, query heads, key heads, rows, width, head size, pieces (0: by threads)
        (2, 6, 2, 5, 300, 16, 0), (1, 9, 3, 30, 700, 64, 3), (2, 4, 4, 7, 130, 32, 2), (1, 4, 2, 70, 520, 8, 5),
        (3, 2, 1, 3, 64, 24, 1), (1, 3, 1, 40, 257, 16, 2)]
    for dtype in (torch.float32, torch.float16):
        for batch, heads, key_heads, rows, width, dim, pieces in shapes:
            q = torch.randn(batch, heads, rows, dim, generator=g).to(dtype)
            # keys and values as the cache holds them: a view of the first ``width`` slots of a longer buffer
            k = torch.randn(batch, key_heads, width + 37, dim, generator=g).to(dtype)[:, :, :width]
            v = torch.randn(batch, key_heads, width + 37, dim, generator=g).to(dtype)[:, :, :width]
            allowed = torch.rand(batch, 1, rows, width, generator=g) > 0.4
            allowed[:, :, 0] = False
            allowed[:, :, 0, :] = False
            allowed[:, :, 0, -1] = True  # row 0 sees the last slot only, in the last piece
            allowed[:, :, 1:, 0] = True
            mask = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(dtype).min).to(dtype)
            scale = dim ** -0.5
            want = _reference(q, k, v, mask, scale)
            tolerance = 1e-5 if dtype == torch.float32 else 2e-3
            for tuning in (None, SplitTuning(block_n=32, min_piece=64, block_m=16),
                           SplitTuning(block_n=128, block_m=128, warps=8, stages=3),
                           SplitTuning(block_n=32, min_piece=64, block_m=16, fused_merge=1)):
                got = split_attention(q, k, v, mask, scale, pieces, tuning=tuning)
                # laid out as [B, T, Hq, D], the layout the output projection reads
                assert got.shape == q.shape and got.dtype == dtype and got.transpose(1, 2).is_contiguous()
                torch.testing.assert_close(got.float(), want, rtol=tolerance, atol=tolerance)
    # a mask of -inf (not the dtype's most negative value) over a whole block of slots for some rows
    q, k, v = (torch.randn(1, 4, 6, 16, generator=g), torch.randn(1, 2, 200, 16, generator=g),
               torch.randn(1, 2, 200, 16, generator=g))
    mask = torch.zeros(1, 1, 6, 200)
    mask[:, :, :3, :100] = float("-inf")
    torch.testing.assert_close(split_attention(q, k, v, mask, 0.25, 3), _reference(q, k, v, mask, 0.25),
                               rtol=1e-5, atol=1e-5)
    # more pieces than a merging program holds for a head of 128 (64): capped, one row a merging program
    q, k, v = (torch.randn(1, 2, 3, 128, generator=g), torch.randn(1, 1, 5000, 128, generator=g),
               torch.randn(1, 1, 5000, 128, generator=g))
    mask = torch.zeros(1, 1, 3, 5000)
    mask[:, :, 1:, 4000:] = float("-inf")
    for tuning in (None, SplitTuning(fused_merge=1)):
        torch.testing.assert_close(split_attention(q, k, v, mask, 0.1, 100, tuning=tuning),
                                   _reference(q, k, v, mask, 0.1), rtol=1e-5, atol=1e-5)
    try:
        split_attention(q, k, v, mask.bool(), 1.0)
    except ValueError as error:
        assert "float mask [B, 1, T, W]" in str(error)
    else:
        raise AssertionError("a bool mask was taken")


def test_tuning_is_parsed_from_its_text_and_bad_fields_are_named():
    from ppd.decoding.split_attention import SplitTuning

    tuning = SplitTuning.parse("per_processor=4, block_n=32")
    assert tuning == SplitTuning(per_processor=4, block_n=32) and SplitTuning.parse(tuning.text()) == tuning
    assert SplitTuning.parse("") == SplitTuning()
    assert SplitTuning.parse(" warps = 8 ,") == SplitTuning(warps=8)
    assert SplitTuning.parse("fused_merge=1").fused_merge == 1
    # names and values it cannot take, and launch options Triton's kernel cannot run with
    for bad in ("blocks=3", "block_n=0", "warps=two", "stages", "block_n=48", "block_n=8", "warps=3", "stages=0",
                "block_m=8", "block_m=96", "fused_merge=2"):
        with pytest.raises(ValueError, match="PPD_SPLIT_TUNING"):
            SplitTuning.parse(bad)


def test_pieces_fill_whole_waves_of_programs():
    """At most ``per_processor`` programs a processor (never a few past a wave), at least one piece, and no piece
    shorter than ``min_piece`` where the width is what limits them."""
    from ppd.decoding.split_attention import piece_count

    assert piece_count(21, 8448, 132, 2, 256) == 12  # 252 programs of 264, where 13 would make 273
    assert piece_count(48, 8448, 132, 2, 256) == 5  # batch 16: 240, not 288
    assert piece_count(3, 8448, 132, 2, 256) == 33  # the width's limit: 8448 / 256
    assert piece_count(1000, 8448, 132, 2, 256) == 1 and piece_count(21, 100, 132, 2, 256) == 1


def test_a_split_mask_other_than_width_or_tree_is_refused(monkeypatch):
    from ppd.decoding import grouped_attention

    monkeypatch.delenv("PPD_SPLIT_MASK", raising=False)
    assert grouped_attention.split_mask() == "tree"
    monkeypatch.setenv("PPD_GROUPED_SDPA", "split")
    monkeypatch.setenv("PPD_SPLIT_MASK", "compact")
    with pytest.raises(ValueError, match="PPD_SPLIT_MASK must be one of width, tree"):
        grouped_attention.compact_tree_mask([None], torch.device("cpu"))


def _case_kernel_tree_mask():
    """With the rows' lengths the kernel takes the tree's own mask: the prefix seen by every row, the tree block
    as the mask says, and nothing past the tree read (the stale tail holds NaN here, which one read would spread)."""
    from ppd.attention import step_mask, to_additive
    from ppd.decoding.split_attention import SplitTuning, split_attention

    g = torch.Generator().manual_seed(2)
    for batch, heads, key_heads, rows, width, dim, pieces in [
            (3, 6, 2, 5, 300, 16, 0), (2, 9, 3, 30, 700, 64, 3), (2, 4, 2, 7, 520, 8, 5), (1, 3, 1, 40, 257, 16, 2)]:
        q = torch.randn(batch, heads, rows, dim, generator=g)
        k = torch.randn(batch, key_heads, width, dim, generator=g)
        v = torch.randn(batch, key_heads, width, dim, generator=g)
        lengths = torch.randint(1, width - rows, (batch,), generator=g)
        lengths[0] = width - rows  # a row whose tree ends at the last slot
        allowed = (torch.rand(batch, rows, rows, generator=g) < 0.5) | torch.eye(rows, dtype=torch.bool)
        dense = step_mask(allowed, lengths, torch.arange(width), torch.float32)
        stale = torch.arange(width)[None, :] >= (lengths + rows)[:, None]  # [B, W]
        want = _reference(q, k, v, dense, dim ** -0.5)
        k = k.masked_fill(stale[:, None, :, None], float("nan"))
        v = v.masked_fill(stale[:, None, :, None], float("nan"))
        for tuning in (None, SplitTuning(fused_merge=1)):
            got = split_attention(q, k, v, to_additive(allowed[:, None], torch.float32), dim ** -0.5, pieces,
                                  lengths=lengths, tuning=tuning)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    try:
        split_attention(q, k, v, dense, 1.0, lengths=lengths)
    except ValueError as error:
        assert "with lengths [B], [B, 1, T, T]" in str(error)
    else:
        raise AssertionError("a mask over the whole width was taken with lengths")


def _case_tree_pieces_share_a_row():
    """With the rows' lengths, a row's own slots are shared out among the pieces, whatever the width: a short row
    in a wide cache gives every piece slots to read (a finite log-sum-exp), and the merged result is SDPA's, also
    where the pieces merge themselves."""
    from ppd.attention import step_mask, to_additive
    from ppd.decoding import split_kernel
    from ppd.decoding.split_attention import SplitTuning, split_attention

    merged = []
    launch = split_kernel.merge_kernel

    class Watch:  # the merge's launches, with the pieces' log-sum-exp they read
        def __getitem__(self, grid):
            def run(out, lse, *rest, **options):
                merged.append(lse.clone())
                return launch[grid](out, lse, *rest, **options)
            return run

    split_kernel.merge_kernel = Watch()
    g = torch.Generator().manual_seed(3)
    batch, heads, key_heads, rows, width, dim = 3, 4, 2, 8, 1024, 16
    q = torch.randn(batch, heads, rows, dim, generator=g)
    k = torch.randn(batch, key_heads, width, dim, generator=g)
    v = torch.randn(batch, key_heads, width, dim, generator=g)
    lengths = torch.tensor([200, 700, 1016])  # a quarter of the width and less, most of it, all of it
    allowed = (torch.rand(batch, rows, rows, generator=g) < 0.5) | torch.eye(rows, dtype=torch.bool)
    want = _reference(q, k, v, step_mask(allowed, lengths, torch.arange(width), torch.float32), dim ** -0.5)
    got = split_attention(q, k, v, to_additive(allowed[:, None], torch.float32), dim ** -0.5, 4, lengths=lengths)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    (lse,) = merged  # [pieces, B, key heads, folded rows]
    assert lse.shape[0] == 4 and torch.isfinite(lse).all(), lse[:, :, 0, 0]
    # Merged by the pieces' last program instead (no merging kernel); twice, so its counters must be zero again
    for _ in range(2):
        fused = split_attention(q, k, v, to_additive(allowed[:, None], torch.float32), dim ** -0.5, 4,
                                lengths=lengths, tuning=SplitTuning(fused_merge=1))
        torch.testing.assert_close(fused, want, rtol=1e-5, atol=1e-5)
    assert len(merged) == 1


def _case_one_row_keeps_sdpa():
    """A step of one row (the baseline's) keeps SDPA's decoding kernel; a tree step takes the split kernel."""
    from ppd.decoding import grouped_attention, split_attention

    class Layer:
        is_causal, training, num_key_value_groups = True, False, 3

    calls = []
    original = split_attention.split_attention
    split_attention.split_attention = lambda *a, **kw: calls.append(a[0].shape[2]) or original(*a, **kw)
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(1, 2, 300, 16, generator=g), torch.randn(1, 2, 300, 16, generator=g)
    for rows in (1, 4):
        q = torch.randn(1, 6, rows, 16, generator=g)
        mask = torch.zeros(1, 1, rows, 300)
        got, _ = grouped_attention.split_sdpa(Layer(), q, k, v, mask)
        torch.testing.assert_close(got, _reference(q, k, v, mask, 0.25).transpose(1, 2), rtol=1e-5, atol=1e-5)
    assert calls == [4], calls


def _several_pieces():
    """Have the model-level cases cut every cache into several pieces (and merge them), whatever this machine's
    thread count: up to 4 pieces of at least 128 slots."""
    from ppd.decoding import split_attention

    split_attention.piece_count = lambda programs, width, processors, *tuning: max(1, min(4, width // 128))


def _case_dense_step():
    from ppd import Decoder
    from tests.conftest import random_prompt_tokens, random_tree_set, tiny_model
    from tests.test_tree_forward import tree_step_rows

    _several_pieces()
    for arch in ("llama", "qwen2"):
        model = tiny_model(arch, seed=3, max_positions=1024)
        decoder = Decoder(model, random_prompt_tokens(model, n=3, v=2, seed=3), random_tree_set(3, size=10))
        prompt = [(5 * i + 1) % model.config.vocab_size for i in range(LONG)]
        os.environ["PPD_GROUPED_SDPA"] = "split"
        calls = []
        from ppd.decoding import split_attention

        original = split_attention.split_attention
        split_attention.split_attention = lambda *a, **kw: calls.append(a[0].shape) or original(*a, **kw)
        split = [logits.clone() for logits, row, *_ in tree_step_rows(decoder, prompt) if row == 0]
        split_attention.split_attention = original
        assert len(calls) == len(split) * model.config.num_hidden_layers, (len(calls), len(split))
        os.environ["PPD_GROUPED_SDPA"] = "off"
        repeated = [logits.clone() for logits, row, *_ in tree_step_rows(decoder, prompt) if row == 0]
        for a, b in zip(split, repeated, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def _case_decoding():
    from ppd import DecodeConfig, Decoder
    from ppd.decoding import split_attention
    from tests.conftest import random_prompt_tokens, random_tree_set, tiny_model
    from tests.test_decoder import hf_greedy

    os.environ["PPD_GROUPED_SDPA"] = "split"
    _several_pieces()
    seen = []  # each time the kernel runs: query rows, the mask's last dimension, whether lengths came with it
    original = split_attention.split_attention
    split_attention.split_attention = lambda *a, **kw: (
        seen.append((a[0].shape[2], a[3].shape[-1], kw.get("lengths") is not None)) or original(*a, **kw))
    # The tree's own mask where asked for and no layer has a sliding window, else a mask over the whole width.
    for arch, window, mask in (("llama", None, "tree"), ("llama", None, "width"), ("mistral", 200, "tree")):
        os.environ["PPD_SPLIT_MASK"] = mask
        model = tiny_model(arch, seed=9, max_positions=1024, window=window)
        vocab = model.config.vocab_size
        rng = random.Random(9)
        decoder = Decoder(model, random_prompt_tokens(model, 3, 2, seed=9), random_tree_set(9, size=14))
        prompts = [[rng.randrange(vocab) for _ in range(length)] for length in (LONG, 170, 3)]
        config = dict(max_new_tokens=16, stop_on_eos=False)
        seen.clear()
        ppd = decoder.generate(prompts, DecodeConfig(method="ppd", **config))
        base = decoder.generate(prompts, DecodeConfig(method="baseline", **config))
        for prompt, a, b in zip(prompts, ppd, base):
            assert a.token_ids == b.token_ids == hf_greedy(model, prompt, 16)
        assert sum(o.steps for o in ppd) < sum(o.steps for o in base)  # guesses were accepted
        tree_steps = [(rows, width, compact) for rows, width, compact in seen if rows < 100]  # not the prefills
        assert tree_steps and all(compact == (window is None and mask == "tree") and (width == rows) == compact
                                  for rows, width, compact in tree_steps), seen


def _in_interpreter(case: str) -> None:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    env.pop("PPD_GROUPED_SDPA", None)
    env.pop("PPD_SPLIT_MASK", None)
    done = subprocess.run([sys.executable, "-c", f"from tests.test_split_attention import {case}; {case}()"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]


def test_the_kernel_equals_sdpa_in_any_number_of_pieces():
    """Group sizes 1-3, head sizes 8-64 (padded to the kernel's 16 where smaller), 1-5 pieces, a cache view of a
    longer buffer, a row that sees only the last slot: SDPA's result in float32 and float16; a bool mask is
    refused with the shapes it takes."""
    _in_interpreter("_case_kernel")


def test_with_lengths_it_reads_the_tree_mask_and_nothing_past_the_tree():
    _in_interpreter("_case_kernel_tree_mask")


def test_with_lengths_every_piece_takes_a_share_of_the_row_and_pieces_can_merge_themselves():
    _in_interpreter("_case_tree_pieces_share_a_row")


def test_one_row_keeps_sdpa_and_a_tree_takes_the_kernel():
    _in_interpreter("_case_one_row_keeps_sdpa")


def test_a_dense_tree_step_through_it_gives_the_same_logits():
    """Llama and Qwen2 tiny models, a 600-token prompt (several pieces): every tree step of every key calls it in
    every layer and gives the logits of the step through transformers' SDPA with repeated heads."""
    _in_interpreter("_case_dense_step")


def test_decoding_through_it_equals_greedy_generate():
    """PPD through the split kernel, prompts of 600, 170 and 3 tokens in one batch: transformers' greedy tokens,
    in fewer steps than the baseline; a Llama's tree steps hand the kernel the tree's own mask and the lengths
    (the default), a Mistral's with a sliding window the mask over the whole width, as a Llama's do with
    ``PPD_SPLIT_MASK=width``."""
    _in_interpreter("_case_decoding")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled kernel runs on a CUDA GPU")
@pytest.mark.parametrize("capture", ["eager", "compiled_graph"])
@pytest.mark.parametrize("split_mask", ["width", "tree"])
@pytest.mark.parametrize("merge", ["kernel", "fused"])
def test_on_a_gpu_it_equals_sdpa_and_the_captured_step_equals_the_eager_one(capture, split_mask, merge,
                                                                             monkeypatch):
    """bfloat16 against SDPA, also with the pieces merging themselves (the same result call after call); the
    compiled and captured step through it, with either mask, gives the eager step's tokens and transformers' greedy
    ones, 2,000-token prompts among them."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from ppd import Decoder
    from ppd.decoding.split_attention import SplitTuning, split_attention
    from tests.conftest import random_prompt_tokens, random_tree_set
    from tests.test_decoder import assert_captured_equals_eager_and_generate

    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, 9, 130, 64, device="cuda", generator=g, dtype=torch.bfloat16)
    k, v = (torch.randn(2, 3, 8448, 64, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2))
    mask = torch.zeros(2, 1, 130, 8448, device="cuda", dtype=torch.bfloat16)
    mask[..., 8000:] = torch.finfo(torch.bfloat16).min
    want = _reference(q, k, v, mask, 0.125)
    torch.testing.assert_close(split_attention(q, k, v, mask, 0.125).float(), want, rtol=2e-2, atol=2e-2)
    # The pieces merging themselves: the last piece reads what the others wrote on other processors, many times
    # over (a race in that hand-over would show as a wrong or differing result)
    lengths = torch.tensor([8000 - 130, 3000], device="cuda")
    tree_mask = torch.zeros(2, 1, 130, 130, device="cuda", dtype=torch.bfloat16)
    tuned = SplitTuning(fused_merge=1)
    for pieces in (0, 7, 33):
        first = split_attention(q, k, v, mask, 0.125, pieces, tuning=tuned)
        torch.testing.assert_close(first.float(), want, rtol=2e-2, atol=2e-2)
        unfused = split_attention(q, k, v, tree_mask, 0.125, pieces, lengths=lengths)
        for _ in range(20):
            assert torch.equal(split_attention(q, k, v, mask, 0.125, pieces, tuning=tuned), first)
            torch.testing.assert_close(split_attention(q, k, v, tree_mask, 0.125, pieces, lengths=lengths,
                                                       tuning=tuned), unfused, rtol=1e-2, atol=1e-2)

    if merge == "fused" and capture == "eager":
        pytest.skip("the kernel's own checks above cover it eagerly")
    monkeypatch.setenv("PPD_GROUPED_SDPA", "split")
    monkeypatch.setenv("PPD_SPLIT_MASK", split_mask)
    if merge == "fused":  # the module's tuning, which the step reads as it is traced
        from ppd.decoding import split_attention as split_module
        monkeypatch.setattr(split_module, "TUNING", tuned)
    torch.manual_seed(13)
    config = LlamaConfig(vocab_size=256, hidden_size=192, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=4096)
    model = LlamaForCausalLM(config).eval().requires_grad_(False).cuda()
    decoder = Decoder(model, random_prompt_tokens(model, 3, 1, seed=13), random_tree_set(13, size=10),
                      max_seq_len=2100)
    rng = random.Random(13)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (2000, 300, 7)]
    assert_captured_equals_eager_and_generate(decoder, model, prompts, capture)

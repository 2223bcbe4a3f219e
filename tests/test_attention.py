import pytest
import torch

from ppd.attention import (cut_table, layout_tensors, packed_width, prefill_layout, prompt_block_mask,
                           prompt_rows_layout, step_mask, to_additive)


def test_ensemble_mask_is_v_causal_chains():
    # N=2, V=2: rows (token, copy) = (0,0) (0,1) (1,0) (1,1)
    mask = prompt_block_mask(2, 2, "ensemble").int().tolist()
    assert mask == [
        [1, 0, 0, 0],
        [0, 1, 0, 0],
        [1, 0, 1, 0],
        [0, 1, 0, 1],
    ]


def test_ensemble_with_one_copy_is_plain_causal():
    assert torch.equal(prompt_block_mask(3, 1, "ensemble"), torch.tril(torch.ones(3, 3, dtype=torch.bool)))


def test_decoder_mask_is_causal_over_flattened_rows():
    assert torch.equal(prompt_block_mask(2, 2, "decoder"), torch.tril(torch.ones(4, 4, dtype=torch.bool)))


def test_encoder_mask_sees_only_own_token_copies():
    mask = prompt_block_mask(2, 2, "encoder").int().tolist()
    assert mask == [
        [1, 1, 0, 0],
        [1, 1, 0, 0],
        [0, 0, 1, 1],
        [0, 0, 1, 1],
    ]


def test_prefill_layout_hand_checked():
    # Row 0: 3 real tokens, row 1: 1 real token; N=2 prompt tokens, V=1 -> width 3 + 2 = 5.
    allowed, positions = prefill_layout([3, 1], 2, 1, "ensemble")
    assert positions.tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 0, 0]]
    a0 = allowed[0].int().tolist()
    assert a0 == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [1, 1, 1, 1, 0],  # prompt token 1 sees the input and itself
        [1, 1, 1, 1, 1],  # prompt token 2 sees the input and prompt token 1
    ]
    a1 = allowed[1].int().tolist()
    assert a1 == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [0, 0, 0, 1, 0],  # padding sees only itself
        [0, 0, 0, 0, 1],
    ]
    assert positions[1, 1:3].tolist() == [1, 2]  # prompt tokens of row 1 sit at L + k


def test_prefill_layout_shares_positions_across_copies():
    _, positions = prefill_layout([2], 2, 3, "ensemble")
    assert positions[0].tolist() == [0, 1, 2, 2, 2, 3, 3, 3]


def test_step_mask_prefix_tree_and_stale_slots():
    tree = torch.tensor([[1, 0], [1, 1]], dtype=torch.bool)
    mask = step_mask(tree, torch.tensor([2, 0]), torch.arange(5), dtype=torch.float32)
    allowed = (mask == 0)[:, 0].int().tolist()
    assert allowed[0] == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0]]
    assert allowed[1] == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0]]
    assert mask.min() == torch.finfo(torch.float32).min


def test_step_mask_takes_one_tree_per_batch_row():
    chain = torch.tensor([[1, 0], [1, 1]], dtype=torch.bool)
    apart = torch.eye(2, dtype=torch.bool)
    mask = step_mask(torch.stack([chain, apart]), torch.tensor([1, 1]), torch.arange(4), dtype=torch.float32)
    allowed = (mask == 0)[:, 0].int().tolist()
    assert allowed[0] == [[1, 1, 0, 0], [1, 1, 1, 0]]
    assert allowed[1] == [[1, 1, 0, 0], [1, 0, 1, 0]]


def test_to_additive_keeps_dtype():
    mask = to_additive(torch.tensor([True, False]), torch.bfloat16)
    assert mask.dtype == torch.bfloat16 and mask[0] == 0 and mask[1] < -1e30


@pytest.mark.parametrize("attention_type", ["ensemble", "decoder", "encoder"])
def test_prompt_rows_layout_is_the_packed_layouts_prompt_slots(attention_type):
    """The two-pass forward's second pass: prompt row j of batch row b sees, among the first ``width`` slots, what
    the packed layout's slot ``L_b + j`` sees there of the real tokens, and among the prompt rows what that slot
    sees of slots ``L_b + j'``; rows past a row's cuts see only themselves; positions are the layout's."""
    generator = torch.Generator().manual_seed(11)
    for _ in range(40):
        draw = lambda low, high: int(torch.randint(low, high, (1,), generator=generator))  # noqa: E731
        n, v, batch = draw(1, 4), draw(1, 3), draw(1, 4)
        lengths = [draw(1, 20) for _ in range(batch)]
        cuts = [sorted({draw(1, length + 1) for _ in range(draw(0, 4))}) for length in lengths]
        cuts[0] = cuts[0] or [lengths[0]]
        width = packed_width(lengths, [len(row) for row in cuts], n * v, draw(1, 9))
        args = (torch.tensor(lengths), torch.tensor(cut_table(cuts)), torch.tensor([len(row) for row in cuts]),
                width, n, v, attention_type)
        allowed, positions = layout_tensors(*args)
        rows_allowed, rows_positions = prompt_rows_layout(*args)
        rows = rows_allowed.shape[1]
        assert rows == max(len(row) for row in cuts) * n * v and rows_allowed.shape[2] == width + rows
        for b, (length, row_cuts) in enumerate(zip(lengths, cuts)):
            for j in range(rows):
                if j >= len(row_cuts) * n * v:  # padding: itself only
                    assert rows_allowed[b, j].nonzero().flatten().tolist() == [width + j]
                    continue
                slot = length + j
                assert torch.equal(rows_allowed[b, j, :length], allowed[b, slot, :length])
                assert not rows_allowed[b, j, length:width].any()  # the first pass's slots past the real tokens
                mine = slice(length, length + len(row_cuts) * n * v)
                assert torch.equal(rows_allowed[b, j, width: width + mine.stop - length], allowed[b, slot, mine])
                assert not rows_allowed[b, j, width + mine.stop - length:].any()
                assert rows_positions[b, j] == positions[b, slot]

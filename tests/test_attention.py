import torch

from ppd.attention import prefill_layout, prompt_block_mask, step_mask, to_additive


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

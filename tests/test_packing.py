"""Many cuts of one sequence in one forward: the same losses and gradients as each cut trained alone."""

from __future__ import annotations

import pytest
import torch

from ppd.attention import packed_layout, packed_width, prefill_layout
from ppd.training import (HostCuts, Objective, PackedCuts, PromptTokenCollator, PromptTokenModel, column_values,
                          heldout_split)

from .conftest import random_prompt_tokens, tiny_model

VOCAB = 40
TOP_K = 6


def _targets(generator, cuts: int, n: int) -> dict:
    """Teacher-like targets for ``cuts`` examples: top-k ids and log-probabilities normalised below 1."""
    ids = torch.stack([torch.randperm(VOCAB, generator=generator)[:TOP_K] for _ in range(cuts * n)])
    logprobs = torch.log_softmax(torch.randn(cuts * n, TOP_K + 1, generator=generator), -1)[:, :TOP_K]
    labels = torch.randint(VOCAB, (cuts, n + 1), generator=generator)
    return {"teacher_topk_ids": ids.reshape(cuts, n, TOP_K), "teacher_topk_logprobs": logprobs.reshape(cuts, n, TOP_K),
            "labels": labels}


def _loss_and_grad(model: PromptTokenModel, batch: dict, per_example: bool = False):
    """The per-cut losses and the gradient of their mean over every trained tensor (flattened, joined)."""
    weights = list(model.prompt_tokens.tensors().values())
    for weight in weights:
        weight.grad = None
    logits = model.batch_logits(batch)
    losses = model.loss(logits, batch["labels"], batch["teacher_topk_ids"], batch["teacher_topk_logprobs"],
                        per_example=True)
    losses.mean().backward()
    return losses.detach(), torch.cat([w.grad.flatten() for w in weights])


@pytest.mark.parametrize("arch,window,v,attention,objective,deep,rank", [
    ("llama", None, 1, "ensemble", Objective.DISTILLATION, False, 0),
    ("qwen2", None, 2, "ensemble", Objective.DISTILLATION, False, 0),
    ("mistral", 9, 2, "decoder", Objective.CROSS_ENTROPY, False, 0),
    ("llama", None, 2, "ensemble", Objective.DISTILLATION, True, 0),
    ("qwen2", 9, 1, "ensemble", Objective.CROSS_ENTROPY, True, 0),
    ("llama", None, 2, "ensemble", Objective.DISTILLATION, True, 3),
])
def test_packed_cuts_give_the_losses_and_gradients_of_single_cuts(arch, window, v, attention, objective, deep, rank):
    model = tiny_model(arch, vocab=VOCAB, window=window)
    n = 3
    tokens = random_prompt_tokens(model, n=n, v=v, attention=attention, seed=1, deep=deep, rank=rank)
    trainer = PromptTokenModel(model, tokens, objective)
    generator = torch.Generator().manual_seed(0)
    sequences = [torch.randint(VOCAB, (37,), generator=generator).tolist(),
                 torch.randint(VOCAB, (21,), generator=generator).tolist()]
    cuts = [[4, 12, 13, 30, 37], [1, 21]]
    total = sum(len(c) for c in cuts)
    targets = _targets(generator, total, n)

    features, singles, i = [], [], 0
    for seq, row in zip(sequences, cuts):
        features.append({"input_ids": seq[: max(row)], "cut_lengths": row,
                         **{k: v[i: i + len(row)].tolist() for k, v in targets.items()}})
        for c in row:
            singles.append({"input_ids": seq[:c], **{k: v[i].tolist() for k, v in targets.items()}})
            i += 1
    collate = PromptTokenCollator()
    packed_losses, packed_grad = _loss_and_grad(trainer, collate(features))
    # Without the collator's host lists the model reads the batch back from its tensors: the same cuts.
    read_back = {k: v for k, v in collate(features).items() if k != "host"}
    read_back_losses, read_back_grad = _loss_and_grad(trainer, read_back)
    trainer.width_multiple = 16  # padded to a multiple of 16 slots (as on a GPU): nothing changes
    padded_losses, padded_grad = _loss_and_grad(trainer, collate(features))
    trainer.width_multiple = 1
    # One cut per forward, and all single cuts in one padded batch: both the same as packed.
    alone = [_loss_and_grad(trainer, collate([s])) for s in singles]
    single_losses = torch.cat([loss for loss, _ in alone])
    single_grad = torch.stack([grad for _, grad in alone]).mean(0)
    batched_losses, batched_grad = _loss_and_grad(trainer, collate(singles))

    torch.testing.assert_close(packed_losses, single_losses, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(batched_losses, single_losses, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(packed_grad, single_grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(read_back_losses, packed_losses, rtol=0, atol=0)
    torch.testing.assert_close(read_back_grad, packed_grad, rtol=0, atol=0)
    torch.testing.assert_close(padded_losses, packed_losses, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(padded_grad, packed_grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(batched_grad, single_grad, rtol=1e-4, atol=1e-6)
    assert packed_grad.abs().sum() > 0


def _saved_bytes(model: PromptTokenModel, batch: dict) -> int:
    """Bytes of the tensors the forward keeps for its backward."""
    saved = []

    def pack(tensor):
        saved.append(tensor.numel() * tensor.element_size())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model.batch_logits(batch)
    return sum(saved)


@pytest.mark.parametrize("arch,window,v,attention,objective,deep,rank", [
    ("llama", None, 1, "ensemble", Objective.DISTILLATION, False, 0),
    ("qwen2", None, 2, "encoder", Objective.DISTILLATION, False, 0),
    ("mistral", 9, 2, "decoder", Objective.CROSS_ENTROPY, False, 0),
    ("qwen2", 9, 1, "ensemble", Objective.CROSS_ENTROPY, True, 0),
    ("llama", None, 2, "ensemble", Objective.DISTILLATION, True, 3),
])
def test_two_passes_give_the_losses_and_gradients_of_one(arch, window, v, attention, objective, deep, rank,
                                                        monkeypatch):
    """The default forward (``ppd.two_pass``: the real tokens without gradients, then the prompt rows against their
    keys and values) gives the one-pass forward's losses and gradients, keeping far less for its backward. Without a
    sliding window its first pass runs SDPA causal, with no mask; with one, over the mask."""
    from ppd import two_pass

    causal_layers = []
    causal = two_pass.causal_sdpa
    monkeypatch.setattr(two_pass, "causal_sdpa", lambda *args, **kwargs: causal_layers.append(1) or causal(*args,
                                                                                                        **kwargs))
    model = tiny_model(arch, vocab=VOCAB, window=window)
    n = 3
    trainer = PromptTokenModel(model, random_prompt_tokens(model, n=n, v=v, attention=attention, seed=2, deep=deep,
                                                           rank=rank), objective)
    generator = torch.Generator().manual_seed(3)
    sequences = [torch.randint(VOCAB, (length,), generator=generator).tolist() for length in (60, 23, 41)]
    cuts = [[2, 17, 18, 59, 60], [23], [5, 40]]
    targets = _targets(generator, sum(len(row) for row in cuts), n)
    features, i = [], 0
    for seq, row in zip(sequences, cuts):
        features.append({"input_ids": seq, "cut_lengths": row, **{k: t[i: i + len(row)].tolist()
                                                                   for k, t in targets.items()}})
        i += len(row)
    batch = PromptTokenCollator()(features)
    assert trainer.two_pass
    two_losses, two_grad = _loss_and_grad(trainer, batch)
    two_saved = _saved_bytes(trainer, batch)
    trainer.two_pass = False
    one_losses, one_grad = _loss_and_grad(trainer, batch)
    one_saved = _saved_bytes(trainer, batch)
    torch.testing.assert_close(two_losses, one_losses, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(two_grad, one_grad, rtol=1e-4, atol=1e-7)
    assert two_grad.abs().sum() > 0
    assert two_saved < one_saved / 2, (two_saved, one_saved)
    assert len(causal_layers) == (0 if window else 2 * model.config.num_hidden_layers)  # the two runs' first passes


def test_gradient_checkpointing_trains_in_one_pass_with_the_same_gradients():
    """transformers drops the cache of a forward whose layers recompute their activations, so a checkpointed model
    runs one pass: the same losses and gradients as the two-pass forward without checkpointing."""
    model = tiny_model("llama", vocab=VOCAB)
    trainer = PromptTokenModel(model, random_prompt_tokens(model, n=3, v=1, seed=6, deep=True, rank=2))
    batch = PromptTokenCollator()([{"input_ids": list(range(1, 30)), "cut_lengths": [3, 17, 29],
                                    **{k: t.tolist()
                                       for k, t in _targets(torch.Generator().manual_seed(7), 3, 3).items()}}])
    expected = _loss_and_grad(trainer, batch)
    trainer.gradient_checkpointing_enable()
    found = _loss_and_grad(trainer, batch)
    torch.testing.assert_close(found[0], expected[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(found[1], expected[1], rtol=1e-4, atol=1e-7)


def test_a_model_ppd_cannot_run_in_pieces_trains_in_one_pass(monkeypatch, caplog):
    from ppd.decoding.step import LanguageModel
    from ppd.decoding.support import UnsupportedModelError

    model = tiny_model("llama", vocab=VOCAB)
    trainer = PromptTokenModel(model, random_prompt_tokens(model, n=2, v=1, seed=4))
    batch = PromptTokenCollator()([{"input_ids": list(range(1, 12)), "cut_lengths": [4, 11],
                                    **{k: t.tolist()
                                       for k, t in _targets(torch.Generator().manual_seed(5), 2, 2).items()}}])
    trainer.two_pass = False
    expected = _loss_and_grad(trainer, batch)

    def refuse(cls, model):
        raise UnsupportedModelError("this model keeps a cache of its own")

    monkeypatch.setattr(LanguageModel, "of", classmethod(refuse))
    fresh = PromptTokenModel(model, trainer.prompt_tokens)
    assert fresh.pieces() is None and "training in one pass: this model keeps a cache of its own" in caplog.text
    found = _loss_and_grad(fresh, batch)
    torch.testing.assert_close(found[0], expected[0], rtol=0, atol=0)
    torch.testing.assert_close(found[1], expected[1], rtol=0, atol=0)


def test_one_cut_at_the_end_is_the_prefill_layout():
    for lengths in ([5], [3, 7, 1]):
        packed = packed_layout(lengths, [[n] for n in lengths], 3, 2, "ensemble")
        plain = prefill_layout(lengths, 3, 2, "ensemble")
        assert all(torch.equal(a, b) for a, b in zip(packed, plain))
    allowed, positions = packed_layout([6], [[2, 6]], 2, 1, "ensemble")
    # block of cut 2 at slots 6, 7 (positions 2, 3): sees tokens 0, 1 and its own earlier rows only
    assert positions[0].tolist() == [0, 1, 2, 3, 4, 5, 2, 3, 6, 7]
    assert allowed[0, 7].nonzero().flatten().tolist() == [0, 1, 6, 7]
    assert allowed[0, 9].nonzero().flatten().tolist() == [0, 1, 2, 3, 4, 5, 8, 9]
    with pytest.raises(ValueError, match="outside a sequence of 6"):
        packed_layout([6], [[7]], 2, 1, "ensemble")


def _rows(ids_and_lengths):
    import datasets

    rows = []
    for conversation, lengths in ids_and_lengths:
        sequence = list(range(100, 100 + max(lengths) + 4))
        for n in lengths:
            rows.append({"id": conversation, "input_ids": sequence[:n], "labels": sequence[n: n + 4]})
    return datasets.Dataset.from_list(rows)


def test_packed_dataset_groups_cuts_by_conversation():
    dataset = _rows([("a", [3, 5, 9]), ("b", [4]), ("c", [2, 6])])
    packed = PackedCuts(dataset)
    assert len(packed) == 3 and packed.num_cuts == 6
    assert packed[0]["cut_lengths"] == [3, 5, 9] and packed[0]["input_ids"] == list(range(100, 109))
    assert [len(g) for g in PackedCuts(dataset, per_forward=2).groups] == [2, 1, 1, 2]
    assert len(PackedCuts(dataset, per_forward=1)) == 6
    batch = PromptTokenCollator()([packed[0], packed[2]])
    assert batch["cut_lengths"].tolist() == [3, 5, 9, 2, 6] and batch["cut_rows"].tolist() == [0, 0, 0, 1, 1]
    assert batch["labels"].shape == (5, 4)
    # the host's copy of the batch (a step builds its layout from it, never reading the tensors back)
    host, read_back = batch["host"], HostCuts.read_back(batch["input_ids"], batch["lengths"], batch["cut_lengths"],
                                                         batch["cut_rows"])
    assert host.sequences == read_back.sequences == [list(range(100, 109)), list(range(100, 106))]
    assert host.cuts == read_back.cuts == [[3, 5, 9], [2, 6]]
    single = PromptTokenCollator()([dataset[0], dataset[3]])["host"]
    assert single.sequences == [[100, 101, 102], [100, 101, 102, 103]] and single.cuts == [[3], [4]]
    broken = dataset.map(lambda row, i: {"input_ids": row["input_ids"][:-1] + [7] if i == 1 else row["input_ids"]},
                         with_indices=True)
    with pytest.raises(ValueError, match="not prefixes of one sequence"):
        PackedCuts(broken)[0]


def test_held_out_split_keeps_conversations_whole():
    dataset = _rows([(f"c{i}", [2, 3, 5][: 1 + i % 3]) for i in range(60)])
    train, held = heldout_split(dataset, 0.2, seed=3)
    assert set(train["id"]).isdisjoint(held["id"]) and len(train) + len(held) == len(dataset)
    assert 4 <= len(set(held["id"])) <= 24
    # A split is a view through an index mapping: its ids are read (as one array) in the split's own order.
    assert column_values(held, "id") == list(held["id"]) and column_values(dataset, "id") == list(dataset["id"])
    assert [held[g.start]["id"] for g in PackedCuts(held).groups] == list(dict.fromkeys(held["id"]))
    # each item's packed width, read from the split's own rows (a captured step captures these widths' buckets)
    for packed in (PackedCuts(held), PackedCuts(held, per_forward=1)):
        items = [packed[i] for i in range(len(packed))]
        assert packed.row_widths(3) == [packed_width([len(x["input_ids"])], [len(x["cut_lengths"])], 3) for x in items]
    assert heldout_split(dataset, 0.2, seed=3)[1]["id"] == held["id"]
    assert heldout_split(dataset, 0.2, seed=4)[1]["id"] != held["id"]
    # The conversations themselves (one row each, some missing) hold out the same ones as their cuts.
    conversations = _rows([(f"c{i}", [5]) for i in range(60) if i % 7])
    assert set(heldout_split(conversations, 0.2, seed=3)[1]["id"]) == set(held["id"]) - {f"c{i}" for i in range(0, 60, 7)}
    assert len(set(heldout_split(dataset, 7, seed=3)[1]["id"])) == 7
    with pytest.raises(ValueError, match="leaves nothing to train on"):
        heldout_split(dataset, 60, seed=3)

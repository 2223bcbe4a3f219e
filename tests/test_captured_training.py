"""The captured training step: batches padded to fixed shapes give the eager step's losses and gradients."""

from __future__ import annotations

import pytest
import torch

from ppd.captured_training import CapturedTrainingStep
from ppd.training import Objective, PromptTokenCollator, PromptTokenModel

from .conftest import random_prompt_tokens, tiny_model
from .test_packing import VOCAB, _targets


def _features(generator, lengths_and_cuts, n: int) -> list[dict]:
    total = sum(len(cuts) for _, cuts in lengths_and_cuts)
    targets = _targets(generator, total, n)
    features, i = [], 0
    for length, cuts in lengths_and_cuts:
        sequence = torch.randint(VOCAB, (length,), generator=generator).tolist()
        features.append({"input_ids": sequence, "cut_lengths": cuts,
                         **{k: v[i: i + len(cuts)].tolist() for k, v in targets.items()}})
        i += len(cuts)
    return features


def _eager(model: PromptTokenModel, batch: dict) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The eager step's loss (the mean over cuts) and gradients."""
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = None
    loss = model(**batch)["loss"]
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in params]


@pytest.mark.parametrize("arch,window,v,objective,deep,rank", [
    ("llama", None, 1, Objective.DISTILLATION, True, 2),
    ("qwen2", None, 2, Objective.CROSS_ENTROPY, False, 0),
    ("mistral", 9, 2, Objective.DISTILLATION, True, 0),
])
def test_padded_step_gives_the_eager_losses_and_gradients(arch, window, v, objective, deep, rank):
    model = tiny_model(arch, vocab=VOCAB, window=window)
    n = 3
    tokens = random_prompt_tokens(model, n=n, v=v, seed=2, deep=deep, rank=rank)
    trainer = PromptTokenModel(model, tokens, objective)
    captured = CapturedTrainingStep(trainer, rows=3, cuts_per_row=5, width_multiple=64)
    generator = torch.Generator().manual_seed(0)
    collate = PromptTokenCollator()
    # a full batch, then one with fewer rows and cuts than the step has room for (padded rows and cuts)
    for shape in ([(37, [4, 12, 13, 30, 37]), (21, [1, 21]), (9, [9])], [(15, [3, 15])]):
        batch = collate(_features(generator, shape, n))
        eager_loss, eager_grads = _eager(trainer, batch)
        for p in captured.params:
            p.grad = None
        cuts = batch["cut_lengths"].numel()
        loss = captured.step(batch, cuts)
        torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=1e-6)
        for grad, param in zip(eager_grads, captured.params):
            torch.testing.assert_close(param.grad, grad, rtol=1e-4, atol=1e-6)
        assert all(g.abs().sum() > 0 for g in eager_grads)
        # a second micro-batch adds to the gradient, as a backward does
        captured.step(batch, cuts)
        for grad, param in zip(eager_grads, captured.params):
            torch.testing.assert_close(param.grad, 2 * grad, rtol=1e-4, atol=1e-6)
        # every .grad is a slice of one buffer (what one all-reduce sums)
        torch.testing.assert_close(captured.grad_buffer(), torch.cat([2 * g.reshape(-1) for g in eager_grads]),
                                   rtol=1e-4, atol=1e-6)
    captured.params[0].grad = captured.params[0].grad.clone()  # a .grad set elsewhere: no single buffer to sum
    assert captured.grad_buffer() is None


def test_a_batch_larger_than_the_step_is_refused():
    model = tiny_model("llama", vocab=VOCAB)
    trainer = PromptTokenModel(model, random_prompt_tokens(model, n=2, v=1))
    captured = CapturedTrainingStep(trainer, rows=1, cuts_per_row=2, width_multiple=16)
    collate = PromptTokenCollator()
    generator = torch.Generator().manual_seed(0)
    with pytest.raises(ValueError, match="a batch of 2 sequences, but the captured step has 1 rows"):
        captured.step(collate(_features(generator, [(5, [5]), (6, [6])], 2)), 2)
    with pytest.raises(ValueError, match="a sequence with 3 cuts, but the captured step has room for 2"):
        captured.step(collate(_features(generator, [(9, [2, 5, 9])], 2)), 3)
    with pytest.raises(ValueError, match="at least 1"):
        CapturedTrainingStep(trainer, rows=0, cuts_per_row=2)


def test_prepare_names_the_buckets_of_the_rows_widest_first():
    model = tiny_model("llama", vocab=VOCAB)
    trainer = PromptTokenModel(model, random_prompt_tokens(model, n=2, v=1))
    captured = CapturedTrainingStep(trainer, rows=2, cuts_per_row=3, width_multiple=16)
    template = PromptTokenCollator()(_features(torch.Generator().manual_seed(0), [(9, [4, 9])], 2))
    assert captured.prepare(template, [5, 16, 17, 40, 33, 12]) == [48, 32, 16]
    assert captured.graphs == {} and captured.captures == []  # no graphs without CUDA


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_replayed_graphs_give_the_eager_step_on_a_gpu():
    model = tiny_model("llama", vocab=VOCAB).cuda()
    tokens = random_prompt_tokens(model, n=3, v=1, seed=3, deep=True, rank=2).cuda()
    trainer = PromptTokenModel(model, tokens)
    captured = CapturedTrainingStep(trainer, rows=2, cuts_per_row=4, width_multiple=32)
    generator = torch.Generator().manual_seed(1)
    collate = PromptTokenCollator()
    batches = [collate(_features(generator, shape, 3)) for shape in
               ([(20, [3, 9, 20]), (11, [11])], [(50, [5, 40, 50, 50])], [(7, [2, 7])])]
    batches = [{k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in b.items()} for b in batches]
    # Both buckets captured before the first step (from the rows' widths), none while stepping
    assert captured.prepare(batches[0], [20 + 3 * 3, 50 + 4 * 3]) == [64, 32]
    assert [width for width, _ in captured.captures] == [64, 32]
    # As DDP does: every tensor's gradient accumulator made on the default stream, and kept (a capture that synced
    # with them would fail)
    accumulators = [t.view_as(t).grad_fn.next_functions[0][0] for t in captured.params]
    for batch in batches + batches[::-1]:  # widths 32, 64, 32, then back: graphs of one pool replayed in any order
        eager_loss, eager_grads = _eager(trainer, batch)
        for p in captured.params:
            p.grad = None
        loss = captured.step(batch, batch["cut_lengths"].numel())
        torch.testing.assert_close(loss, eager_loss, rtol=1e-4, atol=1e-5)
        for grad, param in zip(eager_grads, captured.params):
            torch.testing.assert_close(param.grad, grad, rtol=1e-3, atol=1e-5)
    assert [width for width, _ in captured.captures] == [64, 32]
    assert 0 < captured.replay_seconds() < 60  # the device time of the 6 replays
    gaps = captured.gap_seconds()  # between them: the eager steps run there
    assert len(gaps) == 5 and all(0 < gap < 60 for gap in gaps)
    assert [type(node).__name__ for node in accumulators] == ["AccumulateGrad"] * 4  # embeddings, offsets, maps


def test_compiled_layers_add_the_deep_offsets_inside_their_graph(monkeypatch):
    """``compile_base`` compiles each decoder layer together with the deep prompt tokens' change to its output
    (offsets and low-rank maps): one graph serves every layer in each of the forward's two passes (``ppd.two_pass``:
    the real tokens without gradients, then the prompt rows), the prompt rows' graph holds the offsets' lookup and
    the maps' products, the hooks stand aside while gradients are on (nothing added twice), and losses and gradients
    are the eager model's; without gradients (evaluation) the prompt rows' layers and hooks run eagerly, as before."""
    from ppd import deep_prompts

    model = tiny_model("llama", vocab=VOCAB)
    trainer = PromptTokenModel(model, random_prompt_tokens(model, n=3, v=1, seed=5, deep=True, rank=2))
    batch = PromptTokenCollator()(_features(torch.Generator().manual_seed(1), [(30, [5, 17, 30]), (12, [12])], 3))
    expected_loss, expected_grads = _eager(trainer, batch)
    graphs, calls = [], []

    def backend(graph, example_inputs):  # keeps what dynamo traced, runs it as traced
        graphs.append(graph)
        return graph.forward

    torch._dynamo.reset()
    trainer.compile_base(backend=backend)
    real = deep_prompts.add_to_output
    monkeypatch.setattr(deep_prompts, "add_to_output", lambda *args: calls.append(1) or real(*args))  # the hooks'
    loss, grads = _eager(trainer, batch)
    assert not calls  # with gradients on the hooks stood aside
    with torch.no_grad():
        trainer(**batch)
    assert len(calls) == model.config.num_hidden_layers  # without them, the hooks added the offsets
    assert len(graphs) == 2  # one graph for every layer in each pass
    targets = [[str(node.target) for node in graph.graph.nodes] for graph in graphs]
    with_offsets = [any("embedding" in t for t in found) and sum("matmul" in t for t in found) >= 2
                    for found in targets]
    assert with_offsets == [False, True], targets  # the first pass has no prompt rows
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-6)
    for grad, expected in zip(grads, expected_grads):
        torch.testing.assert_close(grad, expected, rtol=1e-4, atol=1e-6)

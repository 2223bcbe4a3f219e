"""Deep prompt tokens: per-layer offsets (and low-rank maps) at the prompt rows only, trained, saved and loaded."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from ppd.deep_prompts import MAPS_ENV, DeepWeights, decoder_layers, deep_weights, merge_maps, merges_maps
from ppd.prefill import build_prefill
from ppd.prompt_tokens import AdapterMismatchError, PromptTokens
from ppd.training import PromptTokenModel

from .conftest import random_prompt_tokens, tiny_model

BATCH = [[5, 9, 2, 7, 7, 1], [3, 8]]


def _all_logits(trainer: PromptTokenModel, batch=BATCH, merged=False) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of every slot of the prefill forward, and which slots are real tokens (``merged``: the maps merged)."""
    config = trainer.prompt_tokens.config
    inputs = build_prefill(trainer.base_model, batch, trainer.prompt_tokens(), config.num_prompt_tokens,
                           config.num_ensemble, config.attention_type)
    if trainer.layer_offsets is not None:
        table = deep_weights(trainer.prompt_tokens)
        trainer.layer_offsets.set(inputs.prompt_rows, merge_maps(table) if merged else table, merged=merged)
    logits = trainer.base_model(inputs_embeds=inputs.embeds, attention_mask=inputs.mask,
                                position_ids=inputs.positions, use_cache=False).logits
    if trainer.layer_offsets is not None:
        trainer.layer_offsets.set(None, None)
    real = torch.arange(inputs.width)[None, :] < inputs.lengths[:, None]
    return logits, real


@pytest.mark.parametrize("arch,rank", [("llama", 0), ("qwen2", 0), ("mistral", 0), ("llama", 4), ("qwen2", 2)])
def test_zero_offsets_are_the_plain_prompt_tokens_and_real_rows_never_change(arch, rank):
    model = tiny_model(arch)
    deep = random_prompt_tokens(model, n=3, v=2, seed=3, deep=True, rank=rank)
    plain_config = dataclasses.replace(deep.config, deep=False, num_layers=0, map_rank=0)
    plain = PromptTokens(plain_config, deep.embeddings)
    plain_logits, real = _all_logits(PromptTokenModel(model, plain))
    deep_logits, _ = _all_logits(PromptTokenModel(model, deep))
    # real tokens: the base model's own logits, whatever the offsets; prompt rows: moved by them
    torch.testing.assert_close(deep_logits[real], plain_logits[real], rtol=0, atol=0)
    prompt = ~real & (torch.arange(real.shape[1])[None, :] < torch.tensor([6 + 6, 2 + 6])[:, None])
    assert (deep_logits[prompt] - plain_logits[prompt]).abs().amax() > 1e-3
    with torch.no_grad():
        deep.offsets.zero_()
        if rank:  # the maps alone still move the prompt rows; with their up-projection at zero nothing does
            assert (_all_logits(PromptTokenModel(model, deep))[0][prompt] - plain_logits[prompt]).abs().amax() > 1e-3
            deep.map_up.zero_()
    torch.testing.assert_close(_all_logits(PromptTokenModel(model, deep))[0], plain_logits, rtol=0, atol=0)


def test_hooks_are_installed_once_and_act_only_when_told():
    model = tiny_model("llama")
    plain = random_prompt_tokens(model, seed=2)
    expected = PromptTokenModel(model, plain).prompt_logits(torch.tensor([BATCH[0]]), torch.tensor([6]))
    for seed in (2, 3):  # two deep adapters, one after the other, on the same model
        PromptTokenModel(model, random_prompt_tokens(model, seed=seed, deep=True)).prompt_logits(
            torch.tensor([BATCH[0]]), torch.tensor([6]))
    again = PromptTokenModel(model, plain).prompt_logits(torch.tensor([BATCH[0]]), torch.tensor([6]))
    torch.testing.assert_close(again, expected, rtol=0, atol=0)
    assert all(len(layer._forward_hooks) == 1 for layer in decoder_layers(model))
    assert model(input_ids=torch.tensor([BATCH[0]])).logits.isfinite().all()  # a plain forward: nothing added


def test_offsets_train_and_round_trip(tmp_path):
    model = tiny_model("llama")
    tokens = random_prompt_tokens(model, n=2, v=1, seed=4, deep=True)
    trainer = PromptTokenModel(model, tokens)
    logits = trainer.prompt_logits(torch.tensor([BATCH[0]]), torch.tensor([6]))
    logits.logsumexp(-1).sum().backward()
    assert tokens.offsets.grad is not None and tokens.offsets.grad.abs().sum() > 0
    # every layer's offset moves the prompt rows (the last layer's too: it feeds the final norm)
    assert (tokens.offsets.grad.abs().sum((1, 2)) > 0).all()

    tokens.save_pretrained(tmp_path / "deep")
    loaded = PromptTokens.from_pretrained(tmp_path / "deep", model)
    assert loaded.config == tokens.config and loaded.config.deep and loaded.config.num_layers == 2
    assert torch.equal(loaded.offsets, tokens.offsets.detach()) and torch.equal(loaded.embeddings,
                                                                                 tokens.embeddings.detach())
    torch.testing.assert_close(PromptTokenModel(model, loaded).prompt_logits(torch.tensor([BATCH[0]]),
                                                                             torch.tensor([6])), logits.detach())


def test_low_rank_maps_train_round_trip_and_start_as_no_change(tmp_path):
    import json
    model = tiny_model("llama")
    tokens = random_prompt_tokens(model, n=2, v=2, seed=5, deep=True, rank=3)
    trainer = PromptTokenModel(model, tokens)
    logits = trainer.prompt_logits(torch.tensor([BATCH[0]]), torch.tensor([6]))
    logits.logsumexp(-1).sum().backward()
    for name in ("map_down", "map_up"):
        grad = getattr(tokens, name).grad
        assert grad is not None and (grad.abs().sum((1, 2)) > 0).all(), name  # every layer's map learns
    # each prompt row has a map of its own: prompt token 1 (rows 0 and 1, which do not see token 2's rows)
    # trains only its rows' columns of the maps
    tokens.map_up.grad = None
    trainer.prompt_logits(torch.tensor([BATCH[0]]), torch.tensor([6]))[:, 0].logsumexp(-1).sum().backward()
    own = torch.arange(4 * 3) < 2 * 3
    assert tokens.map_up.grad[:, own].abs().sum() > 0 and not tokens.map_up.grad[:, ~own].any()

    tokens.save_pretrained(tmp_path / "maps")
    written = json.loads((tmp_path / "maps" / "ppd_config.json").read_text())
    assert written["format_version"] == 3 and written["map_rank"] == 3
    loaded = PromptTokens.from_pretrained(tmp_path / "maps", model)
    assert loaded.config == tokens.config
    assert torch.equal(loaded.map_down, tokens.map_down.detach()) and torch.equal(loaded.map_up, tokens.map_up.detach())
    torch.testing.assert_close(PromptTokenModel(model, loaded).prompt_logits(torch.tensor([BATCH[0]]),
                                                                             torch.tensor([6])), logits.detach())
    # new maps (the training start) change nothing: up is zero, down random
    fresh = PromptTokens(tokens.config, tokens.embeddings, tokens.offsets)
    assert not fresh.map_up.any() and fresh.map_down.std() > 0
    without = PromptTokens(dataclasses.replace(tokens.config, map_rank=0), tokens.embeddings, tokens.offsets)
    torch.testing.assert_close(PromptTokenModel(model, fresh).prompt_logits(torch.tensor([BATCH[0]]), torch.tensor([6])),
                               PromptTokenModel(model, without).prompt_logits(torch.tensor([BATCH[0]]),
                                                                              torch.tensor([6])), rtol=0, atol=0)
    with pytest.raises(ValueError, match="map_rank=3 needs deep prompt tokens"):
        dataclasses.replace(tokens.config, deep=False)
    from safetensors.torch import save_file
    save_file({k: v.detach() for k, v in tokens.tensors().items() if k != "map_up"},
              str(tmp_path / "maps" / "prompt_tokens.safetensors"))
    with pytest.raises(ValueError, match="holds no 'map_up' tensor"):
        PromptTokens.from_pretrained(tmp_path / "maps")


def test_deep_adapters_refuse_a_model_of_another_depth_and_files_without_offsets(tmp_path):
    model = tiny_model("llama")
    tokens = random_prompt_tokens(model, deep=True)
    tokens.save_pretrained(tmp_path / "deep")
    deeper = tiny_model("llama")
    deeper.config.num_hidden_layers = 3
    with pytest.raises(AdapterMismatchError, match="2 layers of offsets != model's 3 layers"):
        PromptTokens.from_pretrained(tmp_path / "deep", deeper)
    from safetensors.torch import save_file
    save_file({"embeddings": tokens.embeddings.detach()}, str(tmp_path / "deep" / "prompt_tokens.safetensors"))
    with pytest.raises(ValueError, match="holds no 'offsets' tensor"):
        PromptTokens.from_pretrained(tmp_path / "deep")
    with pytest.raises(ValueError, match="offsets have shape"):
        PromptTokens(tokens.config, tokens.embeddings, torch.zeros(1, 3, 32))


def test_plain_adapters_are_still_written_as_format_1(tmp_path):
    import json
    model = tiny_model("llama")
    random_prompt_tokens(model).save_pretrained(tmp_path / "plain")
    random_prompt_tokens(model, deep=True).save_pretrained(tmp_path / "deep")
    plain = json.loads((tmp_path / "plain" / "ppd_config.json").read_text())
    deep = json.loads((tmp_path / "deep" / "ppd_config.json").read_text())
    assert plain["format_version"] == 1 and "deep" not in plain
    assert deep["format_version"] == 2 and deep["deep"] is True and deep["num_layers"] == 2


ON_GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


@pytest.mark.parametrize("capture,rank", [("eager", 0), ("compile", 0), ("compile", 2),
                                          pytest.param("graph", 0, marks=ON_GPU),
                                          pytest.param("compiled_graph", 2, marks=ON_GPU)])
def test_deep_prompt_tokens_decode_losslessly_and_every_step_mode_agrees(capture, rank):
    from ppd.decoder import Decoder
    model = tiny_model("llama")
    if capture in ("graph", "compiled_graph"):  # the offsets as inputs of a captured step
        model = model.cuda()
    tokens = random_prompt_tokens(model, n=3, v=1, seed=1, deep=True, rank=rank)
    decoder = Decoder(model, tokens)
    prompts = [[5, 9, 2, 7, 7, 1, 4, 4], [3, 8, 1], [11]]
    eager = decoder.generate(prompts, max_new_tokens=40, capture="eager")
    ppd = decoder.generate(prompts, max_new_tokens=40, capture=capture)
    baseline = decoder.generate(prompts, method="baseline", max_new_tokens=40, capture=capture)
    assert [o.token_ids for o in ppd] == [o.token_ids for o in baseline]
    assert [o.steps for o in ppd] == [o.steps for o in eager]  # the offsets act in every step mode alike
    assert sum(o.new_tokens - 1 - o.steps for o in ppd) > 0
    # the one-row step after a deep step: no prompt rows, no offsets (the hooks were told so)
    assert decoder.lm.offsets.rows is None


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_merged_maps_move_the_prompt_rows_as_the_low_rank_products_do_and_real_rows_not_at_all(arch):
    model = tiny_model(arch)
    tokens = random_prompt_tokens(model, n=3, v=2, seed=5, deep=True, rank=3)
    trainer = PromptTokenModel(model, tokens)
    with torch.no_grad():
        low_rank, real = _all_logits(trainer)
        merged, _ = _all_logits(trainer, merged=True)
        plain_config = dataclasses.replace(tokens.config, deep=False, num_layers=0, map_rank=0)
        plain, _ = _all_logits(PromptTokenModel(model, PromptTokens(plain_config, tokens.embeddings)))
    torch.testing.assert_close(merged[real], plain[real], rtol=0, atol=0)
    torch.testing.assert_close(merged, low_rank, rtol=1e-4, atol=1e-5)
    table = merge_maps(deep_weights(tokens))
    assert table.merged.shape == (table.down.shape[0], table.down.shape[1], 6 * table.down.shape[1])
    # a table with merged maps still gives the low-rank products unless the forward asks for the merged ones (a
    # prefill's rows are the prompt's tokens, thousands where it is long: the products cost less there)
    rows = torch.tensor([[0, 1, 2]])
    for asked in (False, True):
        trainer.layer_offsets.set(rows, table, merged=asked)
        _, _, down, up, selected, merged_maps = trainer.layer_offsets.layer_inputs(0)
        assert (merged_maps is not None, down is None, up is None, selected is None) == (asked,) * 4
    trainer.layer_offsets.set(None, None)


@pytest.mark.parametrize("capture", ["eager", "compile", pytest.param("compiled_graph", marks=ON_GPU)])
def test_a_decoder_with_merged_maps_is_lossless_and_guesses_as_the_low_rank_one(capture, monkeypatch):
    from ppd.decoder import Decoder
    model = tiny_model("llama")
    if capture == "compiled_graph":
        model = model.cuda()
    tokens = random_prompt_tokens(model, n=3, v=1, seed=1, deep=True, rank=2)
    prompts = [[5, 9, 2, 7, 7, 1, 4, 4], [3, 8, 1], [11]]
    # auto: merged on CUDA only (where a step is bound by its kernels' count, not their arithmetic)
    monkeypatch.delenv(MAPS_ENV, raising=False)
    assert (Decoder(model, tokens).lm.offset_table.merged is not None) == (model.device.type == "cuda")
    monkeypatch.setenv(MAPS_ENV, "low_rank")
    low_rank = Decoder(model, tokens).generate(prompts, max_new_tokens=40, capture=capture)
    monkeypatch.setenv(MAPS_ENV, "merged")
    decoder = Decoder(model, tokens)
    assert decoder.lm.offset_table.merged is not None
    ppd = decoder.generate(prompts, max_new_tokens=40, capture=capture)
    baseline = decoder.generate(prompts, method="baseline", max_new_tokens=40, capture=capture)
    assert [o.token_ids for o in ppd] == [o.token_ids for o in baseline] == [o.token_ids for o in low_rank]
    assert [o.steps for o in ppd] == [o.steps for o in low_rank]
    assert sum(o.new_tokens - 1 - o.steps for o in ppd) > 0  # guesses were accepted: the steps say something
    monkeypatch.setenv(MAPS_ENV, "lowrank")
    with pytest.raises(ValueError, match="PPD_DEEP_MAPS must be low_rank, merged or auto, got 'lowrank'"):
        Decoder(model, tokens)


def test_auto_merges_the_maps_on_cuda_where_a_layer_of_them_stays_small(monkeypatch):
    def table(hidden, rows=3, rank=16, dtype=torch.bfloat16):  # shapes only: meta tensors, nothing allocated
        empty = functools.partial(torch.empty, device="meta", dtype=dtype)
        return DeepWeights(empty(30, 1 + rows, hidden), empty(30, hidden, rows * rank), empty(30, rows * rank, hidden),
                           empty(1 + rows, rows * rank))
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.delenv(MAPS_ENV, raising=False)
    assert merges_maps(cuda, table(576))  # the default model: 2 MB a layer
    assert not merges_maps(cuda, table(2048))  # 25 MB a layer: read whole in every layer of every step
    assert not merges_maps(cuda, table(1536, dtype=torch.float32))  # 28 MB
    assert not merges_maps(cpu, table(576))
    assert not merges_maps(cuda, dataclasses.replace(table(576), down=None, up=None, select=None))  # offsets only
    monkeypatch.setenv(MAPS_ENV, "merged")
    assert merges_maps(cpu, table(2048))
    monkeypatch.setenv(MAPS_ENV, "low_rank")
    assert not merges_maps(cuda, table(576))


def test_hooks_told_about_another_forward_refuse_instead_of_adding_offsets_in_the_wrong_places():
    model = tiny_model("llama")
    trainer = PromptTokenModel(model, random_prompt_tokens(model, deep=True))
    trainer.layer_offsets.set(torch.zeros(1, 4, dtype=torch.long), deep_weights(trainer.prompt_tokens))
    with pytest.raises(RuntimeError, match=r"prompt rows of a \[1, 4\] forward during a \[1, 6\] one"):
        model(input_ids=torch.tensor([BATCH[0]]))
    trainer.layer_offsets.set(None, None)
    model(input_ids=torch.tensor([BATCH[0]]))  # told there are none: the model's own forward


def test_a_backward_writes_each_deep_table_once_not_once_a_layer():
    """Each layer reads its slice of the offsets and maps; the backward must not build a table-sized gradient for
    every layer and add them up (what indexing each layer's slice did: a fixed cost in every training step)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    layers = 6
    model = tiny_model("llama", layers=layers)
    trainer = PromptTokenModel(model, random_prompt_tokens(model, n=3, v=1, seed=1, deep=True, rank=2))
    table = deep_weights(trainer.prompt_tokens)
    shapes = {tuple(t.shape) for t in (table.offsets, table.down, table.up)}
    logits, real = _all_logits(trainer)

    class TableSized(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and tuple(out.shape) in shapes:
                self.ops.append(func.overloadpacket.__name__)
            return out

    with TableSized() as mode:
        logits[~real].sum().backward()
    grads = [p.grad for p in trainer.prompt_tokens.tensors().values()]
    assert all(g is not None and g.abs().sum() > 0 for g in grads)
    assert len(mode.ops) < layers, mode.ops  # a few for the three tables, not one or two per layer and table

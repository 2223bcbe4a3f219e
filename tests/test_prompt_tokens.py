import json
import logging

import pytest
import torch
from safetensors.torch import load_file

from ppd import AdapterMismatchError, PromptTokenConfig, PromptTokens
from ppd.prompt_tokens import CONFIG_NAME, WEIGHTS_NAME
from tests.conftest import random_prompt_tokens, tiny_model


def test_save_load_round_trip(tmp_path):
    model = tiny_model()
    tokens = random_prompt_tokens(model, n=4, v=2, attention="decoder")
    tokens.save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [CONFIG_NAME, WEIGHTS_NAME]
    loaded = PromptTokens.from_pretrained(tmp_path, model)
    assert loaded.config == tokens.config
    assert torch.equal(loaded.embeddings, tokens.embeddings)
    raw = (tmp_path / CONFIG_NAME).read_text()
    assert list(json.loads(raw)) == sorted(json.loads(raw))  # sorted keys
    assert set(load_file(str(tmp_path / WEIGHTS_NAME))) == {"embeddings"}


def test_mismatched_model_is_a_clear_error(tmp_path):
    random_prompt_tokens(tiny_model()).save_pretrained(tmp_path)
    other = tiny_model(vocab=40)
    with pytest.raises(AdapterMismatchError, match="vocabulary size 24 != model's 40"):
        PromptTokens.from_pretrained(tmp_path, other)


def test_unknown_config_keys_are_dropped_with_a_warning(tmp_path, caplog):
    random_prompt_tokens(tiny_model()).save_pretrained(tmp_path)
    config = json.loads((tmp_path / CONFIG_NAME).read_text())
    config["from_the_future"] = 1
    (tmp_path / CONFIG_NAME).write_text(json.dumps(config))
    with caplog.at_level(logging.WARNING):
        PromptTokens.from_pretrained(tmp_path)
    assert "from_the_future" in caplog.text


def test_missing_or_broken_adapter_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a ppd adapter"):
        PromptTokens.from_pretrained(tmp_path)
    random_prompt_tokens(tiny_model()).save_pretrained(tmp_path)
    (tmp_path / CONFIG_NAME).write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        PromptTokens.from_pretrained(tmp_path)


def test_shape_must_match_config():
    with pytest.raises(ValueError, match=r"config expects \[6, 8\]"):
        PromptTokens(PromptTokenConfig(num_prompt_tokens=3, num_ensemble=2, hidden_size=8), torch.zeros(3, 8))


def test_init_from_text_uses_word_embeddings(real_model):
    model, tokenizer, info = real_model
    tokens = PromptTokens.from_text(model, tokenizer, PromptTokenConfig(num_prompt_tokens=3, num_ensemble=2))
    ids = tokenizer("Next 2 word", add_special_tokens=False)["input_ids"]
    table = model.get_input_embeddings().weight
    for row in range(6):
        assert torch.equal(tokens.embeddings[row], table[ids[row % len(ids)]].float())
    assert tokens.config.hidden_size == 576 and tokens.config.vocab_size == 49152
    assert tokens.config.base_model == info.model_id


def test_shipped_adapter_and_its_device_trees_are_used_by_default():
    import argparse

    from ppd.cli import load_decoder
    from ppd.models import resolve_dtype
    from ppd.prompt_tokens import packaged_adapter
    from ppd.tree import TreeSet

    shipped = packaged_adapter("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert shipped is not None and (shipped / "README.md").is_file()
    for device_type in ("cpu", "cuda"):
        trees = TreeSet.for_adapter(shipped, device_type)
        assert trees is not None and trees.num_prompt_tokens == 3
    assert TreeSet.for_adapter(shipped, "mps") is None
    args = argparse.Namespace(model="smollm2-135m-instruct", device="cpu", dtype=None, adapter=None, tree=None)
    loaded = load_decoder(args)
    # The tree for this CPU's default dtype where the adapter ships one (tree_cpu_float32.json), else tree_cpu.json.
    dtype = str(resolve_dtype(None, torch.device("cpu"))).removeprefix("torch.")
    expected = TreeSet.adapter_file(shipped, "cpu", dtype)
    assert expected.name in (f"tree_cpu_{dtype}.json", "tree_cpu.json")
    assert loaded.adapter == "shipped:smollm2-135m-instruct" and loaded.tree.endswith(expected.name)
    assert loaded.decoder.trees == TreeSet.for_adapter(shipped, "cpu", dtype)


def test_a_tree_for_the_dtype_comes_before_the_device_tree(tmp_path):
    from ppd.tree import Tree, TreeSet

    device_tree = TreeSet(1, 2, {1: Tree(((0,),), (1,), 1)})
    bf16_tree = TreeSet(1, 2, {1: Tree(((0,), (1,)), (1, 1), 1)})
    device_tree.save(tmp_path / "tree_cuda.json")
    bf16_tree.save(tmp_path / "tree_cuda_bfloat16.json")
    assert TreeSet.for_adapter(tmp_path, "cuda", "bfloat16") == bf16_tree
    assert TreeSet.for_adapter(tmp_path, "cuda", "float32") == device_tree
    assert TreeSet.for_adapter(tmp_path, "cuda") == device_tree


def test_non_finite_prompt_tokens_are_refused_on_load_and_save(tmp_path):
    model = tiny_model()
    tokens = random_prompt_tokens(model)
    tokens.save_pretrained(tmp_path)
    weights = load_file(str(tmp_path / WEIGHTS_NAME))["embeddings"]
    weights[2, 5] = float("nan")  # one damaged value is enough to corrupt every real row of a forward
    from safetensors.torch import save_file
    save_file({"embeddings": weights}, str(tmp_path / WEIGHTS_NAME))
    with pytest.raises(ValueError, match="holds 1 of 96 prompt-token values that are not finite"):
        PromptTokens.from_pretrained(tmp_path, model)
    with torch.no_grad():
        tokens.embeddings[0, 0] = float("inf")
    with pytest.raises(ValueError, match="refusing to save"):
        tokens.save_pretrained(tmp_path / "out")
    assert not (tmp_path / "out" / WEIGHTS_NAME).exists()


def test_a_truncated_weights_file_is_named(tmp_path):
    random_prompt_tokens(tiny_model()).save_pretrained(tmp_path)
    path = tmp_path / WEIGHTS_NAME
    path.write_bytes(path.read_bytes()[:40])
    with pytest.raises(ValueError, match=f"{WEIGHTS_NAME} cannot be read as a safetensors file"):
        PromptTokens.from_pretrained(tmp_path)

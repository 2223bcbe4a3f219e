"""`train.train` on the real default model (CPU, a few steps on short real ShareGPT examples)."""

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import datasets
import pytest
import torch
from safetensors.torch import load_file

import train.train as train
from data_gen import generate
from ppd import Decoder, DecodeConfig, PromptTokens, eos_ids_of
from ppd.chat import chat_input_ids
from ppd.dataset_info import PPDDatasetInfo
from ppd.training import PromptTokenModel
from train.trainer import LaggedChecks, NonFiniteError, PromptTokenTrainer

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def datasets_dir(tmp_path_factory):
    """A truncated and a distillation dataset of short real ShareGPT examples, and a truncated one with 4 cuts
    per conversation (``cuts4``)."""
    root = tmp_path_factory.mktemp("train-data")
    common = ["--max_samples", "240", "--model_max_length", "96", "--shard_size", "240"]
    assert generate.main(["--dataset_type", "finetune", "--output_path", str(root / "ft"), *common]) == 0
    assert generate.main(["--dataset_type", "distillation", "--data_path", str(root / "ft"), "--top_k", "20",
                          "--output_path", str(root / "distill"), "--shard_size", "240"]) == 0
    assert generate.main(["--dataset_type", "finetune", "--output_path", str(root / "cuts4"), "--max_samples", "60",
                          "--model_max_length", "96", "--cuts_per_conversation", "4", "--shard_size", "60"]) == 0
    return root


def run_train(datasets_dir, output, *extra, dataset="distill"):
    argv = ["--dataset_path", str(datasets_dir / dataset), "--output_dir", str(output),
            "--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "8", "--learning_rate", "1e-2",
            "--lr_scheduler_type", "cosine", "--logging_steps", "1", "--eval_size", "24", "--seed", "0",
            "--dataloader_pin_memory", "false", *extra]
    assert train.main(argv) == 0
    return json.loads((Path(output) / "training_log.json").read_text())


def test_a_few_steps_lower_the_held_out_loss(datasets_dir, tmp_path):
    log = run_train(datasets_dir, tmp_path / "run", "--max_steps", "8")
    assert log["final_eval"]["eval_loss"] < log["initial_eval"]["initial_loss"] - 0.3
    assert len(log["rank_accuracy"]) == 3 and len(log["rank_accuracy"][0]) == 10
    assert {"eval_top1_token1", "eval_top5_token3"} <= set(log["final_eval"])
    assert log["dataset"]["eval_examples"] == 24 and log["prompt_tokens"]["base_model"].startswith("HuggingFaceTB")


def test_deep_prompt_tokens_with_low_rank_maps_train_from_the_command_line(datasets_dir, tmp_path):
    log = run_train(datasets_dir, tmp_path / "deep", "--max_steps", "8", "--deep", "--map_rank", "2",
                    "--map_learning_rate", "1e-3")
    assert log["final_eval"]["eval_loss"] < log["initial_eval"]["initial_loss"] - 0.3
    tokens = PromptTokens.from_pretrained(tmp_path / "deep")
    assert tokens.config.deep and tokens.config.num_layers == 30 and log["prompt_tokens"]["deep"]
    assert tokens.config.map_rank == 2 and log["prompt_tokens"]["map_rank"] == 2
    assert (tokens.offsets.abs().sum((1, 2)) > 0).all()  # every layer's offset was trained
    assert (tokens.map_up.abs().sum((1, 2)) > 0).all()  # and every layer's map


def test_the_low_rank_maps_get_their_own_learning_rate(tmp_path):
    from transformers import TrainingArguments
    from .conftest import random_prompt_tokens, tiny_model
    model = tiny_model("llama")
    tokens = random_prompt_tokens(model, deep=True, rank=2)
    args = TrainingArguments(output_dir=str(tmp_path), learning_rate=1e-2, report_to=[], use_cpu=True)
    for map_lr, expected in ((3e-4, {1e-2: 2, 3e-4: 2}), (None, {1e-2: 4})):
        trainer = PromptTokenTrainer(model=PromptTokenModel(model, tokens), args=args, map_learning_rate=map_lr)
        optimizer = trainer.create_optimizer()
        counts = {}
        for group in optimizer.param_groups:
            counts[group["lr"]] = counts.get(group["lr"], 0) + len(group["params"])
        assert counts == expected
        maps = {id(tokens.map_down), id(tokens.map_up)}
        assert all(group["lr"] == (map_lr or 1e-2) for group in optimizer.param_groups
                   if any(id(p) in maps for p in group["params"]))
    with pytest.raises(SystemExit):
        train.main(["--dataset_path", str(tmp_path), "--output_dir", str(tmp_path / "o"), "--map_rank", "2"])


def test_only_prompt_tokens_get_gradients(real_model):
    model, tokenizer, info = real_model
    from ppd import PromptTokenConfig

    tokens = PromptTokens.from_text(model, tokenizer, PromptTokenConfig(base_model=info.model_id))
    wrapped = PromptTokenModel(model, tokens, "cross_entropy")
    assert [name for name, _ in wrapped.named_parameters()] == ["prompt_tokens.embeddings"]
    assert list(wrapped.state_dict()) == ["prompt_tokens.embeddings"]
    ids = torch.tensor([[5, 6, 7, 8, 9], [11, 12, 13, 0, 0]])
    out = wrapped(ids, torch.tensor([5, 3]), labels=torch.tensor([[1, 2, 3, 4], [4, 3, 2, 1]]))
    out["loss"].backward()
    assert tokens.embeddings.grad is not None and tokens.embeddings.grad.abs().sum() > 0
    assert all(not p.requires_grad and p.grad is None for p in model.parameters())


def test_resume_from_a_checkpoint_equals_an_uninterrupted_run(datasets_dir, tmp_path):
    run_train(datasets_dir, tmp_path / "full", "--max_steps", "6", "--save_steps", "3", "--eval_size", "0")
    interrupted = tmp_path / "resumed"
    interrupted.mkdir()
    # As if the run had stopped right after its first checkpoint.
    shutil.copytree(tmp_path / "full" / "checkpoint-3", interrupted / "checkpoint-3")
    run_train(datasets_dir, interrupted, "--max_steps", "6", "--save_steps", "3", "--eval_size", "0",
              "--resume_from_checkpoint", "latest")
    full = load_file(str(tmp_path / "full" / "prompt_tokens.safetensors"))["embeddings"]
    resumed = load_file(str(interrupted / "prompt_tokens.safetensors"))["embeddings"]
    third = load_file(str(tmp_path / "full" / "checkpoint-3" / "prompt_tokens.safetensors"))["embeddings"]
    assert not torch.equal(full, third)  # training moved on after the checkpoint
    torch.testing.assert_close(resumed, full, atol=1e-6, rtol=0)


def test_packed_cuts_train_every_cut_of_a_conversation(datasets_dir, tmp_path):
    data = datasets_dir / "cuts4"
    log = run_train(datasets_dir, tmp_path / "run", "--max_steps", "4", "--trainer_type", "cross_entropy",
                    "--eval_size", "5", dataset="cuts4")
    rows = len(datasets.load_from_disk(str(data)))
    assert log["dataset"]["train_examples"] + log["dataset"]["eval_examples"] == rows
    assert log["dataset"]["train_sequences"] < log["dataset"]["train_examples"]
    # 4 steps of 4 conversations, each trained on all of its cuts in one forward
    assert 4 * 4 < log["throughput"]["examples"] <= 4 * 4 * 4
    assert log["final_eval"]["eval_loss"] < log["initial_eval"]["initial_loss"]
    # two datasets mixed: every example of both, the second one made for more prompt tokens than trained
    more = tmp_path / "cuts2-n4"
    assert generate.main(["--dataset_type", "finetune", "--output_path", str(more), "--max_samples", "20",
                          "--model_max_length", "96", "--cuts_per_conversation", "2", "--num_prompt_tokens", "4",
                          "--shard_size", "20"]) == 0
    mixed = run_train(tmp_path, tmp_path / "mixed", "--max_steps", "2", "--trainer_type", "cross_entropy",
                      "--eval_size", "0", "--dataset_path", str(data), str(more))
    assert mixed["dataset"]["train_examples"] == rows + len(datasets.load_from_disk(str(more)))
    assert len(mixed["dataset"]["info"]) == 2


def test_trained_adapter_decodes_losslessly(datasets_dir, tmp_path, real_model):
    model, tokenizer, _ = real_model
    run_train(datasets_dir, tmp_path / "run", "--max_steps", "4", "--eval_size", "0")
    tokens = PromptTokens.from_pretrained(tmp_path / "run", model)
    checkpoint_tokens = PromptTokens.from_pretrained(tmp_path / "run" / "checkpoint-4", model)
    assert torch.equal(tokens.embeddings, checkpoint_tokens.embeddings)
    decoder = Decoder(model, tokens, eos_token_ids=eos_ids_of(model, tokenizer))
    ids = chat_input_ids(tokenizer, [{"role": "user", "content": "List three uses of copper."}])
    ppd = decoder.generate(ids, DecodeConfig(max_new_tokens=48))
    baseline = decoder.generate(ids, DecodeConfig(max_new_tokens=48, method="baseline"))
    assert ppd.token_ids == baseline.token_ids and ppd.new_tokens == 48


def test_reference_flags_parse(datasets_dir, tmp_path):
    reference = ["--model_name_or_path", "smollm2-135m-instruct", "--dataset_path", str(datasets_dir / "distill"),
                 "--output_dir", str(tmp_path), "--num_train_epochs", "1", "--save_steps", "500",
                 "--model_max_length", "2048", "--num_special_tokens", "3", "--virtual_tokens_per_special_token", "1",
                 "--per_device_train_batch_size", "1", "--per_device_eval_batch_size", "1",
                 "--gradient_accumulation_steps", "4", "--evaluation_strategy", "no", "--learning_rate", "1e-2",
                 "--weight_decay", "0.0", "--warmup_ratio", "0.0", "--lr_scheduler_type", "cosine",
                 "--logging_steps", "10", "--load_in_4bit", "--vt_attention_type", "ensemble",
                 "--trainer_type", "distillation_trainer"]
    argv = train.translate_reference_flags(reference)
    model_args, data_args, pt_args, training_args = train.make_parser().parse_args_into_dataclasses(args=argv)
    assert model_args.load_in_4bit and pt_args.objective.value == "distillation"
    assert (pt_args.num_prompt_tokens, pt_args.num_ensemble, data_args.model_max_length) == (3, 1, 2048)
    assert training_args.eval_strategy == "no" and training_args.gradient_accumulation_steps == 4


def test_bad_pairings_are_clear_errors(datasets_dir, tmp_path, capsys):
    base = ["--output_dir", str(tmp_path / "x"), "--max_steps", "1"]
    assert train.main(["--dataset_path", str(datasets_dir / "ft"), *base]) == 1
    assert "without teacher targets" in capsys.readouterr().err
    assert train.main(["--dataset_path", str(tmp_path / "data.pt"), *base]) == 1
    assert "torch pickles" in capsys.readouterr().err
    assert train.main(["--dataset_path", str(datasets_dir / "distill"), "--num_prompt_tokens", "4", *base]) == 1
    assert "targets for 3 prompt tokens" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train.main(["--dataset_path", str(datasets_dir / "distill"), "--trainer_type", "magic", *base])


def test_cross_entropy_on_a_truncated_dataset_and_fewer_prompt_tokens(datasets_dir, tmp_path):
    log = run_train(datasets_dir, tmp_path / "ce", "--max_steps", "2", "--trainer_type", "cross_entropy",
                    "--num_prompt_tokens", "2", "--num_ensemble", "2", "--vt_attention_type", "decoder",
                    dataset="ft")
    assert log["objective"] == "cross_entropy" and log["prompt_tokens"]["num_ensemble"] == 2
    assert len(log["rank_accuracy"]) == 2


def test_base_adapter_is_merged_before_training(tmp_path):
    from peft import LoraConfig, get_peft_model

    from tests.conftest import tiny_model

    folder, lora = tmp_path / "base", tmp_path / "lora"
    base = tiny_model()
    base.save_pretrained(folder)
    from ppd import load_tokenizer

    load_tokenizer("smollm2-135m-instruct").save_pretrained(folder)
    peft_model = get_peft_model(tiny_model(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_()
    peft_model.save_pretrained(lora)
    expected = peft_model.merge_and_unload().state_dict()
    model_args = train.ModelArguments(model_name_or_path=str(folder), base_adapter=str(lora))
    merged, _, _ = train.load_base(model_args, torch.device("cpu"), gradient_checkpointing=False)
    q = "model.layers.0.self_attn.q_proj.weight"
    torch.testing.assert_close(merged.state_dict()[q], expected[q])
    assert not torch.allclose(merged.state_dict()[q], base.state_dict()[q])
    assert all(not p.requires_grad for p in merged.parameters())


def test_two_processes_train_and_evaluate_as_one(datasets_dir, tmp_path):
    # Two processes with 2 conversations each train what one process with 4 does: the loss divides by the cuts
    # of the whole step across processes and micro-batches. Packed cuts give each process's batch its own number of cuts (which
    # also stalled the Trainer's own evaluation loop under NCCL), and 11 held-out conversations do not split
    # evenly over two processes.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    flags = ["--trainer_type", "cross_entropy", "--eval_size", "11", "--per_device_eval_batch_size", "3",
             "--seed", "0", "--max_steps", "3", "--learning_rate", "0.3", "--lr_scheduler_type", "cosine",
             "--optim", "sgd", "--cuts_per_forward", "3"]  # SGD: the gradient's scale counts too
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "train.train",
           "--dataset_path", str(datasets_dir / "cuts4"), "--output_dir", str(tmp_path / "ddp"),
           "--per_device_train_batch_size", "2", "--dataloader_pin_memory", "false", *flags]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = json.loads((tmp_path / "ddp" / "training_log.json").read_text())
    assert log["world_size"] == 2 and log["train_metrics"]["train_samples_per_second"] > 0
    alone = run_train(datasets_dir, tmp_path / "one", *flags, dataset="cuts4")  # 4 conversations a step
    assert alone["world_size"] == 1 and alone["throughput"]["examples"] == log["throughput"]["examples"]
    assert log["final_eval"]["eval_loss"] < log["initial_eval"]["initial_loss"] - 0.1  # the 3 steps moved them
    # So does one process accumulating two micro-batches of 2.
    run_train(datasets_dir, tmp_path / "accumulated", *flags, "--per_device_train_batch_size", "2",
              "--gradient_accumulation_steps", "2", dataset="cuts4")
    two, one, accumulated = (load_file(str(tmp_path / run / "prompt_tokens.safetensors"))["embeddings"]
                             for run in ("ddp", "one", "accumulated"))
    torch.testing.assert_close(two, one, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(accumulated, one, rtol=1e-4, atol=1e-6)
    # Every held-out cut counted once, with the one-process figures.
    cuts = log["dataset"]["eval_examples"]
    assert cuts > 11 and log["initial_eval"]["initial_examples"] == alone["initial_eval"]["initial_examples"] == cuts
    assert log["final_eval"]["eval_examples"] == cuts and len(log["rank_accuracy"]) == 3
    for phase in ("initial_eval", "final_eval"):
        for key, value in alone[phase].items():
            if key != "epoch" and not key.endswith("runtime"):
                assert log[phase][key] == pytest.approx(value, rel=1e-4, abs=1e-6), (phase, key)


@pytest.fixture(scope="module")
def tiny_setup(tmp_path_factory):
    """A tiny random model (the default model's tokenizer, so its vocabulary) and a synthetic distillation
    dataset for it, plus a copy of the dataset whose teacher log-probabilities are NaN: fast runs."""
    import datasets

    from ppd import load_tokenizer
    from tests.conftest import tiny_model

    root = tmp_path_factory.mktemp("tiny-train")
    tokenizer = load_tokenizer("smollm2-135m-instruct")
    tiny_model(vocab=len(tokenizer)).save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    n, k, vocab = 3, 4, len(tokenizer)
    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(40):
        logprobs = torch.log_softmax(torch.randn(n, k, generator=g), -1).sort(-1, descending=True).values - 0.5
        rows.append({"id": str(i), "input_ids": torch.randint(0, vocab, (4 + i % 8,), generator=g).tolist(),
                     "labels": torch.randint(0, vocab, (n + 1,), generator=g).tolist(),
                     "teacher_token_ids": torch.randint(0, vocab, (n + 1,), generator=g).tolist(),
                     "teacher_topk_ids": torch.randint(0, vocab, (n, k), generator=g).tolist(),
                     "teacher_topk_logprobs": logprobs.tolist()})
    info = PPDDatasetInfo(dataset_type="distillation", model=str((root / "model").resolve()), model_revision="local",
                          num_prompt_tokens=n, model_max_length=64, seed=0, source="synthetic", top_k=k,
                          teacher_dtype="float32")
    features = generate._features(generate.DatasetType.DISTILLATION)
    info.attach(datasets.Dataset.from_list(rows, features=features)).save_to_disk(str(root / "data"))
    nan_rows = [{**row, "teacher_topk_logprobs": [[float("nan")] * k] * n} for row in rows]
    info.attach(datasets.Dataset.from_list(nan_rows, features=features)).save_to_disk(str(root / "nan-data"))
    return root


def run_tiny(tiny, output, *extra, dataset="data") -> int:
    return train.main(["--model", str(tiny / "model"), "--dataset_path", str(tiny / dataset),
                       "--output_dir", str(output), "--per_device_train_batch_size", "4", "--learning_rate", "1e-2",
                       "--logging_steps", "1", "--eval_size", "8", "--seed", "0", "--dataloader_pin_memory", "false",
                       *extra])


@pytest.fixture
def nothing_loads(monkeypatch):
    """train.main fails the test if it loads a model or data (settings are checked before either)."""
    def must_not_run(*args, **kwargs):
        raise AssertionError("loaded something before checking the settings")

    for name in ("resolve_model", "load_dataset_for", "load_base"):
        monkeypatch.setattr(train, name, must_not_run)


@pytest.mark.parametrize("flag, value, message", [
    ("--learning_rate", "inf", "--learning_rate must be a finite number > 0, got inf"),
    ("--learning_rate", "nan", "--learning_rate must be a finite number > 0, got nan"),
    ("--learning_rate", "-0.01", "--learning_rate must be a finite number > 0, got -0.01"),
    ("--num_train_epochs", "0", "--num_train_epochs must be a finite number > 0 (or pass --max_steps), got 0.0"),
    ("--per_device_train_batch_size", "0", "--per_device_train_batch_size must be at least 1, got 0"),
    ("--gradient_accumulation_steps", "0", "--gradient_accumulation_steps must be at least 1, got 0"),
    ("--weight_decay", "nan", "--weight_decay must be a finite number >= 0, got nan"),
    ("--loss_decay", "nan", "--loss_decay must be in (0, 1], got nan"),
    ("--num_prompt_tokens", "0", "--num_prompt_tokens must be at least 1, got 0"),
    ("--eval_size", "inf", "--eval_size must be a finite number >= 0, got inf"),
    ("--width_multiple", "0", "--width_multiple must be at least 1, got 0"),
])
def test_unusable_numbers_are_refused_before_anything_loads(flag, value, message, tmp_path, capsys, nothing_loads):
    with pytest.raises(SystemExit) as exit_info:
        train.main(["--dataset_path", str(tmp_path / "data"), "--output_dir", str(tmp_path / "out"), flag, value])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == f"train: error: {message}\n"


def test_one_process_seeing_several_gpus_is_told_to_launch_one_per_gpu(tmp_path, capsys, monkeypatch, nothing_loads):
    from transformers import TrainingArguments

    monkeypatch.setattr(TrainingArguments, "n_gpu", property(lambda self: 2))  # as on a 2-GPU host, unlaunched
    with pytest.raises(SystemExit) as exit_info:
        train.main(["--dataset_path", str(tmp_path / "data"), "--output_dir", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == (
        "train: error: this one process sees 2 GPUs: start one process per GPU (accelerate launch --multi_gpu "
        "--num_processes 2 -m train.train ...) or make one GPU visible (CUDA_VISIBLE_DEVICES=0)\n")


def test_diverging_training_stops_without_saving_non_finite_tokens(tiny_setup, tmp_path, capsys):
    # A finite but absurd learning rate: the first optimizer step takes the prompt tokens to inf/NaN.
    assert run_tiny(tiny_setup, tmp_path / "run", "--learning_rate", "1e39", "--max_steps", "3",
                    "--save_steps", "1") == 1
    err = capsys.readouterr().err
    assert "train: error: step 1: 96 of 96 prompt-token values are not finite" in err
    assert not list((tmp_path / "run").glob("**/*.safetensors"))  # no adapter, no checkpoint


def test_a_non_finite_loss_stops_training_at_its_step(tiny_setup, tmp_path, capsys):
    assert run_tiny(tiny_setup, tmp_path / "run", "--max_steps", "3", "--save_steps", "1", "--eval_size", "0",
                    dataset="nan-data") == 1
    assert "train: error: step 1: the training loss is nan" in capsys.readouterr().err
    assert not list((tmp_path / "run").glob("**/*.safetensors"))


def test_saving_non_finite_prompt_tokens_is_refused(tmp_path):
    from transformers import TrainingArguments

    from tests.conftest import random_prompt_tokens, tiny_model

    model = tiny_model()
    tokens = random_prompt_tokens(model)
    trainer = PromptTokenTrainer(model=PromptTokenModel(model, tokens),
                                 args=TrainingArguments(output_dir=str(tmp_path), report_to=[]))
    with torch.no_grad():
        tokens.embeddings[1, 2] = float("inf")
    with pytest.raises(NonFiniteError, match="1 of 96 prompt-token values are not finite"):
        trainer.save_model(str(tmp_path / "checkpoint-1"))
    assert not (tmp_path / "checkpoint-1").exists()


TIMINGS = re.compile(r"runtime|per_second|preparation_time")


def comparable(log: dict) -> dict:
    """A training log without its timings and the two arguments that must differ (folder, resume flag)."""
    def strip(entry: dict) -> dict:
        return {k: v for k, v in entry.items() if not TIMINGS.search(k)}

    out = {k: v for k, v in log.items() if k not in ("train_seconds", "throughput")}
    out["training_arguments"] = {k: v for k, v in log["training_arguments"].items()
                                 if k not in ("output_dir", "resume_from_checkpoint")}
    for key in ("train_metrics", "initial_eval", "final_eval"):
        out[key] = strip(log[key])
    out["log_history"] = [strip(entry) for entry in log["log_history"]]
    return out


@pytest.mark.parametrize("args", [["--max_steps", "6", "--save_steps", "3"],
                                  # 8 steps an epoch: resumed in the second, whose order the sampler draws anew
                                  ["--max_steps", "12", "--save_steps", "10", "--group_by_width"]])
def test_a_resumed_run_writes_the_log_of_an_uninterrupted_one(tiny_setup, tmp_path, args):
    assert run_tiny(tiny_setup, tmp_path / "full", *args) == 0
    interrupted = tmp_path / "resumed"
    interrupted.mkdir()
    saved = f"checkpoint-{args[3]}"
    shutil.copytree(tmp_path / "full" / saved, interrupted / saved)  # stopped after it
    assert run_tiny(tiny_setup, interrupted, *args, "--resume_from_checkpoint", "latest") == 0
    full = json.loads((tmp_path / "full" / "training_log.json").read_text())
    resumed = json.loads((interrupted / "training_log.json").read_text())
    assert "initial_loss" in resumed["initial_eval"]
    assert [e["step"] for e in resumed["log_history"] if "loss" in e] == list(range(1, int(args[1]) + 1))
    assert comparable(resumed) == comparable(full)


def test_lagged_checks_read_all_but_the_latest_and_stop_at_a_non_finite_loss():
    checks = LaggedChecks()
    for step, loss in enumerate([1.0, 2.0, float("nan")], start=1):
        checks.queue("loss", step, torch.tensor(loss))
        if step < 3:
            checks.settle(None, keep=1)  # (the prompt tokens are read only for a count of non-finite values)
    assert checks.loss_sum == 1.0 and len(checks.pending) == 2
    with pytest.raises(NonFiniteError, match="step 3: the training loss is nan"):
        checks.settle(None)
    assert checks.loss_sum == 3.0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_lagged_read_waits_for_its_value_not_for_the_work_queued_after_it():
    checks = LaggedChecks()
    checks.queue("loss", 1, torch.ones((), device="cuda") * 2)
    torch.cuda._sleep(2_000_000_000)  # ~1 s of the device's clock queued after the value, as the next step's replay
    started = time.perf_counter()
    checks.settle(None)
    assert time.perf_counter() - started < 0.5 and checks.loss_sum == 2.0
    torch.cuda.synchronize()


def test_a_captured_step_trains_what_the_eager_step_trains(tiny_setup, tmp_path):
    # Without CUDA the captured step runs its padded batches eagerly: the same losses, the same prompt tokens.
    args = ["--max_steps", "4", "--gradient_accumulation_steps", "2", "--save_strategy", "no"]
    assert run_tiny(tiny_setup, tmp_path / "eager", *args) == 0
    assert run_tiny(tiny_setup, tmp_path / "captured", *args, "--capture_step", "--width_multiple", "16") == 0
    logs = [json.loads((tmp_path / name / "training_log.json").read_text()) for name in ("eager", "captured")]
    assert logs[0]["captured_step"] is None
    assert logs[1]["captured_step"] == {"micro_batches": 8, "width_multiple": 16, "widths": [16],
                                        "replay_seconds": [0.0], "gap_seconds": [0.0], "median_gap": [0.0],
                                        "replays": [[8]], "captures": []}  # no CUDA here
    assert 0 <= logs[1]["throughput"]["host_waited_s"] <= logs[1]["train_seconds"]
    steps = logs[1]["throughput"]["step_seconds"]  # between the 4 optimizer steps
    assert steps["steps"] == 3 and 0 < steps["median"] <= steps["p90"] <= logs[1]["train_seconds"]
    losses = [[e["loss"] for e in log["log_history"] if "loss" in e] for log in logs]
    assert len(losses[0]) == 4
    assert losses[1] == pytest.approx(losses[0], rel=1e-4)
    assert logs[1]["final_eval"]["eval_loss"] == pytest.approx(logs[0]["final_eval"]["eval_loss"], rel=1e-4)
    tokens = [load_file(str(tmp_path / name / "prompt_tokens.safetensors")) for name in ("eager", "captured")]
    for name, value in tokens[0].items():
        torch.testing.assert_close(tokens[1][name], value, rtol=1e-4, atol=1e-6)


def test_two_processes_with_a_captured_step_train_what_one_eager_process_does(tiny_setup, tmp_path):
    # The captured step replaces DDP's backward hooks with its own all-reduce: with the cuts counted across processes
    # (the default) the gradients are summed; with each process dividing by its own cuts they are averaged. Two
    # processes of 2 one-cut conversations train, by either way, what one eager process of 4 trains (SGD without
    # clipping: the gradient's scale counts too); and, with steps of like width, the steps one process of 4 trains.
    flags = ["--max_steps", "3", "--optim", "sgd", "--learning_rate", "0.5", "--max_grad_norm", "0",
             "--save_strategy", "no", "--eval_size", "0"]
    for average, grouping in (("true", []), ("false", ["--group_by_width"])):
        assert run_tiny(tiny_setup, tmp_path / f"one-{average}", *flags, *grouping) == 0
        expected = load_file(str(tmp_path / f"one-{average}" / "prompt_tokens.safetensors"))
        output = tmp_path / f"two-{average}"
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "train.train",
               "--model", str(tiny_setup / "model"), "--dataset_path", str(tiny_setup / "data"),
               "--output_dir", str(output), "--per_device_train_batch_size", "2", "--seed", "0",
               "--dataloader_pin_memory", "false", "--capture_step", "--width_multiple", "16",
               "--average_tokens_across_devices", average, *flags, *grouping]
        proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                              text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        log = json.loads((output / "training_log.json").read_text())
        assert log["world_size"] == 2 and log["captured_step"]["micro_batches"] == 3
        assert [sum(row) for row in log["captured_step"]["replays"]] == [3, 3]  # each process's micro-batches
        for name, value in load_file(str(output / "prompt_tokens.safetensors")).items():
            torch.testing.assert_close(value, expected[name], rtol=1e-4, atol=1e-6, msg=f"{average}: {name}")


@pytest.mark.parametrize("flags, named", [(["--gradient_checkpointing"], "--gradient_checkpointing"),
                                          (["--bf16", "--use_cpu"], "--bf16"),
                                          (["--optim", "schedule_free_adamw"], "--optim schedule_free_adamw")])
def test_capture_step_with_what_it_cannot_run_is_refused(flags, named, tmp_path, capsys, nothing_loads):
    with pytest.raises(SystemExit) as exit_info:
        train.main(["--dataset_path", str(tmp_path / "data"), "--output_dir", str(tmp_path / "out"),
                    "--capture_step", *flags])
    assert exit_info.value.code == 2
    assert f"train: error: --capture_step cannot be combined with {named} (" in capsys.readouterr().err


def test_the_training_step_profile_reports_every_variant_and_batch_size(tiny_setup, tmp_path):
    from eval import train_profile

    out = tmp_path / "profile.json"
    assert train_profile.main(["--dataset_path", str(tiny_setup / "data"), "--batch_sizes", "4", "2", "--steps", "2",
                               "--warmup", "1", "--variants", "any:1", "plan_free:16", "captured:16", "--output",
                               str(out), "--", "--model", str(tiny_setup / "model"), "--deep", "--map_rank", "2"]) == 0
    results = json.loads(out.read_text())["results"]
    assert [(r["variant"], r["batch_size"]) for r in results] == [("any:1", 4), ("any:1", 2), ("plan_free:16", 4),
                                                                   ("plan_free:16", 2), ("captured:16", 4),
                                                                   ("captured:16", 2)]
    # the captured step (eager here: no CUDA) pads its batches as the plain step padded to 16 does
    assert [r["forward_slots_per_step"] for r in results[4:]] == [r["forward_slots_per_step"] for r in results[2:4]]
    assert [r["captures"] for r in results] == [None] * 4 + [[]] * 2
    for r in results:
        assert r["cuts_per_step"] == r["batch_size"] and r["wall_ms_per_step"] > 0 and r["kernels_per_step"] > 0
        assert any("mm" in k["kernel"] for k in r["top"])  # on a CPU: the operators' own time
    # the forward's slots: each row's 3 prompt rows after the longest conversation, then padding to the multiple
    unpadded, padded = results[:2], results[2:]
    for one, sixteen in zip(unpadded, padded):
        assert one["forward_slots_per_step"] == one["padded_tokens_per_step"] + 3 * one["batch_size"]
        most = one["forward_slots_per_step"] + 16 * one["batch_size"]
        assert one["forward_slots_per_step"] < sixteen["forward_slots_per_step"] < most
    with pytest.raises(SystemExit, match=re.escape("expected any|plan_free|captured:MULTIPLE")):
        train_profile.main(["--dataset_path", str(tiny_setup / "data"), "--variants", "cudnn:0"])
    with pytest.raises(SystemExit, match="40 conversations in the dataset, 84 needed"):
        train_profile.main(["--dataset_path", str(tiny_setup / "data"), "--batch_sizes", "4", "--steps", "10",
                            "--warmup", "1", "--", "--model", str(tiny_setup / "model")])


def test_the_training_speed_benchmark_times_two_passes_against_one(tiny_setup, tmp_path, capsys):
    from eval import train_speed

    out = tmp_path / "speed.json"
    assert train_speed.main(["--dataset_path", str(tiny_setup / "data"), "--max_steps", "2", "--cuts_per_forward", "0",
                             "--passes", "2", "1", "--output", str(out), "--", "--model", str(tiny_setup / "model"),
                             "--per_device_train_batch_size", "4", "--dataloader_pin_memory", "false"]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["cuts_per_forward"], r["passes"]) for r in rows] == [(0, 2), (0, 1)]
    assert "--single_pass" in rows[1]["command"] and "--single_pass" not in rows[0]["command"]
    assert rows[0]["examples"] == rows[1]["examples"] > 0  # the same steps, timed both ways
    assert "| all of a conversation | 1 | 1 |" in capsys.readouterr().out


def test_torch_compile_trains_what_the_eager_base_model_trains(tiny_setup, tmp_path, monkeypatch):
    """``--torch_compile`` compiles the base model's decoder layers (every size dynamic; each with the deep tokens'
    offsets and maps): one graph for each of the forward's two passes serves every layer and the four steps'
    different widths (the evaluation's first pass shares the training's; the batch sizes differ from the tiny
    model's head size, 8, which the first compilation would otherwise tie them to), the prompt
    tokens end as those of the eager run, and the Trainer's own compile of the whole module stays off. With
    ``PPD_COMPILE_CACHE`` the run leaves what it compiled there for the next run."""
    from ppd.compile_cache import SUFFIX

    common = ["--max_steps", "4", "--deep", "--map_rank", "2", "--save_strategy", "no", "--per_device_eval_batch_size",
              "4"]
    assert run_tiny(tiny_setup, tmp_path / "eager", *common) == 0
    from torch._dynamo.utils import counters

    graphs = counters["stats"]["unique_graphs"]
    monkeypatch.setenv("PPD_COMPILE_CACHE", str(tmp_path / "compiled-steps"))
    assert run_tiny(tiny_setup, tmp_path / "compiled", *common, "--torch_compile") == 0
    assert counters["stats"]["unique_graphs"] - graphs == 2  # a graph a pass: every layer, every width
    assert len(list((tmp_path / "compiled-steps").glob(f"*{SUFFIX}"))) == 1
    logs = {name: json.loads((tmp_path / name / "training_log.json").read_text()) for name in ("eager", "compiled")}
    assert logs["compiled"]["compiled_base"] and not logs["eager"]["compiled_base"]
    assert not logs["compiled"]["training_arguments"]["torch_compile"]
    eager = load_file(str(tmp_path / "eager" / "prompt_tokens.safetensors"))
    compiled = load_file(str(tmp_path / "compiled" / "prompt_tokens.safetensors"))
    assert set(compiled) == set(eager) and len(eager) == 4  # embeddings, offsets, the maps' two halves
    for name, value in eager.items():
        torch.testing.assert_close(compiled[name], value, rtol=1e-4, atol=1e-5)


def test_torch_compile_with_gradient_checkpointing_is_refused(tmp_path, capsys, nothing_loads):
    with pytest.raises(SystemExit) as exit_info:
        train.main(["--dataset_path", str(tmp_path / "data"), "--output_dir", str(tmp_path / "out"),
                    "--torch_compile", "--gradient_checkpointing"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == ("train: error: --torch_compile and --gradient_checkpointing cannot be combined "
                                       "here: choose one\n")

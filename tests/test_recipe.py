"""`python -m train.recipe` end to end on the real default model at toy scale: every step runs once, in
order, and leaves an adapter that decodes losslessly with the tree it picked; run again, every step is
skipped; a step whose output is gone runs again alone."""

import json

import torch

from ppd import PPDModel
from ppd.chat import chat_input_ids
from tests.test_data_gen import sharegpt_file  # noqa: F401 (a fixture: short real ShareGPT records)
from train import recipe

STEPS = ["truncated", "distillation", "training", "accuracies", "trees", "pick"]


def test_recipe_runs_every_step_then_skips_them(sharegpt_file, tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["--output_dir", str(out), "--data_path", str(sharegpt_file), "--max_samples", "8",
            "--cuts_per_conversation", "2",
            "--eval_size", "3", "--budgets", "2", "4", "--batch_size", "4", "--dtype", "float32",
            "--pick_context", "64", "--pick_steps", "4", "--train_args", "--max_steps", "2", "--report_to", "none"]
    assert recipe.main(argv) == 0
    log = json.loads((out / "recipe.json").read_text())
    assert [s["step"] for s in log["steps"]] == STEPS and all(s["seconds"] > 0 for s in log["steps"])
    adapter = out / "adapter"
    assert (adapter / "tree_cpu_float32.json").is_file()
    card = (adapter / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: ppd\nbase_model: HuggingFaceTB/SmolLM2-135M-Instruct")
    assert all(f"| {step} |" in card for step in STEPS) and "Held-out accuracy (" in card
    ppd = PPDModel.from_pretrained(adapter=str(adapter), dtype="float32", device="cpu")
    assert ppd.tree == f"{adapter}:tree_cpu_float32.json"
    ids = torch.tensor([chat_input_ids(ppd.tokenizer, [{"role": "user", "content": "Say hello."}])])
    assert torch.equal(ppd.generate(ids, max_new_tokens=12),
                       ppd.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False))

    capsys.readouterr()
    assert recipe.main(argv) == 0
    printed = capsys.readouterr().out
    assert printed.count("done already") == len(STEPS)
    (out / "trees" / "pick.json").unlink()
    assert recipe.main(argv) == 0
    printed = capsys.readouterr().out
    assert printed.count("done already") == len(STEPS) - 1 and "[6/6] pick: python -m eval.pick_tree" in printed

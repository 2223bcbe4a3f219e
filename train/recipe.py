"""Prompt tokens for a new model in one command: data, training, accuracies, trees and the pick.

Usage (from the repository root):

    python -m train.recipe --model MODEL --output_dir runs/MODEL [--self_distill] [--max_samples K] \\
        [--num_prompt_tokens 3] [--epochs 2] [--budgets 4 8 16 32 64 128] [--train_args ...]

Runs, in order, the programs a user would otherwise run by hand, each writing under ``--output_dir``:

1. ``conversations`` (with ``--self_distill``): the model answers the source's user turns itself
   (``data_gen.generate --dataset_type conversations``), so the training text is its own;
2. ``truncated``: cut points in the conversations (``--dataset_type finetune``);
3. ``distillation``: the model's own top-k targets at each cut (``--dataset_type distillation``);
4. ``training``: the prompt tokens (``train.train``), written to ``OUTPUT/adapter``;
5. ``accuracies``: each prompt token's held-out rank accuracy (``eval.accuracy``);
6. ``trees``: tree sets for each row budget from those accuracies (``eval.build_trees``);
7. ``pick``: the budget with the most expected tokens per second of this device's step, installed in the
   adapter as ``tree_<device>_<dtype>.json`` (``eval.pick_tree --install``);

then writes the adapter's model card (``OUTPUT/adapter/README.md``: what was run, how long each step took,
the held-out accuracies and the picked tree) and ``OUTPUT/recipe.json``. A step whose output is already
there is skipped; one that was interrupted resumes (the data and training programs resume from their
shards and checkpoints), so running the same command again finishes the work. The adapter then decodes
with ``--adapter OUTPUT/adapter`` and publishes with ``python -m train.push``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ppd.files import atomic_write_json, atomic_write_text
from ppd.models import DEFAULT_MODEL


@dataclass
class Step:
    """One program run of the recipe: its name, the output that marks it done, and its command line."""

    name: str
    output: Path
    program: str  # module, run as ``python -m``
    argv: list[str]
    done: Callable[[Path], bool] = field(default=lambda path: path.exists())

    @property
    def command(self) -> str:
        return shlex.join(["python", "-m", self.program, *self.argv])


def dataset_done(path: Path) -> bool:
    return (path / "dataset_info.json").is_file()


def adapter_done(path: Path) -> bool:
    return (path / "training_log.json").is_file() and (path / "ppd_config.json").is_file()


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m train.recipe", description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", "--model_name_or_path", dest="model", default=DEFAULT_MODEL,
                        help="alias, Hugging Face folder or hub id (default: %(default)s)")
    parser.add_argument("--output_dir", required=True, help="where every step writes (data/, adapter/, trees/)")
    parser.add_argument("--data_path", default=None, help="conversations or a plain-text corpus (default: the "
                                                          "embedded ShareGPT file)")
    parser.add_argument("--chat_template", default="auto", help="auto | plain | none | FILE.jinja (see data_gen)")
    parser.add_argument("--self_distill", action="store_true",
                        help="train on the model's own answers to the source's user turns (a conversations step first)")
    parser.add_argument("--max_samples", type=int, default=None, help="use the first K source records only")
    parser.add_argument("--max_turns", type=int, default=2, help="self-distillation: user turns answered")
    parser.add_argument("--max_new_tokens", type=int, default=512, help="self-distillation: tokens per reply")
    parser.add_argument("--cuts_per_conversation", type=int, default=1)
    parser.add_argument("--num_prompt_tokens", type=int, default=3)
    parser.add_argument("--num_ensemble", type=int, default=1)
    parser.add_argument("--epochs", type=float, default=2.0)
    parser.add_argument("--learning_rate", type=float, default=1e-2)
    parser.add_argument("--batch_size", type=int, default=16, help="per-device training batch size")
    parser.add_argument("--eval_size", type=float, default=0.02, help="held-out share or count (accuracies, trees)")
    parser.add_argument("--budgets", type=int, nargs="+", default=[4, 8, 16, 32, 64, 128],
                        help="tree sizes (rows per step) built and timed for the pick")
    parser.add_argument("--dtype", default=None, help="model dtype (default: bf16 on a GPU, fp32 on most CPUs)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--capture", default="auto", help="how pick_tree runs the timed step (see eval.pick_tree)")
    parser.add_argument("--pick_context", type=int, default=300, help="pick: tokens of context of the timed steps")
    parser.add_argument("--pick_steps", type=int, default=32, help="pick: timed steps per tree")
    parser.add_argument("--train_args", nargs=argparse.REMAINDER, default=[],
                        help="anything else for train.train (TrainingArguments flags), after everything else")
    return parser


def plan(args: argparse.Namespace) -> list[Step]:
    """The recipe's steps for these arguments, in order."""
    out = Path(args.output_dir)
    data, adapter, trees = out / "data", out / "adapter", out / "trees"
    model = ["--model", args.model]
    common = [*model, "--chat_template", args.chat_template, "--num_prompt_tokens", str(args.num_prompt_tokens)]
    if args.dtype:
        common += ["--dtype", args.dtype]
    limit = ["--max_samples", str(args.max_samples)] if args.max_samples else []
    source = ["--data_path", args.data_path] if args.data_path else []
    steps = []
    if args.self_distill:
        steps.append(Step("conversations", data / "conversations", "data_gen.generate",
                          ["--dataset_type", "conversations", *common, *source, *limit,
                           "--max_turns", str(args.max_turns), "--max_new_tokens", str(args.max_new_tokens),
                           "--output_path", str(data / "conversations")], dataset_done))
        source, limit = ["--data_path", str(data / "conversations")], []
    steps += [
        Step("truncated", data / "truncated", "data_gen.generate",
             ["--dataset_type", "finetune", *common, *source, *limit,
              "--cuts_per_conversation", str(args.cuts_per_conversation), "--output_path", str(data / "truncated")],
             dataset_done),
        Step("distillation", data / "distillation", "data_gen.generate",
             ["--dataset_type", "distillation", *common, "--data_path", str(data / "truncated"),
              "--output_path", str(data / "distillation")], dataset_done),
        Step("training", adapter, "train.train",
             [*model, "--dataset_path", str(data / "distillation"), "--output_dir", str(adapter),
              "--num_prompt_tokens", str(args.num_prompt_tokens), "--num_ensemble", str(args.num_ensemble),
              "--trainer_type", "distillation", "--learning_rate", str(args.learning_rate),
              "--lr_scheduler_type", "cosine", "--num_train_epochs", str(args.epochs),
              "--per_device_train_batch_size", str(args.batch_size), "--eval_size", f"{args.eval_size:g}",
              "--save_steps", "250", "--logging_steps", "20", "--resume_from_checkpoint", "latest",
              *(["--dtype", args.dtype] if args.dtype else []), *args.train_args],
             adapter_done),
        Step("accuracies", trees / "accuracy.json", "eval.accuracy",
             [*model, "--adapter", str(adapter), "--dataset", str(data / "distillation"),
              "--eval_size", f"{args.eval_size:g}", "--output", str(trees / "accuracy.json"),
              *(["--dtype", args.dtype] if args.dtype else []), *(["--device", args.device] if args.device else [])]),
        Step("trees", trees / f"tree_{max(args.budgets)}.json", "eval.build_trees",
             ["--accuracy", str(trees / "accuracy.json"), "--budgets", *map(str, args.budgets),
              "--output_dir", str(trees)]),
        Step("pick", trees / "pick.json", "eval.pick_tree",
             [*model, "--adapter", str(adapter), "--trees", *(str(trees / f"tree_{b}.json") for b in args.budgets),
              "--capture", args.capture, "--context", str(args.pick_context), "--steps", str(args.pick_steps),
              "--output", str(trees / "pick.json"), "--install",
              *(["--dtype", args.dtype] if args.dtype else []), *(["--device", args.device] if args.device else [])]),
    ]
    return steps


def run_step(step: Step) -> int:
    """Run one program in this process, as ``python -m`` would."""
    import importlib

    module = importlib.import_module(step.program)
    try:
        return int(module.main(step.argv) or 0)
    except SystemExit as exit_:  # argparse errors and programs that exit with a status
        return exit_.code if isinstance(exit_.code, int) else 1


def model_card(args: argparse.Namespace, record: list[dict]) -> str:
    """The adapter's model card: the hub header and description of ``ppd.hub.model_card``, then what the
    recipe ran, how long each step took, the held-out accuracies and the picked tree."""
    from ppd.hub import model_card as base_card
    from ppd.prompt_tokens import PromptTokens

    out = Path(args.output_dir)
    adapter = out / "adapter"
    tokens = PromptTokens.from_pretrained(adapter)
    lines = [base_card(tokens, sorted(p.name for p in adapter.glob("tree_*.json"))).rstrip(), "",
             "## How it was made", "", "`python -m train.recipe` ran these steps:", "",
             "| step | seconds | command |", "|---|---|---|"]
    lines += [f"| {r['step']} | {r['seconds']:.0f} | `{r['command']}` |" for r in record]
    accuracy = out / "trees" / "accuracy.json"
    if accuracy.is_file():
        data = json.loads(accuracy.read_text())
        lines += ["", f"Held-out accuracy ({data['dataset']['eval_examples']} examples):", "",
                  "| prompt token (predicts) | top-1 | top-5 |", "|---|---|---|"]
        lines += [f"| {k + 1} (t+{k + 2}) | {t1:.3f} | {t5:.3f} |"
                  for k, (t1, t5) in enumerate(zip(data["top1"], data["top5"]))]
    pick = out / "trees" / "pick.json"
    if pick.is_file():
        data = json.loads(pick.read_text())
        lines += ["", f"Step timings on {data.get('device', 'this device')} ({data.get('dtype', '')}, "
                  f"{data.get('context')} tokens of context); the pick: `{Path(data['best_tree']).name}`.", "",
                  "| tree | rows | expected tokens / step | step ms | expected tokens/s |", "|---|---|---|---|---|"]
        lines += [f"| {Path(r['tree']).name} | {r['rows']} | {r['expected_tokens']:.2f} | {1e3 * r['latency_s']:.1f} "
                  f"| {r['tokens_per_s']:.0f} |" for r in data["rows"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    if args.max_samples is not None and args.max_samples < 1:
        print("train.recipe: error: --max_samples must be at least 1", file=sys.stderr)
        return 2
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    record_path = out / "recipe.json"
    previous = {r["step"]: r for r in json.loads(record_path.read_text())["steps"]} if record_path.is_file() else {}
    record = []
    steps = plan(args)
    for number, step in enumerate(steps, 1):
        header = f"[{number}/{len(steps)}] {step.name}"
        if step.done(step.output):
            print(f"{header}: done already ({step.output}), skipped")
            record.append(previous.get(step.name) or {"step": step.name, "command": step.command, "seconds": 0.0,
                                                      "output": str(step.output)})
            continue
        print(f"{header}: {step.command}", flush=True)
        start = time.perf_counter()
        status = run_step(step)
        seconds = time.perf_counter() - start
        if status != 0 or not step.done(step.output):
            print(f"train.recipe: error: step {step.name} failed (exit status {status}); fix what it said and run the "
                  "same command again: finished steps are skipped, this one resumes", file=sys.stderr)
            return 1
        print(f"{header}: done in {seconds:.0f} s")
        record.append({"step": step.name, "command": step.command, "seconds": seconds, "output": str(step.output)})
        atomic_write_json(record_path, {"model": args.model, "steps": record})
    atomic_write_json(record_path, {"model": args.model, "steps": record})
    atomic_write_text(out / "adapter" / "README.md", model_card(args, record))
    total = sum(r["seconds"] for r in record)
    print(f"adapter ready in {out / 'adapter'} ({total:.0f} s of steps); decode with --adapter {out / 'adapter'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

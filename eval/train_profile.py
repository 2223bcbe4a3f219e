"""Where a training step's time goes: wall and device time per optimizer step at several batch sizes.

Usage (``train.train`` flags after ``--``):

    python -m eval.train_profile --dataset_path data/sd_distill --batch_sizes 8 4 2 \\
        --output results/train/train_profile.json -- --deep --map_rank 16 --num_prompt_tokens 3

For each batch size (conversations per step): the batches are made first (their host time is reported
apart, ``data ms``), then ``--warmup`` untimed steps, then ``--steps`` timed ones, forward, backward and
the optimizer (AdamW) as one step of ``train.train`` runs them, without the Trainer around them, and the
same steps again under ``torch.profiler``. Reports per step the wall time, the kernels' summed device time
(the rest is the device idle: host work between kernels), the kernels that take the most and, on a GPU, how
many operations of one step made the host wait for the device (``syncs_per_step``, torch's sync debug mode:
each drains the device's queue, so the host cannot run ahead). How the wall
time grows with the batch shows the step's fixed cost: what two processes of half the batch each still pay
in full. ``--single_pass`` among the training flags profiles the one-pass forward instead of the default two
passes (``ppd.two_pass``). ``--torch_compile`` among them runs the base model's layers compiled, as ``train.train``
does with it (the warm-up steps of the first batch size compile; ``warmup_s`` says how long they took). Writes JSON
and a markdown table.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings

import torch

from ppd.attention import packed_width
from ppd.captured_training import CapturedTrainingStep
from ppd.uploads import upload

from .records import environment, write_json
from .step_profile import kernels_per_step


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m eval.train_profile", description=__doc__.split("\n")[0])
    parser.add_argument("--dataset_path", required=True)
    parser.add_argument("--batch_sizes", type=int, nargs="+", default=[8, 4, 2], help="conversations per step")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per batch size")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--variants", nargs="+", default=["any:1"], metavar="ATTENTION:MULTIPLE",
                        help="how the steps run, each timed at every batch size: ATTENTION any (torch picks the "
                             "attention kernel), plan_free (no cuDNN) or captured (forward and backward replayed "
                             "from CUDA graphs, ppd.captured_training; its warm-up runs every batch once, capturing "
                             "each width), MULTIPLE the width each batch is padded to a multiple of")
    parser.add_argument("--top", type=int, default=20, help="kernels listed per batch size")
    parser.add_argument("--output", default=None)
    parser.add_argument("train_args", nargs=argparse.REMAINDER, help="-- then flags for train.train")
    return parser


def load(args: argparse.Namespace):
    """The model, dataset and collator ``train.train`` would build from the same flags."""
    from ppd.models import resolve_model
    from ppd.training import PromptTokenCollator, PromptTokenModel
    from train.train import compile_if_asked, load_base, load_dataset_for, make_parser as train_parser, new_prompt_tokens

    flags = [a for a in args.train_args if a != "--"]
    model_args, data_args, pt_args, training_args = train_parser().parse_args_into_dataclasses(
        args=["--dataset_path", args.dataset_path, "--output_dir", "unused", "--eval_size", "0", *flags])
    _, model_info = resolve_model(model_args.model_name_or_path)
    dataset, _, _ = load_dataset_for(data_args, pt_args, model_info.model_id, training_args.seed)
    base, tokenizer, model_info = load_base(model_args, training_args.device, False)
    prompt_tokens = new_prompt_tokens(pt_args, model_args, base, tokenizer, model_info)
    model = PromptTokenModel(base, prompt_tokens, pt_args.objective, pt_args.loss_decay).to(training_args.device)
    model.two_pass = not data_args.single_pass  # (``-- --single_pass``: the one-pass forward)
    compile_if_asked(model, training_args)  # --torch_compile: every variant's steps run the layers compiled
    collator = PromptTokenCollator(num_prompt_tokens=pt_args.num_prompt_tokens)
    return model, dataset, collator, training_args


def profile_batch_size(model, dataset, collator, optimizer, device, size: int, args, captured=None) -> dict:
    """Wall and device time per step at ``size`` conversations per step (see the module docstring); ``captured``:
    by this :class:`CapturedTrainingStep` of ``size`` rows."""
    needed = args.warmup + 2 * args.steps
    started = time.perf_counter()
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(size)).tolist()
    batches = [collator([dataset[i] for i in order[j * size:(j + 1) * size]]) for j in range(needed)]
    data_ms = 1e3 * (time.perf_counter() - started) / needed

    def step(batch: dict) -> None:
        inputs = {k: upload(v, device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        if captured is None:
            model(**inputs)["loss"].backward()
        else:
            captured.step(inputs, inputs["cut_lengths"].numel())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def synchronize() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    started = time.perf_counter()
    # captured: every batch once, so that each width's graph is captured before the timing
    for batch in batches if captured is not None else batches[: args.warmup]:
        step(batch)
    synchronize()
    warmup_s = time.perf_counter() - started  # with --torch_compile, the first batch size's compilation too
    timed = batches[args.warmup: args.warmup + args.steps]
    started = time.perf_counter()
    for batch in timed:
        step(batch)
    synchronize()
    wall = (time.perf_counter() - started) / args.steps

    syncs = None
    if device.type == "cuda":  # the operations in one step that make the host wait for the device
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                step(batches[args.warmup])
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs = sum("synchroniz" in str(w.message) for w in caught)
        synchronize()

    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as profiler:
        for batch in batches[args.warmup + args.steps:]:
            step(batch)
        synchronize()
    events = profiler.events()
    # on a CPU the operators' own CPU time stands for the kernels'; the host operators by their own time
    rows = kernels_per_step(events, device.type == "cpu", args.steps)
    host_rows = kernels_per_step(events, True, args.steps)
    cuts = sum(int(b["cut_lengths"].numel()) for b in timed) / args.steps
    tokens = sum(b["input_ids"].numel() for b in timed) / args.steps
    config = model.prompt_tokens.config
    slots = sum(len(b["lengths"]) * packed_width(b["lengths"].tolist(),
                                                 torch.bincount(b["cut_rows"], minlength=len(b["lengths"])).tolist(),
                                                 config.num_rows, model.width_multiple)
                for b in timed) / args.steps
    return {"batch_size": size, "cuts_per_step": cuts, "padded_tokens_per_step": tokens,
            "forward_slots_per_step": slots, "data_ms_per_batch": data_ms,
            "warmup_s": warmup_s, "wall_ms_per_step": 1e3 * wall, "cuts_per_s": cuts / wall, "syncs_per_step": syncs,
            "captures": None if captured is None else [{"width": w, "seconds": t} for w, t in captured.captures],
            "device_ms_per_step": sum(r[2] for r in rows) / 1e3, "kernels_per_step": sum(r[1] for r in rows),
            "top": [{"kernel": n, "calls_per_step": c, "us_per_step": t} for n, c, t in rows[: args.top]],
            "top_host": [{"operator": n, "calls_per_step": c, "us_per_step": t} for n, c, t in host_rows[: args.top]]}


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    variants = []
    for variant in args.variants:
        attention, _, multiple = variant.partition(":")
        if attention not in ("any", "plan_free", "captured") or not multiple.isdigit() or int(multiple) < 1:
            raise SystemExit(f"train_profile: error: --variants {variant!r}: expected any|plan_free|captured:MULTIPLE")
        variants.append((variant, attention, int(multiple)))
    if min(args.batch_sizes) < 1 or args.steps < 1 or args.warmup < 0:
        raise SystemExit("train_profile: error: batch sizes and --steps must be at least 1, --warmup at least 0")
    model, dataset, collator, training_args = load(args)
    needed = max(args.batch_sizes) * (args.warmup + 2 * args.steps)
    if needed > len(dataset):
        raise SystemExit(f"train_profile: error: {len(dataset)} conversations in the dataset, {needed} needed "
                         "(the largest batch size times --warmup + 2 x --steps)")
    optimizer = torch.optim.AdamW(model.parameters(), lr=training_args.learning_rate)
    results = []
    per_row = max(len(group) for group in dataset.groups)
    for variant, attention, multiple in variants:
        model.plan_free_attention, model.width_multiple = attention == "plan_free", multiple
        for size in args.batch_sizes:
            captured = CapturedTrainingStep(model, size, per_row, multiple) if attention == "captured" else None
            results.append({"variant": variant, **profile_batch_size(model, dataset, collator, optimizer,
                                                                      training_args.device, size, args, captured)})
    # input tokens: the collated batch's ids, padded to its longest conversation; forward slots: rows times the
    # width the model runs, prompt rows and the padding to the variant's multiple included
    print("| variant | batch | cuts/step | input tokens/step | forward slots/step | data ms | wall ms/step "
          "| device ms/step | kernels/step | syncs/step | cuts/s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['variant']} | {r['batch_size']} | {r['cuts_per_step']:.0f} | {r['padded_tokens_per_step']:.0f} | "
              f"{r['forward_slots_per_step']:.0f} | "
              f"{r['data_ms_per_batch']:.1f} | {r['wall_ms_per_step']:.1f} | {r['device_ms_per_step']:.1f} | "
              f"{r['kernels_per_step']:.0f} | {'-' if r['syncs_per_step'] is None else r['syncs_per_step']} | "
              f"{r['cuts_per_s']:.1f} |")
    for r in results:
        print(f"\n{r['variant']}, batch {r['batch_size']}: top kernels per step\n| kernel | calls | us |\n|---|---|---|")
        for k in r["top"]:
            print(f"| {k['kernel'][:100]} | {k['calls_per_step']:.1f} | {k['us_per_step']:.0f} |")
        print(f"\nhost operators (own time)\n| operator | calls | us |\n|---|---|---|")
        for k in r["top_host"][:10]:
            print(f"| {k['operator'][:100]} | {k['calls_per_step']:.1f} | {k['us_per_step']:.0f} |")
    if args.output:
        write_json(args.output, {"dataset_path": args.dataset_path, "train_args": args.train_args,
                                 **environment(training_args.device),
                                 "command": " ".join(["python -m eval.train_profile", *(argv or sys.argv[1:])]),
                                 "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())

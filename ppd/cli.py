"""Command-line vocabulary shared by every program: the model, the adapter, the tree and decoding flags.

Each program (``application``, ``data_gen``, ``train``, ``eval``) builds its parser from these helpers so
that ``--model`` (alias ``--model_name_or_path``) and ``--adapter`` mean the same thing everywhere.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from dataclasses import dataclass

from .config import CaptureMode, DecodeConfig, StepAttention
from .decoder import Decoder, eos_ids_of
from .adapter import AdapterFiles, TreeChoice, prompt_tokens_and_trees
from .models import DEFAULT_MODEL, ModelInfo, load_model
from .tree import CandidateChoice, TreeSet
from .tree_builder import default_tree_set

logger = logging.getLogger(__name__)


def add_model_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model")
    group.add_argument("--model", "--model_name_or_path", dest="model", default=DEFAULT_MODEL,
                       help=f"alias ({DEFAULT_MODEL}), local Hugging Face folder or hub id (default: %(default)s)")
    group.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: bf16 on a GPU and on a CPU "
                       "with bf16 instructions, else fp32)")
    group.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: cuda if available)")
    group.add_argument("--chat_template", default="auto",
                       help="how conversations are rendered: auto (the model's chat template, else a plain "
                            "'User:/Assistant:' transcript for a base model), plain, none (raw text only) or a "
                            "Jinja file (default: %(default)s)")
    quant = group.add_mutually_exclusive_group()
    quant.add_argument("--load_in_4bit", action="store_true", help="NF4 base model via bitsandbytes (GPU)")
    quant.add_argument("--load_in_8bit", action="store_true", help="8-bit base model via bitsandbytes (GPU)")


def add_adapter_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("prompt tokens")
    group.add_argument("--adapter", default=None,
                       help="adapter with the prompt tokens: a folder or a hub id 'org/name[@revision]' (default: "
                            "the one shipped for the model, else freshly initialised prompt tokens)")
    group.add_argument("--adapter_revision", default=None,
                       help="branch, tag or commit of a hub adapter (default: main)")
    group.add_argument("--tree", default=None, help="tree set JSON, used at every batch size (default: the adapter's "
                                                      "batch policy or tree for this device type and dtype if it ships "
                                                      "one, else the packaged default.json)")
    group.add_argument("--tree_choice", choices=[c.value for c in CandidateChoice], default=None,
                       help="where each step's candidates come from: fixed (the tree's paths) or confident (as many "
                            "candidates as the tree has, the paths this step's guesses are surest of) "
                            "(default: as the tree set says, fixed unless it names another)")
    group.add_argument("--lookup", type=int, default=None, metavar="NODES",
                       help="verify beside each step's tree a chain of this many candidates found by prompt lookup "
                            "(the tokens after the latest earlier occurrence of the text's last tokens); 0: none "
                            "(default: as the tree set says, none unless it names a chain)")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    group.add_argument("--capture", choices=[m.value for m in CaptureMode], default="auto",
                       help="how the decoding step runs: auto (compiled and captured on CUDA, compiled on a CPU; "
                            "$PPD_CAPTURE overrides), eager, "
                            "graph, compile, compiled_graph, reduce_overhead (default: %(default)s)")
    group.add_argument("--max_seq_len", type=int, default=None,
                       help="tokens (prompt and answer) the decoder's cache holds per row "
                            "(default: the context window, at most 8192)")
    group.add_argument("--attention", choices=[a.value for a in StepAttention], default="auto",
                       help="how a decoding step's attention reads the cache: flex (FlexAttention over a block "
                            "mask; its cost does not grow with the cache's width), dense (the model's own attention "
                            "over a float mask), or auto (dense: measured faster so far) "
                            "(default: %(default)s)")
    group.add_argument("--packed_weights", choices=["auto", "off"], default="auto",
                       help="multiply tree steps with weights packed for their row count: auto (a float32 model on "
                            "a CPU with MKL) or off (default: %(default)s)")


def add_decode_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("decoding")
    group.add_argument("--method", choices=["ppd", "baseline"], default="ppd")
    group.add_argument("--max_new_tokens", type=int, default=512)
    group.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (lossless)")
    group.add_argument("--top_p", type=float, default=1.0, help="nucleus mass when sampling")
    group.add_argument("--top_k", type=int, default=0, help="sample among the k most likely tokens (0: all)")
    group.add_argument("--acceptance", choices=["lossless", "typical"], default="lossless",
                       help="how sampled guesses are verified: lossless (exact samples from the model) or "
                            "typical (Medusa's typical acceptance: more guesses kept, not the model's "
                            "distribution)")
    group.add_argument("--posterior_threshold", type=float, default=0.09, help="typical acceptance only")
    group.add_argument("--posterior_alpha", type=float, default=0.3, help="typical acceptance only")
    group.add_argument("--seed", type=int, default=None)


def decode_config(args: argparse.Namespace) -> DecodeConfig:
    return DecodeConfig(
        method=args.method, max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, acceptance=args.acceptance, posterior_threshold=args.posterior_threshold, posterior_alpha=args.posterior_alpha, seed=args.seed,
        capture=getattr(args, "capture", "auto"),
    )


@dataclass
class Loaded:
    model: object
    tokenizer: object
    info: ModelInfo
    decoder: Decoder
    adapter: str  # where the prompt tokens came from, for logs and reports
    tree: str = "none"  # where the tree set (or batch policy) came from


def load_decoder(args: argparse.Namespace, with_prompt_tokens: bool = True) -> Loaded:
    """The model, its prompt tokens and tree set as the common flags ask, in one decoder. What the user
    names is read first (``--adapter``, ``--tree``), so that a bad file or an unreachable hub id fails
    before the model loads."""
    adapter = getattr(args, "adapter", None) if with_prompt_tokens else None
    tree = getattr(args, "tree", None) if with_prompt_tokens else None
    given = AdapterFiles.read(adapter, getattr(args, "adapter_revision", None)) if adapter else None
    given_trees = TreeSet.load(tree) if tree else None
    model, tokenizer, info = load_model(
        args.model, device=args.device, dtype=args.dtype,
        load_in_4bit=getattr(args, "load_in_4bit", False), load_in_8bit=getattr(args, "load_in_8bit", False),
        chat_template=getattr(args, "chat_template", "auto"),
    )
    files, choice = None, TreeChoice(None, None, "none")
    if with_prompt_tokens:
        files, choice = prompt_tokens_and_trees(model, tokenizer, info, given, given_trees, str(tree))
        picked, lookup = getattr(args, "tree_choice", None), getattr(args, "lookup", None)
        if picked is not None or lookup is not None:
            trees = choice.trees
            if trees is None and choice.policy is None:  # the packaged default the decoder would take
                config = files.prompt_tokens.config
                trees = default_tree_set(config.num_prompt_tokens, config.num_ensemble)
            choice = dataclasses.replace(
                choice, trees=edited(trees, picked, lookup) if trees is not None else None,
                policy=choice.policy.each(lambda t: edited(t, picked, lookup)) if choice.policy is not None else None,
                source=f"{choice.source}{edit_label(picked, lookup)}")
    decoder = Decoder(model, files.prompt_tokens if files else None, choice.trees,
                      eos_token_ids=eos_ids_of(model, tokenizer), max_seq_len=getattr(args, "max_seq_len", None),
                      policy=choice.policy,
                      packed_weights=False if getattr(args, "packed_weights", "auto") == "off" else None,
                      attention=getattr(args, "attention", "auto"))
    return Loaded(model, tokenizer, info, decoder, files.source if files else "none", choice.source)


# What a model, adapter or tree set that cannot be loaded as asked raises: a missing or damaged file, a hub
# id that cannot be reached (OSError), a mismatch or an impossible setting (ValueError).
LOAD_ERRORS = (OSError, ValueError)


def load_decoder_or_exit(args: argparse.Namespace, with_prompt_tokens: bool = True) -> Loaded:
    """:func:`load_decoder` for a program's ``main``: what cannot be loaded ends the program with one line
    naming it (exit status 2), not a traceback."""
    try:
        return load_decoder(args, with_prompt_tokens)
    except LOAD_ERRORS as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None


def edited(trees: TreeSet, choice: str | None, lookup: int | None) -> TreeSet:
    """``trees`` with candidates chosen as ``choice`` says and a lookup chain of ``lookup`` nodes, where given."""
    if choice is not None:
        trees = trees.chosen(choice)
    return trees if lookup is None else trees.with_lookup(lookup)


def edit_label(choice: str | None, lookup: int | None) -> str:
    """What :func:`edited` changes, for a tree set's name: `` (confident)``, `` (lookup 8)``, or nothing."""
    parts = ([choice] if choice is not None else []) + ([f"lookup {lookup}"] if lookup is not None else [])
    return f" ({', '.join(parts)})" if parts else ""


def tree_files(names, choice: str | None = None, lookup: int | None = None) -> dict[str, TreeSet]:
    """The tree-set files a tool compares (its ``--trees``), by name, with candidates chosen as ``choice`` says
    and a lookup chain of ``lookup`` nodes where given (``--tree_choice`` and ``--lookup`` apply to them as to the
    decoder's own trees); a file they change is named ``<file> (<what changed>)``. What cannot be read ends the
    program as :func:`load_decoder_or_exit` does."""
    found = {}
    for name in names or []:
        try:
            trees = TreeSet.load(name)
            changed = edited(trees, choice, lookup)
        except LOAD_ERRORS as err:
            print(f"error: {err}", file=sys.stderr)
            raise SystemExit(2) from None
        # (named for what it changes in this file: a file that already is as asked keeps its name)
        name += edit_label(choice if changed.choice is not trees.choice else None,
                           lookup if changed.lookup != trees.lookup else None)
        found[name] = changed
    return found

"""Publish a trained adapter to the Hugging Face Hub.

Usage (from the repository root):

    python -m train.push --adapter runs/smollm2-ppd --repo_id ORG/NAME [--private] [--revision BRANCH]

Uploads the adapter's ``ppd_config.json``, ``prompt_tokens.safetensors``, tree sets and batch policies and
its model card (``README.md``, written from the adapter's config where the folder has none); checkpoints
and logs stay local. The adapter is read first, so a damaged one is never published. The token is the one
``huggingface-cli login`` stored, or ``--token``/``$HF_TOKEN``. Users then decode with
``--adapter ORG/NAME`` (``ORG/NAME@COMMIT`` pins a revision).
"""

from __future__ import annotations

import argparse
import sys

from ppd.hub import push_adapter


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m train.push", description=__doc__.split("\n")[0])
    parser.add_argument("--adapter", required=True, help="adapter folder (the output_dir of train.train)")
    parser.add_argument("--repo_id", required=True, help="hub repository 'org/name' (created if missing)")
    parser.add_argument("--revision", default=None, help="branch to commit to (default: main)")
    parser.add_argument("--private", action="store_true", help="create the repository as private")
    parser.add_argument("--token", default=None, help="hub token (default: the stored login or $HF_TOKEN)")
    parser.add_argument("--commit_message", default=None)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    try:
        commit = push_adapter(args.adapter, args.repo_id, revision=args.revision, private=args.private or None,
                              token=args.token, commit_message=args.commit_message)
    except (OSError, ValueError) as error:
        print(f"train.push: error: {error}", file=sys.stderr)
        return 1
    print(f"pushed {args.adapter} to {args.repo_id}: {getattr(commit, 'commit_url', commit)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

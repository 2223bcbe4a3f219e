"""Adapters on the Hugging Face Hub: fetching one by repository id, and publishing one.

An adapter on the Hub is a model repository holding the adapter folder's files as they are
(``ppd_config.json``, ``prompt_tokens.safetensors``, the tree sets and batch policies, the model card
``README.md``). ``--adapter`` takes a folder or a hub id, optionally pinned to a revision as
``org/name@REVISION`` (a branch, a tag or a commit); the files come through ``huggingface_hub``'s cache, so
the usual ``HF_HUB_OFFLINE=1`` and ``HF_HUB_CACHE`` apply, and what was read is named by its commit
(``hub:org/name@<commit>``), so a report says exactly which prompt tokens it measured.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from .prompt_tokens import CONFIG_NAME, WEIGHTS_NAME, PromptTokens

# Everything an adapter folder may hold that decoding reads, and its model card; nothing else is fetched
# or published (checkpoints, optimizer states and logs of a training run stay local).
ADAPTER_PATTERNS = (CONFIG_NAME, WEIGHTS_NAME, "tree_*.json", "policy_*.json", "README.md")
CARD_NAME = "README.md"
# A repository id as the Hub accepts it ("org/name"), with an optional "@revision".
HUB_ADAPTER = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(@(?P<revision>[\w./-]+))?")


@dataclass(frozen=True)
class AdapterLocation:
    """A folder holding an adapter, and how reports name it: the folder, or ``hub:org/name@<commit>``."""

    path: Path
    source: str


def resolve_adapter(name: str | Path, revision: str | None = None) -> AdapterLocation:
    """The local folder of the adapter ``name``: an existing folder, or a hub id (``org/name`` or
    ``org/name@REVISION``; ``revision`` names the revision too) fetched into the Hugging Face cache.

    A name that is neither raises ``FileNotFoundError``; a hub repository that cannot be fetched (offline
    and not cached, not found, no such revision) raises ``OSError`` naming it.
    """
    path = Path(name).expanduser()
    if path.is_dir():
        if revision:
            raise ValueError(f"a revision ({revision}) applies to hub ids only; {name} is a local folder")
        return AdapterLocation(path, str(path))
    if path.exists():
        raise ValueError(f"{name} is a file; an adapter is a folder (with {CONFIG_NAME} and {WEIGHTS_NAME}) "
                         "or a hub id 'org/name'")
    match = HUB_ADAPTER.fullmatch(str(name))
    if match is None:
        raise FileNotFoundError(f"adapter folder {name} does not exist (and it is not a hub id 'org/name' or "
                                "'org/name@revision')")
    repo, pinned = match["repo"], match["revision"]
    if pinned and revision and pinned != revision:
        raise ValueError(f"adapter {name} names revision {pinned} but {revision} was asked for as well")
    revision = pinned or revision or "main"
    from huggingface_hub import snapshot_download

    try:
        folder = Path(snapshot_download(repo, revision=revision, allow_patterns=list(ADAPTER_PATTERNS)))
    except Exception as err:  # huggingface_hub's own errors: offline, not found, gated, no such revision
        raise OSError(f"adapter {repo}@{revision} is not a folder here and cannot be fetched from the Hugging "
                      f"Face Hub: {type(err).__name__}: {err}") from err
    if not (folder / CONFIG_NAME).is_file():
        raise FileNotFoundError(f"hub repository {repo}@{revision} holds no {CONFIG_NAME}: not a ppd adapter")
    # snapshot_download returns .../snapshots/<commit>: the commit pins what was read.
    return AdapterLocation(folder, f"hub:{repo}@{folder.name}")


def model_card(tokens: PromptTokens, tree_files: list[str]) -> str:
    """A model card for an adapter folder that has none: the Hub's metadata header, what the adapter is
    and how to decode with it."""
    config = tokens.config
    lines = [
        "---",
        "library_name: ppd",
        *([f"base_model: {config.base_model}"] if config.base_model else []),
        "tags:",
        "- ppd",
        "- parallel-prompt-decoding",
        "- speculative-decoding",
        "---",
        "",
        f"# ppd prompt tokens for {config.base_model or 'a causal LM'}",
        "",
        f"{config.num_prompt_tokens} prompt tokens (N = {config.num_prompt_tokens}, V = {config.num_ensemble}, "
        f"{config.attention_type.value} attention) trained with ppd (Parallel Prompt Decoding) for "
        f"`{config.base_model or 'the base model'}`"
        + (f" (revision `{config.base_model_revision}`)" if config.base_model_revision else "")
        + ". The base model is frozen and unchanged: greedy output is token for token the base model's own.",
        "",
        "Tree sets: " + (", ".join(f"`{f}`" for f in tree_files) if tree_files else "none (ppd's default tree)")
        + ".",
        "",
        "```python",
        "from ppd import PPDModel",
        "",
        f'model = PPDModel.from_pretrained("{config.base_model or "BASE_MODEL"}", adapter="THIS_REPO_ID")',
        "output = model.generate(input_ids, max_new_tokens=256)",
        "```",
        "",
    ]
    return "\n".join(lines)


def push_adapter(adapter_dir: str | Path, repo_id: str, *, revision: str | None = None, private: bool | None = None,
                 token: str | None = None, commit_message: str | None = None, api=None):
    """Publish the adapter folder ``adapter_dir`` to the Hub repository ``repo_id`` (created if missing):
    its config, prompt tokens, tree sets, batch policies and model card (written from the config when the
    folder has none). The adapter is read first, so a damaged one is never published. Returns the commit
    information ``HfApi.upload_folder`` gives; ``api`` replaces the ``HfApi`` client."""
    from .files import atomic_write_text

    adapter_dir = Path(adapter_dir)
    if HUB_ADAPTER.fullmatch(repo_id) is None or "@" in repo_id:
        raise ValueError(f"{repo_id!r} is not a hub repository id 'org/name'")
    tokens = PromptTokens.from_pretrained(adapter_dir)
    card = adapter_dir / CARD_NAME
    if not card.is_file():
        trees = sorted(p.name for p in adapter_dir.glob("tree_*.json"))
        atomic_write_text(card, model_card(tokens, trees))
    if api is None:
        from huggingface_hub import HfApi

        api = HfApi(token=token)
    api.create_repo(repo_id, private=private, exist_ok=True)
    return api.upload_folder(repo_id=repo_id, folder_path=str(adapter_dir), allow_patterns=list(ADAPTER_PATTERNS),
                             revision=revision,
                             commit_message=commit_message or f"ppd adapter for {tokens.config.base_model or 'a model'}")

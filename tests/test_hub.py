"""Adapters by hub id: read from a folder laid out as the Hugging Face cache serves a downloaded
repository (``models--org--name/refs``, ``snapshots/<commit>`` linking into ``blobs``), offline, pinned by
revision; and published: ``push_adapter`` uploads the adapter's files and model card and nothing else, and
what it uploaded loads back the same."""

import fnmatch
import hashlib
import shutil
from pathlib import Path

import pytest
import torch

from ppd import PPDModel, PromptTokens
from ppd.adapter import AdapterFiles
from ppd.hub import ADAPTER_PATTERNS, push_adapter, resolve_adapter
from ppd.prompt_tokens import packaged_adapter

SHIPPED = packaged_adapter("HuggingFaceTB/SmolLM2-135M-Instruct")


class CachedHub:
    """Repositories written into a Hugging Face cache folder exactly as ``snapshot_download`` leaves them; as
    an upload client (``create_repo``, ``upload_folder``), each upload becomes a new commit of the branch."""

    def __init__(self, root: Path):
        self.root = root
        self.uploads: list[list[str]] = []

    def repo_dir(self, repo_id: str) -> Path:
        return self.root / f"models--{repo_id.replace('/', '--')}"

    def commit(self, repo_id: str, files: dict[str, bytes], ref: str = "main") -> str:
        commit = hashlib.sha1(b"".join(sorted(files.values())) + ref.encode()).hexdigest()
        repo = self.repo_dir(repo_id)
        snapshot = repo / "snapshots" / commit
        snapshot.mkdir(parents=True, exist_ok=True)
        (repo / "blobs").mkdir(exist_ok=True)
        for name, data in files.items():
            blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
            blob.write_bytes(data)
            (snapshot / name).symlink_to(Path("../..") / "blobs" / blob.name)
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
        return commit

    def create_repo(self, repo_id, private=None, exist_ok=False):
        self.repo_dir(repo_id).mkdir(parents=True, exist_ok=True)

    def upload_folder(self, repo_id, folder_path, allow_patterns, revision=None, commit_message=""):
        files = {p.name: p.read_bytes() for p in sorted(Path(folder_path).iterdir())
                 if p.is_file() and any(fnmatch.fnmatch(p.name, pattern) for pattern in allow_patterns)}
        self.uploads.append(sorted(files))
        return self.commit(repo_id, files, revision or "main")


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """An offline Hugging Face cache in ``tmp_path``, the way HF_HUB_CACHE and HF_HUB_OFFLINE=1 set one."""
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return CachedHub(tmp_path / "hub")


def shipped_files() -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(SHIPPED.iterdir()) if p.is_file()}


def test_an_adapter_loads_by_hub_id_pinned_to_its_commit(hub):
    commit = hub.commit("ppd-test/smollm2-prompt-tokens", shipped_files())
    location = resolve_adapter("ppd-test/smollm2-prompt-tokens")
    assert location.source == f"hub:ppd-test/smollm2-prompt-tokens@{commit}"
    loaded = PromptTokens.from_pretrained(location.path)
    assert torch.equal(loaded.embeddings, PromptTokens.from_pretrained(SHIPPED).embeddings)
    # Pinned by commit, by "@revision" in the name, or by a branch name recorded in refs/.
    assert resolve_adapter("ppd-test/smollm2-prompt-tokens", revision=commit).path == location.path
    assert resolve_adapter(f"ppd-test/smollm2-prompt-tokens@{commit}").path == location.path
    changed = dict(shipped_files(), **{"README.md": b"# another card\n"})
    other = hub.commit("ppd-test/smollm2-prompt-tokens", changed, ref="v2")
    assert resolve_adapter("ppd-test/smollm2-prompt-tokens@v2").source.endswith(other)


def test_hub_ids_that_cannot_be_read_name_the_problem(hub, tmp_path):
    with pytest.raises(OSError, match="ppd-test/missing@main .* cannot be fetched"):
        resolve_adapter("ppd-test/missing")
    hub.commit("ppd-test/smollm2-prompt-tokens", shipped_files())
    with pytest.raises(OSError, match="@v9"):
        resolve_adapter("ppd-test/smollm2-prompt-tokens@v9")
    with pytest.raises(ValueError, match="names revision main but v2"):
        resolve_adapter("ppd-test/smollm2-prompt-tokens@main", revision="v2")
    with pytest.raises(FileNotFoundError, match="not a hub id"):
        resolve_adapter("./no/such/adapter/folder")
    with pytest.raises(ValueError, match="hub ids only"):
        resolve_adapter(SHIPPED, revision="main")
    not_adapter = hub.commit("ppd-test/a-model", {"README.md": b"# a model, not an adapter\n"})
    with pytest.raises(FileNotFoundError, match="no ppd_config.json"):
        resolve_adapter(f"ppd-test/a-model@{not_adapter}")


def test_push_uploads_the_adapter_with_a_card_and_it_loads_back(hub, tmp_path):
    adapter = tmp_path / "run"
    shutil.copytree(SHIPPED, adapter)
    (adapter / "README.md").unlink()
    (adapter / "checkpoint-4").mkdir()  # what a training run leaves beside the adapter: never published
    (adapter / "trainer_log.jsonl").write_text("{}\n")
    commit = push_adapter(adapter, "ppd-test/pushed", api=hub)
    uploaded = hub.uploads[-1]
    assert "README.md" in uploaded and "trainer_log.jsonl" not in uploaded
    assert all(any(fnmatch.fnmatch(name, p) for p in ADAPTER_PATTERNS) for name in uploaded)
    assert set(uploaded) - {"README.md"} == {p.name for p in SHIPPED.iterdir() if p.name != "README.md"}
    card = (adapter / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: ppd\nbase_model: HuggingFaceTB/SmolLM2-135M-Instruct\n")
    assert "tree_cpu_float32.json" in card
    back = AdapterFiles.read("ppd-test/pushed")
    assert back.source == f"hub:ppd-test/pushed@{commit}"
    assert torch.equal(back.prompt_tokens.embeddings, PromptTokens.from_pretrained(SHIPPED).embeddings)
    with pytest.raises(ValueError, match="not a hub repository id"):
        push_adapter(adapter, "no-org-name", api=hub)
    (adapter / "prompt_tokens.safetensors").write_bytes(b"damaged")
    with pytest.raises(ValueError, match="cannot be read as a safetensors file"):
        push_adapter(adapter, "ppd-test/pushed", api=hub)


def test_ppd_model_decodes_with_a_hub_adapter_and_its_trees(hub, real_model):
    model, tokenizer, _ = real_model
    commit = hub.commit("ppd-test/smollm2-prompt-tokens", shipped_files())
    ppd = PPDModel.from_model(model, tokenizer, adapter="ppd-test/smollm2-prompt-tokens")
    assert ppd.adapter == f"hub:ppd-test/smollm2-prompt-tokens@{commit}"
    assert ppd.tree.endswith(":tree_cpu_float32.json")
    ids = torch.tensor([tokenizer("The capital of France is")["input_ids"]])
    assert torch.equal(ppd.generate(ids, max_new_tokens=24, do_sample=False),
                       model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False))

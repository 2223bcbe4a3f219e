"""Sparse trees as data: JSON files of candidate paths, and the tensors one tree step needs.

A tree answers "which guesses to verify, and which prompt tokens to attach" for one *depth key* d, the
number of prompt distributions available this step (REFERENCE section 3). A candidate is a path of ranks:
element k of a path picks the rank-``path[k]`` token of the k-th prompt distribution's top-K. Every node,
the root included, carries ``1..N`` attached prompt tokens that draft the next step; the next step uses
the tree whose key equals the count attached to the last accepted node.

A tree set's ``choice`` says where each step's candidates come from: ``fixed`` (the default), the paths as
written; ``confident``, as many candidates as the key's tree has, chosen anew at every step as the rank paths
(no deeper than the key) with the largest products of the prompt tokens' probabilities, and the tree's
attached prompt-token counts handed out largest first in that order: each step has the written tree's rows,
spent where this step's guesses are surest (``ppd.decoding.confident``).

A tree set's ``lookup`` (0: none) adds to every fixed tree a chain of that many nodes beside its candidates, whose
tokens come from prompt lookup instead of the guesses: the tokens that followed the latest earlier occurrence of
the text's last few tokens, in the prompt or in the answer so far (``ppd.decoding.lookup``). Chain nodes carry no
prompt tokens; a step that accepts a chain's node is followed by the key-0 tree, the root with N prompt tokens and
the chain alone.

JSON layout (``ppd/trees/*.json``)::

    {"format_version": 1, "num_prompt_tokens": 3, "top_k": 10, "metadata": {...}, "choice": "fixed",
     "lookup": 8, "trees": {"3": {"root_prompt_tokens": 3,
                     "nodes": [{"path": [0], "prompt_tokens": 3}, {"path": [0, 0], "prompt_tokens": 2}]}}}
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path

import torch

from .attention import prompt_block_mask
from .config import AttentionType
from .files import atomic_write_json, check_format_version, load_json_file

TREE_FORMAT_VERSION = 1
DEFAULT_TREE_FILE = "default.json"
MAX_LOOKUP = 64  # the longest prompt-lookup chain a tree set may ask for


@dataclass(frozen=True)
class Tree:
    """Candidate paths (without the root) and the prompt tokens attached to the root and to each path."""

    paths: tuple[tuple[int, ...], ...]
    prompt_tokens: tuple[int, ...]  # attached to each path, same order as ``paths``
    root_prompt_tokens: int

    def __post_init__(self) -> None:
        if len(self.paths) != len(self.prompt_tokens):
            raise ValueError("a tree needs one prompt-token count per path")
        seen = set(self.paths)
        if len(seen) != len(self.paths):
            raise ValueError("a tree lists the same path twice")
        for path in self.paths:
            if not path:
                raise ValueError("the root is implicit: a path must not be empty")
            if path[:-1] and path[:-1] not in seen:
                raise ValueError(f"path {list(path)} has no parent {list(path[:-1])} in the tree")

    @property
    def depth(self) -> int:
        return max((len(p) for p in self.paths), default=0)

    @property
    def num_nodes(self) -> int:
        """Root plus candidates."""
        return 1 + len(self.paths)

    def num_rows(self, num_ensemble: int) -> int:
        """Rows of one tree forward: root, candidates and every attached prompt-token copy."""
        return self.num_nodes + num_ensemble * (self.root_prompt_tokens + sum(self.prompt_tokens))

    def to_json(self) -> dict:
        return {
            "root_prompt_tokens": self.root_prompt_tokens,
            "nodes": [{"path": list(p), "prompt_tokens": n} for p, n in zip(self.paths, self.prompt_tokens)],
        }

    @classmethod
    def from_json(cls, data: dict) -> "Tree":
        nodes = data.get("nodes", [])
        return cls(
            paths=tuple(tuple(int(x) for x in node["path"]) for node in nodes),
            prompt_tokens=tuple(int(node["prompt_tokens"]) for node in nodes),
            root_prompt_tokens=int(data["root_prompt_tokens"]),
        )


class CandidateChoice(str, enum.Enum):
    """Where a step's candidates come from (see the module's docstring)."""

    FIXED = "fixed"
    CONFIDENT = "confident"


@dataclass(frozen=True)
class TreeSet:
    """One tree per depth key 1..N, read from and written to JSON."""

    num_prompt_tokens: int
    top_k: int
    trees: dict[int, Tree]
    metadata: dict = field(default_factory=dict)
    choice: CandidateChoice = CandidateChoice.FIXED
    lookup: int = 0  # prompt-lookup chain nodes beside each tree (0: none)

    def __post_init__(self) -> None:
        object.__setattr__(self, "choice", CandidateChoice(self.choice))
        n, k = self.num_prompt_tokens, self.top_k
        if not 0 <= self.lookup <= MAX_LOOKUP:
            raise ValueError(f"a tree set's lookup chain must have 0..{MAX_LOOKUP} nodes, got {self.lookup}")
        if self.lookup and self.confident:
            raise ValueError("a prompt-lookup chain is built beside fixed trees only, not beside confident ones")
        if set(self.trees) != set(range(1, n + 1)):
            raise ValueError(f"a tree set for N={n} needs trees for depth keys 1..{n}, got {sorted(self.trees)}")
        for key, tree in self.trees.items():
            if tree.depth > key:
                raise ValueError(f"tree {key} has a path deeper than its key ({tree.depth} > {key})")
            for path in tree.paths:
                if any(not 0 <= r < k for r in path):
                    raise ValueError(f"tree {key}: path {list(path)} has a rank outside top-{k}")
            for count in (tree.root_prompt_tokens, *tree.prompt_tokens):
                if not 1 <= count <= n:
                    raise ValueError(f"tree {key}: attached prompt tokens must be in 1..{n}, got {count}")

    def max_rows(self, num_ensemble: int) -> int:
        """Rows of the set's largest step: its largest tree's, and its lookup chain's."""
        return max(tree.num_rows(num_ensemble) for tree in self.trees.values()) + self.lookup

    @property
    def confident(self) -> bool:
        return self.choice is CandidateChoice.CONFIDENT

    def identity(self) -> tuple:
        """The trees, their top-k and their choice without the metadata: equal for two files that verify the same
        candidates the same way (how a measurement of one file is found for another)."""
        return (self.num_prompt_tokens, self.top_k, self.choice.value, self.lookup,
                tuple((k, t.paths, t.prompt_tokens, t.root_prompt_tokens) for k, t in sorted(self.trees.items())))

    def chosen(self, choice: CandidateChoice | str) -> "TreeSet":
        """The same trees with candidates chosen as ``choice`` says."""
        return replace(self, choice=CandidateChoice(choice))

    def with_lookup(self, nodes: int) -> "TreeSet":
        """The same trees with a prompt-lookup chain of ``nodes`` beside them (0: none)."""
        return replace(self, lookup=nodes)

    def to_json(self) -> dict:
        return {
            "format_version": TREE_FORMAT_VERSION,
            "num_prompt_tokens": self.num_prompt_tokens,
            "top_k": self.top_k,
            "metadata": self.metadata,
            "choice": self.choice.value,
            **({"lookup": self.lookup} if self.lookup else {}),
            "trees": {str(key): self.trees[key].to_json() for key in sorted(self.trees)},
        }

    @classmethod
    def from_json(cls, data: dict) -> "TreeSet":
        check_format_version(data, TREE_FORMAT_VERSION, "tree file")
        choice = data.get("choice", CandidateChoice.FIXED.value)
        if choice not in {c.value for c in CandidateChoice}:
            raise ValueError(f"a tree file's choice must be one of {[c.value for c in CandidateChoice]}, "
                             f"got {choice!r}")
        return cls(
            num_prompt_tokens=int(data["num_prompt_tokens"]),
            top_k=int(data["top_k"]),
            trees={int(key): Tree.from_json(tree) for key, tree in data["trees"].items()},
            metadata=dict(data.get("metadata", {})),
            choice=CandidateChoice(choice),
            lookup=int(data.get("lookup", 0)),
        )

    def save(self, path: str | Path) -> None:
        atomic_write_json(path, self.to_json(), sort_keys=True)

    @classmethod
    def load(cls, path: str | Path) -> "TreeSet":
        return load_json_file(path, cls.from_json, "a ppd tree file (num_prompt_tokens, top_k and trees)")

    @staticmethod
    def adapter_file(adapter_dir: str | Path, device_type: str, dtype: str | None = None) -> Path | None:
        """The file of the tree set an adapter ships for this device type and dtype, if any:
        ``tree_<device_type>_<dtype>.json``, else ``tree_<device_type>.json``."""
        names = ([f"tree_{device_type}_{dtype}.json"] if dtype else []) + [f"tree_{device_type}.json"]
        return next((Path(adapter_dir) / n for n in names if (Path(adapter_dir) / n).is_file()), None)

    @classmethod
    def for_adapter(cls, adapter_dir: str | Path, device_type: str, dtype: str | None = None) -> "TreeSet | None":
        """The tree set an adapter ships for this device type and dtype (see :meth:`adapter_file`), if any.

        Trees depend on the prompt tokens' accuracies and on how a step's cost grows with its rows, which
        differs by device and dtype, so an adapter may carry one per device type (``cpu``, ``cuda``) and
        optionally per dtype (``tree_cuda_bfloat16.json``).
        """
        path = cls.adapter_file(adapter_dir, device_type, dtype)
        return cls.load(path) if path is not None else None

    @classmethod
    def packaged(cls, name: str = DEFAULT_TREE_FILE) -> "TreeSet":
        """A tree set shipped inside the package (``ppd/trees/NAME``)."""
        return cls.from_json(json.loads(resources.files("ppd").joinpath("trees", name).read_text()))


@dataclass
class TreeBuffers:
    """Tensors of one tree step, built once per tree and device.

    Row order of the forward: row 0 the root, rows ``1..C`` the candidates (parents before children),
    then the attached prompt-token rows. ``T`` rows in all.
    """

    key: int
    num_rows: int  # T
    num_nodes: int  # 1 + C
    depth: int
    max_offset: int  # largest position offset of any row
    candidate_index: torch.Tensor  # long [C]: index into the flattened guesses [key * K]
    parent_row: torch.Tensor  # long [C]: row of each candidate's parent
    prompt_index: torch.Tensor  # long [T - 1 - C]: row of the prompt-token table for each prompt row
    position_offset: torch.Tensor  # long [T]: position minus the root's position
    allowed: torch.Tensor  # bool [T, T]: row may attend to row
    retrieve_indices: torch.Tensor  # long [P, depth + 1]: rows of each root-to-leaf path, 0-padded
    retrieve_valid: torch.Tensor  # bool [P, depth + 1]
    node_prompt_rows: torch.Tensor  # long [1 + C, N * V]: rows of each node's attached prompt tokens, 0-padded
    node_prompt_count: torch.Tensor  # long [1 + C]: prompt tokens attached to each node

    @classmethod
    def build(
        cls, tree: Tree, key: int, num_prompt_tokens: int, num_ensemble: int,
        attention_type: AttentionType | str, top_k: int, device: torch.device | str = "cpu",
    ) -> "TreeBuffers":
        order = sorted(range(len(tree.paths)), key=lambda i: (len(tree.paths[i]), tree.paths[i]))
        paths = [tree.paths[i] for i in order]
        attached = [tree.root_prompt_tokens] + [tree.prompt_tokens[i] for i in order]
        row_of = {(): 0, **{p: i + 1 for i, p in enumerate(paths)}}
        num_nodes = len(paths) + 1
        V = num_ensemble

        # Nodes: each sees its ancestors and itself.
        ancestors = [[0]] + [[row_of[p[:j]] for j in range(len(p) + 1)] for p in paths]
        depth_of = [0] + [len(p) for p in paths]

        prompt_index, position_offset = [], list(depth_of)
        node_prompt_rows = torch.zeros(num_nodes, num_prompt_tokens * V, dtype=torch.long)
        prompt_owner, prompt_local = [], []  # owning node, and index within that node's prompt block
        row = num_nodes
        for node, count in enumerate(attached):
            for local in range(count * V):
                k = local // V
                prompt_index.append(local)  # the table row: copy j of prompt token k is row k * V + j
                position_offset.append(depth_of[node] + 1 + k)
                prompt_owner.append(node)
                prompt_local.append(local)
                node_prompt_rows[node, local] = row
                row += 1
        num_rows = row
        allowed = torch.zeros(num_rows, num_rows, dtype=torch.bool)
        for node, anc in enumerate(ancestors):
            allowed[node, anc] = True
        block = prompt_block_mask(num_prompt_tokens, V, attention_type)
        start = num_nodes
        for node, count in enumerate(attached):
            rows = torch.arange(start, start + count * V)
            allowed[rows[:, None], torch.tensor(ancestors[node])[None, :]] = True
            allowed[rows[:, None], rows[None, :]] = block[: count * V, : count * V]
            start += count * V

        parents = {p[:-1] for p in paths}
        leaves = [p for p in paths if p not in parents]
        depth = tree.depth
        retrieve = torch.zeros(max(len(leaves), 1), depth + 1, dtype=torch.long)
        valid = torch.zeros_like(retrieve, dtype=torch.bool)
        valid[:, 0] = True
        for i, leaf in enumerate(leaves):
            for j in range(len(leaf)):
                retrieve[i, j + 1] = row_of[leaf[: j + 1]]
                valid[i, j + 1] = True

        def t(x, dtype=torch.long):
            return torch.as_tensor(x, dtype=dtype).to(device)

        return cls(
            key=key,
            num_rows=num_rows,
            num_nodes=num_nodes,
            depth=depth,
            max_offset=max(position_offset),
            candidate_index=t([(len(p) - 1) * top_k + p[-1] for p in paths]),
            parent_row=t([row_of[p[:-1]] for p in paths]),
            prompt_index=t(prompt_index),
            position_offset=t(position_offset),
            allowed=allowed.to(device),
            retrieve_indices=retrieve.to(device),
            retrieve_valid=valid.to(device),
            node_prompt_rows=node_prompt_rows.to(device),
            node_prompt_count=t(attached),
        )

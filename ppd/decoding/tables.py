"""Every tree of a tree set as one stack of device tensors, indexed by each batch row's depth key.

The captured step does not switch trees on the host: it reads row b's tree as ``table[key[b]]``. So all
trees of a set are padded to the same shapes (the largest tree's rows, candidates, paths and depth) and
stacked along a leading key axis (index 0 repeats key 1, so any key a finished row holds stays in range).
Padding is inert: a padded candidate lies on no path and so is never accepted, a padded row attends only
to itself, and nothing reads its logits.

Row layout of every padded tree: row 0 the root, rows ``1..C`` the candidates (parents before children,
padding last), rows ``C + 1 .. T - 1`` the attached prompt-token rows (padding last).

A tree set with a prompt-lookup chain of L nodes (``TreeSet.lookup``) has L candidate rows more, after the padded
guessed ones, that hold the chain (``chain_node`` says which): its node i is the child of node i - 1 (the root for
the first), its candidate index points past the guesses (``N * K + i``, into the lookup's tokens that the step
appends to them), it carries no prompt tokens, and the last path is the chain's. Key 0, unused otherwise, is then
the root with N prompt tokens and no guessed candidate: the tree after a step that accepted a chain node (whose
guesses no prompt row made).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..config import AttentionType
from ..tree import Tree, TreeBuffers, TreeSet


MIN_SIZE = 2  # the least padded size of every tree dimension (see ``TreeTables.build``)


@dataclass
class RowTrees:
    """Each batch row's tree for one step (the shapes of :class:`TreeTables` without the key axis, with a batch
    axis): gathered by the rows' keys from a fixed tree set's tables, or chosen for this step
    (``ppd.decoding.confident``)."""

    candidate_index: torch.Tensor  # long [B, C]
    parent_row: torch.Tensor  # long [B, C]
    is_candidate: torch.Tensor  # bool [B, C]
    prompt_index: torch.Tensor  # long [B, T-1-C]
    position_offset: torch.Tensor  # long [B, T]
    allowed: torch.Tensor  # bool [B, T, T]
    retrieve_indices: torch.Tensor  # long [B, P, depth + 1]
    retrieve_valid: torch.Tensor  # bool [B, P, depth + 1]
    node_prompt_rows: torch.Tensor  # long [B, 1+C, N*V]
    node_prompt_count: torch.Tensor  # long [B, 1+C]


@dataclass
class TreeTables:
    num_prompt_tokens: int  # N
    num_ensemble: int  # V
    top_k: int  # K
    num_rows: int  # T, rows of one forward
    num_candidates: int  # C, candidate rows (root excluded)
    depth: int  # longest path
    candidate_index: torch.Tensor  # long [N+1, C]: index into a row's flattened guesses [N * K]
    parent_row: torch.Tensor  # long [N+1, C]: row of each candidate's parent
    is_candidate: torch.Tensor  # bool [N+1, C]: a real candidate, not padding
    prompt_index: torch.Tensor  # long [N+1, T-1-C]: prompt-token table row of each prompt row
    position_offset: torch.Tensor  # long [N+1, T]: position minus the root's position
    allowed: torch.Tensor  # bool [N+1, T, T]: row may attend to row
    retrieve_indices: torch.Tensor  # long [N+1, P, depth + 1]: rows of each root-to-leaf path, 0-padded
    retrieve_valid: torch.Tensor  # bool [N+1, P, depth + 1]
    node_prompt_rows: torch.Tensor  # long [N+1, 1+C, N*V]: rows of each node's attached prompt tokens
    node_prompt_count: torch.Tensor  # long [N+1, 1+C]: prompt tokens attached to each node (the next key)
    max_offset: int  # largest position offset of any row of any tree
    lookup: int = 0  # L, the prompt-lookup chain's nodes (0: none)
    # long [C]: which chain node each candidate is (-1: a guessed one). A tensor, not the chain's first row, so
    # that one compiled step serves tree sets whose chains start at different rows.
    chain_node: torch.Tensor | None = None

    confident = False  # candidates chosen per step (``ppd.decoding.confident.ConfidentTables``)

    def for_rows(self, state) -> RowTrees:
        """Each row's tree this step: its key's tables (``state``: a ``DecodeState``)."""
        key = state.key
        return RowTrees(self.candidate_index[key], self.parent_row[key], self.is_candidate[key],
                        self.prompt_index[key], self.position_offset[key], self.allowed[key],
                        self.retrieve_indices[key], self.retrieve_valid[key], self.node_prompt_rows[key],
                        self.node_prompt_count[key])

    def with_chain(self, trees: RowTrees, real: torch.Tensor) -> RowTrees:
        """``trees`` (this set's, for each row) with the lookup chain's nodes that ``real`` [B, L] leaves out made
        padding: no candidate, on no path (the chain's, the last)."""
        node = self.chain_node.expand(real.shape[0], -1)
        is_candidate = torch.where(node >= 0, real.gather(1, node.clamp_min(0)), trees.is_candidate)
        paths = trees.retrieve_valid
        chain = torch.cat([paths[:, -1, :1], real, paths[:, -1, 1 + self.lookup:]], dim=1)
        return dataclasses.replace(trees, is_candidate=is_candidate,
                                   retrieve_valid=torch.cat([paths[:, :-1], chain[:, None]], dim=1))

    @property
    def most_emitted(self) -> int:
        """The most tokens one step emits for a row, as its report's columns count them: a path is at most N deep
        (padded to at least MIN_SIZE), or L where a lookup chain is longer, then the root."""
        return max(self.num_prompt_tokens, self.lookup, MIN_SIZE) + 1

    @classmethod
    def build(cls, trees: TreeSet, num_ensemble: int, attention_type: AttentionType | str,
              device: torch.device | str = "cpu", top_k: int | None = None) -> "TreeTables":
        """``top_k``: guesses kept per prompt token (default the tree set's own); tree sets that share a
        decoder state share one, at least each set's own."""
        n = trees.num_prompt_tokens
        top_k = top_k or trees.top_k
        if top_k < trees.top_k:
            raise ValueError(f"top_k {top_k} is below the tree set's top_k {trees.top_k}")
        per_key = [TreeBuffers.build(trees.trees[key], key, n, num_ensemble, attention_type, top_k)
                   for key in range(1, n + 1)]
        L = trees.lookup
        # Index 0 repeats key 1, or with a lookup chain is the root with N prompt tokens (see the module's docstring).
        first = TreeBuffers.build(Tree((), (), n), 0, n, num_ensemble, attention_type, top_k) if L else per_key[0]
        per_key = [first] + per_key
        # Every size the compiled step keeps symbolic is at least 2, and so is the depth (the step's emitted
        # tokens past the root): torch specialises a dimension of size 1, so a tree set with one path (or one
        # candidate, one prompt row, depth 1) would compile a step of its own, in each process, instead of
        # sharing the one step (and Inductor's cached code) of every other set.
        guessed = max(max(b.num_nodes for b in per_key) - 1, 0 if L else MIN_SIZE)  # candidate rows of the trees
        C = max(guessed + L, MIN_SIZE)
        prompt_rows = max(max(b.num_rows - b.num_nodes for b in per_key), MIN_SIZE)
        T = 1 + C + prompt_rows
        depth = max(max(b.depth for b in per_key), L, MIN_SIZE)
        paths = max(max(b.retrieve_indices.shape[0] for b in per_key) + (1 if L else 0), MIN_SIZE)
        NV = n * num_ensemble
        K1 = n + 1

        candidate_index = torch.zeros(K1, C, dtype=torch.long)
        parent_row = torch.zeros(K1, C, dtype=torch.long)
        is_candidate = torch.zeros(K1, C, dtype=torch.bool)
        prompt_index = torch.zeros(K1, prompt_rows, dtype=torch.long)
        position_offset = torch.zeros(K1, T, dtype=torch.long)
        allowed = torch.eye(T, dtype=torch.bool).repeat(K1, 1, 1)
        retrieve = torch.zeros(K1, paths, depth + 1, dtype=torch.long)
        valid = torch.zeros(K1, paths, depth + 1, dtype=torch.bool)
        valid[:, :, 0] = True
        node_rows = torch.zeros(K1, 1 + C, NV, dtype=torch.long)
        node_count = torch.ones(K1, 1 + C, dtype=torch.long)
        for k, b in enumerate(per_key):
            nodes, rows = b.num_nodes, b.num_rows
            # Tree row r -> padded row: nodes keep their index, prompt rows move to start after C + 1.
            remap = torch.cat([torch.arange(nodes), torch.arange(1 + C, 1 + C + rows - nodes)])
            c = nodes - 1
            candidate_index[k, :c] = b.candidate_index.cpu()
            parent_row[k, :c] = b.parent_row.cpu()
            is_candidate[k, :c] = True
            prompt_index[k, : rows - nodes] = b.prompt_index.cpu()
            position_offset[k, remap] = b.position_offset.cpu()
            allowed[k, remap[:, None], remap[None, :]] = b.allowed.cpu()
            p, d = b.retrieve_indices.shape
            retrieve[k, :p, :d] = b.retrieve_indices.cpu()  # node rows are not remapped
            valid[k, :p, :d] = b.retrieve_valid.cpu()
            count = b.node_prompt_count.cpu()
            node_count[k, :nodes] = count
            # Each node's attached prompt rows, remapped; unused slots point at row 0 (never read).
            used = torch.arange(NV)[None, :] < count[:, None] * num_ensemble
            node_rows[k, :nodes] = torch.where(used, remap[b.node_prompt_rows.cpu()], 0)
        chain_row = 1 + guessed  # the chain's first row
        chain_node = torch.full((C,), -1, dtype=torch.long)
        if L:  # the chain, the same in every key's tree (its validity is the step's: see ``ppd.decoding.lookup``)
            rows = torch.arange(chain_row, chain_row + L)
            candidate_index[:, rows - 1] = n * top_k + torch.arange(L)
            parent_row[:, rows - 1] = torch.cat([torch.zeros(1, dtype=torch.long), rows[:-1]])
            is_candidate[:, rows - 1] = True
            position_offset[:, rows] = torch.arange(1, L + 1)
            allowed[:, rows[:, None], rows[None, :]] = torch.ones(L, L, dtype=torch.bool).tril()
            allowed[:, rows, 0] = True
            retrieve[:, -1] = 0
            retrieve[:, -1, 1: L + 1] = rows
            valid[:, -1] = False
            valid[:, -1, : L + 1] = True
            node_count[:, rows] = 0
            chain_node[rows - 1] = torch.arange(L)
        return cls(
            num_prompt_tokens=n, num_ensemble=num_ensemble, top_k=top_k, num_rows=T, num_candidates=C,
            depth=depth, candidate_index=candidate_index.to(device), parent_row=parent_row.to(device),
            is_candidate=is_candidate.to(device), prompt_index=prompt_index.to(device),
            position_offset=position_offset.to(device),
            allowed=allowed.to(device), retrieve_indices=retrieve.to(device), retrieve_valid=valid.to(device),
            node_prompt_rows=node_rows.to(device), node_prompt_count=node_count.to(device),
            max_offset=max(max(b.max_offset for b in per_key), L),
            lookup=L, chain_node=chain_node.to(device),
        )

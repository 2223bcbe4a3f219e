"""Trees chosen at every step from the guesses' own probabilities (a tree set whose ``choice`` is ``confident``).

A fixed tree verifies the same rank paths at every step, whatever the prompt tokens are sure of. Here each
key's tree gives only the budget: its candidate count M, its attached prompt-token counts and the root's.
At every step each batch row takes the M rank paths (no deeper than its key) with the largest sums of the
guesses' log-probabilities along them, most likely first, and hands the tree's attached counts to them
largest first; so a step has the written tree's rows, spent where this step's guesses are surest: a chain
where the first guess is sure, a wide first level where it is not. Any tree is verified exactly, so greedy
output and the lossless sampling rule are unchanged; only the accept length moves (``results/dynamic_trees/``).

Everything runs on the device with fixed shapes, inside the compiled and captured step. The best M paths
come from a beam over the levels: a path among the best M has every prefix among them (a prefix's sum is
never smaller, and a depth penalty of :data:`DEPTH_TIE` breaks ties toward the shorter), so the best M of
depth ``l`` extend only the best M of depth ``l - 1``, and the best M overall are the best M of the levels'
survivors. Each chosen path's parent is then a chosen slot; the slots' ancestor chains give the mask,
positions and root-to-node paths of the step.

The row layout (which rows are whose prompt rows) depends only on the slot order, so it is built once, from
a template tree per key: M depth-1 nodes carrying the counts largest first.

The guesses' log-probabilities are kept by the prefill and by the steps of confident tables only (a step of
fixed trees skips the reduction over the vocabulary): a confident step after a fixed one, which a hand-made
batch policy mixing both could make, chooses from the prefill's older ones. Still exact, only less apt.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..config import AttentionType
from ..tree import Tree, TreeSet
from .tables import MIN_SIZE, RowTrees, TreeTables

# Subtracted per level from a path's log-probability sum before the best M are taken: a child whose guess has
# probability 1 (in float32) then still ranks after its parent, so the chosen paths are closed under prefixes.
DEPTH_TIE = 1e-5


def top_guesses(logits: torch.Tensor, top_k: int, log_probs: bool = True
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The ``top_k`` guesses of prompt-token ``logits`` [..., vocab]: their ids and, with ``log_probs``, their
    log-probabilities over the whole vocabulary in float32 (what confident trees choose by). The decoder's
    steps and replay both take them from here, so that both choose the same trees."""
    top = logits.topk(top_k, dim=-1)
    if not log_probs:
        return top.indices, None
    return top.indices, top.values.float() - logits.float().logsumexp(-1, keepdim=True)


def template_set(trees: TreeSet) -> TreeSet:
    """Each key's budget as a tree of depth-1 slots: M nodes, the attached counts largest first."""
    templates = {}
    for key, tree in trees.trees.items():
        counts = tuple(sorted(tree.prompt_tokens, reverse=True))
        templates[key] = Tree(tuple((i,) for i in range(len(counts))), counts, tree.root_prompt_tokens)
    width = max(max(len(t.paths) for t in templates.values()), 1)
    return TreeSet(trees.num_prompt_tokens, width, templates)


def best_paths(log_probs: torch.Tensor, keys: torch.Tensor, slots: int, ranks: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's ``slots`` rank paths with the largest log-probability sums, best first.

    ``log_probs`` [B, N, K] are the guesses' log-probabilities (ranks ``< ranks`` are used), ``keys`` [B] the
    deepest level each row may use. Returns, per slot [B, slots]: its score (``-inf`` where a row has fewer
    paths), its depth, its last rank and the slot of its parent (-1: the root). Slots are sorted by score
    less :data:`DEPTH_TIE` per level.
    """
    B, N = log_probs.shape[:2]
    log_probs = log_probs[:, :, :ranks].float()
    level_scores, level_ranks, level_parents, level_sizes = [], [], [], []
    previous = None
    for level in range(N):
        if previous is None:
            expanded = log_probs[:, 0]  # [B, R]
        else:
            expanded = (previous[:, :, None] + log_probs[:, level, None, :]).flatten(1)  # [B, m * R]
        expanded = expanded.masked_fill((keys <= level)[:, None], float("-inf"))
        top = expanded.topk(min(slots, expanded.shape[1]), dim=-1)
        previous = top.values
        level_scores.append(top.values)
        level_ranks.append(top.indices % ranks)
        level_parents.append(top.indices // ranks if level else torch.full_like(top.indices, -1))
        level_sizes.append(top.values.shape[1])
    # Every survivor in one row of entries; a parent index becomes an entry index.
    offsets = [0]
    for size in level_sizes[:-1]:
        offsets.append(offsets[-1] + size)
    scores = torch.cat(level_scores, dim=1)  # [B, E]
    depths = torch.cat([torch.full((size,), level + 1, device=scores.device)
                        for level, size in enumerate(level_sizes)])  # [E]
    rank_of = torch.cat(level_ranks, dim=1)
    parent_of = torch.cat([p if level == 0 else p + offsets[level - 1]
                           for level, p in enumerate(level_parents)], dim=1)
    if (missing := slots - scores.shape[1]) > 0:  # fewer paths than slots (a tiny top-k): empty slots
        scores = torch.cat([scores, scores.new_full((B, missing), float("-inf"))], dim=1)
        depths = torch.cat([depths, depths.new_ones(missing)])
        rank_of = torch.cat([rank_of, rank_of.new_zeros(B, missing)], dim=1)
        parent_of = torch.cat([parent_of, parent_of.new_full((B, missing), -1)], dim=1)
    chosen = (scores - DEPTH_TIE * depths).topk(slots, dim=-1).indices  # [B, slots], best first
    slot_of = torch.full_like(scores, -1, dtype=torch.long).scatter(
        1, chosen, torch.arange(slots, device=scores.device).expand(B, -1))
    parent_entry = parent_of.gather(1, chosen)
    parent_slot = torch.where(parent_entry >= 0, slot_of.gather(1, parent_entry.clamp_min(0)), -1)
    return scores.gather(1, chosen), depths[chosen], rank_of.gather(1, chosen), parent_slot


@dataclass
class ConfidentTables(TreeTables):
    """The tables of a ``confident`` tree set: the fixed layout of its template trees (:func:`template_set`),
    padded and stacked by key as :class:`TreeTables` does; the candidates, their parents, the mask's node part,
    the positions and the root-to-node paths are chosen at every step (:meth:`for_rows`). ``candidate_index``,
    ``parent_row`` and ``retrieve_*`` of the base class describe the template and are not read."""

    ranks: int = 0  # ranks a path may use (the tree set's top_k)
    slot_count: torch.Tensor | None = None  # long [N+1]: the key's candidate count M
    prompt_owner: torch.Tensor | None = None  # long [N+1, P]: node row each prompt row belongs to (0: padding)
    prompt_level: torch.Tensor | None = None  # long [N+1, P]: which prompt token of its node's block a row is
    prompt_used: torch.Tensor | None = None  # bool [N+1, P]: a real prompt row, not padding

    confident = True

    @classmethod
    def build(cls, trees: TreeSet, num_ensemble: int, attention_type: AttentionType | str,
              device: torch.device | str = "cpu", top_k: int | None = None) -> "ConfidentTables":
        top_k = top_k or trees.top_k
        if top_k < trees.top_k:
            raise ValueError(f"top_k {top_k} is below the tree set's top_k {trees.top_k}")
        n = trees.num_prompt_tokens
        layout = TreeTables.build(template_set(trees), num_ensemble, attention_type, device)
        C, T = layout.num_candidates, layout.num_rows
        P = T - 1 - C
        owner = torch.zeros(n + 1, P, dtype=torch.long, device=device)
        used = torch.zeros(n + 1, P, dtype=torch.bool, device=device)
        for k in range(n + 1):
            for node in range(1 + C):
                rows = layout.node_prompt_rows[k, node, : int(layout.node_prompt_count[k, node]) * num_ensemble]
                if node and not layout.is_candidate[k, node - 1]:
                    continue
                owner[k, rows - 1 - C] = node
                used[k, rows - 1 - C] = True
        level = layout.position_offset[:, 1 + C:] - (owner > 0).long() - 1
        depth = max(n, MIN_SIZE)
        slot_count = layout.is_candidate.long().sum(1)
        counts = [(*t.prompt_tokens, t.root_prompt_tokens) for t in trees.trees.values()]
        fields = {f.name: getattr(layout, f.name) for f in dataclasses.fields(TreeTables)}
        fields.update(top_k=top_k, depth=depth, max_offset=n + max(max(c, default=0) for c in counts))
        return cls(**fields, ranks=trees.top_k, slot_count=slot_count, prompt_owner=owner,
                   prompt_level=level.clamp_min(0), prompt_used=used)

    def for_rows(self, state) -> RowTrees:
        """Each row's tree for this step, chosen from ``state.guess_log_probs`` (see the module's docstring)."""
        key = state.key
        B, C, K = key.shape[0], self.num_candidates, state.guesses.shape[-1]
        device = key.device
        score, depth, rank, parent_slot = best_paths(state.guess_log_probs, key.clamp_min(1), C, self.ranks)
        valid = (torch.arange(C, device=device)[None, :] < self.slot_count[key][:, None]) & torch.isfinite(score)
        parent_row = torch.where(valid, parent_slot + 1, 0)  # [B, C]
        depth = torch.where(valid, depth, 0)
        candidate_index = torch.where(valid, (depth - 1).clamp_min(0) * K + rank, 0)
        # Ancestor chains, as rows: chain[..., j] is the row j levels above each slot (the root repeats itself).
        to_parent = torch.cat([torch.zeros_like(parent_row[:, :1]), parent_row], dim=1)  # [B, 1 + C] per row
        link = torch.arange(1, C + 1, device=device).expand(B, -1)
        chain = [link]
        for _ in range(self.depth):
            link = to_parent.gather(1, link)
            chain.append(link)
        chain = torch.stack(chain, dim=-1)  # [B, C, depth + 1]
        rows = torch.arange(1 + C, device=device)
        sees = (chain[..., None] == rows).any(-2)  # [B, C, 1 + C]: ancestors, the root and itself
        itself = rows[None, None, :] == torch.arange(1, C + 1, device=device)[:, None]  # [1, C, 1 + C]
        sees = torch.where(valid[..., None], sees, itself)
        root_row = (rows == 0).expand(B, 1, -1)
        nodes = torch.cat([root_row, sees], dim=1)  # [B, 1 + C, 1 + C]
        owner, used = self.prompt_owner[key], self.prompt_used[key]  # [B, P]
        prompt_sees = nodes.gather(1, owner[..., None].expand(-1, -1, 1 + C)) & used[..., None]
        P = owner.shape[1]
        allowed = torch.cat([torch.cat([nodes, nodes.new_zeros(B, 1 + C, P)], dim=2),
                             torch.cat([prompt_sees, self.allowed[key][:, 1 + C:, 1 + C:]], dim=2)], dim=1)
        node_depth = torch.cat([torch.zeros_like(depth[:, :1]), depth], dim=1)  # [B, 1 + C]
        position_offset = torch.cat([node_depth, node_depth.gather(1, owner) + 1 + self.prompt_level[key]], dim=1)
        levels = torch.arange(self.depth + 1, device=device)
        retrieve_valid = (levels <= depth[..., None]) & (valid[..., None] | (levels == 0))
        retrieve = chain.gather(2, (depth[..., None] - levels).clamp(0, self.depth))
        retrieve = torch.where(retrieve_valid, retrieve, 0)
        return RowTrees(candidate_index, parent_row, valid, self.prompt_index[key], position_offset, allowed,
                        retrieve, retrieve_valid, self.node_prompt_rows[key], self.node_prompt_count[key])


def build_tables(trees: TreeSet, num_ensemble: int, attention_type: AttentionType | str,
                 device: torch.device | str = "cpu", top_k: int | None = None) -> TreeTables:
    """The step tables of ``trees``: fixed or chosen per step, as the set's ``choice`` says."""
    maker = ConfidentTables if trees.confident else TreeTables
    return maker.build(trees, num_ensemble, attention_type, device, top_k)

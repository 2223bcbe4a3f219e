"""Replay: the accept length of any tree set on known greedy answers, without decoding.

Greedy PPD emits the baseline's greedy text ``x``, so what every step sees is known in advance. At a step
whose committed prefix is ``x[:t]`` the root is ``x[t]`` (already emitted) and the guesses come from the
prompt tokens attached after ``x[:t]``: prompt token i guesses ``x[t+1+i]``. Their top-K ids are the
*guess ranks* of cut t, and the *match path* at t is ``(m_0, m_1, ...)``: ``m_i`` the rank that
``x[t+1+i]`` holds in prompt token i's top-K, for as long as it is there (ranks are distinct tokens, so at
most one matches). A tree accepts the deepest of its paths that is a prefix of the match path (depth d),
the step emits those d guesses and the next root, and the next step is at ``t + d + 1`` with the tree
whose key is the count of prompt tokens attached to the accepted node (REFERENCE section 3).

So one packed forward per answer (``PromptTokenModel.prompt_logits``, every cut of the answer with its own
block of prompt tokens) gives the match path at every position, and :func:`replay` then gives any tree
set's steps exactly as the decoder takes them. :class:`PathStats` counts how often each path is a prefix of
the match path: measured, joint acceptance chances for ``ppd.tree_builder``.

What replay leaves out: near the end of the context window the decoder falls back to one row per step
(no tree), and the guesses of a forward in another dtype or on another device can order a near-tie of two
ranks differently; the text itself is taken as given, so answers made in another dtype than the replay's
are replayed as if they were this dtype's greedy text.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from .files import atomic_write_json, check_format_version, load_json_file
from .decoding.confident import best_paths, top_guesses
from .decoding.lookup import MAX_NGRAM
from .tree import TreeSet
from .tree_builder import CHAIN_WIDTH
from .training import PromptTokenModel

PATH_STATS_FORMAT_VERSION = 1
DEFAULT_CUTS_PER_FORWARD = 256
DEFAULT_SLOTS_PER_FORWARD = 8192

RankPath = tuple[int, ...]  # a path of ranks


def _forward_items(lengths: Sequence[int], starts: Sequence[int], block: int, max_cuts: int, max_slots: int
                   ) -> list[list[tuple[int, list[int]]]]:
    """The forwards that compute every cut ``t in [starts[b], lengths[b] - 1]``: lists of ``(sequence, cuts)``,
    one batch row each. A row holds its sequence up to its last cut, then ``block`` prompt rows per cut."""
    items = []
    for b, (length, start) in enumerate(zip(lengths, starts)):
        t = start
        while t < length:
            # n consecutive cuts from t make a row of (t + n - 1) + n * block slots.
            n = max(1, min(max_cuts, length - t, (max_slots - t + 1) // (block + 1)))
            items.append((b, list(range(t, t + n))))
            t += n
    forwards, current, width, num_cuts = [], [], 0, 0
    for b, cuts in items:
        row_width = cuts[-1] + len(cuts) * block
        new_width = max(width, row_width)
        if current and (num_cuts + len(cuts) > max_cuts or new_width * (len(current) + 1) > max_slots):
            forwards.append(current)
            current, new_width, num_cuts = [], row_width, 0
        current.append((b, cuts))
        width, num_cuts = new_width, num_cuts + len(cuts)
    if current:
        forwards.append(current)
    return forwards


def guess_ranks(model: PromptTokenModel, sequences: Sequence[Sequence[int]], starts: Sequence[int], top_k: int,
                max_cuts_per_forward: int = DEFAULT_CUTS_PER_FORWARD,
                max_slots_per_forward: int = DEFAULT_SLOTS_PER_FORWARD,
                progress: Callable[[int], None] | None = None) -> list[np.ndarray]:
    """The top-``top_k`` guess ids of the prompt tokens attached after ``sequence[:t]``, for every cut
    ``t in [starts[b], len(sequence) - 1]`` of every sequence: one array [positions, N, K] per sequence
    (:func:`guess_top` without the probabilities)."""
    return [ids for ids, _ in guess_top(model, sequences, starts, top_k, max_cuts_per_forward, max_slots_per_forward,
                                        progress)]


@torch.no_grad()
def guess_top(model: PromptTokenModel, sequences: Sequence[Sequence[int]], starts: Sequence[int], top_k: int,
              max_cuts_per_forward: int = DEFAULT_CUTS_PER_FORWARD,
              max_slots_per_forward: int = DEFAULT_SLOTS_PER_FORWARD,
              progress: Callable[[int], None] | None = None) -> list[tuple[np.ndarray, np.ndarray]]:
    """The top-``top_k`` guesses of the prompt tokens attached after ``sequence[:t]``, for every cut
    ``t in [starts[b], len(sequence) - 1]`` of every sequence: per sequence, their ids (int64) and the
    log-probabilities the prompt tokens give them (float32, over the whole vocabulary, as the decoder computes
    them), two arrays [positions, N, K].

    ``sequences`` are prompt + answer ids and ``starts`` the prompt lengths (the first decoding step reads
    the prompt tokens of the prefill, cut ``len(prompt)``). Cuts of one sequence share a forward (one block
    of N * V prompt rows each); a forward holds at most ``max_cuts_per_forward`` cuts and, over its batch
    rows, at most ``max_slots_per_forward`` slots (rows x width, padding included), unless a single cut
    needs more. That bounds a forward's activations by the slots, its attention mask by rows x width^2 and
    its kept logits by ``cuts x (1 + N*V) x vocab``. ``progress(n)`` is called as n more sequences are done.
    """
    if len(sequences) != len(starts):
        raise ValueError(f"{len(sequences)} sequences but {len(starts)} starts")
    if max_cuts_per_forward < 1 or max_slots_per_forward < 1:
        raise ValueError("max_cuts_per_forward and max_slots_per_forward must be at least 1")
    config = model.prompt_tokens.config
    vocab = model.base_model.get_output_embeddings().weight.shape[0]
    if not 1 <= top_k <= vocab:
        raise ValueError(f"top_k must be in 1..{vocab} (the vocabulary), got {top_k}")
    lengths = [len(s) for s in sequences]
    for b, (length, start) in enumerate(zip(lengths, starts)):
        if not 1 <= start <= length:
            raise ValueError(f"sequence {b}: start {start} is outside 1..{length} (its length)")
    n_prompt = config.num_prompt_tokens
    ids = [np.zeros((length - start, n_prompt, top_k), dtype=np.int64) for length, start in zip(lengths, starts)]
    log_probs = [np.zeros((length - start, n_prompt, top_k), dtype=np.float32)
                 for length, start in zip(lengths, starts)]
    remaining = [length - start for length, start in zip(lengths, starts)]
    if progress is not None and (empty := sum(r == 0 for r in remaining)):
        progress(empty)
    block = n_prompt * config.num_ensemble
    for forward in _forward_items(lengths, starts, block, max_cuts_per_forward, max_slots_per_forward):
        rows = [sequences[b][: cuts[-1]] for b, cuts in forward]
        width = max(len(r) for r in rows)
        input_ids = torch.zeros(len(rows), width, dtype=torch.long)
        for i, r in enumerate(rows):
            input_ids[i, : len(r)] = torch.as_tensor(list(r), dtype=torch.long)
        cut_lengths = torch.tensor([t for _, cuts in forward for t in cuts])
        cut_rows = torch.tensor([i for i, (_, cuts) in enumerate(forward) for _ in cuts])
        logits = model.prompt_logits(input_ids, torch.tensor([len(r) for r in rows]), cut_lengths, cut_rows)
        top_ids, top_log_probs = (t.cpu().numpy() for t in top_guesses(logits, top_k))  # [C, N, K] each
        done = 0
        at = 0
        for b, cuts in forward:
            where = slice(cuts[0] - starts[b], cuts[-1] + 1 - starts[b])
            ids[b][where], log_probs[b][where] = top_ids[at: at + len(cuts)], top_log_probs[at: at + len(cuts)]
            at += len(cuts)
            remaining[b] -= len(cuts)
            done += remaining[b] == 0
        if progress is not None and done:
            progress(done)
    return list(zip(ids, log_probs))


def match_paths(guesses: np.ndarray, sequence: Sequence[int], start: int) -> list[RankPath]:
    """The match path at every cut ``t = start + j`` of ``sequence``: the ranks of ``sequence[t+1+i]`` in
    ``guesses[j, i]`` ([positions, N, K], from :func:`guess_ranks`) for i = 0, 1, ... while it is there and
    the sequence lasts."""
    positions, n_prompt, _ = guesses.shape
    seq = np.asarray(sequence, dtype=np.int64)
    index = start + np.arange(positions)[:, None] + 1 + np.arange(n_prompt)[None, :]  # [P, N]
    inside = index < len(seq)
    targets = np.where(inside, seq[np.minimum(index, len(seq) - 1)], -1)
    hits = guesses == targets[..., None]  # [P, N, K]
    found = hits.any(-1) & inside
    depth = np.cumprod(found, axis=1).sum(1)  # matched guesses before the first miss
    ranks = hits.argmax(-1)
    return [tuple(int(r) for r in ranks[j, : depth[j]]) for j in range(positions)]


def replay(trees: TreeSet, paths: Sequence[RankPath], answer_length: int,
           log_probs: np.ndarray | None = None, text: tuple[Sequence[int], Sequence[int]] | None = None
           ) -> tuple[int, int]:
    """``(new_tokens, steps)`` that greedy PPD with ``trees`` takes for an answer of ``answer_length`` tokens
    whose match paths are ``paths`` (``paths[j]`` at cut ``len(prompt) + j``, :func:`match_paths`).
    A ``confident`` tree set chooses each step's tree from the guesses' ``log_probs`` [positions, N, K]
    (from :func:`guess_top`) as the decoder does (``ppd.decoding.confident``). A set with a lookup chain needs the
    ``text``, the prompt's ids and the answer's: a step accepts the chain's matched tokens where they are more than
    its tree's path, and the step after runs the key-0 tree (``ppd.decoding.tables``).

    As the decoder: the prefill emits the answer's first token and reads the first guesses (key N); a
    step accepts the deepest tree path that is a prefix of the match path, emits it and the next root, and
    hands the accepted node's prompt-token count on as the next key; the last step may emit fewer tokens
    (EOS or the token limit).
    """
    if answer_length < 1:
        return 0, 0
    if len(paths) < answer_length - 1:
        raise ValueError(f"an answer of {answer_length} tokens needs match paths at {answer_length - 1} cuts at "
                         f"least, got {len(paths)}")
    if trees.confident and log_probs is None:
        raise ValueError("a confident tree set chooses its trees from the guesses' log-probabilities: pass them")
    if trees.lookup and text is None:
        raise ValueError("a tree set with a lookup chain finds its chains in the text: pass the prompt and answer ids")
    attached = fixed_nodes(trees)
    attached[0] = {(): trees.num_prompt_tokens}  # the tree after a chain's win: the root and its prompt tokens
    emitted, steps, key = 1, 0, trees.num_prompt_tokens
    while emitted < answer_length:
        nodes = chosen_tree(trees, key, log_probs[emitted - 1]) if trees.confident else attached[key]
        match = paths[emitted - 1]
        depth = accepted_depth(nodes, match)
        key = nodes[match[:depth]]
        if trees.lookup:
            prompt, answer = text
            chain = lookup_chain([*prompt, *answer[:emitted]], trees.lookup)
            matched = chain_matched(chain, answer, emitted)
            if matched > depth:  # (on a tie the tree's path is kept: it comes first among the step's paths)
                depth, key = matched, 0
        emitted += depth + 1
        steps += 1
    return answer_length, steps


def lookup_chain(text: Sequence[int], nodes: int) -> list[int]:
    """The chain ``ppd.decoding.lookup.propose`` finds for a row whose text is ``text``, in plain Python: the (at most
    ``nodes``) tokens after the latest earlier occurrence of its last 3, else 2, else 1 tokens."""
    for n in range(MAX_NGRAM, 0, -1):
        ending = list(text[-n:])
        for start in range(len(text) - n - 1, -1, -1):
            if list(text[start: start + n]) == ending:
                return list(text[start + n: start + n + nodes])
    return []


def chain_matched(chain: Sequence[int], answer: Sequence[int], at: int) -> int:
    """How many leading tokens of ``chain`` equal ``answer[at:]`` (what greedy verification accepts of it)."""
    depth = 0
    while depth < len(chain) and at + depth < len(answer) and chain[depth] == answer[at + depth]:
        depth += 1
    return depth


def fixed_nodes(trees: TreeSet) -> dict[int, dict[RankPath, int]]:
    """Each key's tree as its paths with their attached prompt-token counts, the root (``()``) included."""
    return {key: {(): tree.root_prompt_tokens, **dict(zip(tree.paths, tree.prompt_tokens))}
            for key, tree in trees.trees.items()}


def accepted_depth(nodes: dict[RankPath, int], match: RankPath) -> int:
    """How deep a step with tree ``nodes`` accepts: its deepest path that is a prefix of the match path."""
    depth = 0
    while depth < len(match) and match[: depth + 1] in nodes:
        depth += 1
    return depth


def chosen_tree(trees: TreeSet, key: int, log_probs: np.ndarray) -> dict[RankPath, int]:
    """The tree a ``confident`` set verifies at a step with depth key ``key`` and guesses' ``log_probs`` [N, K]:
    each chosen path with its attached prompt-token count, the root (``()``) included."""
    tree = trees.trees[key]
    slots = len(tree.paths)
    nodes = {(): tree.root_prompt_tokens}
    if not slots:
        return nodes
    score, depth, rank, parent = (t[0].tolist() for t in best_paths(
        torch.from_numpy(np.ascontiguousarray(log_probs))[None], torch.tensor([key]), slots, trees.top_k))
    chosen: list[RankPath] = []
    for i in range(slots):
        if score[i] == float("-inf"):
            break
        chosen.append((chosen[parent[i]] if parent[i] >= 0 else ()) + (rank[i],))
    nodes.update(zip(chosen, sorted(tree.prompt_tokens, reverse=True)))
    return nodes


@dataclass
class PathStats:
    """How often each path of ranks (depth <= N, ranks < K) was a prefix of the match path, over
    ``positions`` cuts of known answers: measured acceptance chances, joint over depths (each conditional on
    the guesses before it being right). A :class:`ppd.tree_builder.PathModel`."""

    num_prompt_tokens: int
    top_k: int
    positions: int = 0
    counts: Counter = field(default_factory=Counter)  # path -> cuts whose match path starts with it
    metadata: dict = field(default_factory=dict)

    def add(self, paths: Iterable[RankPath]) -> None:
        """Count the match paths of some cuts (one path per cut)."""
        for path in paths:
            path = tuple(path)
            if len(path) > self.num_prompt_tokens or any(not 0 <= r < self.top_k for r in path):
                raise ValueError(f"match path {list(path)} is deeper than N={self.num_prompt_tokens} or has a rank "
                                 f"outside top-{self.top_k}")
            self.positions += 1
            for depth in range(1, len(path) + 1):
                self.counts[path[:depth]] += 1

    def count(self, path: RankPath) -> int:
        return self.positions if not path else self.counts.get(tuple(path), 0)

    def prob(self, path: RankPath) -> float:
        """The share of cuts whose match path starts with ``path`` (1 for the root)."""
        return self.count(path) / self.positions if self.positions else 0.0

    def stop_prob(self, path: RankPath, num_children: int) -> float:
        if not self.positions:
            return 0.0
        path = tuple(path)
        return (self.count(path) - sum(self.count(path + (r,)) for r in range(num_children))) / self.positions

    def reach(self, width: int = CHAIN_WIDTH) -> list[float]:
        totals = [0] * self.num_prompt_tokens
        for path, count in self.counts.items():
            if all(r < width for r in path):
                totals[len(path) - 1] += count
        return [t / self.positions if self.positions else 0.0 for t in totals]

    def rank_accuracy(self) -> list[list[float]]:
        """[N][K]: the chance that guess i is right at rank r given guesses 0..i-1 were right (0 where no
        cut got that far): the conditional table that ``tree_builder.IndependentPaths`` takes."""
        reached = [self.positions] + [0] * self.num_prompt_tokens
        hits = [[0] * self.top_k for _ in range(self.num_prompt_tokens)]
        for path, count in self.counts.items():
            reached[len(path)] += count
            hits[len(path) - 1][path[-1]] += count
        return [[h / reached[i] if reached[i] else 0.0 for h in hits[i]] for i in range(self.num_prompt_tokens)]

    def tree_metadata(self) -> dict:
        return {"accuracy": self.rank_accuracy(), "path_positions": self.positions}

    def to_json(self) -> dict:
        paths = sorted(self.counts, key=lambda p: (len(p), p))
        return {"format_version": PATH_STATS_FORMAT_VERSION, "num_prompt_tokens": self.num_prompt_tokens,
                "top_k": self.top_k, "positions": self.positions, "metadata": self.metadata,
                "paths": [{"path": list(p), "count": self.counts[p]} for p in paths]}

    @classmethod
    def from_json(cls, data: dict) -> "PathStats":
        check_format_version(data, PATH_STATS_FORMAT_VERSION, "path stats")
        stats = cls(int(data["num_prompt_tokens"]), int(data["top_k"]), int(data["positions"]),
                    Counter({tuple(int(r) for r in e["path"]): int(e["count"]) for e in data["paths"]}),
                    dict(data.get("metadata", {})))
        for path, count in stats.counts.items():
            if not 1 <= len(path) <= stats.num_prompt_tokens or any(not 0 <= r < stats.top_k for r in path):
                raise ValueError(f"path {list(path)} is empty, deeper than N={stats.num_prompt_tokens} or has a "
                                 f"rank outside top-{stats.top_k}")
            if count > stats.count(path[:-1]):
                raise ValueError(f"path {list(path)} is counted more often than its parent")
        return stats

    def save(self, path: str | Path) -> None:
        atomic_write_json(path, self.to_json(), sort_keys=True)

    @classmethod
    def load(cls, path: str | Path) -> "PathStats":
        return load_json_file(path, cls.from_json,
                              "a ppd path_stats file (from `python -m eval.replay --paths_output`)")

"""Building trees for a budget of rows per forward pass, from how likely each candidate path is accepted.

A candidate path is accepted when it is a prefix of the *match path*: the ranks that the right tokens hold
in the successive guess distributions, for as long as each is within the top-K. The builder needs only
the chance of that event for every path, which comes from one of two sources (a :class:`PathModel`):

- :class:`IndependentPaths`, a rank-accuracy table: ``accuracy[k][r]`` is the probability that rank r of
  prompt distribution k+1's top-K is the right token, given the tokens before it were right (measured on
  held-out prompts, never on benchmark questions); a path's chance is the product of its ranks'
  accuracies, as if successive guesses were independent;
- measured path counts (``ppd.replay.PathStats``): how often each path was a prefix of the match path on
  known greedy answers, the joint chance with no independence assumed.

The builder grows each tree greedily by the best gain per row among two moves: add the next-ranked child of
a node (one candidate row plus V rows for its first attached prompt token) or attach one more prompt
token to a node (V rows). The gain of a candidate is its probability of being accepted; the gain of an
attached prompt token is the probability that its node is the last one accepted times how many tokens
the next step is expected to accept with one more guess distribution.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from .tree import Tree, TreeSet

CHAIN_WIDTH = 3  # ranks per guess distribution that the next-step estimate counts on


@runtime_checkable
class PathModel(Protocol):
    """The chance that candidate paths are accepted: everything the greedy builder reads."""

    num_prompt_tokens: int
    top_k: int

    def prob(self, path: tuple[int, ...]) -> float:
        """The chance that ``path`` is a prefix of the match path (1 for the root, the empty path)."""

    def stop_prob(self, path: tuple[int, ...], num_children: int) -> float:
        """The chance that ``path`` is accepted and none of its children of ranks ``0..num_children-1`` is."""

    def reach(self, width: int) -> list[float]:
        """For d = 1..N: the chance that the first d guesses are all right within the top ``width`` ranks."""

    def tree_metadata(self) -> dict:
        """What a tree set built from this model records about it (``accuracy``: an [N][K] table)."""


@dataclass(frozen=True)
class IndependentPaths:
    """A rank-accuracy table [N][K], successive guesses taken as independent."""

    accuracy: Sequence[Sequence[float]]

    def __post_init__(self) -> None:
        acc = self.accuracy
        if len(acc) < 1 or len(acc[0]) < 1 or any(len(row) != len(acc[0]) for row in acc):
            raise ValueError("accuracy must be N rows of K probabilities each")

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.accuracy)

    @property
    def top_k(self) -> int:
        return len(self.accuracy[0])

    def prob(self, path: tuple[int, ...]) -> float:
        chance = 1.0
        for depth, rank in enumerate(path):
            chance *= self.accuracy[depth][rank]
        return chance

    def stop_prob(self, path: tuple[int, ...], num_children: int) -> float:
        depth = len(path)
        mass = sum(self.accuracy[depth][r] for r in range(num_children)) if depth < self.num_prompt_tokens else 0.0
        return self.prob(path) * (1.0 - mass)

    def reach(self, width: int) -> list[float]:
        chances, chance = [], 1.0
        for row in self.accuracy:
            chance *= min(1.0, sum(row[:width]))
            chances.append(chance)
        return chances

    def tree_metadata(self) -> dict:
        return {"accuracy": [list(map(float, row)) for row in self.accuracy]}


PathSource = PathModel | Sequence[Sequence[float]]


def path_model(source: PathSource) -> PathModel:
    """``source`` itself if it is a :class:`PathModel`, else an [N][K] rank-accuracy table read as
    :class:`IndependentPaths`."""
    return source if isinstance(source, PathModel) else IndependentPaths(source)


def _next_step_value(model: PathModel, width: int = CHAIN_WIDTH) -> list[float]:
    """Expected tokens accepted next step from n guess distributions (n = 0..N), a chain estimate."""
    values = [0.0]
    for chance in model.reach(width):
        values.append(values[-1] + chance)
    return values


def build_tree(source: PathSource, key: int, budget: int, num_ensemble: int = 1) -> Tree:
    """Greedy tree for depth key ``key`` whose forward uses at most ``budget`` rows (root included)."""
    model = path_model(source)
    n_prompt, top_k = model.num_prompt_tokens, model.top_k
    later = _next_step_value(model)
    V = num_ensemble
    # node -> [probability of acceptance, attached prompt tokens]; the root is the empty path.
    nodes: dict[tuple[int, ...], list[float | int]] = {(): [1.0, 1]}
    children: dict[tuple[int, ...], int] = {(): 0}
    used = 1 + V

    while True:
        best, best_gain = None, 0.0
        for path, (_, attached) in nodes.items():
            depth = len(path)
            rank = children[path]
            if depth < key and rank < top_k and used + 1 + V <= budget:
                p = model.prob(path + (rank,))
                gain = (p + p * later[1]) / (1 + V)
                if gain > best_gain:
                    best, best_gain = ("child", path), gain
            if attached < n_prompt and used + V <= budget:
                last = model.stop_prob(path, rank)
                gain = last * (later[attached + 1] - later[attached]) / V
                if gain > best_gain:
                    best, best_gain = ("attach", path), gain
        if best is None:
            break
        move, path = best
        if move == "child":
            child = path + (children[path],)
            children[path] += 1
            nodes[child] = [model.prob(child), 1]
            children[child] = 0
            used += 1 + V
        else:
            nodes[path][1] += 1
            used += V
    paths = sorted((p for p in nodes if p), key=lambda p: (len(p), p))
    return Tree(tuple(paths), tuple(int(nodes[p][1]) for p in paths), int(nodes[()][1]))


def build_tree_set(source: PathSource, budget: int, num_ensemble: int = 1, metadata: dict | None = None) -> TreeSet:
    """One tree per depth key 1..N for the same row budget, from a :class:`PathModel` (measured path
    counts) or a rank-accuracy table [N][K]."""
    model = path_model(source)
    if budget < 1 + num_ensemble:
        raise ValueError(f"a budget of {budget} rows cannot hold the root and one prompt token")
    n_prompt = model.num_prompt_tokens
    trees = {key: build_tree(model, key, budget, num_ensemble) for key in range(1, n_prompt + 1)}
    meta = {"budget": budget, "num_ensemble": num_ensemble, **model.tree_metadata()}
    meta.update(metadata or {})
    return TreeSet(n_prompt, model.top_k, trees, meta)


def expected_tokens_per_step(tree: Tree, source: PathSource) -> float:
    """Expected tokens one step of ``tree`` emits: 1 (the root) plus, for every candidate, the chance that
    it is accepted. From a rank-accuracy table that chance is the product of its ranks' accuracies (each
    prompt token measured on its own, so successive guesses are treated as independent); from measured
    path counts it is the joint chance."""
    model = path_model(source)
    total = 1.0
    for path in tree.paths:
        total += model.prob(path)
    return total


def default_tree_set(num_prompt_tokens: int, num_ensemble: int = 1) -> TreeSet:
    """The tree set a decoder uses when neither the caller nor the adapter names one: the packaged default
    where it is built for ``num_prompt_tokens``, else one built the same way (its accuracy table, the last row
    repeated for deeper prompt tokens, and its row budget) for this many prompt tokens."""
    packaged = TreeSet.packaged()
    if packaged.num_prompt_tokens == num_prompt_tokens:
        return packaged
    accuracy = packaged.metadata["accuracy"]
    rows = [accuracy[min(i, len(accuracy) - 1)] for i in range(num_prompt_tokens)]
    return build_tree_set(rows, int(packaged.metadata["budget"]), num_ensemble,
                          metadata={"source": f"the packaged default's accuracies, for N={num_prompt_tokens}"})

"""Building trees from measured prompt-token accuracies, for a budget of rows per forward pass.

``accuracy[k][r]`` is the probability that rank r of prompt distribution k+1's top-K is the right token,
given the tokens before it were right (measured on held-out prompts, never on benchmark questions). The
builder grows each tree greedily by the best gain per row among two moves: add the next-ranked child of
a node (one candidate row plus V rows for its first attached prompt token) or attach one more prompt
token to a node (V rows). The gain of a candidate is its probability of being accepted; the gain of an
attached prompt token is the probability that its node is the last one accepted times how many tokens
the next step is expected to accept with one more guess distribution.
"""

from __future__ import annotations

from collections.abc import Sequence

from .tree import Tree, TreeSet


def _next_step_value(accuracy: Sequence[Sequence[float]], width: int = 3) -> list[float]:
    """Expected tokens accepted next step from n guess distributions (n = 0..N), a chain estimate."""
    values, reach = [0.0], 1.0
    for row in accuracy:
        reach *= min(1.0, sum(row[:width]))
        values.append(values[-1] + reach)
    return values


def build_tree(
    accuracy: Sequence[Sequence[float]], key: int, budget: int, num_ensemble: int = 1
) -> Tree:
    """Greedy tree for depth key ``key`` whose forward uses at most ``budget`` rows (root included)."""
    n_prompt, top_k = len(accuracy), len(accuracy[0])
    later = _next_step_value(accuracy)
    V = num_ensemble
    # node -> [probability of acceptance, attached prompt tokens]; the root is the empty path.
    nodes: dict[tuple[int, ...], list[float | int]] = {(): [1.0, 1]}
    children: dict[tuple[int, ...], int] = {(): 0}
    used = 1 + V

    def child_mass(path: tuple[int, ...]) -> float:
        depth = len(path)
        return sum(accuracy[depth][r] for r in range(children[path])) if depth < n_prompt else 0.0

    while True:
        best, best_gain = None, 0.0
        for path, (prob, attached) in nodes.items():
            depth = len(path)
            rank = children[path]
            if depth < key and rank < top_k and used + 1 + V <= budget:
                p = prob * accuracy[depth][rank]
                gain = (p + p * later[1]) / (1 + V)
                if gain > best_gain:
                    best, best_gain = ("child", path), gain
            if attached < n_prompt and used + V <= budget:
                last = prob * (1.0 - child_mass(path))
                gain = last * (later[attached + 1] - later[attached]) / V
                if gain > best_gain:
                    best, best_gain = ("attach", path), gain
        if best is None:
            break
        move, path = best
        if move == "child":
            child = path + (children[path],)
            children[path] += 1
            nodes[child] = [nodes[path][0] * accuracy[len(path)][child[-1]], 1]
            children[child] = 0
            used += 1 + V
        else:
            nodes[path][1] += 1
            used += V
    paths = sorted((p for p in nodes if p), key=lambda p: (len(p), p))
    return Tree(tuple(paths), tuple(int(nodes[p][1]) for p in paths), int(nodes[()][1]))


def build_tree_set(
    accuracy: Sequence[Sequence[float]], budget: int, num_ensemble: int = 1, metadata: dict | None = None
) -> TreeSet:
    """One tree per depth key 1..N for the same row budget."""
    n_prompt = len(accuracy)
    if n_prompt < 1 or any(len(row) != len(accuracy[0]) for row in accuracy):
        raise ValueError("accuracy must be N rows of K probabilities each")
    if budget < 1 + num_ensemble:
        raise ValueError(f"a budget of {budget} rows cannot hold the root and one prompt token")
    trees = {key: build_tree(accuracy, key, budget, num_ensemble) for key in range(1, n_prompt + 1)}
    meta = {"budget": budget, "num_ensemble": num_ensemble, "accuracy": [list(map(float, r)) for r in accuracy]}
    meta.update(metadata or {})
    return TreeSet(n_prompt, len(accuracy[0]), trees, meta)


def expected_tokens_per_step(tree: Tree, accuracy: Sequence[Sequence[float]]) -> float:
    """Expected tokens one step of ``tree`` emits: 1 (the root) plus, for every candidate, the chance that
    it is accepted (the product of its ranks' accuracies). Rank-accuracy tables measure each prompt token
    on its own, so this treats successive guesses as independent."""
    total = 1.0
    for path in tree.paths:
        chance = 1.0
        for depth, rank in enumerate(path):
            chance *= accuracy[depth][rank]
        total += chance
    return total

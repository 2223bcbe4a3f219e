"""Which tree PPD verifies at each batch size: speculation where it pays, none where it does not.

A step's cost grows with its rows, and a batch multiplies them: a tree that pays at batch 1 can cost more
than the tokens it adds at batch 128. A :class:`BatchPolicy` names, for each batch bucket (the powers of
two the decoder pads a batch to), the tree set with the most expected tokens per second there, or none,
where the one-row step is faster. ``eval.pick_tree --batch_sizes`` makes one from measured step times and
installs it in the adapter as ``policy_<device type>_<dtype>.json``; the decoder follows it as a batch
grows and shrinks.

A tree step's attention also grows with the cache slots it reads (its width), much faster than the one-row
step's: a bucket may name the widest attention its tree still pays at (``max_width``); past it, as a
conversation grows long, the decoder runs the one-row step.

Static batches (``Decoder.generate`` with a list of prompts: every row starts together and the batch steps until
its last row stops) may pay differently from a continuously refilled one (the serving engine's batcher, where a
finished row takes the next request at once): a static batch waits for its slowest row, and a tree's rows
accept unevenly. A bucket may therefore name another tree set, or none, for its static batches
(``static_trees``, chosen from end-to-end timing as ``eval.batch_speed`` measures it); the other buckets' static
batches run the bucket's own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from .files import atomic_write_json, check_format_version, load_json_file
from .tree import TreeSet

POLICY_FORMAT_VERSION = 1


@dataclass(frozen=True)
class BatchPolicy:
    """``trees[i]`` serves batches of ``buckets[i - 1] + 1 .. buckets[i]`` rows (``None``: no tree, the
    one-row step) while a step attends over at most ``max_widths[i]`` cache slots (``None``: any width);
    batches past the last bucket take the last entry. ``static_trees[bucket]`` (by the bucket's max_batch), where
    given, serves that bucket's static batches instead (``None``: the one-row step)."""

    buckets: tuple[int, ...]
    trees: tuple[TreeSet | None, ...]
    metadata: dict = field(default_factory=dict)
    max_widths: tuple[int | None, ...] | None = None  # one per bucket; left out: no bucket limits its tree
    static_trees: dict[int, TreeSet | None] = field(default_factory=dict)  # by bucket; the others: ``trees``

    def __post_init__(self) -> None:
        if not self.buckets or len(self.buckets) != len(self.trees):
            raise ValueError("a batch policy needs one tree set (or none) per bucket, and at least one bucket")
        if self.max_widths is None:
            object.__setattr__(self, "max_widths", (None,) * len(self.buckets))
        if len(self.max_widths) != len(self.buckets) or any(w is not None and w < 1 for w in self.max_widths):
            raise ValueError(f"a batch policy needs one max_width (a width >= 1, or none) per bucket, got "
                             f"{list(self.max_widths)} for {len(self.buckets)} buckets")
        if any(b < 1 for b in self.buckets) or list(self.buckets) != sorted(set(self.buckets)):
            raise ValueError(f"buckets must be increasing batch sizes >= 1, got {list(self.buckets)}")
        unknown = sorted(set(self.static_trees) - set(self.buckets))
        if unknown:
            raise ValueError(f"static tree sets for buckets {unknown}, which the policy does not have "
                             f"({list(self.buckets)})")
        sets = [t for t in self.trees + tuple(self.static_trees.values()) if t is not None]
        if len({t.num_prompt_tokens for t in sets}) > 1:
            raise ValueError("every tree set of a batch policy must be built for the same number of prompt tokens")

    def _index(self, size: int) -> int:
        return next((i for i, bucket in enumerate(self.buckets) if size <= bucket), len(self.buckets) - 1)

    def for_batch(self, size: int, static: bool = False) -> TreeSet | None:
        """The tree set (or ``None``) for a batch of ``size`` rows: a continuously refilled one, or a ``static``
        one (every row starts together; the batch steps until its last row stops)."""
        i = self._index(size)
        if static and self.buckets[i] in self.static_trees:
            return self.static_trees[self.buckets[i]]
        return self.trees[i]

    def max_width_for(self, size: int) -> int | None:
        """The widest attention (cache slots) a batch of ``size`` rows runs its tree at (``None``: any)."""
        return self.max_widths[self._index(size)]

    def each(self, edit: Callable[[TreeSet], TreeSet]) -> "BatchPolicy":
        """The same policy with ``edit`` applied to every tree set (once to a set that serves several buckets)."""
        made: dict[int, TreeSet] = {}

        def edited(t):
            return None if t is None else made.setdefault(id(t), edit(t))

        return replace(self, trees=tuple(edited(t) for t in self.trees),
                       static_trees={b: edited(t) for b, t in self.static_trees.items()})

    @property
    def tree_sets(self) -> list[TreeSet]:
        """The distinct tree sets the policy uses, in bucket order."""
        seen: list[TreeSet] = []
        for trees in self.trees + tuple(self.static_trees.values()):
            if trees is not None and all(trees is not s for s in seen):
                seen.append(trees)
        return seen

    def describe(self) -> str:
        """One line: each bucket and the rows of its tree (``-`` for none)."""
        def rows(t):
            if t is None:
                return "-"
            budget = str(t.metadata.get("budget", max(len(x.paths) for x in t.trees.values())))
            return budget + (f" + lookup {t.lookup}" if t.lookup else "")
        return ", ".join(f"<= {b}: {rows(t)}" + ("" if w is None or t is None else f" (to width {w})")
                         + ("" if b not in self.static_trees else f" (static batches: {rows(self.static_trees[b])})")
                         for b, t, w in zip(self.buckets, self.trees, self.max_widths))

    # ------------------------------------------------------------------ JSON
    def to_json(self) -> dict:
        def tree_json(t):
            return None if t is None else t.to_json()

        return {"format_version": POLICY_FORMAT_VERSION, "metadata": self.metadata,
                "buckets": [{"max_batch": b, "trees": tree_json(t), **({} if w is None else {"max_width": w}),
                             **({"static_trees": tree_json(self.static_trees[b])} if b in self.static_trees else {})}
                            for b, t, w in zip(self.buckets, self.trees, self.max_widths)]}

    @classmethod
    def from_json(cls, data: dict) -> "BatchPolicy":
        check_format_version(data, POLICY_FORMAT_VERSION, "batch policy")
        entries = data["buckets"]

        def tree_set(found):
            return None if found is None else TreeSet.from_json(found)

        return cls(tuple(int(e["max_batch"]) for e in entries), tuple(tree_set(e["trees"]) for e in entries),
                   dict(data.get("metadata", {})),
                   tuple(None if e.get("max_width") is None else int(e["max_width"]) for e in entries),
                   {int(e["max_batch"]): tree_set(e["static_trees"]) for e in entries if "static_trees" in e})

    def save(self, path: str | Path) -> None:
        atomic_write_json(path, self.to_json(), sort_keys=True)

    @classmethod
    def load(cls, path: str | Path) -> "BatchPolicy":
        return load_json_file(path, cls.from_json, "a ppd batch policy (from `python -m eval.pick_tree --batch_sizes`)")

    @staticmethod
    def adapter_file(adapter_dir: str | Path, device_type: str, dtype: str) -> Path | None:
        """``policy_<device type>_<dtype>.json`` in the adapter directory, if it is there."""
        path = Path(adapter_dir) / f"policy_{device_type}_{dtype}.json"
        return path if path.is_file() else None

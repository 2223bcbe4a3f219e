"""Finding evaluation prompts inside training text, so that a training set can leave them out.

A text *contains* a prompt when, after collapsing every run of whitespace to one space and stripping the
ends, the text equals the prompt, or (for prompts of at least ``min_substring_chars`` characters) the
prompt occurs anywhere inside it. Shorter prompts ("What is the meaning of life?") only count as a whole
message: as substrings they would match ordinary text.

The substring search is one vectorised pass over all texts: a rolling polynomial hash (modulo 2**64) of
every window of ``min_substring_chars`` characters is compared with the hash of each long prompt's first
window, and only the few windows that hash alike are compared as strings. A prompt inside a text always
starts with a window whose hash matches, so nothing is missed, and the string comparison keeps hash
collisions from counting.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np

MIN_SUBSTRING_CHARS = 40
_BASE = 0x100000001B3  # odd, so invertible modulo 2**64
_BASE_INVERSE = pow(_BASE, -1, 1 << 64)
_SEPARATOR = "\x00"  # between texts: no normalised prompt holds it, so no window across two texts matches
_CHUNK_CHARS = 1 << 22  # texts hashed together, at most (bounds memory: a few uint64 arrays of this length)


def normalise(text: str) -> str:
    """``text`` with every run of whitespace collapsed to one space and no leading or trailing space."""
    return " ".join(text.split())


def _powers(base: int, n: int) -> np.ndarray:
    powers = np.full(n, base, dtype=np.uint64)
    powers[0] = 1
    return np.cumprod(powers, dtype=np.uint64)  # wraps modulo 2**64, as intended


def _window_hashes(text: str, width: int) -> np.ndarray:
    """Hash of every ``width``-character window of ``text``: sum_j char[i + j] * BASE**-j (mod 2**64)."""
    codes = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32).astype(np.uint64)
    n = codes.size
    if n < width:
        return np.zeros(0, dtype=np.uint64)
    with np.errstate(over="ignore"):
        prefix = np.zeros(n + 1, dtype=np.uint64)
        np.cumsum(codes * _powers(_BASE_INVERSE, n), dtype=np.uint64, out=prefix[1:])
        starts = n - width + 1
        return (prefix[width:] - prefix[:starts]) * _powers(_BASE, starts)


class PromptIndex:
    """Evaluation prompts, ready to be looked for in many texts at once.

    ``prompts`` maps each prompt to a label (say ``"gsm8k:12"``); prompts are normalised here.
    """

    def __init__(self, prompts: Mapping[str, str] | Iterable[str], min_substring_chars: int = MIN_SUBSTRING_CHARS):
        if min_substring_chars < 1:
            raise ValueError(f"min_substring_chars must be at least 1, got {min_substring_chars}")
        labelled = prompts.items() if isinstance(prompts, Mapping) else ((p, p) for p in prompts)
        self.width = min_substring_chars
        self.labels: dict[str, str] = {}
        for prompt, label in labelled:
            key = normalise(prompt)
            if key:
                self.labels.setdefault(key, label)
        self._by_first_window: dict[int, list[str]] = {}
        for prompt in self.labels:
            if len(prompt) >= self.width:
                key = int(_window_hashes(prompt[: self.width], self.width)[0])
                self._by_first_window.setdefault(key, []).append(prompt)
        self._first_hashes = np.array(sorted(self._by_first_window), dtype=np.uint64)

    def __len__(self) -> int:
        return len(self.labels)

    def find(self, texts: Sequence[str]) -> list[set[str]]:
        """For each text, the labels of the prompts it contains (empty sets for clean texts)."""
        normalised = [normalise(t) for t in texts]
        found: list[set[str]] = [set() for _ in texts]
        for i, text in enumerate(normalised):
            if text in self.labels:
                found[i].add(self.labels[text])
        if self._first_hashes.size == 0:
            return found
        start = 0
        while start < len(normalised):  # chunks of whole texts, about _CHUNK_CHARS characters each
            stop, size = start, 0
            while stop < len(normalised) and (stop == start or size + len(normalised[stop]) < _CHUNK_CHARS):
                size += len(normalised[stop]) + 1
                stop += 1
            self._find_substrings(normalised, start, stop, found)
            start = stop
        return found

    def _find_substrings(self, texts: list[str], start: int, stop: int, found: list[set[str]]) -> None:
        joined = _SEPARATOR.join(texts[start:stop])
        hashes = _window_hashes(joined, self.width)
        if hashes.size == 0:
            return
        slot = np.minimum(np.searchsorted(self._first_hashes, hashes), self._first_hashes.size - 1)
        positions = np.flatnonzero(self._first_hashes[slot] == hashes)
        if positions.size == 0:
            return
        offsets = np.cumsum([0] + [len(t) + 1 for t in texts[start:stop]])  # where each text starts in `joined`
        owners = np.searchsorted(offsets, positions, side="right") - 1
        for position, owner in zip(positions.tolist(), owners.tolist()):
            text, at = texts[start + owner], position - int(offsets[owner])
            for prompt in self._by_first_window[int(hashes[position])]:
                if text.startswith(prompt, at):
                    found[start + owner].add(self.labels[prompt])

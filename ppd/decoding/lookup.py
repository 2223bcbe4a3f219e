"""Prompt lookup on the device: a chain of candidates copied from earlier in the text, verified beside the tree.

A model that repeats its prompt or itself (code, lists, quoted names, an answer that loops) is guessed better by
copying than by any prompt token: the tokens that followed the latest earlier occurrence of the text's last
:data:`MAX_NGRAM` tokens (else its last two, else its last one), in the prompt or in the answer so far, are a chain
of L candidates that the step verifies beside its tree (``TreeSet.lookup``; the rows are laid out in
``ppd.decoding.tables``). Any tree is verified exactly, so greedy output and the lossless sampling rule are
unchanged; only the accept length moves (``results/lookup_estimate/`` measured it by replay before this was built).

Each row keeps its text in the state's ``history`` [B, W] (token ids by position: the prompt, then every committed
token and the root), written by the prefill (:func:`start`) and by every step (:func:`record`). The lookup itself
(:func:`propose`) compares the whole buffer with the last tokens, with fixed shapes, so that it compiles and
captures inside the step like the rest of it.
"""

from __future__ import annotations

import torch

from ..uploads import upload

MAX_NGRAM = 3  # the longest ending of the text that is looked up (then shorter ones, down to one token)


def start(history: torch.Tensor, prompts: list[list[int]], root: torch.Tensor) -> None:
    """Write each row's prompt ``prompts[b]`` and its first root ``root[b]`` into ``history[b]`` (the first rows)."""
    n, width = len(prompts), history.shape[1]
    longest = max(len(p) for p in prompts)
    if longest + 1 > width:
        raise ValueError(f"a prompt of {longest} tokens does not fit a lookup history of {width} positions")
    rows = torch.zeros(n, longest + 1, dtype=torch.long)
    for b, prompt in enumerate(prompts):
        rows[b, : len(prompt)] = torch.tensor(prompt, dtype=torch.long)
    # (uploaded without waiting for the device: a joining request's prefill runs beside the running rows' steps)
    history[:n, : longest + 1] = upload(rows, history.device)
    lengths = upload([len(p) for p in prompts], history.device, torch.long)
    history[:n].scatter_(1, lengths[:, None], root[:n, None])


def record(history: torch.Tensor, lengths: torch.Tensor, emitted: torch.Tensor, running: torch.Tensor) -> None:
    """After a step: each running row's ``emitted`` tokens (its accepted candidates, then the new root, then
    padding) follow its root, which sits at position ``lengths[b]`` (the cache length before the step). The
    padding lands past the row's new root, where nothing reads it before a later step writes there."""
    positions = lengths[:, None] + 1 + torch.arange(emitted.shape[1], device=lengths.device)
    positions = positions.clamp_max(history.shape[1] - 1)
    old = history.gather(1, positions)
    history.scatter_(1, positions, torch.where(running[:, None], emitted, old))


def propose(history: torch.Tensor, lengths: torch.Tensor, nodes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's chain of ``nodes`` candidates: the tokens after the latest earlier occurrence of its text's last
    3, else 2, else 1 tokens (its text: ``history[b, :lengths[b] + 1]``, the root last). Returns the tokens
    [B, nodes] and which are real [B, nodes] (a prefix of each row: none where nothing matched, fewer where the
    text ends before the chain would)."""
    B, width = history.shape
    device = history.device
    known = lengths + 1  # tokens of each row's text
    start = torch.zeros_like(lengths)
    found = torch.zeros_like(lengths, dtype=torch.bool)
    for n in range(MAX_NGRAM, 0, -1):
        ending = history.gather(1, (known[:, None] - n + torch.arange(n, device=device)).clamp_min(0))  # [B, n]
        at = torch.arange(width - n + 1, device=device)  # where an occurrence may start
        match = at[None, :] + n < known[:, None]  # its next token is known: an occurrence before the ending
        for i in range(n):
            match = match & (history[:, i: width - n + 1 + i] == ending[:, i: i + 1])
        latest = torch.where(match, at[None, :], -1).amax(1)
        take = ~found & (latest >= 0)
        start = torch.where(take, latest + n, start)
        found = found | take
    positions = start[:, None] + torch.arange(nodes, device=device)
    valid = found[:, None] & (positions < known[:, None])
    tokens = history.gather(1, positions.clamp_max(width - 1))
    return torch.where(valid, tokens, 0), valid

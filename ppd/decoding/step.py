"""The device side of one decoding step, as a pure function of persistent tensors.

One PPD step (REFERENCE section 3) in Medusa's vocabulary:
``generate_candidates -> tree_decoding -> evaluate_posterior -> update_inference_inputs``, plus the stopping
rules, all on the device: row b reads its own tree ``tables[key[b]]``, the forward attends over the first
``width`` cache slots, logits are computed only for the node rows (acceptance) and for the prompt rows of
each row's last accepted node (the next guesses), the accepted path's KV entries move down in place (one
indexed copy per layer buffer), and EOS and token limits are decided here. Every input and output lives in
a :class:`~ppd.decoding.state.DecodeState`, so the function allocates nothing the host has to know about
and can be compiled (``torch.compile(fullgraph=True)``) and captured in a CUDA graph as it is.

With ``tables=None`` the same function is one autoregressive step (the root alone): the baseline.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from ..acceptance import accept_candidates, longest_accepted_path, sample_tokens, walk_tree
from ..attention import LayerAttention, step_mask, to_additive
from ..config import DecodeConfig
from ..deep_prompts import DeepWeights, LayerOffsets
from ..prefill import average_copies
from .state import EOS, REPORT_HEAD, RUNNING, DecodeState
from .kv_cache import cache_keyword
from .support import LogitTransform, UnsupportedModelError, checked_transform, refuse_by_design
from . import grouped_attention, lookup, tree_attention
from .confident import top_guesses
from .tables import RowTrees, TreeTables


@dataclass
class LanguageModel:
    """The pieces of a transformers causal LM that a step calls: embeddings, the body, the head."""

    embed: nn.Module
    body: nn.Module  # returns ``last_hidden_state`` (the final norm applied)
    head: nn.Module
    layers: LayerAttention  # full or sliding attention, layer by layer
    # What the model does to the head's output: the config's ``final_logit_softcapping``, and the constant
    # it multiplies or divides its logits by where its config names one (``ppd.decoding.support``).
    transform: LogitTransform = field(default_factory=LogitTransform)
    # A tree step computes the head once over all its rows, instead of over the nodes and then over the
    # prompt rows of the accepted node. Cheaper where reading the head's weight is what the head costs
    # (a CPU, a small tree), dearer where its arithmetic is (a GPU, large trees and batches).
    one_head_pass: bool = False
    # Attention runs FlexAttention over a block mask made from the lengths (``ppd.decoding.tree_attention``)
    # instead of the model's own attention over a dense float mask.
    flex: bool = False
    # Tree steps hand the split attention kernel their tree's own mask and their rows' lengths instead of a mask
    # over the whole cache (``grouped_attention.compact_tree_mask``; decided on the host in :meth:`stepping`).
    compact_mask: bool = False
    # Deep prompt tokens' hooks (``ppd.deep_prompts``), told each step which rows are prompt rows, and what
    # they add (offsets and low-rank maps, the maps also merged where ``deep_prompts.merges_maps`` says; the
    # model's dtype): inputs of the step like its tables.
    offsets: LayerOffsets | None = None
    offset_table: DeepWeights | None = None
    query_group: int = 1  # query heads per key head (FlexAttention's block masks lay their rows out by it)
    key_heads: int = 1  # key heads of an attention layer (a split FlexAttention step makes heads of its pieces)
    cache_key: str = "past_key_values"  # the keyword the body takes its KV cache by (``kv_cache.cache_keyword``)

    @classmethod
    def of(cls, model) -> "LanguageModel":
        """The model's pieces, once ppd has checked that it decodes the model exactly (else
        :class:`~ppd.decoding.support.UnsupportedModelError`, naming the reason; the probe forward runs once
        per model object)."""
        refuse_by_design(model)
        layers = LayerAttention.of(model.config)
        body = model.base_model
        if body is model:
            raise UnsupportedModelError(f"{type(model).__name__} exposes no base model under its head: not a "
                                        "causal LM as transformers builds them")
        lm = cls(model.get_input_embeddings(), body, model.get_output_embeddings(), layers,
                 cache_key=cache_keyword(body))
        text = model.config.get_text_config()
        heads = getattr(text, "num_attention_heads", None) or 1
        lm.query_group = max(heads // (getattr(text, "num_key_value_heads", None) or heads), 1)
        lm.key_heads = max(heads // lm.query_group, 1)
        lm.transform = checked_transform(model, lm)
        return lm

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The head's logits for ``hidden`` [..., hidden] -> [..., vocab], its rows handed to the head as one
        matrix. Given a view that is not contiguous (a step's node rows, ``hidden[:, :C]``), ``F.linear`` would
        run a batched product with the weight broadcast over the batch, eager and compiled alike, which reads
        the head's weight once per batch row: on a GPU, 16 reads of the default model's 56 MB head at batch 16."""
        rows = hidden.reshape(-1, hidden.shape[-1])  # a copy only of a view that is not contiguous
        return self.transform(self.head(rows)).view(*hidden.shape[:-1], -1)

    @contextlib.contextmanager
    def stepping(self):
        """The context a step's forward runs in (host side: entered around the compiled or captured call): the
        model's attention layers switched to ppd's FlexAttention function where :attr:`flex` is set, else to
        SDPA over the unrepeated key heads where :func:`grouped_attention.applies` (and :attr:`compact_mask` set
        for this step as :func:`grouped_attention.compact_tree_mask` says, and unset again on leaving)."""
        switched = contextlib.nullcontext()
        if self.flex:
            switched = tree_attention.active(self.body.config)
        elif grouped_attention.applies(self.body.config, self.query_group):
            device = self.embed.weight.device
            self.compact_mask = grouped_attention.compact_tree_mask(self.layers.kinds.values(), device)
            switched = grouped_attention.active(self.body.config, device)
        try:
            with switched:
                yield
        finally:
            self.compact_mask = False


@dataclass(frozen=True)
class StepKind:
    """What one compiled/captured step is specialised for (everything else is a tensor it reads)."""

    tree: bool  # PPD tree step, or one autoregressive row
    greedy: bool = True  # every row is greedy
    filtered: bool = False  # some sampled row applies top-k or top-p
    typical: bool = False  # some sampled row uses typical acceptance

    @classmethod
    def of(cls, tree: bool, configs: Iterable[DecodeConfig]) -> "StepKind":
        """The step that serves rows decoded as ``configs`` say."""
        configs = list(configs)
        return cls(tree, greedy=all(c.greedy for c in configs), filtered=any(c.filtered for c in configs),
                   typical=any(c.typical for c in configs))


def next_tokens(logits: torch.Tensor, state: DecodeState, kind: StepKind, index: torch.Tensor) -> torch.Tensor:
    """Each row's token after ``logits`` [B, vocab]: the argmax in greedy rows, else a sample with the random
    numbers of the row's output token ``index[b]`` (see ``ppd.acceptance``)."""
    greedy = logits.argmax(-1)
    if kind.greedy:
        return greedy
    sampled = sample_tokens(logits, state.temperature, state.top_k if kind.filtered else None,
                            state.top_p if kind.filtered else None, state.seed, index)
    return torch.where(state.greedy, greedy, sampled)


def set_guesses(state: DecodeState, prompt_logits: torch.Tensor, top_k: int, rows: int | None = None,
                log_probs: bool = True) -> None:
    """The next step's guesses of the first ``rows`` rows (all by default) from their prompt tokens' logits
    [rows, N, vocab]: the top-``top_k`` ids and, with ``log_probs``, their log-probabilities (what confident
    trees choose by; a step of fixed trees skips the reduction over the vocabulary they cost)."""
    ids, found = top_guesses(prompt_logits, top_k, log_probs)
    # (no slice where all rows are written: a compiled step would specialise on the batch size)
    for buffer, value in ((state.guesses, ids), (state.guess_log_probs, found)):
        if value is not None:
            (buffer if rows is None else buffer[:rows]).copy_(value)


def stop_rows(state: DecodeState, emitted: torch.Tensor, count: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Cut each row's ``emitted[b, :count[b]]`` at its first EOS or its token limit.

    Returns the tokens kept per row and each row's reason after this step (unchanged while running).
    """
    width = emitted.shape[1]
    live = torch.arange(width, device=emitted.device)[None, :] < count[:, None]
    is_eos = (emitted[..., None] == state.eos[:, None, :]).any(-1) & live
    any_eos = is_eos.any(1)
    upto_eos = torch.where(any_eos, is_eos.long().argmax(1) + 1, width)
    room = state.limit - state.generated
    kept = torch.minimum(count, torch.minimum(upto_eos, room))
    eos_stop = any_eos & (upto_eos <= room)
    limit_stop = (count > 0) & ~eos_stop & (state.generated + kept >= state.limit)
    reason = torch.where(eos_stop, EOS, torch.where(limit_stop, state.limit_reason, state.reason))
    return kept, reason


def _finish(state: DecodeState, emitted: torch.Tensor, count: torch.Tensor, committed: torch.Tensor,
            accepted: torch.Tensor) -> None:
    """Apply the stopping rules to ``emitted[b, :count[b]]``, grow the cache by ``committed`` entries and
    write the report the host reads."""
    kept, reason = stop_rows(state, emitted, count)
    state.lengths.add_(committed)
    state.generated.add_(kept)
    state.reason.copy_(reason)
    report = state.report
    report[:, 0] = kept
    report[:, 1] = torch.minimum(kept, accepted)
    report[:, 2] = reason
    report[:, 3] = state.lengths
    # Padded to the report's fixed width, so that one compiled step serves trees of any depth.
    report[:, REPORT_HEAD:] = torch.nn.functional.pad(emitted, (0, report.shape[1] - REPORT_HEAD - emitted.shape[1]))


def start_rows(state: DecodeState) -> None:
    """After the prefill: each running row emits its root, which is not in the cache yet."""
    count = (state.reason == RUNNING).long()
    zero = torch.zeros_like(count)
    _finish(state, state.root[:, None], count, zero, zero)


@dataclass
class Candidates:
    """The rows of one step's forward, for every batch row."""

    node_tokens: torch.Tensor  # long [B, 1 + C]: the root, then the candidates
    embeds: torch.Tensor  # [B, T, hidden]: node embeddings, then the prompt-token rows
    offsets: torch.Tensor  # long [B, T]: position of each row minus the root's
    allowed: torch.Tensor  # bool [B, T, T] (or [T, T]): which rows see which
    prompt_rows: torch.Tensor | None = None  # long [B, T]: prompt-table row + 1 of each row, 0 for a node
    trees: RowTrees | None = None  # each row's tree this step (None: one autoregressive row)


def generate_candidates(lm: LanguageModel, tables: TreeTables | None, prompt_embeds: torch.Tensor | None,
                        state: DecodeState) -> Candidates:
    """Each row's root and candidate tokens (picked from its guesses by its own tree), then its prompt rows."""
    if tables is None:
        node_tokens = state.root[:, None]  # [B, 1]
        allowed = torch.ones(1, 1, dtype=torch.bool, device=node_tokens.device)
        return Candidates(node_tokens, lm.embed(node_tokens), torch.zeros_like(node_tokens), allowed)
    trees = tables.for_rows(state)
    guesses = state.guesses.flatten(1)  # [B, N * K]
    if tables.lookup:  # the chain's tokens follow the guesses; a node the lookup did not fill is never accepted
        chain, real = lookup.propose(state.history, state.lengths, tables.lookup)
        guesses = torch.cat([guesses, chain], dim=1)
        trees = tables.with_chain(trees, real)
    candidates = guesses.gather(1, trees.candidate_index)  # [B, C]
    node_tokens = torch.cat([state.root[:, None], candidates], dim=1)
    embeds = torch.cat([lm.embed(node_tokens), prompt_embeds[state.key]], dim=1)
    prompt_rows = None
    if lm.offsets is not None:
        prompt_rows = torch.cat([torch.zeros_like(node_tokens), trees.prompt_index + 1], dim=1)
    return Candidates(node_tokens, embeds, trees.position_offset, trees.allowed, prompt_rows, trees)


def tree_decoding(lm: LanguageModel, state: DecodeState, rows: Candidates, slot_ids: torch.Tensor) -> torch.Tensor:
    """One forward over every row, written to cache slots ``lengths + [0, T)``; returns hidden states
    [B, T, hidden] (the final norm applied). Attention sees the slots ``slot_ids`` (under
    :meth:`LanguageModel.stepping` where ``lm.flex`` is set)."""
    lengths = state.lengths
    num_rows = rows.embeds.shape[1]
    positions = lengths[:, None] + rows.offsets
    slots = lengths[:, None] + torch.arange(num_rows, device=lengths.device)[None, :]
    extra = {}
    if lm.flex:
        width, key_heads = slot_ids.shape[0], lm.key_heads
        chunks = tree_attention.kv_chunks(lengths.shape[0], key_heads, num_rows * lm.query_group, width, lengths.device)
        masks = {kind: tree_attention.tree_block_mask(rows.allowed, lengths, rows.offsets, width, window,
                                                      lm.query_group, chunks, key_heads)
                 for kind, window in lm.layers.kinds.items()}
    elif lm.compact_mask and num_rows > 1:  # the split kernel reads the prefix from the lengths
        tree = to_additive(rows.allowed.expand(lengths.shape[0], num_rows, num_rows)[:, None], rows.embeds.dtype)
        masks = {kind: tree for kind in lm.layers.kinds}
        extra = {grouped_attention.LENGTHS_KEYWORD: lengths}
    else:
        masks = {kind: step_mask(rows.allowed, lengths, slot_ids, rows.embeds.dtype, rows.offsets, window)
                 for kind, window in lm.layers.kinds.items()}
    if lm.offsets is not None:
        lm.offsets.set(rows.prompt_rows, lm.offset_table, merged=True)  # a few hundred rows: one product a layer
    extra[lm.cache_key] = state.kv.view(slots, slot_ids.shape[0])
    hidden = lm.body(inputs_embeds=rows.embeds, attention_mask=lm.layers.pack(masks), position_ids=positions,
                     use_cache=True, **extra).last_hidden_state
    if lm.offsets is not None:
        lm.offsets.set(None, None)
    return hidden


def evaluate_posterior(tables: TreeTables | None, state: DecodeState, rows: Candidates, node_logits: torch.Tensor,
                       kind: StepKind) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's accepted path: its tree rows [B, depth + 1] (root first), how many of its candidates were
    accepted [B], and the next root, the model's token after the last of them [B].

    Greedy rows keep the longest path whose candidates are their parents' argmax; sampled rows walk the tree
    with lossless verification, or keep the longest typically-accepted path where they asked for it.
    """
    generated = state.generated  # output index of the token each row's root draws next (see ``ppd.acceptance``)
    if tables is None:
        zero = torch.zeros_like(state.root)
        return zero[:, None], zero, next_tokens(node_logits[:, 0], state, kind, generated)
    trees = rows.trees
    batch = torch.arange(node_logits.shape[0], device=node_logits.device)
    parents = trees.parent_row

    def longest(verdict: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The longest path of candidates that ``verdict`` accepts: its rows, its length, the logits after it."""
        best, accepted = longest_accepted_path(verdict, trees.retrieve_indices, trees.retrieve_valid)
        path = trees.retrieve_indices[batch, best]
        return path, accepted, node_logits[batch, path.gather(1, accepted[:, None])[:, 0]]

    if kind.greedy:
        path, accepted, last_logits = longest(accept_candidates(node_logits, rows.node_tokens, parents, True))
        return path, accepted, last_logits.argmax(-1)
    path, accepted, root = walk_tree(node_logits, rows.node_tokens, parents, trees.is_candidate, tables.depth,
                                     lambda logits, depth: next_tokens(logits, state, kind, generated + depth))
    if kind.typical:
        typical_path, typical_accepted, last_logits = longest(accept_candidates(
            node_logits, rows.node_tokens, parents, False, state.temperature, state.posterior_threshold,
            state.posterior_alpha))
        typical_root = next_tokens(last_logits, state, kind, generated + typical_accepted)
        path = torch.where(state.typical[:, None], typical_path, path)
        accepted = torch.where(state.typical, typical_accepted, accepted)
        root = torch.where(state.typical, typical_root, root)
    return path, accepted, root


def update_inference_inputs(lm: LanguageModel, tables: TreeTables | None, state: DecodeState, rows: Candidates,
                            hidden: torch.Tensor, path: torch.Tensor, accepted: torch.Tensor,
                            new_root: torch.Tensor, row_logits: torch.Tensor | None = None) -> None:
    """Keep the accepted path in the cache (one gather/scatter for all layers); the next guesses and key
    from the last accepted node (logits only for its prompt rows, or read from ``row_logits``, every row's,
    where the step computed them); the next root; the stopping rules; the report."""
    batch = torch.arange(path.shape[0], device=path.device)
    running = state.reason == RUNNING
    emitted = torch.cat([rows.node_tokens.gather(1, path)[:, 1:], torch.zeros_like(new_root)[:, None]], dim=1)
    emitted = emitted.scatter(1, accepted[:, None], new_root[:, None])  # accepted candidates, then the root
    if tables is not None:
        last = path.gather(1, accepted[:, None])[:, 0]  # tree row of the last accepted node
        trees = rows.trees
        prompt_rows = trees.node_prompt_rows[batch, last]  # [B, N * V]
        if row_logits is None:
            prompt_hidden = hidden.gather(1, prompt_rows[..., None].expand(-1, -1, hidden.shape[-1]))
            prompt_logits = lm.logits(prompt_hidden)
        else:
            prompt_logits = row_logits.gather(1, prompt_rows[..., None].expand(-1, -1, row_logits.shape[-1]))
        prompt_logits = average_copies(prompt_logits, tables.num_prompt_tokens, tables.num_ensemble)
        set_guesses(state, prompt_logits, tables.top_k, log_probs=tables.confident)
        state.key.copy_(torch.where(running, trees.node_prompt_count[batch, last], state.key))
        state.kv.compact(state.lengths[:, None] + path, state.lengths)
    if state.history is not None:
        lookup.record(state.history, state.lengths, emitted, running)
    state.root.copy_(torch.where(running, new_root, state.root))
    committed = torch.where(running, accepted + 1, 0)
    _finish(state, emitted, committed, committed, accepted)


def decode_step(lm: LanguageModel, tables: TreeTables | None, prompt_embeds: torch.Tensor | None,
                state: DecodeState, kind: StepKind, slot_ids: torch.Tensor) -> None:
    """One step for every row of ``state``; everything it produces is written into ``state``.

    ``slot_ids`` (``state.slot_ids[:W]``) are the cache slots attention sees: the step's width comes from
    its shape, so one compiled step serves every width.
    """
    rows = generate_candidates(lm, tables, prompt_embeds, state)
    hidden = tree_decoding(lm, state, rows, slot_ids)
    num_nodes = rows.node_tokens.shape[1]
    row_logits = lm.logits(hidden) if tables is not None and lm.one_head_pass else None
    # [B, 1 + C, vocab]: the only logits acceptance reads
    node_logits = lm.logits(hidden[:, :num_nodes]) if row_logits is None else row_logits[:, :num_nodes]
    path, accepted, new_root = evaluate_posterior(tables, state, rows, node_logits, kind)
    update_inference_inputs(lm, tables, state, rows, hidden, path, accepted, new_root, row_logits)

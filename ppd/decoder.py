"""The decoding loop: dynamic sparse-tree PPD and, on the same engine, autoregressive decoding.

One PPD step is one forward over ``T`` rows (root, candidates, attached prompt tokens) that verifies this
step's guesses and drafts the next step's (REFERENCE section 3). The loop reads the named steps
``generate_candidates -> tree_decoding -> evaluate_posterior -> update_inference_inputs``. The baseline is
the same loop over a one-row "tree" (the root alone, no prompt tokens), with the same cache and model.

The engine knows only token ids. It runs the model's own forward with ``inputs_embeds``, a 4D float
mask, explicit ``position_ids`` and a preallocated :class:`~ppd.kv_cache.KVCache`. Shapes are fixed per
tree, and the only host synchronisation of a step is the one read of its results (accepted tokens and
lengths), which the loop needs to decide whether to stop.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from .acceptance import accept_candidates, choose_tokens, longest_accepted_path
from .attention import step_mask
from .config import DecodeConfig, DecodeMethod
from .kv_cache import KVCache
from .prefill import average_copies, build_prefill
from .prompt_tokens import PromptTokens
from .tree import Tree, TreeBuffers, TreeSet


class PromptTooLongError(ValueError):
    """The prompt leaves no room in the model's context window."""


@dataclass
class StepOutput:
    """New tokens of one forward pass (the prefill is step 0) for each batch row."""

    step: int
    tokens: list[list[int]]  # empty for a row that had already finished
    guessed: list[int]  # how many leading tokens of ``tokens`` were accepted guesses
    finished: list[bool]
    finish_reason: list[str | None] = field(default_factory=list)  # "eos" | "length" | "max_length" once finished


@dataclass
class GenerationOutput:
    token_ids: list[int]
    steps: int  # forward passes after the prefill
    finish_reason: str  # "eos" | "length" | "max_length"
    wall_time_s: float
    step_tokens: list[int] = field(default_factory=list)  # tokens emitted by each step

    @property
    def new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def accept_length(self) -> float:
        """New tokens per decoding step (prefill excluded), as the reference reports it."""
        return self.new_tokens / self.steps if self.steps else float(self.new_tokens)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_time_s if self.wall_time_s > 0 else 0.0

    def stats(self) -> dict:
        return {
            "new_tokens": self.new_tokens,
            "steps": self.steps,
            "accept_length": self.accept_length,
            "tokens_per_s": self.tokens_per_s,
            "wall_time_s": self.wall_time_s,
            "finish_reason": self.finish_reason,
        }


def eos_ids_of(model, tokenizer=None) -> set[int]:
    """Every EOS id that the model's generation config or the tokenizer names."""
    ids: set[int] = set()
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for source in (eos, getattr(tokenizer, "eos_token_id", None)):
        if source is None:
            continue
        ids.update([source] if isinstance(source, int) else source)
    return ids


class _Batch:
    """Host-side bookkeeping of what each row has emitted and whether it may go on."""

    def __init__(self, size: int, limits: list[int], limit_reasons: list[str], eos: set[int], stop_on_eos: bool):
        self.tokens: list[list[int]] = [[] for _ in range(size)]
        self.step_tokens: list[list[int]] = [[] for _ in range(size)]
        self.steps = [0] * size
        self.limits = limits  # new tokens each row may produce
        self.limit_reasons = limit_reasons  # "length" (max_new_tokens) or "max_length" (context window)
        self.reason: list[str | None] = [None] * size
        self.eos = eos if stop_on_eos else set()
        self.current_step = 0  # the forward pass the latest tokens came from (0 = prefill)
        self.current_guessed = [0] * size  # accepted guesses among each row's latest tokens

    def finished(self) -> list[bool]:
        return [r is not None for r in self.reason]

    def add(self, row: int, new: list[int], count_step: bool) -> list[int]:
        """Append ``new`` to a row, cut at EOS or the row's limit; returns what was kept."""
        if self.reason[row] is not None:
            return []
        kept = []
        for token in new:
            kept.append(token)
            if token in self.eos:
                self.reason[row] = "eos"
                break
            if len(self.tokens[row]) + len(kept) >= self.limits[row]:
                break
        self.tokens[row].extend(kept)
        if count_step:
            self.steps[row] += 1
            self.step_tokens[row].append(len(kept))
        if self.reason[row] is None and len(self.tokens[row]) >= self.limits[row]:
            self.reason[row] = self.limit_reasons[row]
        return kept


class Decoder:
    """Decodes with trained prompt tokens over a tree set; ``method=baseline`` decodes one token per step.

    ``prompt_tokens`` may be ``None`` for a decoder that only runs the baseline.
    """

    def __init__(
        self,
        model,
        prompt_tokens: PromptTokens | None = None,
        trees: TreeSet | None = None,
        eos_token_ids: Iterable[int] = (),
    ):
        self.model = model
        self.prompt_tokens = prompt_tokens
        self.eos_token_ids = set(eos_token_ids)
        if prompt_tokens is not None:
            prompt_tokens.check_compatible(model)
            prompt_tokens.to(self.device)
            trees = trees if trees is not None else TreeSet.packaged()
            if trees.num_prompt_tokens != prompt_tokens.num_prompt_tokens:
                raise ValueError(
                    f"the tree set is built for N={trees.num_prompt_tokens} prompt tokens, "
                    f"the adapter has N={prompt_tokens.num_prompt_tokens}"
                )
        self.trees = trees
        self._buffers: dict[int, TreeBuffers] = {}
        self._prompt_rows: dict[int, torch.Tensor] = {}
        self._chain: TreeBuffers | None = None

    # ------------------------------------------------------------------ properties and set-up
    @property
    def device(self) -> torch.device:
        return self.model.get_input_embeddings().weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.get_input_embeddings().weight.dtype

    @property
    def max_positions(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 0) or 1 << 30)

    def tree_buffers(self, key: int) -> TreeBuffers:
        if key not in self._buffers:
            pt = self.prompt_tokens
            self._buffers[key] = TreeBuffers.build(
                self.trees.trees[key], key, pt.num_prompt_tokens, pt.num_ensemble, pt.config.attention_type,
                self.trees.top_k, self.device,
            )
        return self._buffers[key]

    def _prompt_embeds(self, buffers: TreeBuffers, dtype: torch.dtype) -> torch.Tensor:
        """The prompt-token rows of a tree, in the model's dtype, computed once per tree."""
        cached = self._prompt_rows.get(buffers.key)
        if cached is None or cached.dtype != dtype:
            cached = self.prompt_tokens(buffers.prompt_index).detach().to(dtype=dtype)
            self._prompt_rows[buffers.key] = cached
        return cached

    def chain_buffers(self) -> TreeBuffers:
        """The one-row step of autoregressive decoding: the root alone."""
        if self._chain is None:
            n = self.prompt_tokens.num_prompt_tokens if self.prompt_tokens is not None else 1
            self._chain = TreeBuffers.build(Tree((), (), 0), 0, n, 1, "ensemble", 1, self.device)
        return self._chain

    # ------------------------------------------------------------------ public API
    def generate(self, input_ids: Sequence[int] | Sequence[Sequence[int]], config: DecodeConfig | None = None,
                 **overrides) -> GenerationOutput | list[GenerationOutput]:
        """Decode one prompt (a list of ids) or a batch (a list of lists); returns one output per prompt."""
        config = _with_overrides(config, overrides)
        single = len(input_ids) > 0 and isinstance(input_ids[0], int)
        batch = [list(input_ids)] if single else [list(x) for x in input_ids]
        start = time.perf_counter()
        state = None
        for state in self._run(batch, config):
            pass
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        wall = time.perf_counter() - start
        outputs = [
            GenerationOutput(state.tokens[b], state.steps[b], state.reason[b] or "length", wall, state.step_tokens[b])
            for b in range(len(batch))
        ]
        return outputs[0] if single else outputs

    def stream(self, input_ids: Sequence[int], config: DecodeConfig | None = None, **overrides) -> Iterator[StepOutput]:
        """Decode one prompt, yielding the tokens of every forward pass as soon as they are known."""
        config = _with_overrides(config, overrides)
        seen = 0
        for state in self._run([list(input_ids)], config):
            tokens = state.tokens[0][seen:]
            seen += len(tokens)
            yield StepOutput(state.current_step, [tokens], [state.current_guessed[0]], state.finished(),
                             list(state.reason))

    # ------------------------------------------------------------------ the loop
    def _run(self, batch: list[list[int]], config: DecodeConfig) -> Iterator["_Batch"]:
        if not batch or any(len(x) == 0 for x in batch):
            raise ValueError("every prompt needs at least one token")
        use_ppd = config.method is DecodeMethod.PPD
        if use_ppd and self.prompt_tokens is None:
            raise ValueError("method 'ppd' needs prompt tokens (an adapter); use method 'baseline' without one")
        lengths = [len(x) for x in batch]
        longest = max(lengths)
        if longest >= self.max_positions:
            raise PromptTooLongError(
                f"the prompt has {longest} tokens but the model's context window is {self.max_positions}: "
                f"no room for a single new token"
            )
        limits = [min(config.max_new_tokens, self.max_positions - n) for n in lengths]
        reasons = ["length" if config.max_new_tokens <= self.max_positions - n else "max_length" for n in lengths]
        state = _Batch(len(batch), limits, reasons, self.eos_token_ids, config.stop_on_eos)
        generator = None
        if config.seed is not None:
            generator = torch.Generator(self.device).manual_seed(config.seed)

        n_prompt = self.prompt_tokens.num_prompt_tokens if use_ppd else 0
        widest = self.trees.max_rows(self.prompt_tokens.num_ensemble) if use_ppd else 1
        prefill_rows = longest + (n_prompt * self.prompt_tokens.num_ensemble if use_ppd else 0)
        # An active row holds at most longest + max_new_tokens - 1 entries and writes `widest` rows past
        # them; a row that finished may have committed up to one tree path more before it stopped growing.
        capacity = max(prefill_rows, min(longest + config.max_new_tokens, self.max_positions) + 2 * widest)
        cache = KVCache(self.model.config.num_hidden_layers, len(batch), capacity, self.device)

        # Inference mode is thread-local and the caller may resume this generator on another thread (a web
        # server's worker pool does): it is entered afresh between yields, never held across one.
        with torch.inference_mode():
            root, guesses = self._prefill(batch, cache, n_prompt, config, generator)
            roots = root.tolist()
        for b in range(len(batch)):
            state.add(b, [roots[b]], count_step=False)
        yield state

        host_lengths = list(lengths)
        key = n_prompt
        step = 0
        while not all(state.finished()):
            buffers = self.tree_buffers(key) if key else self.chain_buffers()
            if max(host_lengths) + buffers.max_offset >= self.max_positions:
                # Near the end of the context window the tree's positions would not fit: one row a step.
                buffers, key = self.chain_buffers(), 0
            with torch.inference_mode():
                active = torch.tensor([not f for f in state.finished()], device=self.device)
                attend = capacity if config.static_kv else max(host_lengths) + buffers.num_rows
                result = self._step(buffers, key, root, guesses, cache, attend, active, config, generator)
                root, guesses, emitted, count, next_key = result
                # The one host synchronisation of the step: counts, next keys and tokens in one transfer.
                host = torch.cat([count[:, None], next_key[:, None], emitted], dim=1).tolist()
            step += 1
            counts, keys = [row[0] for row in host], [row[1] for row in host]
            guessed = []
            for b in range(len(batch)):
                kept = state.add(b, host[b][2: 2 + counts[b]], count_step=True)
                guessed.append(max(0, min(len(kept), counts[b] - 1)))
                host_lengths[b] += counts[b]
            # With a batch, every row takes the smallest tree any unfinished row can feed.
            alive = [keys[b] for b, done in enumerate(state.finished()) if not done]
            key = min(alive) if alive else 0
            state.current_step, state.current_guessed = step, guessed
            yield state

    def _forward(self, embeds: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                 logits_to_keep: torch.Tensor | int = 0) -> torch.Tensor:
        out = self.model(
            inputs_embeds=embeds, attention_mask=mask, position_ids=positions, past_key_values=cache,
            use_cache=True, logits_to_keep=logits_to_keep,
        )
        return out.logits

    def _prefill(self, batch, cache: KVCache, n_prompt: int, config: DecodeConfig, generator):
        """Run ``[x_b, prompt tokens]``; return the root token [B] and the guesses [B, N, K] (or None)."""
        V = self.prompt_tokens.num_ensemble if n_prompt else 1
        attention = self.prompt_tokens.config.attention_type if n_prompt else "ensemble"
        table = self.prompt_tokens().detach() if n_prompt else None
        inputs = build_prefill(self.model, batch, table, n_prompt, V, attention)
        width = inputs.width
        cache.prepare(torch.arange(width, device=self.device)[None].expand(len(batch), -1), width)
        logits = self._forward(inputs.embeds, inputs.mask, inputs.positions, cache, inputs.keep)
        rows = inputs.rows(logits)  # [B, 1 + nV, vocab]
        cache.lengths.copy_(inputs.lengths)
        root = choose_tokens(rows[:, 0], config, generator)
        guesses = self._guesses(rows[:, 1:], n_prompt, V) if n_prompt else None
        return root, guesses

    def _guesses(self, prompt_logits: torch.Tensor, n_prompt: int, V: int) -> torch.Tensor:
        """Top-K guesses [B, N, K] from the prompt rows' logits [B, N * V, vocab], copies averaged."""
        return average_copies(prompt_logits, n_prompt, V).topk(self.trees.top_k, dim=-1).indices

    def _step(self, buffers: TreeBuffers, key: int, root, guesses, cache: KVCache, attend: int,
              active: torch.Tensor, config: DecodeConfig, generator):
        node_tokens = self._generate_candidates(buffers, key, root, guesses)
        logits = self._tree_decoding(buffers, node_tokens, cache, attend)
        best, accept_length = self._evaluate_posterior(buffers, node_tokens, logits, config)
        return self._update_inference_inputs(
            buffers, node_tokens, logits, best, accept_length, cache, active, config, generator
        )

    def _generate_candidates(self, buffers: TreeBuffers, key: int, root, guesses) -> torch.Tensor:
        """Tokens of the root and every candidate node: long [B, 1 + C]."""
        if buffers.num_nodes == 1:
            return root[:, None]
        flat = guesses[:, :key].reshape(root.shape[0], -1)  # [B, key * K]
        return torch.cat([root[:, None], flat[:, buffers.candidate_index]], dim=1)

    def _tree_decoding(self, buffers: TreeBuffers, node_tokens, cache: KVCache, attend: int) -> torch.Tensor:
        """One forward over every row of the tree; returns logits [B, T, vocab]."""
        batch = node_tokens.shape[0]
        embeds = self.model.get_input_embeddings()(node_tokens)
        if buffers.num_rows > buffers.num_nodes:
            table = self._prompt_embeds(buffers, embeds.dtype)
            embeds = torch.cat([embeds, table[None].expand(batch, -1, -1)], dim=1)
        lengths = cache.lengths
        positions = lengths[:, None] + buffers.position_offset[None, :]
        slots = lengths[:, None] + torch.arange(buffers.num_rows, device=lengths.device)[None, :]
        cache.prepare(slots, attend)
        mask = step_mask(buffers.allowed, lengths, attend, embeds.dtype)
        return self._forward(embeds, mask, positions, cache)

    def _evaluate_posterior(self, buffers: TreeBuffers, node_tokens, logits, config: DecodeConfig):
        if buffers.num_nodes == 1:
            zero = torch.zeros(node_tokens.shape[0], dtype=torch.long, device=node_tokens.device)
            return zero, zero
        accepted = accept_candidates(logits[:, : buffers.num_nodes], node_tokens, buffers.parent_row, config)
        return longest_accepted_path(accepted, buffers.retrieve_indices, buffers.retrieve_valid)

    def _update_inference_inputs(self, buffers: TreeBuffers, node_tokens, logits, best, accept_length,
                                 cache: KVCache, active, config: DecodeConfig, generator):
        """Keep the accepted path in the cache; pick the next root and guesses.

        Returns ``(root [B], guesses [B, N, K] | None, emitted [B, depth + 1], count [B], next_key [B])``:
        row b emitted ``emitted[b, :count[b]]`` (its accepted candidates, then the new root).
        """
        batch = node_tokens.shape[0]
        rows = torch.arange(batch, device=node_tokens.device)
        path = buffers.retrieve_indices[best]  # [B, depth + 1] tree rows, root first
        last = path[rows, accept_length]  # row of the last accepted node
        new_root = choose_tokens(logits[rows, last], config, generator)
        path_tokens = node_tokens.gather(1, path)
        emitted = torch.cat([path_tokens[:, 1:], torch.zeros_like(new_root)[:, None]], dim=1)
        emitted = emitted.scatter(1, accept_length[:, None], new_root[:, None])
        count = torch.where(active, accept_length + 1, torch.zeros_like(accept_length))
        cache.compact(cache.lengths[:, None] + path, count)

        next_key = buffers.node_prompt_count[last]
        guesses = None
        if buffers.num_rows > buffers.num_nodes:
            pt = self.prompt_tokens
            prompt_rows = buffers.node_prompt_rows[last]  # [B, N * V]
            guesses = self._guesses(logits[rows[:, None], prompt_rows], pt.num_prompt_tokens, pt.num_ensemble)
        return new_root, guesses, emitted, count, next_key


def _with_overrides(config: DecodeConfig | None, overrides: dict) -> DecodeConfig:
    config = config or DecodeConfig()
    if overrides:
        config = DecodeConfig(**{**config.__dict__, **overrides})
    return config

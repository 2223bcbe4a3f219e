"""``PPDModel``: a base model with its prompt tokens, decoded by ppd behind transformers' ``generate``.

Code that calls ``model.generate(input_ids, max_new_tokens=..., do_sample=..., streamer=...)`` on a
transformers causal LM swaps one line::

    model = PPDModel.from_pretrained("HuggingFaceTB/SmolLM2-135M-Instruct")   # or (base, adapter=...)
    output = model.generate(input_ids, attention_mask=mask, max_new_tokens=256)

``generate`` takes what transformers' ``generate`` takes for greedy decoding and sampling (a
``GenerationConfig`` and/or its fields as keyword arguments, a left-padded batch with its attention mask,
a ``TextStreamer``/``TextIteratorStreamer``, ``StoppingCriteria``, EOS ids) and returns what it returns: a
``LongTensor`` [batch, prompt + new tokens], the prompt as given, then the new tokens, rows that stopped
early padded with ``pad_token_id``. Greedy output is token for token the base model's own. What ppd does
not do (beam search, repetition penalties, logits processors, returning scores) is refused with an error
naming the setting, never ignored.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from .adapter import AdapterFiles, prompt_tokens_and_trees
from .config import CaptureMode, DecodeConfig
from .decoder import Decoder, GenerationOutput, eos_ids_of
from .decoding.loop import decode
from .models import DEFAULT_MODEL, ModelInfo, load_model
from .tree import TreeSet

# GenerationConfig fields ppd cannot honour, with the value at which they do nothing.
UNSUPPORTED = {
    "num_beams": 1, "num_beam_groups": 1, "num_return_sequences": 1, "penalty_alpha": None,
    "repetition_penalty": 1.0, "encoder_repetition_penalty": 1.0, "no_repeat_ngram_size": 0,
    "encoder_no_repeat_ngram_size": 0, "bad_words_ids": None, "force_words_ids": None, "sequence_bias": None,
    "min_length": 0, "min_new_tokens": None, "forced_bos_token_id": None, "forced_eos_token_id": None,
    "suppress_tokens": None, "begin_suppress_tokens": None, "typical_p": 1.0, "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0, "min_p": None, "diversity_penalty": 0.0, "guidance_scale": None,
    "prompt_lookup_num_tokens": None, "assistant_early_exit": None, "output_scores": False,
    "output_logits": False, "output_attentions": False, "output_hidden_states": False,
    "return_dict_in_generate": False, "watermarking_config": None,
    "length_penalty": 1.0, "exponential_decay_length_penalty": None,
}


class PPDModel:
    """A causal LM and its ppd decoder. ``model``, ``tokenizer`` and ``decoder`` are the parts;
    ``last_outputs`` holds the last ``generate`` call's per-row statistics (steps, accept length)."""

    def __init__(self, model, tokenizer, decoder: Decoder, info: ModelInfo | None = None, adapter: str = "",
                 tree: str = ""):
        self.model = model
        self.tokenizer = tokenizer
        self.decoder = decoder
        self.info = info
        self.adapter = adapter  # where the prompt tokens came from
        self.tree = tree  # where the tree set came from
        self.last_outputs: list[GenerationOutput] = []

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_pretrained(cls, base: str = DEFAULT_MODEL, adapter: str | Path | None = None, *,
                        revision: str | None = None, tree: str | Path | None = None, device=None, dtype=None,
                        load_in_4bit: bool = False, load_in_8bit: bool = False, max_seq_len: int | None = None,
                        packed_weights: bool | None = None) -> "PPDModel":
        """Load ``base`` (an alias, a folder or a hub id) and its prompt tokens: ``adapter`` (a folder, or a
        hub id ``org/name[@revision]``; ``revision`` pins it), else the adapter shipped for the model, else
        freshly initialised prompt tokens. The tree set is ``tree``, else the adapter's for the device
        and dtype. The adapter is read before the model, so a bad one fails fast."""
        files = AdapterFiles.read(adapter, revision) if adapter is not None else None
        given_trees = TreeSet.load(tree) if tree is not None else None
        model, tokenizer, info = load_model(base, device=device, dtype=dtype, load_in_4bit=load_in_4bit,
                                            load_in_8bit=load_in_8bit)
        return cls._assemble(model, tokenizer, info, files, given_trees, str(tree), max_seq_len, packed_weights)

    @classmethod
    def from_model(cls, model, tokenizer=None, adapter: str | Path | None = None, *, revision: str | None = None,
                   tree: str | Path | None = None, max_seq_len: int | None = None,
                   packed_weights: bool | None = None) -> "PPDModel":
        """Wrap a transformers causal LM already loaded (its ``config._name_or_path`` names it, which picks
        the shipped adapter when no ``adapter`` is given). The model is frozen and put in eval mode."""
        model.eval().requires_grad_(False)
        name = getattr(model.config, "_name_or_path", "") or type(model).__name__
        info = ModelInfo(name, "", name)
        files = AdapterFiles.read(adapter, revision) if adapter is not None else None
        given_trees = TreeSet.load(tree) if tree is not None else None
        return cls._assemble(model, tokenizer, info, files, given_trees, str(tree), max_seq_len, packed_weights)

    @classmethod
    def _assemble(cls, model, tokenizer, info, files: AdapterFiles | None, given_trees: TreeSet | None,
                  tree_name: str, max_seq_len, packed_weights) -> "PPDModel":
        files, choice = prompt_tokens_and_trees(model, tokenizer, info, files, given_trees, tree_name)
        decoder = Decoder(model, files.prompt_tokens, choice.trees, eos_token_ids=eos_ids_of(model, tokenizer),
                          max_seq_len=max_seq_len, policy=choice.policy, packed_weights=packed_weights)
        return cls(model, tokenizer, decoder, info, files.source, choice.source)

    # ------------------------------------------------------------------ what transformers code reads
    @property
    def config(self):
        return self.model.config

    @property
    def generation_config(self):
        return self.model.generation_config

    @property
    def device(self) -> torch.device:
        return self.decoder.device

    # ------------------------------------------------------------------ generate
    @torch.no_grad()
    def generate(self, inputs: torch.Tensor | None = None, generation_config=None, stopping_criteria=None,
                 streamer=None, *, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                 method: str = "ppd", capture: CaptureMode | str = CaptureMode.AUTO, **kwargs) -> torch.Tensor:
        """transformers' ``generate`` for greedy decoding and sampling, decoded by ppd (``method="baseline"``:
        the same engine one token per step). Returns ``LongTensor`` [batch, prompt + new tokens]."""
        ids = inputs if inputs is not None else input_ids
        if ids is None:
            raise ValueError("generate needs input_ids (a LongTensor [batch, tokens])")
        ids = torch.as_tensor(ids)
        if ids.dim() != 2 or ids.shape[0] == 0 or ids.shape[1] == 0 or ids.dtype not in (torch.long, torch.int):
            raise ValueError(f"input_ids must be an integer tensor [batch, tokens], got {tuple(ids.shape)} "
                             f"{ids.dtype}")
        tokenizer = kwargs.pop("tokenizer", None) or self.tokenizer
        config = self._generation_config(generation_config, kwargs)
        prompts = self._prompts(ids, attention_mask, config)
        new_tokens = config.max_new_tokens
        if new_tokens is None:
            new_tokens = config.max_length - ids.shape[1]
            if new_tokens < 1:
                raise ValueError(f"max_length {config.max_length} leaves no room after the {ids.shape[1]}-token "
                                 "input; set max_new_tokens")
        eos = _eos_ids(config)
        sampled = bool(config.do_sample)
        decode_config = DecodeConfig(
            method=method, max_new_tokens=new_tokens, capture=capture, eos_token_ids=eos, stop_on_eos=bool(eos),
            temperature=float(config.temperature if config.temperature is not None else 1.0) if sampled else 0.0,
            top_p=float(config.top_p if config.top_p is not None else 1.0) if sampled else 1.0,
            top_k=int(config.top_k or 0) if sampled else 0,
            # Sampling draws its seed from torch's global generator: torch.manual_seed makes a call repeatable.
            seed=int(torch.randint(0, 1 << 31, ())) if sampled else None,
        )
        if streamer is not None:
            if len(prompts) > 1:
                raise ValueError("a streamer takes one sequence; generate a batch without a streamer")
            streamer.put(ids[:1].cpu())
        criteria = list(stopping_criteria or [])
        if config.stop_strings:
            if tokenizer is None:
                raise ValueError("stop_strings need the tokenizer: pass tokenizer=... or build PPDModel with one")
            from transformers import StopStringCriteria

            criteria.append(StopStringCriteria(tokenizer, config.stop_strings))
        answers, outputs = self._decode(prompts, decode_config, criteria, streamer)
        if streamer is not None:
            streamer.end()
        self.last_outputs = outputs
        return self._pack(ids, answers, config, eos)

    def _generation_config(self, given, kwargs: dict):
        """The model's generation config, updated by ``given`` and then by the keyword arguments, as
        transformers resolves them; anything ppd would have to ignore is an error."""
        config = copy.deepcopy(given if given is not None else self.model.generation_config)
        unused = config.update(**kwargs)
        if unused:
            raise TypeError(f"generate got arguments that are neither generation settings nor supported by ppd: "
                            f"{', '.join(sorted(unused))}")
        refused = [f"{name}={value!r}" for name, neutral in UNSUPPORTED.items()
                   if (value := getattr(config, name, None)) is not None and value != neutral]
        if refused:
            raise ValueError(f"ppd decodes greedily or samples (temperature, top-k, top-p); it does not support "
                             f"{', '.join(refused)}")
        return config

    def _prompts(self, ids: torch.Tensor, mask: torch.Tensor | None, config) -> list[list[int]]:
        """Each row's tokens without its left padding. Without a mask, padding is read from
        ``pad_token_id`` where it differs from EOS, as transformers reads it."""
        pad = config.pad_token_id
        if mask is None:
            mask = (ids != pad) if pad is not None and pad not in _eos_ids(config) and bool((ids == pad).any()) else None
        if mask is None:
            return ids.tolist()
        mask = torch.as_tensor(mask).bool()
        if mask.shape != ids.shape:
            raise ValueError(f"attention_mask has shape {tuple(mask.shape)}, input_ids {tuple(ids.shape)}")
        prompts = []
        for b, (row, keep) in enumerate(zip(ids.tolist(), mask.tolist())):
            first = keep.index(True) if True in keep else len(keep)
            if not all(keep[first:]):
                raise ValueError(f"row {b} of the batch is not left-padded (its attention mask has a 0 after a 1): "
                                 "decoder-only generation takes left padding (tokenizer.padding_side = 'left')")
            if first == len(keep):
                raise ValueError(f"row {b} of the batch is all padding")
            prompts.append(row[first:])
        return prompts

    def _decode(self, prompts: list[list[int]], config: DecodeConfig, criteria: Sequence[Callable],
                streamer) -> tuple[list[list[int]], list[GenerationOutput]]:
        """Decode the batch; ``criteria`` (transformers ``StoppingCriteria``, called on each row's sequence
        after each new token, ``scores=None``) cut a row where one of them first says stop."""
        answers: list[list[int]] = [[] for _ in prompts]
        cut = [False] * len(prompts)
        progress = None
        start = time.perf_counter()
        for progress in decode(self.decoder, prompts, config):
            for b, tokens in enumerate(progress.current_tokens):
                kept = []
                for token in tokens if not cut[b] else ():
                    kept.append(token)
                    if criteria and _should_stop(criteria, prompts[b] + answers[b] + kept, self.device):
                        cut[b] = True
                        break
                answers[b].extend(kept)
                if streamer is not None and kept:
                    streamer.put(torch.tensor(kept))
            if all(c or f for c, f in zip(cut, progress.finished())):
                break  # closing the decoding generator frees its cache
        wall = time.perf_counter() - start
        outputs = [GenerationOutput(answers[b], progress.steps[b],
                                    "stopping_criteria" if cut[b] else progress.reason[b] or "length", wall,
                                    progress.step_tokens[b]) for b in range(len(prompts))]
        return answers, outputs

    def _pack(self, ids: torch.Tensor, answers: list[list[int]], config, eos: list[int]) -> torch.Tensor:
        """[batch, prompt + longest answer]: the input as given, each answer, then ``pad_token_id``."""
        width = max(len(a) for a in answers)
        pad = config.pad_token_id if config.pad_token_id is not None else (eos[0] if eos else None)
        if pad is None and any(len(a) < width for a in answers):
            raise ValueError("rows of the batch stopped at different lengths and there is no pad_token_id (nor an "
                             "EOS id) to pad the shorter ones with; set pad_token_id")
        out = torch.full((ids.shape[0], width), pad if pad is not None else 0, dtype=torch.long)
        for b, answer in enumerate(answers):
            out[b, : len(answer)] = torch.tensor(answer, dtype=torch.long)
        return torch.cat([ids.to(torch.long).cpu(), out], dim=1).to(ids.device)


def _eos_ids(config) -> list[int]:
    """A generation config's ``eos_token_id`` (None, an id or a list of ids) as a list."""
    eos = config.eos_token_id
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


def _should_stop(criteria: Sequence[Callable], sequence: list[int], device: torch.device) -> bool:
    ids = torch.tensor([sequence], device=device)
    return any(bool(torch.as_tensor(c(ids, None)).any()) for c in criteria)

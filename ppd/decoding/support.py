"""Which causal LMs ppd decodes exactly, decided before anything decodes.

ppd needs a model whose base model takes ``inputs_embeds``, a 4D float attention mask (one per attention
kind, :class:`~ppd.attention.LayerAttention`), ``position_ids`` and a cache object that writes each new row
at a slot the decoder chose, and whose logits are its output embeddings applied to the base model's last
hidden state (then scaled and soft-capped as its config says). Most transformers decoder-only models are
built that way; the rest are refused with :class:`UnsupportedModelError`, naming the reason:

- from the model and its config, without running it: an encoder-decoder model, a model without a base
  model under its head, and a model whose cache holds a recurrent state (what transformers marks
  ``_is_stateful``: its own assisted generation cannot roll that cache back either; ppd's tree step writes
  every candidate into the cache and keeps the accepted ones);
- by running it once on a few tokens (:func:`probe`): a model that does not compute through those inputs
  what it computes on its own, e.g. one whose attention is bidirectional, ignores the 4D mask or the
  positions, applies a causal mask of its own by slot index, keeps a cache of its own, or transforms its
  logits in a way the config does not say. The probe also picks the constant the model multiplies its
  logits by, where its config names one (``logit_scale``, ``logits_scaling``).

The probe lays out its tokens as decoding may, not in order: the prefill's last token in the first cache
slot, an embedding of no token (as a prompt token is) that nothing may see in the second, the others after
it; then one step through that cache. Its logits must equal the model's own forward over the tokens in
order (to a tolerance that the dtype's rounding allows; a wrong mask or position changes logits by about
their spread). In float32 that catches small departures too; in 16-bit precision only those as large as a
real model's (a tiny random model's may slip through there).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from ..attention import LayerAttention, to_additive, within_window
from .kv_cache import KVBuffer, cache_keyword

PROBE_TOKENS = 8
# How far the probe's logits may be from the model's own (float32 or wider, 16-bit): per token, the mean
# absolute difference over the vocabulary as a share of the spread (standard deviation) of the model's own
# logits. Rounding and attention kernels that sum the keys in another order stay far below (SmolLM2-135M:
# 3e-6 in float32, 0.03 in bfloat16); a mask or a position the model does not honour moves logits by about
# their spread (0.4 to 10 there: a key it should not see, bidirectional attention, one position off by 3).
PROBE_TOLERANCE = (1e-3, 0.15)
# The same for the head alone (one hidden state, two ways to its logits), as a share of the largest logit.
HEAD_TOLERANCE = (1e-5, 1e-2)


class UnsupportedModelError(ValueError):
    """ppd cannot decode this model exactly; the message says why."""


@dataclass(frozen=True)
class LogitTransform:
    """What the model does to ``head(hidden)``: multiply or divide by a constant, then soft-cap."""

    multiply: float | None = None
    divide: float | None = None
    softcap: float | None = None

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        if self.multiply is not None:
            logits = logits * self.multiply
        if self.divide is not None:
            logits = logits / self.divide
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


def text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def refuse_by_design(model) -> None:
    """Raise :class:`UnsupportedModelError` for what the model's class and config already rule out."""
    name = type(model).__name__
    config = model.config
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(f"{name} is an encoder-decoder model; ppd decodes decoder-only causal LMs")
    if getattr(model, "_is_stateful", False):
        raise UnsupportedModelError(
            f"{name} keeps a recurrent state in its cache (transformers marks it stateful), which cannot be "
            "rolled back to the accepted candidates; ppd decodes models whose cache holds keys and values only")
    if model.get_output_embeddings() is None:
        raise UnsupportedModelError(f"{name} has no language-model head (output embeddings)")


def transforms_of(config) -> list[LogitTransform]:
    """The logit transforms the config can stand for: none, or a constant named ``logit_scale`` (Cohere
    multiplies by it) or ``logits_scaling`` (Granite divides by it, others multiply), each then soft-capped
    by ``final_logit_softcapping``."""
    config = text_config(config)
    softcap = getattr(config, "final_logit_softcapping", None) or None
    found = [LogitTransform(softcap=softcap)]
    for field in ("logit_scale", "logits_scaling"):
        value = getattr(config, field, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value not in (0, 1):
            found += [LogitTransform(multiply=float(value), softcap=softcap),
                      LogitTransform(divide=float(value), softcap=softcap)]
    return found


_checked: "weakref.WeakKeyDictionary[torch.nn.Module, LogitTransform]" = weakref.WeakKeyDictionary()


def checked_transform(model, lm) -> LogitTransform:
    """:func:`probe`, once per model object."""
    found = _checked.get(model)
    if found is None:
        found = _checked[model] = probe(model, lm)
    return found


def _tolerance(dtype: torch.dtype, tolerances: tuple[float, float]) -> float:
    return tolerances[dtype in (torch.float16, torch.bfloat16)]


def probe(model, lm) -> LogitTransform:
    """Run the model on :data:`PROBE_TOKENS` tokens, on its own and the way ppd runs it (see the module's
    docstring); return the logit transform that makes them agree, or raise :class:`UnsupportedModelError`."""
    name = type(model).__name__
    config = text_config(model.config)
    vocab = lm.head.weight.shape[0]
    device = lm.embed.weight.device
    m = PROBE_TOKENS
    ids = torch.tensor([(11 + 7919 * i) % vocab for i in range(m)], device=device)
    with torch.no_grad():
        try:
            own = model(input_ids=ids[None], use_cache=False).logits[0]  # [m, vocab]
            hidden = lm.body(input_ids=ids[None], use_cache=False).last_hidden_state
        except Exception as err:  # noqa: BLE001 (any failure here means ppd cannot run the model)
            raise UnsupportedModelError(f"{name} failed on a plain forward over {m} tokens: "
                                        f"{type(err).__name__}: {err}") from err
        try:
            head = lm.head(hidden)[0]
        except Exception as err:  # noqa: BLE001
            raise UnsupportedModelError(
                f"{name}'s output embeddings do not apply to its base model's last hidden state ({type(err).__name__}: "
                f"{err}): its head does more than that, and ppd computes the logits of its tree rows that way") from err
        transform = _head_transform(name, config, own, head)
        try:
            prefill, step = _ppd_forwards(model, lm, ids, transform)
        except UnsupportedModelError:
            raise
        except Exception as err:  # noqa: BLE001
            raise UnsupportedModelError(
                f"{name} cannot run ppd's forward (inputs_embeds, among them prompt tokens that embed no token, "
                f"a 4D float attention mask, position_ids and a cache written at chosen slots): "
                f"{type(err).__name__}: {err}") from err
    reference = own.float()
    tolerance = _tolerance(own.dtype, PROBE_TOLERANCE)
    for what, logits, rows in (("the prefill", prefill, slice(0, m - 1)), ("a cached step", step, slice(m - 1, m))):
        wanted = reference[rows]
        gap = float(((logits.float() - wanted).abs().mean(-1) / wanted.std(-1).clamp(min=1e-6)).max())
        if not gap <= tolerance:
            raise UnsupportedModelError(
                f"{name} does not compute through ppd's inputs what it computes on its own ({what}: logits differ "
                f"by {gap:.3g} of their spread, allowed {tolerance:.3g}): its attention does not follow the 4D "
                "float mask, the position ids or the cache as transformers' decoder-only models do (it may be "
                "bidirectional, mask by slot index or keep a state of its own), so ppd cannot decode it exactly")
    return transform


def _head_transform(name: str, config, own: torch.Tensor, head: torch.Tensor) -> LogitTransform:
    """The transform of ``head`` (the output embeddings over the last hidden state) that gives ``own``."""
    reference = own.float()
    tolerance = _tolerance(own.dtype, HEAD_TOLERANCE) * max(float(reference.abs().max()), 1e-6)
    for transform in transforms_of(config):
        if float((transform(head).float() - reference).abs().max()) <= tolerance:
            return transform
    raise UnsupportedModelError(
        f"{name}'s logits are not its output embeddings over its last hidden state, nor that scaled or "
        "soft-capped as its config says (final_logit_softcapping, logit_scale, logits_scaling); ppd computes "
        "the logits of its tree rows that way, so it cannot decode this model exactly")


def _masks(layers: LayerAttention, allowed: torch.Tensor, query_positions: torch.Tensor,
           key_positions: torch.Tensor, dtype: torch.dtype):
    """The model's ``attention_mask`` for one sequence: ``allowed`` [Q, K], narrowed by each sliding layer's
    window, as float masks per attention kind."""
    return layers.pack({kind: to_additive((allowed if window is None else allowed & within_window(
        query_positions, key_positions, window))[None, None], dtype) for kind, window in layers.kinds.items()})


def _ppd_forwards(model, lm, ids: torch.Tensor, transform: LogitTransform) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of ``ids[:-1]`` through a prefill the way ppd lays one out (the model's own head, with
    ``logits_to_keep``), and of ``ids[-1]`` through one step over that cache (base model, then ``lm.head``
    and ``transform``), each against the cache the decoder's layers write through."""
    device = ids.device
    n = ids.shape[0] - 1
    layers = LayerAttention.of(model.config)
    # Slots: [ids[n-1], a decoy, ids[0], ..., ids[n-2]], then the step's ids[n] at slot n + 1. The decoy is,
    # like a prompt token, the embedding of no token.
    tokens = torch.cat([ids[n - 1: n], ids[:1], ids[: n - 1]])
    positions = torch.cat([torch.tensor([n - 1, 0], device=device), torch.arange(n - 1, device=device)])
    real = torch.ones(n + 1, dtype=torch.bool, device=device)
    real[1] = False
    eye = torch.eye(n + 1, dtype=torch.bool, device=device)

    embeds = lm.embed(tokens[None])
    generator = torch.Generator().manual_seed(0)
    decoy = torch.randn(embeds.shape[-1], generator=generator).to(device) * embeds.float().std()
    embeds[0, 1] = decoy.to(embeds.dtype)
    allowed = (real[:, None] & real[None, :] & (positions[None, :] <= positions[:, None])) | (~real[:, None] & eye)
    cache = KVBuffer(text_config(model.config).num_hidden_layers, 1, n + 2)
    keep = torch.nonzero(real).flatten()
    slots = torch.arange(n + 1, device=device)[None]
    out = model(inputs_embeds=embeds, attention_mask=_masks(layers, allowed, positions, positions, embeds.dtype),
                position_ids=positions[None], use_cache=True, **{cache_keyword(model): cache.view(slots, n + 1)},
                logits_to_keep=keep)
    if out.logits.shape[1] != keep.shape[0]:
        raise UnsupportedModelError(f"{type(model).__name__} ignores logits_to_keep (asked for {keep.shape[0]} "
                                    f"rows, computed {out.logits.shape[1]})")
    order = positions[keep].argsort()
    prefill = out.logits[0, order]  # back in token order

    step_embeds = lm.embed(ids[None, n:])
    step_allowed = torch.cat([real, torch.ones(1, dtype=torch.bool, device=device)])[None]  # [1, n + 2]
    step_positions = torch.tensor([n], device=device)
    key_positions = torch.cat([positions, step_positions])
    hidden = lm.body(inputs_embeds=step_embeds, attention_mask=_masks(layers, step_allowed, step_positions,
                                                                       key_positions, step_embeds.dtype),
                     position_ids=step_positions[None], use_cache=True,
                     **{lm.cache_key: cache.view(torch.tensor([[n + 1]], device=device), n + 2)}).last_hidden_state
    return prefill, transform(lm.head(hidden))[0]


def tree_attention_gap(model, lm) -> str | None:
    """Why the model's attention layers cannot run ppd's FlexAttention step exactly, or ``None`` where they
    can: the probe's tokens prefilled in order through the model's own attention, then one step of the last
    token through :func:`~ppd.decoding.tree_attention.tree_attention` (over a cache wider than it needs, as
    a captured step attends); its logits must match the model's own forward as :func:`probe`'s do."""
    from .tree_attention import active, tree_block_mask

    name = type(model).__name__
    config = text_config(model.config)
    layers = LayerAttention.of(model.config)
    device = lm.embed.weight.device
    m = PROBE_TOKENS
    vocab = lm.head.weight.shape[0]
    ids = torch.tensor([(13 + 7907 * i) % vocab for i in range(m)], device=device)
    n = m - 1
    width = n + 3
    cache = KVBuffer(config.num_hidden_layers, 1, width)
    positions = torch.arange(m, device=device)
    with torch.no_grad():
        own = model(input_ids=ids[None], use_cache=False).logits[0, -1]
        causal = positions[:n, None] >= positions[None, :n]
        masks = _masks(layers, causal, positions[:n], positions[:n], lm.embed.weight.dtype)
        lm.body(input_ids=ids[None, :n], attention_mask=masks, position_ids=positions[None, :n],
                         use_cache=True, **{lm.cache_key: cache.view(positions[None, :n], n)})
        one = torch.ones(1, 1, dtype=torch.bool, device=device)
        lengths = torch.tensor([n], device=device)
        offsets = torch.zeros(1, 1, dtype=torch.long, device=device)
        block_masks = layers.pack({kind: tree_block_mask(one, lengths, offsets, width, window, lm.query_group)
                                   for kind, window in layers.kinds.items()})
        try:
            with active(model.config):
                hidden = lm.body(inputs_embeds=lm.embed(ids[None, n:]), attention_mask=block_masks,
                                 position_ids=positions[None, n:], use_cache=True,
                                 **{lm.cache_key: cache.view(positions[None, n:], width)}).last_hidden_state
        except Exception as err:  # noqa: BLE001 (any failure means the dense step must be used)
            return f"{name}'s attention layers cannot run FlexAttention through ppd: {type(err).__name__}: {err}"
    step = lm.transform(lm.head(hidden))[0, -1].float()
    wanted = own.float()
    gap = float((step - wanted).abs().mean() / wanted.std().clamp(min=1e-6))
    tolerance = _tolerance(own.dtype, PROBE_TOLERANCE)
    if not gap <= tolerance:
        return (f"{name}'s logits through ppd's FlexAttention step differ from its own by {gap:.3g} of their "
                f"spread (allowed {tolerance:.3g}): its attention does more than FlexAttention over a mask")
    return None


_flex_checked: "weakref.WeakKeyDictionary[torch.nn.Module, str | None]" = weakref.WeakKeyDictionary()


def checked_tree_attention(model, lm) -> str | None:
    """:func:`tree_attention_gap`, once per model object."""
    if model not in _flex_checked:
        _flex_checked[model] = tree_attention_gap(model, lm)
    return _flex_checked[model]


__all__ = ["LogitTransform", "UnsupportedModelError", "checked_transform", "checked_tree_attention", "probe",
           "refuse_by_design", "tree_attention_gap"]

"""Running a step's forward with an attention function of ppd's own, and the model's own after it.

transformers' attention layers look their function up by ``config._attn_implementation`` on every call, so
:func:`switched` registers a function with transformers' ``AttentionInterface`` and names it in the config
(and every sub-config) for the duration of a block, then restores what each had, whatever happens inside.
A step is entered host side, around the compiled or captured call; prefill and everything else keep the
model's own attention.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable


def configs_of(config) -> list:
    """The config and every sub-config under it (a multimodal model's text config among them)."""
    found = [config]
    for name in getattr(config, "sub_configs", {}) or {}:
        sub = getattr(config, name, None)
        if sub is not None and hasattr(sub, "_attn_implementation_internal"):
            found += configs_of(sub)
    return found


def register(name: str, function: Callable) -> None:
    """Make ``function`` an attention implementation transformers' layers can look up as ``name``
    (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(name, function)


@contextlib.contextmanager
def switched(model_config, name: str, function: Callable):
    """Within this block, the model's attention layers run ``function`` (registered as ``name``)."""
    register(name, function)
    configs = configs_of(model_config)
    saved = [c._attn_implementation_internal for c in configs]
    try:
        for c in configs:
            c._attn_implementation_internal = name
        yield
    finally:
        for c, own in zip(configs, saved):
            c._attn_implementation_internal = own


__all__ = ["configs_of", "register", "switched"]

"""CUDA streams of ppd's own: no two that are alive are one CUDA stream.

``torch.cuda.Stream()`` hands out the streams of a pool, 32 per priority, in turn, so two streams drawn 32 draws
apart are one CUDA stream. That matters where work runs at once: on torch 2.11 cuBLAS keeps a workspace per handle
and stream, and a CUDA graph keeps the workspace of the stream it was captured on (pytorch/pytorch#193402). The
continuous batcher replays a joining request's prefill on a side stream while the running rows' step replays on
the main one (``ppd.serving.batcher``): had the side stream, or the prefills' capture stream, been the steps'
capture stream, a prefill's products and a step's would write one workspace at once (h100/v34 saw a joined request
decode wrongly with four staging rows beside the steps). So the batcher's side streams and ppd's capture streams
come from :func:`own_stream`, which skips the pool's streams that another of them (alive) already is, and torch's
default capture stream.
"""

from __future__ import annotations

import contextlib
import weakref

import torch

POOL = 32  # streams in torch's pool for each priority (c10's kStreamsPerPool)

_handed: dict[tuple[int, int], weakref.ref] = {}  # (device index, stream handle) -> the stream handed out


def own_stream(device: torch.device | str | int, priority: int = 0) -> torch.cuda.Stream:
    """A stream of torch's pool on ``device`` (at ``priority``) that is no other stream this handed out and still
    alive, nor ``torch.cuda.graph``'s default capture stream; raises where every stream of the pool is one."""
    device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    default = torch.cuda.graph.default_capture_stream
    for _ in range(POOL + 1):
        stream = torch.cuda.Stream(device, priority=priority)
        key = (index, stream.cuda_stream)
        held = _handed.get(key)
        if (held is None or held() is None) and (default is None or default.cuda_stream != stream.cuda_stream):
            _handed[key] = weakref.ref(stream)
            return stream
    raise RuntimeError(f"every pooled CUDA stream of priority {priority} on {device} is already one of ppd's "
                       f"streams ({POOL} a priority): close batchers or decoders no longer used")


@contextlib.contextmanager
def ordered_on(stream: torch.cuda.Stream):
    """Run the block on ``stream`` after everything queued so far on the current stream, and queue the current
    stream's later work after the block's (whether or not it raises)."""
    current = torch.cuda.current_stream(stream.device)
    stream.wait_stream(current)
    try:
        with torch.cuda.stream(stream):
            yield
    finally:
        current.wait_stream(stream)


__all__ = ["POOL", "ordered_on", "own_stream"]

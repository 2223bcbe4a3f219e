"""Device-to-host copies that wait for their own values only.

``tensor.tolist()`` or ``.item()`` on a GPU tensor waits for everything queued on the stream by the time it is
called, kernels queued after the tensor's own included. A :class:`Download` is queued right behind the kernels
that make a tensor, into pinned host memory, with an event after it: reading it waits for that event alone, so
the host may queue more work first (the next decoding step, the next training step) and the device never runs
dry while the host reads. The copy is a snapshot: the device may overwrite the tensor afterwards.
"""

from __future__ import annotations

import torch


class Download:
    """The values ``tensor`` holds once the work queued so far has run (on a CPU, its values now)."""

    def __init__(self, tensor: torch.Tensor):
        tensor = tensor.detach()
        self._event: torch.cuda.Event | None = None
        if tensor.device.type == "cuda":
            self._host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self._host.copy_(tensor, non_blocking=True)
            self._device = tensor.device
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(tensor.device))  # the stream the copy went to
        else:
            self._host = tensor.clone()

    def ready(self) -> bool:
        """Whether the copy has run (reading it now would not wait); always on a CPU."""
        return self._event is None or self._event.query()

    def order_after(self) -> None:
        """Make the current stream's later work wait for the copy, and so for everything queued before it on its
        own stream (the host does not wait)."""
        if self._event is not None:
            torch.cuda.current_stream(self._device).wait_event(self._event)

    def wait(self) -> torch.Tensor:
        """The host tensor, once the copy has run (waits for nothing queued after it)."""
        if self._event is not None:
            self._event.synchronize()
        return self._host


__all__ = ["Download"]

"""Host-to-device copies that do not wait for the device.

A plain ``tensor.to("cuda")`` (or ``torch.tensor(values, device="cuda")``) from ordinary host memory returns only
once the device has run every kernel queued before it: the host cannot prepare the next forward while the device
runs the last one. A step that builds its small index tensors on the host (layouts, positions, cut rows) therefore
uploads them from pinned memory without waiting; the copy still runs in stream order, before the kernels that read
it, and torch keeps the pinned buffer alive until it has.
"""

from __future__ import annotations

import torch


def upload(values, device: torch.device | str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``values`` (a host tensor, or numbers a tensor is made of) on ``device``, copied without waiting for it.
    A host tensor that is already pinned is copied from as it is: it must not change until the copy has run."""
    tensor = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if dtype is not None:
        tensor = tensor.to(dtype)
    device = torch.device(device)
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def upload_into(buffer: torch.Tensor, values) -> None:
    """Copy ``values`` (numbers, or a host tensor of ``buffer``'s shape) into the device tensor ``buffer`` without
    waiting for the device (as :func:`upload`; on a CPU a plain copy)."""
    tensor = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=buffer.dtype)
    if buffer.device.type != "cuda" or tensor.device.type != "cpu":
        buffer.copy_(tensor)
        return
    buffer.copy_(tensor.to(buffer.dtype).pin_memory(), non_blocking=True)

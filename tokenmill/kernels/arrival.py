"""Per-device arrival counters for kernels whose last-finishing program completes a reduction (split-K gemv, split
decode attention): each program bumps its group's counter after storing its partial; the one that sees the count
reach the group size reads every partial, writes the result and resets the counter to 0, so the next launch (or
CUDA-graph replay) finds it clean. One zeroed int32 buffer per (device, user), created outside graph capture."""
from __future__ import annotations

import torch

_BUFFERS: dict[tuple[torch.device, str], torch.Tensor] = {}


def arrival_counters(device: torch.device, user: str, size: int) -> torch.Tensor | None:
    """The zeroed counter buffer of `user` on `device` (at least `size` counters), or None when it does not exist
    yet and a CUDA graph is being captured: a zeros() inside a capture would only run at replay, and graphs
    replayed in another order would start from garbage counters. Callers fall back or raise on None."""
    key = (device, user)
    buf = _BUFFERS.get(key)
    if buf is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        buf = _BUFFERS[key] = torch.zeros(size, dtype=torch.int32, device=device)
    return buf

"""Ticket counters for kernels whose last program finishes a launch's work (triton_ced_route.Tail, the GEMV's add +
RMSNorm tail): an int32 per (purpose, device, stream), zeroed once and left zeroed by every kernel that takes a
ticket, so a CUDA graph that captured a call replays it. Two calls on one stream never overlap (with PDL a kernel
waits for the previous grid before any load), and separate streams get separate counters."""

from __future__ import annotations

import torch

_counters: dict = {}


def counter(purpose: str, device: torch.device) -> torch.Tensor:
    """The zeroed int32 [1] counter of ``purpose`` on this device's current stream."""
    key = (purpose, device.type, device.index,
           torch.cuda.current_stream(device).stream_id if device.type == "cuda" else 0)
    buf = _counters.get(key)
    if buf is None:
        buf = _counters[key] = torch.zeros(1, dtype=torch.int32, device=device)
    return buf

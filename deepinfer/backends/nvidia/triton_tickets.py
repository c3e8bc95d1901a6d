"""Ticket counters for kernels whose last program finishes a launch's work (triton_splitk's column tiles,
triton_ced_route.Tail, the GEMV's add + RMSNorm tail): int32s per (purpose, device, stream), zeroed once and left
zeroed by every kernel that takes a ticket, so a CUDA graph that captured a call replays it. Two calls on one
stream never overlap (with PDL a kernel waits for the previous grid before any load), and separate streams get
separate counters."""

from __future__ import annotations

import torch

_counters: dict = {}


def counter(purpose: str, device: torch.device, size: int = 1) -> torch.Tensor:
    """The zeroed int32 [size] counters of ``purpose`` on this device's current stream (one size per purpose)."""
    key = (purpose, device.type, device.index,
           torch.cuda.current_stream(device).stream_id if device.type == "cuda" else 0)
    buf = _counters.get(key)
    if buf is None:
        buf = _counters[key] = torch.zeros(size, dtype=torch.int32, device=device)
    elif buf.numel() != size:
        raise ValueError(f"ticket counters {purpose!r} hold {buf.numel()} counters, asked for {size}: "
                         "one size a purpose")
    return buf

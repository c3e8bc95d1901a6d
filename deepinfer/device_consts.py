"""Small constant tables (code grids, rotary frequencies) kept per device once built, so the eager paths do not
rebuild them with a handful of tiny ops at every call (on the CPU the reference path built the FP8 grid ~45
times a decode step). A table is a pure function of its key and device, so the kept one is bit for bit the table
a fresh build gives. Callers only read them. Nothing is kept from inside a CUDA-graph capture: a tensor made
there holds nothing until a replay, so there the table is built into the graph, as before."""

from __future__ import annotations

from typing import Callable, Hashable

import torch

_TABLES: dict = {}


def device_const(key: Hashable, device, build: Callable[[torch.device], torch.Tensor]) -> torch.Tensor:
    """The table ``build(device)`` for ``key`` on ``device``: built the first time (outside graph capture), then
    kept. Never write into the result."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:  # "cuda": the current device, whichever that is now
        device = torch.device("cuda", torch.cuda.current_device())
    got = _TABLES.get((key, device))
    if got is None:
        got = build(device)
        if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            _TABLES[(key, device)] = got
    return got

"""Per-layer expert load (tokens routed to each expert), accumulated over a window of engine steps.

Recorded on the device with scatter-add, so a step adds no host sync; the host
reads the totals only when asked (``LLM.expert_load()``), which is what
expert-parallel balancing will consume.
"""

from __future__ import annotations

import contextlib
import json
import time
from typing import Optional

import torch


class ExpertLoad:
    def __init__(self, moe_layers: list, num_experts: int, window: int = 64, device=None):
        if window < 1:
            raise ValueError(f"expert load window={window} must be >= 1")
        self.layers = list(moe_layers)  # model layer index of each MoE layer
        self.row = {layer: i for i, layer in enumerate(self.layers)}
        self.num_experts, self.window = num_experts, window
        self.steps = self.current = None  # allocated on the device of the first record (models are built on meta)
        self.num_steps = 0
        self._held = None  # inside ``batched``: [(row, ids)] waiting for one scatter-add
        if device is not None:
            self._alloc(torch.device(device))

    def _alloc(self, device) -> None:
        self.steps = torch.zeros(self.window, len(self.layers), self.num_experts, dtype=torch.long, device=device)
        self.current = torch.zeros(len(self.layers), self.num_experts, dtype=torch.long, device=device)
        self._one = torch.ones((), dtype=torch.long, device=device)  # each record's increments, as a stride-0 view

    def set_window(self, window: int) -> None:
        """Keep the last ``window`` steps from now on (EPLB's window_size); forgets what was recorded."""
        if window < 1:
            raise ValueError(f"expert load window={window} must be >= 1")
        self.window, self.num_steps = window, 0
        if self.steps is not None:
            self._alloc(self.steps.device)

    def record(self, layer: int, ids: torch.Tensor) -> None:
        """ids: [T, k] expert ids chosen for T tokens at model layer ``layer``."""
        if self.current is None or self.current.device != ids.device:
            self._alloc(ids.device)
        if self._held is not None:
            self._held.append((self.row[layer], ids))
            return
        flat = ids.reshape(-1)
        self.current[self.row[layer]].scatter_add_(0, flat, self._one.expand(flat.shape[0]))  # (no ones kernel)

    @contextlib.contextmanager
    def batched(self):
        """Hold the ``record`` calls made inside and count them on exit: where they are consecutive MoE rows of
        one token count (a forward pass's layers), one stack and one scatter-add instead of a scatter-add per layer
        (a CED decode step: 2 kernels instead of 16); otherwise one per call, as without it. Nothing is read back,
        so it is safe inside a CUDA graph capture. Nested use keeps the outer hold."""
        if self._held is not None:
            yield
            return
        self._held = []
        try:
            yield
        finally:
            held, self._held = self._held, None
            self._count(held)

    def _count(self, held: list) -> None:
        if not held:
            return
        rows = [r for r, _ in held]
        n = held[0][1].numel()
        first = rows[0]
        if rows == list(range(first, first + len(rows))) and all(ids.numel() == n for _, ids in held) \
                and all(ids.device == self.current.device for _, ids in held):
            # row i of the index scatters into row first + i of current
            index = torch.stack([ids.reshape(-1) for _, ids in held])
            self.current[first:first + len(rows)].scatter_add_(1, index, self._one.expand(index.shape))
            return
        for r, ids in held:
            flat = ids.reshape(-1)
            self.current[r].scatter_add_(0, flat, self._one.expand(flat.shape[0]))

    def record_counts(self, layer: int, counts: torch.Tensor) -> None:
        """counts: [E] tokens routed to each expert at model layer ``layer`` (already counted elsewhere)."""
        if self.current is None or self.current.device != counts.device:
            self._alloc(counts.device)
        self.current[self.row[layer]] += counts

    def end_step(self) -> None:
        if self.current is None:
            return
        self.steps[self.num_steps % self.window] = self.current
        self.current.zero_()
        self.num_steps += 1

    def totals(self) -> torch.Tensor:
        """[num MoE layers, E] int64 tokens per expert over the last ``window`` steps (host tensor)."""
        if self.steps is None:
            return torch.zeros(len(self.layers), self.num_experts, dtype=torch.long)
        return self.steps.sum(0).cpu()

    def as_dict(self) -> dict:
        t = self.totals().tolist()
        return {"window": self.window, "steps_recorded": min(self.num_steps, self.window),
                "layers": {layer: t[i] for i, layer in enumerate(self.layers)}}

    def dump_jsonl(self, path, extra: Optional[dict] = None) -> None:
        """Append one row per MoE layer: layer, counts, window, time, plus ``extra`` settings."""
        t = self.totals().tolist()
        now = time.time()
        with open(path, "a") as f:
            for i, layer in enumerate(self.layers):
                row = {"time": now, "layer": layer, "counts": t[i], "window": self.window,
                       "steps_recorded": min(self.num_steps, self.window), **(extra or {})}
                f.write(json.dumps(row) + "\n")

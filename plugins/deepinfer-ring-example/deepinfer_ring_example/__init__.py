"""A compact sliding-window ring: n_win + allowance slots, position p in slot p % slots.

Rolling back k <= allowance positions (rejected speculative tokens) only moves the length back: the window's
positions are still in their slots, because the slots written since then belong to positions at most
allowance above the new length. The deepinfer equivalence kit checks it against a plain list (see
pyproject.toml's [tool.pytest.ini_options]).
"""

from __future__ import annotations

import torch


class CompactRing:
    def __init__(self, n_win: int, allowance: int, width: int):
        self.n_win = n_win
        self.slots = torch.zeros(n_win + allowance, width)  # [slots, width]
        self.length = 0

    def append(self, value: torch.Tensor) -> None:
        self.slots[self.length % self.slots.shape[0]] = value
        self.length += 1

    def rollback(self, k: int) -> None:
        self.length -= k

    def window(self) -> torch.Tensor:
        pos = torch.arange(max(0, self.length - self.n_win), self.length)
        return self.slots[pos % self.slots.shape[0]]  # [min(length, n_win), width]

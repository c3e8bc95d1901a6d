"""The compact SWA ring with slack and rollback, against a plain list.

The contract a ring implementation keeps (``make(n_win, allowance, width) -> ring``):

- ``ring.append(value)`` stores the next position's value (a tensor [width]);
- ``ring.rollback(k)`` forgets the last k positions (speculative tokens that were rejected); the caller never
  rolls back further than ``allowance`` positions below the highest length the ring ever reached;
- ``ring.window()`` returns the values of the last ``min(length, n_win)`` positions, oldest first:
  a tensor [min(length, n_win), width].

A ring of ``n_win + allowance`` slots (position p in slot p % slots) can do this: after a rollback the
window's oldest position is at most n_win + allowance positions below the high-water mark, so its slot has
not been overwritten. The oracle is a Python list (append, ``del l[-k:]``, ``l[-n_win:]``).
"""

from __future__ import annotations

from typing import Callable

import attrs
import torch
from hypothesis import strategies as st


@attrs.frozen
class RingCase:
    """A ring's sizes and a program of ``("append", tensor [width])`` and ``("rollback", k)`` operations that
    keeps the rollback rule (never below high-water mark - allowance)."""

    n_win: int
    allowance: int
    width: int
    ops: list


@st.composite
def ring_cases(draw, max_win: int = 8, max_allowance: int = 4, max_ops: int = 40) -> RingCase:
    n_win = draw(st.integers(1, max_win))
    allowance = draw(st.integers(0, max_allowance))
    width = draw(st.sampled_from([2, 4, 8]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    ops, length, high = [], 0, 0
    for _ in range(draw(st.integers(1, max_ops))):
        room = min(length, length - (high - allowance))  # how far back a rollback may go now
        if room > 0 and draw(st.integers(0, 3)) == 0:
            k = draw(st.integers(1, room))
            ops.append(("rollback", k))
            length -= k
        else:
            ops.append(("append", torch.randn(width, generator=g)))
            length += 1
            high = max(high, length)
    return RingCase(n_win=n_win, allowance=allowance, width=width, ops=ops)


class ListRing:
    """The oracle: every position kept in a list."""

    def __init__(self, n_win: int, allowance: int, width: int):
        self.n_win, self.width, self.values = n_win, width, []

    def append(self, value: torch.Tensor) -> None:
        self.values.append(value)

    def rollback(self, k: int) -> None:
        del self.values[len(self.values) - k:]

    def window(self) -> torch.Tensor:
        vals = self.values[-self.n_win:]
        return torch.stack(vals) if vals else torch.zeros(0, self.width)


class CEDRing:
    """Our implementation: one CED layer's SWA ring of a CEDCache (``ring_write`` / ``ring_read``, position p
    in slot p % (n_win + swa_allowance)), stored in fp32 so values come back exactly."""

    def __init__(self, n_win: int, allowance: int, width: int):
        from ...models.ced.cache import CEDCache
        from ...models.ced.config import CEDConfig

        c = CEDConfig(num_layers=2, num_encoder_layers=1, layer_modes=("swa", "full"), head_dim=width, rope_dim=2,
                      n_win=n_win, swa_allowance=allowance, global_kv_format="fp32", index_k_format="fp32",
                      swa_kv_format="fp32")
        self.cache = CEDCache(c, num_blocks=1, block_size=1, max_seqs=1, dtype=torch.float32, device="cpu")
        self.n_win, self.width, self.length = n_win, width, 0

    def append(self, value: torch.Tensor) -> None:
        self.cache.ring_write(0, torch.tensor([0]), torch.tensor([self.length]), value[None])
        self.length += 1

    def rollback(self, k: int) -> None:
        self.length -= k

    def window(self) -> torch.Tensor:
        pos = torch.arange(max(0, self.length - self.n_win), self.length)
        return self.cache.ring_read(0, torch.zeros_like(pos), pos)


def check_ring(make: Callable, case: RingCase) -> None:
    """Run ``case.ops`` on ``make(n_win, allowance, width)`` and on the list oracle; after every operation the
    windows must be equal bit for bit. Raises AssertionError naming the operation."""
    ring, oracle = make(case.n_win, case.allowance, case.width), ListRing(case.n_win, case.allowance, case.width)
    for i, (op, arg) in enumerate(case.ops):
        getattr(ring, op)(arg)
        getattr(oracle, op)(arg)
        got, want = ring.window(), oracle.window()
        assert got.shape == want.shape and torch.equal(got.to(want.dtype), want), (
            f"ring (n_win={case.n_win}, allowance={case.allowance}) after op {i} {op}"
            f"({arg if op == 'rollback' else '...'}): window {tuple(got.shape)} differs from the list's "
            f"{tuple(want.shape)}")

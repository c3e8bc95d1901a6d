"""A MoE output whose last sum is not yet taken: each token's k weighted expert rows, and how to add them.

The fused MoE's second product writes one row a (token, expert) pair, [T * k, d]; a k-sum then adds each token's k
rows into [T, d], and the next layer's add + RMSNorm reads that back. A consumer that can read the k rows itself
(the CUDA add + RMSNorm kernel: ``Ops.ced_add_rms_norm``) takes a ``PairSum`` instead and adds them where it adds
the residual, the same float32 sum in pair order rounded once, so the bits are the k-sum's and the [T, d] write and
read are saved (16K prefill tokens at d = 2048: 128 MB a layer). Every other consumer calls ``dense``.
"""

from __future__ import annotations

from typing import Callable

import torch


class PairSum:
    """pairs [T * k, d]: token t's rows t * k .. t * k + k - 1 in pair order; ``total`` (pairs, k) -> [T, d] their
    sum as the producer takes it (so ``value`` has its bits exactly), called at most once."""

    __slots__ = ("pairs", "k", "_total", "_value")

    def __init__(self, pairs: torch.Tensor, k: int, total: Callable[[torch.Tensor, int], torch.Tensor]):
        if pairs.dim() != 2 or k < 1 or pairs.shape[0] % k:
            raise ValueError(f"PairSum: pairs must be [T * k, d] with k >= 1, got {tuple(pairs.shape)}, k={k}")
        self.pairs, self.k, self._total, self._value = pairs, k, total, None

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.pairs.shape[0] // self.k, self.pairs.shape[1]))

    @property
    def dtype(self) -> torch.dtype:
        return self.pairs.dtype

    @property
    def device(self) -> torch.device:
        return self.pairs.device

    def value(self) -> torch.Tensor:
        if self._value is None:
            self._value = self._total(self.pairs, self.k)
        return self._value


def dense(x):
    """x itself, or a PairSum's [T, d] sum."""
    return x.value() if isinstance(x, PairSum) else x

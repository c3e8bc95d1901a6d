"""Padded and ragged batches against rows computed alone: batching never changes a row's outputs.

The contract (``run(rows) -> list of tensors``): ``rows`` are token-id lists of different lengths; return
each row's outputs (e.g. logits [len_i, V]) computed in one batch. The oracle runs the case's rows together
and each row alone through the same ``run`` and compares them within a tolerance (a batch may change the
order of a reduction, so the last bits may move). Our runners: ``ragged_engine`` (the engine forward, all rows
in one ragged step over a shuffled paged cache) and ``padded_full`` (the full-sequence path over a
right-padded [B, N] batch, for models whose forward_full takes one, such as CED).
"""

from __future__ import annotations

from typing import Callable

import attrs
import torch
from hypothesis import strategies as st


@attrs.frozen
class BatchCase:
    rows: list  # token-id lists


def batch_cases(vocab_size: int, max_rows: int = 4, max_len: int = 12):
    """A strategy of BatchCase: 2..max_rows rows of 1..max_len tokens below vocab_size."""
    row = st.lists(st.integers(0, vocab_size - 1), min_size=1, max_size=max_len)
    return st.lists(row, min_size=2, max_size=max_rows).map(lambda rows: BatchCase(rows=rows))


def ragged_engine(net, block_size: int = 4, chunk: int = 1 << 30) -> Callable:
    """Our ragged runner: deepinfer.testing.engine.paged_prefill_logits (``chunk`` tokens per row per step)."""
    from ..engine import paged_prefill_logits

    return lambda rows: paged_prefill_logits(net, [list(r) for r in rows], block_size, chunk)


def padded_full(net, pad_id: int = 0) -> Callable:
    """Our padded runner: ``net.forward_full`` over the rows right-padded with ``pad_id`` to [B, N] (a causal
    model's position i never reads a later position, so the padding needs no mask); each row's [len_i, V]."""

    def run(rows):
        N = max(len(r) for r in rows)
        ids = torch.tensor([list(r) + [pad_id] * (N - len(r)) for r in rows])
        with torch.no_grad():
            out = net.forward_full(ids)
        return [out[i, :len(r)] for i, r in enumerate(rows)]

    return run


def check_batch(run: Callable, case: BatchCase, rtol: float = 1e-4, atol: float = 1e-5) -> None:
    """Each row's outputs in the batch equal its outputs alone, within rtol/atol."""
    with torch.no_grad():
        together = run(case.rows)
        assert len(together) == len(case.rows), f"run returned {len(together)} rows for {len(case.rows)}"
        for i, row in enumerate(case.rows):
            alone = run([row])[0]
            got = together[i]
            assert got.shape == alone.shape, f"row {i}: shape {tuple(got.shape)} in the batch, {tuple(alone.shape)} alone"
            err = (got.double() - alone.double()).abs()
            bound = atol + rtol * alone.double().abs()
            bad = (err > bound).flatten(1).any(1).nonzero().flatten().tolist()
            assert not bad, (f"row {i} of {len(case.rows)} (length {len(row)}): positions {bad[:8]} differ from the "
                             f"row alone by up to {float(err.max()):.3g}")

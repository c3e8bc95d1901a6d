"""Public test helpers: hypothesis strategies, oracles (the slow twins of the fast paths), assert_close,
the parity comparisons of compare.py (assert_logits_close: a bound scaled to each row's magnitude;
assert_greedy_matches: greedy tokens equal or parting only at a near-tie of the reference), and builders of tiny
real checkpoints (models.py, ced.py, tokenizers.py)."""

from __future__ import annotations

import torch

from .ced_oracle import CEDOracle
from .compare import assert_greedy_matches, assert_logits_close, assert_same_or_near_tie

_TOL = {torch.float64: (1e-7, 1e-9), torch.float32: (1e-4, 1e-5), torch.bfloat16: (2e-2, 2e-2),
        torch.float16: (5e-3, 5e-3)}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, rtol=None, atol=None) -> None:
    """Compare a fast result with its oracle at the tolerance of the *less* precise dtype of the two."""
    dt = max((actual.dtype, expected.dtype), key=lambda d: _TOL.get(d, (0, 0))[0])
    r, a = _TOL.get(dt, (1e-4, 1e-5))
    torch.testing.assert_close(actual.to(torch.float64).cpu(), expected.to(torch.float64).cpu(),
                               rtol=r if rtol is None else rtol, atol=a if atol is None else atol)


__all__ = ["CEDOracle", "assert_close", "assert_greedy_matches", "assert_logits_close", "assert_same_or_near_tie"]

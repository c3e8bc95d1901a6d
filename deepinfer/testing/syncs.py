"""Host syncs a piece of GPU work makes: torch.cuda.set_sync_debug_mode("warn") makes every synchronizing CUDA
call (``.item()``, a blocking copy, ``nonzero``) warn; counting the warnings over some engine steps checks that
the loop waits for the device only where it means to (an event wait, as a step's collection does, is not
reported)."""

from __future__ import annotations

import warnings

import torch


def synchronizing_calls(step, n: int) -> list:
    """Call step() n times and return the messages of the synchronizing CUDA calls they made (CUDA only)."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(n):
                step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return [str(w.message) for w in caught if "synchroniz" in str(w.message).lower()]

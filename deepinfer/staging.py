"""Pinned host buffers kept across steps for a step's one big host-to-device copy (engine_path.Upload).

``layout.to_device`` pins a fresh staging tensor a call (Tensor.pin_memory), which is right for the few small
lists a step copies. The CED prefill's index lists are one int64 buffer of ~1-2 MB at 16K tokens, and pinning
that a step cost ~3 ms of host time under cProfile on the H100 (34th session), while the device sat idle waiting
for the layer after it. A ``Staging`` keeps a few pinned buffers and reuses one whose last copy has run (its
event says so; checked, never waited on), so a step writes its lists into memory that is already pinned. When
every buffer is still in flight (the device several steps behind), it pins a fresh one as to_device would:
the copy never waits.

Buffers are per thread (each engine's loop owns its own) and per device."""

from __future__ import annotations

import threading

import numpy as np
import torch

SLOTS = 4  # buffers a thread keeps per device: a step uses one; overlap scheduling keeps one step in flight
ON = True  # off: every copy pins a fresh buffer (to_device's way), for A/B runs

_local = threading.local()


class Staging:
    """A ring of pinned int64 buffers for one device. ``event`` makes the completion marker recorded after each
    copy (torch.cuda.Event on CUDA; tests pass their own), ``pin`` whether buffers are pinned."""

    def __init__(self, device, slots: int = SLOTS, event=None, pin: bool = True):
        self.device = torch.device(device)
        self.slots = [None] * slots  # (pinned buffer, event recorded after its last copy or None)
        self.event, self.pin = event or (lambda: torch.cuda.Event()), pin
        self.fresh = 0  # copies that found every buffer in flight (pinned a fresh one)

    def _free_slot(self, n: int):
        """The index of a buffer whose last copy has run, grown to n elements if smaller; None if all are busy."""
        for i, slot in enumerate(self.slots):
            if slot is None:
                return i
            buf, ev = slot
            if ev is None or ev.query():
                if buf.numel() < n:
                    self.slots[i] = None  # regrown below
                return i
        return None

    def copy(self, arr: np.ndarray) -> torch.Tensor:
        """arr (1-D int64) on the device, copied without blocking the host."""
        arr = np.ascontiguousarray(arr, dtype=np.int64).reshape(-1)
        n = arr.size
        out = torch.empty(n, dtype=torch.long, device=self.device)
        if n == 0:
            return out
        i = self._free_slot(n)
        if i is None:  # every buffer still feeds a queued copy: a one-off pinned buffer, as to_device pins
            self.fresh += 1
            return out.copy_(torch.from_numpy(arr).pin_memory() if self.pin else torch.from_numpy(arr),
                             non_blocking=True)
        if self.slots[i] is None:  # (first use, or too small: twice the size, so a growing prompt regrows rarely)
            self.slots[i] = (torch.empty(2 * n, dtype=torch.long, pin_memory=self.pin), None)
        buf = self.slots[i][0]
        buf[:n].numpy()[:] = arr
        out.copy_(buf[:n], non_blocking=True)
        ev = self.event()
        ev.record()
        self.slots[i] = (buf, ev)
        return out


def staged_copy(arr: np.ndarray, device) -> torch.Tensor:
    """A 1-D int64 numpy array on ``device`` without blocking the host: through this thread's pinned buffers on
    CUDA (ON), else to_device's fresh pinned copy, or a plain copy off CUDA."""
    device = torch.device(device)
    if device.type != "cuda" or not ON:
        from .layout import to_device

        return to_device(torch.from_numpy(np.ascontiguousarray(arr, dtype=np.int64)), torch.long, device)
    pools = getattr(_local, "pools", None)
    if pools is None:
        pools = _local.pools = {}
    key = device.index if device.index is not None else torch.cuda.current_device()
    st = pools.get(key)
    if st is None:
        st = pools[key] = Staging(torch.device("cuda", key))
    return st.copy(arr)

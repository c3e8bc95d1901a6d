"""Pinned host buffers kept across steps for a step's one big host-to-device copy (engine_path.Upload).

``layout.to_device`` pins a fresh staging tensor a call (Tensor.pin_memory; the caching host allocator makes that
cheap: 21-39 us for 1-4 MB on the H100's host), which is right for the few small lists a step copies. The CED
prefill's index lists are ~40 arrays, 1.6 MB at 16K tokens; joining them into a fresh array (which page-faults)
and copying that into pinned memory again took 1.30 ms of host in a 16K prefill, with the device idle waiting for
the first layer's attention (34th session, profile_cold_prefill --marks). A ``Staging`` keeps a few pinned buffers
and reuses one whose last copy has run (its event says so; checked, never waited on), so a step joins its lists
straight into memory that is already pinned (np.concatenate's ``out``): 0.45 ms there. When every buffer is still
in flight (the device several steps behind), it pins a fresh one as to_device would: the copy never waits.

Buffers are per thread (each engine's loop owns its own) and per device: at most SLOTS of twice the largest step's
lists (~13 MB of pinned memory for a 16K-token prefill)."""

from __future__ import annotations

import threading

import numpy as np
import torch

from .layout import to_device

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

    def copy(self, arrays: list) -> torch.Tensor:
        """The 1-D int64 arrays end to end on the device, copied without blocking the host: joined straight
        into a pinned buffer (no intermediate array: a fresh multi-MB one costs its page faults)."""
        arrays = [np.asarray(a, dtype=np.int64).reshape(-1) for a in arrays]
        n = sum(a.size for a in arrays)
        out = torch.empty(n, dtype=torch.long, device=self.device)
        if n == 0:
            return out
        i = self._free_slot(n)
        if i is None:  # every buffer still feeds a queued copy: a one-off pinned buffer, as to_device pins
            self.fresh += 1
            return joined_copy(arrays, self.device)
        if self.slots[i] is None:  # (first use, or too small: twice the size, so a growing prompt regrows rarely)
            self.slots[i] = (torch.empty(2 * n, dtype=torch.long, pin_memory=self.pin), None)
        buf = self.slots[i][0]
        np.concatenate(arrays, out=buf[:n].numpy())
        out.copy_(buf[:n], non_blocking=True)
        ev = self.event()
        if self.device.type == "cuda":  # on the stream the copy went to (out's device), whatever device is current
            ev.record(torch.cuda.current_stream(self.device))
        else:
            ev.record()
        self.slots[i] = (buf, ev)
        return out


def joined_copy(arrays: list, device) -> torch.Tensor:
    """The arrays joined into a fresh array and copied by to_device (a fresh pinned buffer on CUDA)."""
    joined = np.concatenate(arrays) if len(arrays) else np.zeros(0, np.int64)
    return to_device(torch.from_numpy(np.ascontiguousarray(joined, dtype=np.int64)), torch.long, device)


def staged_copy(arrays: list, device) -> torch.Tensor:
    """1-D int64 numpy arrays end to end on ``device`` without blocking the host: through this thread's pinned
    buffers on CUDA (ON), else joined and copied by to_device (a fresh pinned copy), or a plain copy off CUDA."""
    device = torch.device(device)
    if device.type != "cuda" or not ON or torch.cuda.is_current_stream_capturing():  # (a capture: no event queries)
        return joined_copy(arrays, device)
    pools = getattr(_local, "pools", None)
    if pools is None:
        pools = _local.pools = {}
    key = device.index if device.index is not None else torch.cuda.current_device()
    st = pools.get(key)
    if st is None:
        st = pools[key] = Staging(torch.device("cuda", key))
    return st.copy(arrays)

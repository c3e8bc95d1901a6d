"""Programmatic dependent launch (PDL, Hopper and later) for the small kernels of a decode step.

A CED decode step is ~350 kernels of a few microseconds, each waiting for the last; between two of them in a CUDA
graph the GPU idles while the next grid launches and its programs are placed (scripts/diag_pdl.py measured ~1.5
us a kernel for a chain of tiny ones on the H200). A kernel launched with the PDL attribute may start while the
previous one is still running; its programs then block in ``griddepcontrol.wait`` until that kernel has finished
and its writes are visible, so the launch overlaps the previous kernel's tail instead of following it.

Every kernel that takes ``PDL`` calls ``pdl_start(PDL)`` first, before any load, store or early return. That
keeps each such kernel ordered after everything before it (the wait covers the previous grid, which itself
waited, or was launched normally after its own predecessor), so correctness does not depend on which kernels
take part. (One exception, a knob: triton_gemv's EARLY_W loads its first weight tile before the wait; weights are
parameters, which no kernel of a step writes.) ``launch_kw()`` is what a launch site passes: nothing where PDL is
off (the interpreter, pre-Hopper GPUs, ``DEEPINFER_PDL=0``), so the kernels compile as before there.

Modes (``DEEPINFER_PDL``): 0 off; 1 wait only (the next grid launches as this one's programs exit); 2 wait and
signal the next grid at once (it launches as soon as every program here has started); 3 as 2, but the kernels
that stream weights or keys (the GEMVs, the pair MoE, CED attention, the indexer's scores: ``pdl_start(PDL,
True)``) signal after their main loop (``pdl_signal``), where a chain of one-wave 8 MB GEMVs measured fastest.
The signal is a hint: the waiting programs take SM slots early, which cost such a GEMV 27% in a chain of them
(scripts/diag_pdl.py) while tiny kernels gained 30%. The default, 2, is the mode the H200 ran fastest for the CED
bench config's decode step (graph replay at batch 1: 1.517 ms off, 1.492 wait only, 1.320 early signal; mode 3
within noise of 2 at batch 1, 16 and 64; docs/benchmarks.md, seventeenth session).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

INTERPRET = bool(triton.knobs.runtime.interpret)
DEFAULT_MODE = 2


def _mode() -> int:
    raw = os.environ.get("DEEPINFER_PDL", str(DEFAULT_MODE)).strip()
    if raw not in ("0", "1", "2", "3"):
        raise ValueError(f"DEEPINFER_PDL must be 0 (off), 1 (wait), 2 (wait and early signal) or 3 (as 2, the "
                         f"streaming kernels signalling late), not {raw!r}")
    return int(raw)


MODE = _mode()
_by_device: dict = {}


def mode_for(device: torch.device) -> int:
    """The PDL mode kernels on this device launch with: MODE on CUDA devices of compute capability 9 or more,
    else 0."""
    if INTERPRET or MODE == 0 or device.type != "cuda":
        return 0
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _by_device:
        _by_device[idx] = MODE if torch.cuda.get_device_capability(idx)[0] >= 9 else 0
    return _by_device[idx]


def launch_kw(device: torch.device) -> dict:
    """Keyword arguments for a launch of a PDL-aware kernel on this device: the kernel's PDL constexpr and
    Triton's launch_pdl option, or nothing where PDL is off (the kernel's PDL defaults to 0)."""
    mode = mode_for(device)
    return {"PDL": mode, "launch_pdl": True} if mode else {}


@triton.jit
def pdl_start(PDL: tl.constexpr, LATE: tl.constexpr = False):
    """First statement of a PDL-aware kernel: wait for the previous grid, and signal the next one (mode 2; mode 3
    unless the kernel says LATE and calls pdl_signal after its main loop). PDL is 0 wherever the kernel does not
    run on a Hopper GPU (the interpreter never reaches the inline PTX)."""
    if PDL == 2 or (PDL == 3 and not LATE):
        gdc_launch_dependents()
    if PDL >= 1:
        gdc_wait()


@triton.jit
def pdl_signal(PDL: tl.constexpr):
    """Mode 3's signal in a LATE kernel, after its main loop (before its stores): the next grid's programs then take
    SM slots only as this one's finish, not while it streams its weights."""
    if PDL == 3:
        gdc_launch_dependents()

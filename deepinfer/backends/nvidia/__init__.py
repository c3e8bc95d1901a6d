"""NVIDIA backend: Triton kernels for the hot ops, each tested against the reference op.

``ops.NvidiaOps`` subclasses the reference backend and overrides the hot ops: norms and activations,
paged attention (decode, MLA decode, ragged prefill), fused MoE experts, rotary, KV write, the sampling
filter, FP8/FP4/MXFP4 KV quantisation and the CED sparse attention and indexer (README "Backends" lists
the modules); anything a kernel does not cover falls back to the reference op. Kernels run on CUDA tensors, or on CPU tensors under Triton's
interpreter (``TRITON_INTERPRET=1``, set before the kernel modules are imported), which is how CI
exercises them without a GPU.

Importing this package does not import triton; ``ops`` and the ``triton_*`` modules do.
"""

from __future__ import annotations

import importlib.util
import os


def interpreter_requested() -> bool:
    """TRITON_INTERPRET is set to a true value (the kernels then run on the CPU through the interpreter)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def triton_importable() -> bool:
    if importlib.util.find_spec("triton") is None:
        return False
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # a broken install counts as absent
        return False
    return True


def available() -> bool:
    """The backend can run here: a CUDA device and an importable triton."""
    import torch

    return torch.cuda.is_available() and triton_importable()

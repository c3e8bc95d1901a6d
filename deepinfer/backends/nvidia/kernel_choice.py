"""Which implementation serves a kernel family that exists in both Triton and TileLang, kept as data.

NvidiaOps asks ``use_tilelang(op, device)`` before each call of such an op. The answer is the op's entry in
DEFAULT (the implementation benchmarks/tilelang_vs_triton.py measured faster on the H200), unless the op's
environment variable in ENV names another ("triton" or "tilelang"); "tilelang" becomes "triton" where tilelang
is not importable or the tensors are not on a CUDA device (Triton's interpreter runs on the CPU, TileLang does
not). The op module's ``supports`` has the last word: inputs the TileLang kernel does not take go to Triton.

Measured on the H200 on 2026-12-01 (docs/benchmarks.md, "TileLang vs Triton"; TileLang's decode speed over
Triton's, geometric mean over batch 1/16/64 at 4K and 16K):
  ced_sparse_attention  (CED bench config): 0.65x (16.8 us Triton vs 43.9 us at batch 1; 1.12x at batch 64)
                        -> triton
  mla_decode            (DeepSeek-V3 shape): 1.40x (1752 us Triton vs 1148 us at batch 64, 16K) -> tilelang
"""

import os

import torch

IMPLS = ("triton", "tilelang")
DEFAULT = {"ced_sparse_attention": "triton", "mla_decode": "tilelang"}
ENV = {"ced_sparse_attention": "DEEPINFER_CED_ATTENTION_IMPL", "mla_decode": "DEEPINFER_MLA_DECODE_IMPL"}


def requested(op: str) -> str:
    """The implementation asked for ``op``: its environment variable when set, else DEFAULT."""
    if op not in DEFAULT:
        raise ValueError(f"op must be one of {sorted(DEFAULT)}, got {op!r}")
    value = os.environ.get(ENV[op], "").strip().lower()
    if not value:
        return DEFAULT[op]
    if value not in IMPLS:
        raise ValueError(f"{ENV[op]} must be one of {IMPLS}, got {value!r}")
    return value


def use_tilelang(op: str, device: torch.device) -> bool:
    """Whether ``op`` on tensors of ``device`` should try the TileLang kernel (see the module doc)."""
    if requested(op) != "tilelang" or device.type != "cuda":
        return False
    from .tilelang_common import importable

    return importable()

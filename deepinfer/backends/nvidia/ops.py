"""NvidiaOps: the reference backend with its hot ops replaced by Triton kernels.

A kernel runs when its inputs are CUDA tensors (or CPU tensors while the kernels were built for Triton's
interpreter, TRITON_INTERPRET=1) and it supports their dtype and shape; otherwise the reference op
runs, so every call gives the reference's function. Decode attention (one query per row, paged KV with
a block table) runs the Triton kernel; prefill rows use the reference op.
"""

from __future__ import annotations

import collections
from typing import Optional

import torch

from ..base import AttnMetadata
from ..reference import lowbit
from ..reference.ops import ReferenceOps
from . import triton_act, triton_attention, triton_kvquant, triton_norm

INTERPRET = triton_norm.INTERPRET  # the kernels were decorated for the interpreter (decided at import)


def kernel_device_ok(*tensors: torch.Tensor) -> bool:
    """All tensors are where the kernels can run: CUDA, or the CPU under the interpreter."""
    for t in tensors:
        if t is None:
            continue
        if t.device.type == "cuda":
            continue
        if INTERPRET and t.device.type == "cpu":
            continue
        return False
    return True


class NvidiaOps(ReferenceOps):
    name = "nvidia"

    def __init__(self, device="cuda"):
        device = torch.device(device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("the nvidia backend was asked for a CUDA device, but CUDA is not available")
        if device.type != "cuda" and not (INTERPRET and device.type == "cpu"):
            raise ValueError(f"the nvidia backend runs on CUDA devices (or on the CPU with TRITON_INTERPRET=1 set "
                             f"before deepinfer.backends.nvidia.ops is imported); got device {str(device)!r}")
        super().__init__(device)
        # Kernel launches by op (Python calls; CUDA-graph replays are not counted), so tests and benchmarks
        # can confirm that the fast path ran.
        self.kernel_calls = collections.Counter()

    # Norms and activations.
    def rms_norm(self, x, weight, eps):
        if kernel_device_ok(x, weight) and triton_norm.supports(x, weight):
            self.kernel_calls["rms_norm"] += 1
            return triton_norm.rms_norm(x, weight, eps)
        return super().rms_norm(x, weight, eps)

    def add_rms_norm(self, x, residual, weight, eps):
        if kernel_device_ok(x, residual, weight) and triton_norm.supports(x, weight, residual):
            self.kernel_calls["add_rms_norm"] += 1
            return triton_norm.add_rms_norm(x, residual, weight, eps)
        return super().add_rms_norm(x, residual, weight, eps)

    def silu_and_mul(self, x):
        if kernel_device_ok(x) and triton_act.supports(x):
            self.kernel_calls["silu_and_mul"] += 1
            return triton_act.silu_and_mul(x)
        return super().silu_and_mul(x)

    # Attention.
    def paged_attention(self, q, k_cache, v_cache, meta: AttnMetadata, scale, window=None, sinks=None):
        decode = meta.block_table is not None and meta.q_index.shape[1] == 1
        if decode and kernel_device_ok(q, k_cache, v_cache, meta.block_table, meta.seq_lens, meta.q_pos, sinks) \
                and triton_attention.supports(q, k_cache, v_cache, meta.block_table, meta.block_size, sinks):
            self.kernel_calls["paged_attention"] += 1
            return triton_attention.paged_decode(q, k_cache, v_cache, meta.block_table, meta.block_size,
                                                 meta.seq_lens, meta.q_pos[:, 0], scale, window, sinks)
        return super().paged_attention(q, k_cache, v_cache, meta, scale, window, sinks)

    # FP8 KV quantisation (the lowbit "fp8_e4m3_pow2" layout); other formats use the reference code.
    def quantize_kv(self, x: torch.Tensor, fmt: str):
        """x [..., C] -> (codes, scales) exactly as reference.lowbit.quantize(x, fmt). The fp8 kernel
        skips the reference's inf/NaN check (a host sync)."""
        if fmt == triton_kvquant.FMT and kernel_device_ok(x) and triton_kvquant.supports_quantize(x):
            self.kernel_calls["quantize_kv"] += 1
            return triton_kvquant.quantize_fp8_pow2(x)
        return lowbit.quantize(x, fmt)

    def dequantize_kv(self, codes: torch.Tensor, scales: Optional[torch.Tensor], fmt: str,
                      dtype: torch.dtype = torch.float32):
        """Inverse of quantize_kv, as reference.lowbit.dequantize(codes, scales, fmt, dtype)."""
        if fmt == triton_kvquant.FMT and scales is not None and kernel_device_ok(codes, scales) \
                and codes.dtype == torch.uint8 and scales.dtype == torch.uint8 and codes.dim() >= 1 \
                and codes.shape[-1] % triton_kvquant.GROUP == 0 \
                and tuple(scales.shape) == (*codes.shape[:-1], codes.shape[-1] // triton_kvquant.GROUP) \
                and dtype in triton_kvquant.SUPPORTED_DTYPES:
            self.kernel_calls["dequantize_kv"] += 1
            return triton_kvquant.dequantize_fp8_pow2(codes, scales, dtype)
        return lowbit.dequantize(codes, scales, fmt, dtype)

"""A CED decode step's SWA key/value, normed, rotated, FP8-rounded and written to its ring, in one launch.

CEDLayer.swa_kv and the ring write after attention ran as 8 small kernels per layer and step (RMSNorm, RoPE,
FP8 quantize and dequantize, quantize again for the ring, the slot's modulo, two index_puts). For y = W_kv x
[T, D] (the projection stays a GEMM), one program per token computes in registers, as the torch formulas do:

    r   = rms(y) rounded to y's dtype                (triton_ced_fused's RMSNorm: float32, weight in float32)
    k   = RoPE(r) on the last R channels, rounded    (adjacent pairs, cos/sin from pos, FMA fusion off)
    kv  = dequantize(quantize(k)) in fp8_e4m3_pow2    (when fake: the fresh key attention reads), rounded
    ring[slot, pos % RING] = quantize(kv)            (what ``CEDCache.ring_write`` stores)

and returns kv. The FP8 steps are triton_kvquant's integer arithmetic (bit for bit the reference's); the
norm and rotation are triton_ced_fused's (the norm's sum may differ from torch's in the last float32 bit).
Capture-safe: nothing is read back to the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_ced_fused import INTERPRET, SUPPORTED_DTYPES, _rms_row, _rope_row
from .triton_kvquant import FMT, GROUP, fp8_pow2_dequant, fp8_pow2_quant
from .triton_norm import cast_rne, to_f32
from .triton_pdl import launch_kw, pdl_start
from deepinfer.backends.nvidia.host_math import next_pow2

MAX_D = 4096


@triton.jit
def _swa_kv_ring_kernel(y_ptr, w_ptr, pos_ptr, slot_ptr, inv_ptr, kv_ptr, rc_ptr, rs_ptr,
                        stride_y, stride_kv, stride_rcs, stride_rcr, stride_rss, stride_rsr,
                        D, HALF, RING, eps, BLOCK: tl.constexpr, FAKE: tl.constexpr, PDL: tl.constexpr = 0):
    pdl_start(PDL)
    t = tl.program_id(0).to(tl.int64)
    DT = kv_ptr.dtype.element_ty
    cols = tl.arange(0, BLOCK)
    ok = cols < D
    yf = to_f32(tl.load(y_ptr + t * stride_y + cols, mask=ok, other=0.0))
    r = to_f32(cast_rne(_rms_row(yf, w_ptr, cols, ok, D, eps), DT))  # functional.rms: one rounding to y's dtype
    # RoPE on pairs (2i, 2i + 1) of the last 2 HALF channels: pair i rotates by pos * inv[i - first].
    k = _rope_row(r, tl.load(pos_ptr + t).to(tl.float32), inv_ptr, D, HALF, DT, BLOCK)
    k = tl.reshape(k, (BLOCK // 32, 32))
    code, sb = fp8_pow2_quant(k)
    if FAKE:  # the fresh key as fake quantisation leaves it, and the ring's codes of that (as ring_write does)
        k = to_f32(cast_rne(fp8_pow2_dequant(code, sb), DT))
        code, sb = fp8_pow2_quant(k)
    ch = tl.reshape(cols, (BLOCK // 32, 32))
    cm = ch < D
    tl.store(kv_ptr + t * stride_kv + ch, cast_rne(k, DT), mask=cm)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    at = (tl.load(pos_ptr + t) % RING).to(tl.int64)
    tl.store(rc_ptr + slot * stride_rcs + at * stride_rcr + ch, code.to(tl.uint8), mask=cm)
    g = tl.arange(0, BLOCK // 32)
    tl.store(rs_ptr + slot * stride_rss + at * stride_rsr + g, sb.to(tl.uint8), mask=g < D // 32)


def supports(y, weight, pos, ring, ring_slot, rope_dim, fmt) -> bool:
    """Whether swa_kv_ring runs these inputs (otherwise the reference op)."""
    if fmt != FMT or y.dim() != 2 or y.dtype not in SUPPORTED_DTYPES or weight.dtype not in SUPPORTED_DTYPES:
        return False
    T, D = y.shape
    codes, scales = ring
    if D % GROUP or not 0 < D <= MAX_D or weight.shape != (D,) or y.stride(1) != 1 or not weight.is_contiguous():
        return False
    if isinstance(rope_dim, bool) or not isinstance(rope_dim, int) or rope_dim % 2 or not 0 < rope_dim <= D:
        return False
    if codes.dtype != torch.uint8 or scales.dtype != torch.uint8 or codes.dim() != 3 or codes.shape[2] != D \
            or scales.shape != (*codes.shape[:2], D // GROUP) or codes.stride(2) != 1 or scales.stride(2) != 1:
        return False
    for v in (pos, ring_slot):
        if v.shape != (T,) or v.dtype not in (torch.int32, torch.int64):
            return False
    return True


def swa_kv_ring(y, weight, eps, pos, inv_freq, ring, ring_slot, fake: bool = True) -> torch.Tensor:
    """y [T, D] the SWA projection, weight [D] the kv norm, pos [T], inv_freq [R/2] float32, ring = (codes
    [S, RING, D], scales [S, RING, D/32]) uint8 written at [ring_slot[t], pos[t] % RING] -> kv [T, D] in y's
    dtype (see the module doc)."""
    R = 2 * inv_freq.shape[0]
    if not supports(y, weight, pos, ring, ring_slot, R, FMT) or inv_freq.dtype != torch.float32:
        raise ValueError(f"swa_kv_ring: unsupported y {y.dtype} {tuple(y.shape)}, weight {weight.dtype} "
                         f"{tuple(weight.shape)}, pos {pos.dtype} {tuple(pos.shape)}, ring "
                         f"{[(t.dtype, tuple(t.shape)) for t in ring]}, ring_slot {ring_slot.dtype} "
                         f"{tuple(ring_slot.shape)}, rope_dim {R}")
    T, D = y.shape
    kv = torch.empty_like(y)
    if T:
        codes, scales = ring
        BLOCK = max(32, next_pow2(D))
        _swa_kv_ring_kernel[(T,)](y, weight, pos.contiguous(), ring_slot.contiguous(), inv_freq.contiguous(), kv,
                                  codes, scales, y.stride(0), kv.stride(0), codes.stride(0), codes.stride(1),
                                  scales.stride(0), scales.stride(1), D, R // 2, codes.shape[1], float(eps),
                                  BLOCK=BLOCK, FAKE=bool(fake),
                                  num_warps=1 if INTERPRET else min(8, max(1, BLOCK // 256)),
                                  enable_fp_fusion=False, **launch_kw(y.device))
    return kv

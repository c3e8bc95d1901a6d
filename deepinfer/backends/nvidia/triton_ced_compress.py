"""A CED full layer's compressed entries, from the projections of their groups to the FP4 cache, in one launch.

CEDLayer.entries and CEDCache.write_entries ran as ~13 small kernels per tensor (the gate's cast and softmax
over each group, the weighted sum and its casts, RMSNorm, the RoPE positions and rotation, FP4 quantize,
dequantize and quantize again, two index_puts). For one tensor (the KV latent, or the indexer key) of G entries,
v [G*m, C] its projection and z [G*m, C] its channel-wise gate (m > 1), one program per entry computes in
registers, as functional's formulas do:

    c = sum over the group of softmax_over_group(z) * v     (float32, rounded to v's dtype; c = v when m = 1)
    c = rms(c) with the weight, rounded                      (the KV; triton_ced_fused's RMSNorm)
    c = RoPE(c) at position entry_id * m, rounded            (the KV)
    c = dequantize(quantize(c)) in fmt, rounded              (when fake: the entry the full-sequence path uses)
    store[rows[g]] = quantize(c)                             (FP4: triton_fp4's bits, the reference's)

Precision: the softmax's exp is the device's (libdevice on the GPU, numpy's under the interpreter) and the
norm sums in another order than torch, so c can differ from the torch formulas in the last bit of v's dtype,
and then, rarely, round to a neighbouring FP4 code. Capture-safe: nothing is read back to the host.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .triton_ced_fused import INTERPRET, SUPPORTED_DTYPES, _exp, _rms_row, _rope_row
from .triton_fp4 import GROUPS, fp4_dequant, fp4_quant
from .triton_norm import cast_rne, to_f32
from .triton_pdl import launch_kw, pdl_start
from deepinfer.backends.nvidia.host_math import next_pow2

MAX_C = 4096
MAX_M = 16


@triton.jit
def _compress_write_kernel(v_ptr, z_ptr, w_ptr, ids_ptr, rows_ptr, inv_ptr, codes_ptr, scales_ptr,
                           stride_v, stride_z, stride_c, stride_s, C, HALF, eps,
                           M: tl.constexpr, BLOCK: tl.constexpr, GROUP: tl.constexpr, E8M0: tl.constexpr,
                           HAS_NORM: tl.constexpr, HAS_ROPE: tl.constexpr, FAKE: tl.constexpr, PDL: tl.constexpr = 0):
    pdl_start(PDL)
    g = tl.program_id(0).to(tl.int64)
    DT = v_ptr.dtype.element_ty
    cols = tl.arange(0, BLOCK)
    ok = cols < C
    if M == 1:
        c = to_f32(tl.load(v_ptr + g * stride_v + cols, mask=ok, other=0.0))
    else:  # softmax over the group's m tokens, channel by channel, then the weighted sum
        mx = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
        for i in tl.static_range(M):
            mx = tl.maximum(mx, to_f32(tl.load(z_ptr + (g * M + i) * stride_z + cols, mask=ok, other=0.0)))
        den = tl.zeros([BLOCK], dtype=tl.float32)
        for i in tl.static_range(M):
            den += _exp(to_f32(tl.load(z_ptr + (g * M + i) * stride_z + cols, mask=ok, other=0.0)) - mx)
        c = tl.zeros([BLOCK], dtype=tl.float32)
        for i in tl.static_range(M):
            p = _exp(to_f32(tl.load(z_ptr + (g * M + i) * stride_z + cols, mask=ok, other=0.0)) - mx) / den
            c += p * to_f32(tl.load(v_ptr + (g * M + i) * stride_v + cols, mask=ok, other=0.0))
        c = to_f32(cast_rne(c, DT))
    if HAS_NORM:
        c = to_f32(cast_rne(_rms_row(c, w_ptr, cols, ok, C, eps), DT))
    if HAS_ROPE:  # pairs (2i, 2i + 1) of the last 2 HALF channels, at position entry_id * m
        c = _rope_row(c, (tl.load(ids_ptr + g) * M).to(tl.float32), inv_ptr, C, HALF, DT, BLOCK)
    # FP4 groups of GROUP channels, as (even, odd) channel pairs
    x0, x1 = tl.split(tl.reshape(c, (BLOCK // GROUP, GROUP // 2, 2)))
    code, sb = fp4_quant(x0, x1, E8M0)
    if FAKE:
        v0, v1 = fp4_dequant(code, sb, E8M0)
        code, sb = fp4_quant(to_f32(cast_rne(v0, DT)), to_f32(cast_rne(v1, DT)), E8M0)
    row = tl.load(rows_ptr + g).to(tl.int64)
    byte = tl.arange(0, BLOCK // GROUP)[:, None] * (GROUP // 2) + tl.arange(0, GROUP // 2)[None, :]
    tl.store(codes_ptr + row * stride_c + byte, code.to(tl.uint8), mask=byte < C // 2)
    ng = tl.arange(0, BLOCK // GROUP)
    tl.store(scales_ptr + row * stride_s + ng, sb.to(tl.uint8), mask=ng < C // GROUP)


def supports(v, z, m: int, weight, fmt: str, store, rows, entry_ids) -> bool:
    """Whether compress_write runs these inputs (otherwise the reference op)."""
    if fmt not in GROUPS or v.dim() != 2 or v.dtype not in SUPPORTED_DTYPES or v.stride(1) != 1:
        return False
    C = v.shape[1]
    if isinstance(m, bool) or not isinstance(m, int) or not 1 <= m <= MAX_M or v.shape[0] % m \
            or not 0 < C <= MAX_C or C % GROUPS[fmt] or next_pow2(C) < GROUPS[fmt]:
        return False
    if m > 1 and (z is None or z.shape != v.shape or z.dtype != v.dtype or z.stride(1) != 1):
        return False
    if weight is not None and (weight.shape != (C,) or not weight.is_contiguous()
                               or weight.dtype not in SUPPORTED_DTYPES):
        return False
    codes, scales = store
    if codes.dtype != torch.uint8 or scales is None or scales.dtype != torch.uint8 or codes.dim() != 2 \
            or codes.shape[1] != C // 2 or scales.shape != (codes.shape[0], C // GROUPS[fmt]) \
            or codes.stride(1) != 1 or scales.stride(1) != 1:
        return False
    G = v.shape[0] // m
    return rows.shape == (G,) and entry_ids.shape == (G,) and rows.dtype in (torch.int32, torch.int64) \
        and entry_ids.dtype in (torch.int32, torch.int64)


def compress_write(v: torch.Tensor, z: Optional[torch.Tensor], m: int, weight: Optional[torch.Tensor], eps: float,
                   entry_ids: torch.Tensor, inv_freq: Optional[torch.Tensor], fmt: str, fake: bool, store: tuple,
                   rows: torch.Tensor) -> None:
    """Compress the groups of v [G*m, C] (gate z, None when m = 1), normalise (weight, or None), rotate at
    entry_ids * m (inv_freq [R/2], or None), fake-quantize (fake) and write quantized in fmt to store =
    (codes [N, C/2], scales [N, C/G]) at rows [G]. See the module doc."""
    if not supports(v, z, m, weight, fmt, store, rows, entry_ids):
        raise ValueError(f"compress_write: unsupported v {v.dtype} {tuple(v.shape)}, z "
                         f"{None if z is None else (z.dtype, tuple(z.shape))}, m {m!r}, fmt {fmt!r}, store "
                         f"{[(t.dtype, tuple(t.shape)) for t in store if t is not None]}, rows {tuple(rows.shape)}, "
                         f"entry_ids {tuple(entry_ids.shape)}")
    G, C = v.shape[0] // m, v.shape[1]
    if not G:
        return
    codes, scales = store
    R = 2 * inv_freq.shape[0] if inv_freq is not None else 0
    if R and (R % 2 or R > C or inv_freq.dtype != torch.float32):
        raise ValueError(f"compress_write: inv_freq must be float32 [R/2] with R <= C={C}, got "
                         f"{inv_freq.dtype} {tuple(inv_freq.shape)}")
    BLOCK = next_pow2(C)
    _compress_write_kernel[(G,)](
        v, z if z is not None else v, weight if weight is not None else v, entry_ids.contiguous(),
        rows.contiguous(), inv_freq.contiguous() if R else v, codes, scales,
        v.stride(0), (z if z is not None else v).stride(0), codes.stride(0), scales.stride(0), C, R // 2, float(eps),
        M=m, BLOCK=BLOCK, GROUP=GROUPS[fmt], E8M0=fmt == "mxfp4", HAS_NORM=weight is not None, HAS_ROPE=R > 0,
        FAKE=bool(fake), num_warps=1 if INTERPRET else min(8, max(1, BLOCK // 256)), enable_fp_fusion=False,
        **launch_kw(v.device))

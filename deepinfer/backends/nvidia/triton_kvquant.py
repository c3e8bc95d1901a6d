"""FP8 E4M3 KV quantisation with a power-of-two scale per 32 channels, in Triton.

Byte layout identical to ``reference.lowbit.quantize(x, "fp8_e4m3_pow2")``: codes [..., C] are
float8_e4m3fn bits; scales [..., C // 32] are E8M0 biased exponents (byte s means 2^(s - 127), byte 0
is 2^-127). The scale of a group is the smallest 2^k with amax / 2^k <= 448, k clamped to [-127, 127];
an all-zero group gets scale byte 0. Codes round to nearest, ties to even, and keep x's sign bit
(-0.0 -> 0x80).

Everything that decides a bit is integer arithmetic on float32 bit patterns, so the result does not
depend on the GPU's approximate division/exp2 or on its float8 conversion instructions: the scale
exponent comes from amax's exponent and mantissa fields (frexp), x / 2^k is a multiplication by the
exactly representable 2^-k (exact, or correctly rounded like the reference's division where the
quotient is subnormal), and the E4M3 rounding is done on the quotient's bits. Dequantisation builds
the E4M3 value from its fields and multiplies by the power-of-two scale; the product is exact.

Unlike the reference, the kernels do not check their input for inf/NaN (that would cost a host sync);
``quantize_fp8_pow2(..., check_finite=True)`` does it on request.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_norm import cast_rne, to_f32
from deepinfer.backends.nvidia.host_math import cdiv, next_pow2

INTERPRET = bool(triton.knobs.runtime.interpret)
GROUP = 32
FMT = "fp8_e4m3_pow2"
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def fp8_pow2_quant(x):
    """x [G, 32] float32 -> (E4M3 codes [G, 32] int32, scale bytes [G] int32) of each group (the layout above)."""
    # Scale exponent k from amax's bits: amax = m * 2^E with m in [0.5, 1) (frexp); amax / 2^k <= 448
    # first holds at k = E - 9 when m <= 0.875, else at E - 8. Subnormal amax gives k < -127: clamp.
    amax = tl.max(tl.abs(x), axis=1)  # [G]
    abits = amax.to(tl.int32, bitcast=True)
    ebits = (abits >> 23) & 0xFF
    mant = abits & 0x7FFFFF
    E = ebits - 126
    k = tl.where(mant <= 0x600000, E - 9, E - 8)
    k = tl.where(ebits == 0, -127, k)
    k = tl.minimum(tl.maximum(k, -127), 127)
    sbyte = tl.where(amax > 0, k + 127, 0)
    # x / 2^k as x * 2^-k: 2^-k is a normal float32 for every k in [-127, 120] (the largest reachable).
    inv = ((127 - k) << 23).to(tl.float32, bitcast=True)
    q = x * inv[:, None]  # |q| <= 448

    # float32 -> E4M3 bits, round to nearest even, from the bit pattern.
    qbits = q.to(tl.int32, bitcast=True)
    sign = (qbits >> 31) & 1
    a = qbits & 0x7FFFFFFF
    # Normal E4M3 (|q| >= 2^-6): drop 20 mantissa bits with RNE; the carry may bump the exponent.
    normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - (120 << 3)
    normal = tl.minimum(normal, 126)  # saturate at 448 (0x7E); 0x7F is NaN
    # Subnormal E4M3: m * 2^-9 for m in 0..7 (m = 8 is 2^-6, the first normal code).
    y = tl.abs(q) * 512.0  # exact
    fl = y.to(tl.int32)  # floor (y >= 0)
    frac = y - fl.to(tl.float32)  # exact
    up = (frac > 0.5) | ((frac == 0.5) & ((fl & 1) == 1))
    sub = fl + up.to(tl.int32)
    mag = tl.where(a >= (121 << 23), normal, sub)
    return mag | (sign << 7), sbyte


@triton.jit
def fp8_pow2_dequant(c, sb):
    """E4M3 codes c [G, 32] int32 and scale bytes sb [G] int32 -> the values [G, 32] float32 (exact)."""
    e = (c >> 3) & 0xF
    m = c & 7
    norm = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)  # (1 + m/8) * 2^(e-7)
    sub = m.to(tl.float32) * 0.001953125  # m * 2^-9, exact
    mag = tl.where(e == 0, sub, norm)
    mag = tl.where((c & 0x7F) == 0x7F, float("nan"), mag)
    # Sign by its bit (negation would lower to 0 - x and turn the code 0x80 into +0.0, not -0.0).
    val = (mag.to(tl.int32, bitcast=True) | ((c & 0x80) << 24)).to(tl.float32, bitcast=True)
    sbits = tl.where(sb == 0, 0x00400000, sb << 23)  # byte 0 is the subnormal 2^-127
    scale = sbits.to(tl.float32, bitcast=True)
    scale = tl.where(sb == 255, float("nan"), scale)
    return val * scale[:, None]  # exact: a 4-bit significand times a power of two


@triton.jit
def _quant_kernel(x_ptr, codes_ptr, scales_ptr, stride_x, stride_c, stride_s, M, NG,
                  BLOCK_G: tl.constexpr, GROUP_SIZE: tl.constexpr, ROWS: tl.constexpr):
    row, g, g_mask = row_groups(M, NG, BLOCK_G, ROWS)
    j = tl.arange(0, GROUP_SIZE)
    ch = g[:, None] * GROUP_SIZE + j[None, :]  # [BLOCK_G, GROUP_SIZE]
    mask = g_mask[:, None]
    x = to_f32(tl.load(x_ptr + row_at(row, stride_x, ROWS) + ch, mask=mask, other=0.0))
    code, sbyte = fp8_pow2_quant(x)
    tl.store(codes_ptr + row_at(row, stride_c, ROWS) + ch, code.to(tl.uint8), mask=mask)
    tl.store(scales_ptr + row * stride_s + g, sbyte.to(tl.uint8), mask=g_mask)


@triton.jit
def _dequant_kernel(codes_ptr, scales_ptr, out_ptr, stride_c, stride_s, stride_o, M, NG,
                    BLOCK_G: tl.constexpr, GROUP_SIZE: tl.constexpr, ROWS: tl.constexpr):
    row, g, g_mask = row_groups(M, NG, BLOCK_G, ROWS)
    j = tl.arange(0, GROUP_SIZE)
    ch = g[:, None] * GROUP_SIZE + j[None, :]
    mask = g_mask[:, None]
    c = tl.load(codes_ptr + row_at(row, stride_c, ROWS) + ch, mask=mask, other=0).to(tl.int32)
    sb = tl.load(scales_ptr + row * stride_s + g, mask=g_mask, other=0).to(tl.int32)
    out = fp8_pow2_dequant(c, sb)
    tl.store(out_ptr + row_at(row, stride_o, ROWS) + ch, cast_rne(out, out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def row_groups(M, NG, BLOCK_G: tl.constexpr, ROWS: tl.constexpr):
    """The (row, group) pairs of this program of a (de)quantisation kernel: ROWS rows [pid0 * ROWS, +ROWS) times
    BLOCK_G groups from pid1 * BLOCK_G, flattened to [ROWS * BLOCK_G] (row-major), with the mask of the pairs
    that exist. ROWS = 1 (on the GPU) gives the scalar row id of a one-row program, as the kernels had it."""
    if ROWS == 1:
        row = tl.program_id(0).to(tl.int64)
        g = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)
        return row, g, g < NG
    else:
        k = tl.arange(0, ROWS * BLOCK_G)
        row = tl.program_id(0).to(tl.int64) * ROWS + k // BLOCK_G
        g = tl.program_id(1) * BLOCK_G + k % BLOCK_G
        return row, g, (g < NG) & (row < M)


@triton.jit
def row_at(row, stride, ROWS: tl.constexpr):
    """Offset of ``row`` for a [groups, bytes] tile's loads: a scalar, or [ROWS * BLOCK_G, 1] for row_groups'
    flattened rows."""
    if ROWS == 1:
        return row * stride
    else:
        return (row * stride)[:, None]


def row_launch(M: int, NG: int) -> tuple[tuple[int, int], int, int]:
    """(grid, BLOCK_G, ROWS) of a (de)quantisation kernel over M rows of NG groups (this module's and triton_fp4's).
    ROWS, the rows a program covers: one on a GPU (a row's groups fill a program; the launch shape the kernels
    were tuned and timed with); under Triton's interpreter as many as make ~512 groups, because there each
    program costs tens of milliseconds of Python whatever its size (a 64-row FP4 quantize took 3 s one row a
    program)."""
    bg = block_g(NG)
    rows = max(1, min(next_pow2(M), 512 // bg)) if INTERPRET else 1
    return (cdiv(M, rows), cdiv(NG, bg)), bg, rows


def block_g(ng: int) -> int:
    """Scale groups per program of the (de)quantisation kernels (this module's and triton_fp4's)."""
    return max(1, min(32, next_pow2(ng)))


def as_rows(t: torch.Tensor, width: int) -> torch.Tensor:
    """t [..., width] as [rows, width] with unit last stride, as the (de)quantisation kernels read it (a copy
    only when the view's channels are strided)."""
    t2 = t.reshape(-1, width)
    return t2.contiguous() if t2.numel() and t2.stride(-1) != 1 else t2


def supports_quantize(x: torch.Tensor) -> bool:
    return x.dim() >= 1 and x.dtype in SUPPORTED_DTYPES and x.shape[-1] % GROUP == 0


def quantize_fp8_pow2(x: torch.Tensor, check_finite: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., C] (C % 32 == 0; bf16/fp16/fp32) -> (codes uint8 [..., C], scales uint8 [..., C // 32])."""
    C = x.shape[-1]
    if C % GROUP:
        raise ValueError(f"channel count C={C} must be a multiple of the {FMT} group size {GROUP}")
    if check_finite and not bool(torch.isfinite(x).all()):
        raise ValueError(f"x must be finite for the scaled format {FMT!r}; it has inf or NaN")
    NG = C // GROUP
    codes = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    scales = torch.empty((*x.shape[:-1], NG), dtype=torch.uint8, device=x.device)
    x2 = as_rows(x, C)
    M = x2.shape[0]
    if M == 0 or NG == 0:
        return codes, scales
    c2, s2 = codes.view(-1, C), scales.view(-1, NG)
    grid, BG, R = row_launch(M, NG)
    _quant_kernel[grid](x2, c2, s2, x2.stride(0), c2.stride(0), s2.stride(0), M, NG,
                        BLOCK_G=BG, GROUP_SIZE=GROUP, ROWS=R, num_warps=4 if BG >= 8 else 1)
    return codes, scales


def dequantize_fp8_pow2(codes: torch.Tensor, scales: torch.Tensor,
                        dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of quantize_fp8_pow2: codes uint8 [..., C], scales uint8 [..., C // 32] -> [..., C] in dtype."""
    C = codes.shape[-1]
    if codes.dtype != torch.uint8 or scales.dtype != torch.uint8 or C % GROUP \
            or tuple(scales.shape) != (*codes.shape[:-1], C // GROUP):
        raise ValueError(f"codes must be uint8 [..., C] with C % {GROUP} == 0 and scales uint8 [..., C // {GROUP}]; "
                         f"got {codes.dtype} {tuple(codes.shape)} and {scales.dtype} {tuple(scales.shape)}")
    NG = C // GROUP
    out = torch.empty(codes.shape, dtype=dtype, device=codes.device)
    c2, s2 = as_rows(codes, C), as_rows(scales, NG)
    M = c2.shape[0]
    if M == 0 or NG == 0:
        return out
    o2 = out.view(-1, C)
    grid, BG, R = row_launch(M, NG)
    _dequant_kernel[grid](c2, s2, o2, c2.stride(0), s2.stride(0), o2.stride(0), M, NG,
                          BLOCK_G=BG, GROUP_SIZE=GROUP, ROWS=R, num_warps=4 if BG >= 8 else 1)
    return out

"""FP4 KV quantisation in Triton: ``fp4_e2m1_e4m3`` (CED global KV) and ``mxfp4`` (CED indexer keys).

Byte layouts identical to ``reference.lowbit``: codes [..., C // 2] hold two E2M1 nibbles per byte (low
nibble = even channel; bit 3 of a nibble is the sign); scales [..., C // G] are one byte per group:
  fp4_e2m1_e4m3  G = 16, an E4M3 scale: the smallest E4M3 value s with 6 * s >= amax, capped at 448;
  mxfp4          G = 32, an E8M0 exponent: floor(log2(amax)) - 2, clamped to [-127, 127] (byte 0 = 2^-127).
An all-zero group gets scale byte 0. Values x / s are clamped to +-6 and rounded to the E2M1 grid
(0, .5, 1, 1.5, 2, 3, 4, 6), ties to the even code; the sign nibble bit follows x's sign bit (-0.0 -> 0x8).

Every bit is decided exactly as the reference decides it: the E4M3 scale by a binary search over the 127
codes comparing 6 * s (exact in float32) with amax, x / s by a correctly rounded division (div_rn, not the
approximate one) for E4M3 scales and by an exact multiplication with 2^-e for E8M0 ones, and the E2M1 code
by comparisons with the exactly representable midpoints. Dequantisation multiplies a decoded nibble by the
decoded scale (exact in float32) and rounds once to the output dtype, with the reference's semantics for the
bytes quantize never writes: a NaN scale byte (E4M3 0x7F / 0xFF, E8M0 0xFF) gives a NaN group, of whatever
payload the hardware makes (canonical on CUDA, the scale's own under the interpreter: only NaN-ness is
specified), and a product beyond the output dtype gives inf of the code's sign. Neither is special-cased here:
plain IEEE multiplication and round-to-nearest conversion produce both, so no select is spent on them.

The ``@triton.jit`` decoders (``e2m1_value``, ``e4m3_value``, ``e8m0_value``, ``fp4_tile``) are shared with
the CED attention and indexer kernels, which dequantise in registers and hand the tiles to tl.dot through
``mma_operand`` (a workaround for a Triton 3.6 miscompilation of small-K dots on such tiles). Like the FP8
kernels, these skip the reference's inf/NaN input check (a host sync).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .triton_kvquant import as_rows, row_at, row_groups, row_launch
from .triton_norm import cast_rne, to_f32

INTERPRET = bool(triton.knobs.runtime.interpret)
_INTERP = tl.constexpr(INTERPRET)
GROUPS = {"fp4_e2m1_e4m3": 16, "mxfp4": 32}  # channels per scale byte
FORMATS = tuple(GROUPS)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def e2m1_value(nib):
    """int32 nibbles 0..15 -> float32 E2M1 values (bit 3 is the sign; 0x8 is -0.0)."""
    e = (nib >> 1) & 3
    m = nib & 1
    norm = (((e + 126) << 23) | (m << 22)).to(tl.float32, bitcast=True)  # (1 + m/2) * 2^(e-1)
    mag = tl.where(e == 0, m.to(tl.float32) * 0.5, norm)
    return (mag.to(tl.int32, bitcast=True) | ((nib & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def e4m3_value(c):
    """int32 float8_e4m3fn bytes -> float32 (0x7F / 0xFF -> NaN), as reference.lowbit decodes them."""
    e = (c >> 3) & 0xF
    m = c & 7
    norm = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)  # (1 + m/8) * 2^(e-7)
    mag = tl.where(e == 0, m.to(tl.float32) * 0.001953125, norm)  # subnormal: m * 2^-9
    mag = tl.where((c & 0x7F) == 0x7F, float("nan"), mag)
    # Sign by its bit (negation would lower to 0 - x and turn 0x80 into +0.0).
    return (mag.to(tl.int32, bitcast=True) | ((c & 0x80) << 24)).to(tl.float32, bitcast=True)


@triton.jit
def e8m0_value(sb):
    """int32 E8M0 bytes -> float32 2^(sb - 127) (byte 0 is the subnormal 2^-127, 255 is NaN)."""
    bits = tl.where(sb == 0, 0x00400000, sb << 23)
    return tl.where(sb == 255, float("nan"), bits.to(tl.float32, bitcast=True))


@triton.jit
def fp4_tile(codes_ptr, scales_ptr, rows, row_mask, stride_c, stride_s, NG, BLOCK_G: tl.constexpr,
             GROUP: tl.constexpr, E8M0: tl.constexpr):
    """Dequantise the FP4 rows ``rows`` [BLOCK_N] (int64 row ids; masked rows give 0) of a code array with NG
    scale groups per row -> float32 [BLOCK_N, BLOCK_G * GROUP], exact. Loaded as [rows, groups, bytes] so each
    scale byte is read once and broadcast over its group; channel 2i comes from byte i's low nibble."""
    byte, sb = fp4_load(codes_ptr, scales_ptr, rows, row_mask, stride_c, stride_s, NG, BLOCK_G, GROUP, False)
    return fp4_tile_decode(byte, sb, GROUP, E8M0)


@triton.jit
def fp4_load(codes_ptr, scales_ptr, rows, row_mask, stride_c, stride_s, NG, BLOCK_G: tl.constexpr,
             GROUP: tl.constexpr, FAST: tl.constexpr):
    """The raw code bytes and scale bytes of FP4 rows ``rows`` [BLOCK_N] (masked rows and groups past NG load 0),
    laid out for fp4_decode of the same FAST: codes uint8 [BLOCK_N, BLOCK_G * GROUP // 2] (FAST) or [BLOCK_N,
    BLOCK_G, GROUP // 2], scales int32 [BLOCK_N, BLOCK_G]. Apart from the decoding so a kernel can issue the
    next tile's loads before it decodes this one (their latency then overlaps the work)."""
    g = tl.arange(0, BLOCK_G)
    gmask = row_mask[:, None] & (g[None, :] < NG)  # [BLOCK_N, BLOCK_G]
    if FAST:  # 2-D tiles: Triton 3.6 fails to lay out a wgmma operand reshaped from [rows, groups, bytes]
        c = tl.arange(0, BLOCK_G * GROUP // 2)
        byte = tl.load(codes_ptr + rows[:, None] * stride_c + c[None, :],
                       mask=row_mask[:, None] & (c < NG * (GROUP // 2))[None, :], other=0)
    else:
        j = tl.arange(0, GROUP // 2)
        byte = tl.load(codes_ptr + rows[:, None, None] * stride_c
                       + (g[None, :, None] * (GROUP // 2) + j[None, None, :]), mask=gmask[:, :, None], other=0)
    sb = tl.load(scales_ptr + rows[:, None] * stride_s + g[None, :], mask=gmask, other=0).to(tl.int32)
    return byte, sb


@triton.jit
def fp4_tile_decode(byte, sb, GROUP: tl.constexpr, E8M0: tl.constexpr):
    """fp4_load's bytes (not FAST) -> float32 [BLOCK_N, BLOCK_G * GROUP], exact (fp4_tile's values)."""
    byte = byte.to(tl.int32)
    if E8M0:
        scale = e8m0_value(sb)[:, :, None]
    else:
        scale = e4m3_value(sb)[:, :, None]
    vals = tl.interleave(e2m1_value(byte & 0xF) * scale, e2m1_value(byte >> 4) * scale)
    return tl.reshape(vals, [byte.shape[0], byte.shape[1] * GROUP])


# Two E2M1 nibbles of a byte n -> bf16 bits ((n & 7) << 6) | ((n & 8) << 12): the nibble's exponent and mantissa
# bits land in bf16's, so the bits are the value times 2^-126 (code 1, 0.5, becomes the subnormal 2^-127); one
# multiplication by 2^126 (0x7E80) restores it and one by the group's scale applies that, both exact (two and
# four significant bits make at most six, and bf16 has fp32's exponent range). Four bytes a register: prmt
# spreads bytes 0, 1 (2, 3) into the two halves, the masks and shifts place both nibbles of both at once.
_FP4_BF16_ASM = tl.constexpr("""
{
.reg .b32 z, k, t, a, b;
mov.b32 z, 0;
mov.b32 k, 0x7E807E80;
prmt.b32 t, $4, z, 0x5140;
and.b32 a, t, 0x00070007; shl.b32 a, a, 6; and.b32 b, t, 0x00080008; shl.b32 b, b, 12; or.b32 a, a, b;
mul.rn.bf16x2 a, a, k; mul.rn.bf16x2 $0, a, $5;
and.b32 a, t, 0x00700070; shl.b32 a, a, 2; and.b32 b, t, 0x00800080; shl.b32 b, b, 8; or.b32 a, a, b;
mul.rn.bf16x2 a, a, k; mul.rn.bf16x2 $2, a, $5;
prmt.b32 t, $4, z, 0x7362;
and.b32 a, t, 0x00070007; shl.b32 a, a, 6; and.b32 b, t, 0x00080008; shl.b32 b, b, 12; or.b32 a, a, b;
mul.rn.bf16x2 a, a, k; mul.rn.bf16x2 $1, a, $6;
and.b32 a, t, 0x00700070; shl.b32 a, a, 2; and.b32 b, t, 0x00800080; shl.b32 b, b, 8; or.b32 a, a, b;
mul.rn.bf16x2 a, a, k; mul.rn.bf16x2 $3, a, $6;
}
""")


@triton.jit
def fp4_bf16_pair(byte, scale):
    """Compiled code only: uint8 code bytes and their groups' bf16 scales (broadcast to byte's shape) -> the low
    and high nibbles' values in bf16, each exactly e2m1 x scale (as cast_rne(fp4_dequant(...)) gives them, NaN
    payloads aside). A few integer operations per byte instead of e2m1_value's per nibble; opaque to Triton's
    operand analysis (side effects), so its results may feed tl.dot directly (see mma_operand)."""
    return tl.inline_asm_elementwise(_FP4_BF16_ASM, "=r,=r,=r,=r,r,r,r", [byte, scale],
                                     dtype=(tl.bfloat16, tl.bfloat16), is_pure=False, pack=4)


@triton.jit
def fp4_operand(codes_ptr, scales_ptr, rows, row_mask, stride_c, stride_s, NG, BLOCK_G: tl.constexpr,
                GROUP: tl.constexpr, E8M0: tl.constexpr, DT: tl.constexpr, FAST: tl.constexpr):
    """fp4_tile's rows as a tl.dot operand in DT. FAST (compiled, DT bf16; the host decides, see fast_decode)
    decodes in fp4_bf16_pair; otherwise fp4_tile then mma_operand."""
    byte, sb = fp4_load(codes_ptr, scales_ptr, rows, row_mask, stride_c, stride_s, NG, BLOCK_G, GROUP, FAST)
    return fp4_decode(byte, sb, GROUP, E8M0, DT, FAST)


@triton.jit
def fp4_decode(byte, sb, GROUP: tl.constexpr, E8M0: tl.constexpr, DT: tl.constexpr, FAST: tl.constexpr):
    """fp4_load's bytes of the same FAST -> fp4_operand's dot operand in DT."""
    if FAST:
        BN: tl.constexpr = byte.shape[0]
        BLOCK_G: tl.constexpr = sb.shape[1]
        if E8M0:
            scale = e8m0_value(sb)
        else:
            scale = e4m3_value(sb)
        scale = tl.reshape(tl.broadcast_to(scale.to(tl.bfloat16)[:, :, None], [BN, BLOCK_G, GROUP // 2]),
                           [BN, BLOCK_G * GROUP // 2])
        lo, hi = fp4_bf16_pair(byte, scale)
        # The join in interleave would widen the operand's kWidth again (see mma_operand): an opaque copy after it.
        return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [tl.interleave(lo, hi)], dtype=tl.bfloat16,
                                         is_pure=False, pack=2)
    else:
        return mma_operand(fp4_tile_decode(byte, sb, GROUP, E8M0), DT)


FAST_DECODE = True  # benchmarks/ced_prefill_kernels.py turns it off to time the decoder it replaces


def fast_decode(dtype: torch.dtype, tile_bytes: int, num_warps: int) -> bool:
    """Whether a kernel decodes its code tiles of tile_bytes bytes through fp4_bf16_pair: compiled, bf16 out,
    FAST_DECODE on, and four bytes at least to each thread, a multiple of four (Triton aborts the process when
    an inline asm's pack does not divide a thread's elements)."""
    return (FAST_DECODE and not INTERPRET and dtype == torch.bfloat16
            and tile_bytes % (4 * 32 * num_warps) == 0)


@triton.jit
def mma_operand(x, DT: tl.constexpr):
    """Dequantised float32 x -> DT for a tl.dot operand. Triton 3.6 gives an MMA operand traced back to 8-bit
    loads a wide kWidth (8 for 16-bit operands past the nibble join, 4 without) and then miscomputes dots with
    K < 8 * kWidth: part of K counted twice, the rest dropped (triton-lang/triton#11691). Compiled with a 16-bit
    DT, x therefore first passes an opaque identity (inline asm with side effects, which that analysis does not
    look through), so the operands keep the plain kWidth, right for any K >= 16."""
    if not _INTERP and DT != tl.float32:
        x = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x.to(tl.int32, bitcast=True)], dtype=tl.int32,
                                      is_pure=False, pack=1).to(tl.float32, bitcast=True)
    return cast_rne(x, DT)


@triton.jit
def _e2m1_code(q):
    """float32 q with |q| <= 6 -> E2M1 magnitude code 0..7, nearest, ties to the even code."""
    a = tl.abs(q)
    lo = ((a > 0.25).to(tl.int32) + (a > 0.75).to(tl.int32) + (a > 1.25).to(tl.int32) + (a > 1.75).to(tl.int32)
          + (a > 2.5).to(tl.int32) + (a > 3.5).to(tl.int32) + (a > 5.0).to(tl.int32))
    tie = (a == 0.25) | (a == 0.75) | (a == 1.25) | (a == 1.75) | (a == 2.5) | (a == 3.5) | (a == 5.0)
    return lo + (tie & ((lo & 1) == 1)).to(tl.int32)


@triton.jit
def fp4_quant(x0, x1, E8M0: tl.constexpr):
    """The even and odd channels x0, x1 [G, GROUP // 2] (float32) of G groups -> (their code bytes [G, GROUP // 2]
    int32, low nibble the even channel; scale bytes [G] int32), as reference.lowbit quantizes them."""
    amax = tl.maximum(tl.max(tl.abs(x0), axis=1), tl.max(tl.abs(x1), axis=1))  # [G]
    if E8M0:
        # floor(log2(amax)) - 2 from amax's exponent field (a subnormal amax gives < -127: clamp).
        ebits = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF
        e = tl.where(ebits == 0, -127, tl.maximum(ebits - 129, -127))
        sbyte = tl.where(amax > 0, e + 127, 0)
        inv = ((127 - e) << 23).to(tl.float32, bitcast=True)  # 2^-e, a normal float32 for e in [-127, 125]
        q0 = x0 * inv[:, None]  # exact, as the reference's division by a power of two
        q1 = x1 * inv[:, None]
    else:
        # The smallest E4M3 code s in 0..126 with 6 * value(s) >= amax (126 if none): binary search.
        lo = tl.zeros_like(amax).to(tl.int32)
        hi = lo + 126
        for _ in tl.static_range(7):
            mid = (lo + hi) // 2
            ok = e4m3_value(mid) * 6.0 >= amax
            hi = tl.where(ok, mid, hi)
            lo = tl.where(ok, lo, mid + 1)
        sbyte = tl.minimum(lo, 126)  # lo passes 126 only when no code reaches amax (saturation)
        scale = e4m3_value(sbyte)
        safe = tl.where(scale > 0, scale, 1.0)
        q0 = tl.math.div_rn(x0, safe[:, None])  # correctly rounded, like the reference's division
        q1 = tl.math.div_rn(x1, safe[:, None])
    c0 = _e2m1_code(tl.minimum(tl.abs(q0), 6.0)) | ((x0.to(tl.int32, bitcast=True) >> 28) & 8)
    c1 = _e2m1_code(tl.minimum(tl.abs(q1), 6.0)) | ((x1.to(tl.int32, bitcast=True) >> 28) & 8)
    return c0 | (c1 << 4), sbyte


@triton.jit
def fp4_dequant(c, sb, E8M0: tl.constexpr):
    """Code bytes c [G, GROUP // 2] and scale bytes sb [G] (int32) -> the even and odd channels' float32 values."""
    if E8M0:
        scale = e8m0_value(sb)
    else:
        scale = e4m3_value(sb)
    return e2m1_value(c & 0xF) * scale[:, None], e2m1_value(c >> 4) * scale[:, None]


@triton.jit
def _quant_kernel(x_ptr, codes_ptr, scales_ptr, stride_x, stride_c, stride_s, M, NG,
                  BLOCK_G: tl.constexpr, GROUP: tl.constexpr, E8M0: tl.constexpr, ROWS: tl.constexpr):
    row, g, g_mask = row_groups(M, NG, BLOCK_G, ROWS)  # group g of row `row` (ROWS > 1: flattened pairs)
    j = tl.arange(0, GROUP // 2)
    byte = g[:, None] * (GROUP // 2) + j[None, :]  # [BLOCK_G, GROUP // 2]: byte i holds channels 2i, 2i + 1
    mask = g_mask[:, None]
    xrow = x_ptr + row_at(row, stride_x, ROWS)
    x0 = to_f32(tl.load(xrow + 2 * byte, mask=mask, other=0.0))
    x1 = to_f32(tl.load(xrow + 2 * byte + 1, mask=mask, other=0.0))
    code, sbyte = fp4_quant(x0, x1, E8M0)
    tl.store(codes_ptr + row_at(row, stride_c, ROWS) + byte, code.to(tl.uint8), mask=mask)
    tl.store(scales_ptr + row * stride_s + g, sbyte.to(tl.uint8), mask=g_mask)


@triton.jit
def _dequant_kernel(codes_ptr, scales_ptr, out_ptr, stride_c, stride_s, stride_o, M, NG,
                    BLOCK_G: tl.constexpr, GROUP: tl.constexpr, E8M0: tl.constexpr, FAST: tl.constexpr,
                    ROWS: tl.constexpr, src_ptr=None, GATHER: tl.constexpr = False):
    row, g, g_mask = row_groups(M, NG, BLOCK_G, ROWS)
    j = tl.arange(0, GROUP // 2)
    byte = g[:, None] * (GROUP // 2) + j[None, :]
    mask = g_mask[:, None]
    src = row
    if GATHER:  # output row i decodes cache row src[i] (row 0 where src[i] < 0)
        src = tl.maximum(tl.load(src_ptr + row, mask=row < M, other=0), 0)
    c = tl.load(codes_ptr + row_at(src, stride_c, ROWS) + byte, mask=mask, other=0)
    sb = tl.load(scales_ptr + src * stride_s + g, mask=g_mask, other=0).to(tl.int32)
    if FAST:  # the attention and indexer kernels' decoder, so the every-byte test holds it to the reference
        if E8M0:
            scale = e8m0_value(sb)
        else:
            scale = e4m3_value(sb)
        v0, v1 = fp4_bf16_pair(c, tl.broadcast_to(scale.to(tl.bfloat16)[:, None], c.shape))
    else:
        v0, v1 = fp4_dequant(c.to(tl.int32), sb, E8M0)
    dt = out_ptr.dtype.element_ty
    orow = out_ptr + row_at(row, stride_o, ROWS)
    tl.store(orow + 2 * byte, cast_rne(v0, dt), mask=mask)
    tl.store(orow + 2 * byte + 1, cast_rne(v1, dt), mask=mask)


def supports_quantize(x: torch.Tensor, fmt: str) -> bool:
    return fmt in GROUPS and x.dim() >= 1 and x.dtype in SUPPORTED_DTYPES and x.shape[-1] % GROUPS[fmt] == 0


def supports_dequantize(codes: torch.Tensor, scales, fmt: str, dtype: torch.dtype, rows=None) -> bool:
    """Whether dequantize takes these inputs; with ``rows``, gathering them (int64 [n] on the codes' device over
    codes [N > 0, C // 2])."""
    if fmt not in GROUPS or scales is None or dtype not in SUPPORTED_DTYPES:
        return False
    if codes.dtype != torch.uint8 or scales.dtype != torch.uint8 or codes.dim() < 1:
        return False
    C = 2 * codes.shape[-1]
    if C % GROUPS[fmt] or tuple(scales.shape) != (*codes.shape[:-1], C // GROUPS[fmt]):
        return False
    return rows is None or _rows_ok(codes, rows)


def _rows_ok(codes: torch.Tensor, rows) -> bool:
    """Whether dequantize can gather ``rows`` of codes: int64 [n] on its device, codes [N > 0, C // 2]."""
    return codes.dim() == 2 and torch.is_tensor(rows) and rows.dim() == 1 and rows.dtype == torch.int64 \
        and rows.device == codes.device and not (rows.numel() and not codes.shape[0])


def quantize(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., C] (bf16/fp16/fp32) -> (codes uint8 [..., C // 2], scales uint8 [..., C // G]) exactly as
    reference.lowbit.quantize(x, fmt) for finite x; fmt is "fp4_e2m1_e4m3" or "mxfp4"."""
    if fmt not in GROUPS:
        raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
    G = GROUPS[fmt]
    if x.dim() < 1 or x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"x must be a bf16/fp16/fp32 tensor [..., C], got {x.dtype} {tuple(x.shape)}")
    C = x.shape[-1]
    if C % G:
        raise ValueError(f"channel count C={C} must be a multiple of the {fmt} group size {G}")
    NG = C // G
    codes = torch.empty((*x.shape[:-1], C // 2), dtype=torch.uint8, device=x.device)
    scales = torch.empty((*x.shape[:-1], NG), dtype=torch.uint8, device=x.device)
    x2 = as_rows(x, C)
    M = x2.shape[0]
    if M == 0 or NG == 0:
        return codes, scales
    c2, s2 = codes.view(-1, C // 2), scales.view(-1, NG)
    grid, BG, R = row_launch(M, NG)
    _quant_kernel[grid](x2, c2, s2, x2.stride(0), c2.stride(0), s2.stride(0), M, NG,
                        BLOCK_G=BG, GROUP=G, E8M0=fmt == "mxfp4", ROWS=R,
                        num_warps=4 if BG >= 8 else 1)
    return codes, scales


def dequantize(codes: torch.Tensor, scales: torch.Tensor, fmt: str,
               dtype: torch.dtype = torch.float32, rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Inverse of quantize: codes uint8 [..., C // 2], scales uint8 [..., C // G] -> [..., C] in dtype,
    exactly as reference.lowbit.dequantize. ``rows`` (int64 [n]): only those rows of codes [N, C // 2] /
    scales [N, C // G], gathered in the same launch -> [n, C]; a negative row decodes row 0 (a slot table's
    padding, which the caller never reads)."""
    if not supports_dequantize(codes, scales, fmt, dtype):
        raise ValueError(f"codes must be uint8 [..., C // 2] and scales uint8 [..., C // G] of a format in "
                         f"{FORMATS}, dtype one of {SUPPORTED_DTYPES}; got fmt={fmt!r}, codes "
                         f"{codes.dtype} {tuple(codes.shape)}, scales {getattr(scales, 'dtype', None)} "
                         f"{tuple(getattr(scales, 'shape', ()))}, dtype {dtype}")
    if rows is not None and not _rows_ok(codes, rows):
        raise ValueError(f"rows must be int64 [n] on the codes' device over codes [N > 0, C // 2], got rows "
                         f"{getattr(rows, 'dtype', type(rows))} {tuple(getattr(rows, 'shape', ()))}, codes "
                         f"{tuple(codes.shape)}")
    G = GROUPS[fmt]
    C = 2 * codes.shape[-1]
    NG = C // G
    lead = tuple(codes.shape[:-1]) if rows is None else (rows.shape[0],)
    out = torch.empty((*lead, C), dtype=dtype, device=codes.device)
    c2, s2 = as_rows(codes, C // 2), as_rows(scales, NG)
    M = out.numel() // C if C else 0
    if M == 0 or NG == 0:
        return out
    o2 = out.view(-1, C)
    grid, BG, R = row_launch(M, NG)
    fast = fast_decode(dtype, BG * G // 2, 1)
    _dequant_kernel[grid](c2, s2, o2, c2.stride(0), s2.stride(0), o2.stride(0), M, NG,
                          BLOCK_G=BG, GROUP=G, E8M0=fmt == "mxfp4", FAST=fast, ROWS=R,
                          src_ptr=None if rows is None else rows.contiguous(), GATHER=rows is not None,
                          num_warps=1 if fast or BG < 8 else 4)
    return out

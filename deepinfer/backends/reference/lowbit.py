"""Low-bit KV-cache formats of the reference backend: real byte layouts, plain PyTorch, any device.

Each format turns x [..., C] into uint8 `codes` (and uint8 per-group `scales`) laid out exactly as
the engine stores them, so GPU kernels can be tested byte-for-byte against this module.

  fp4_e2m1_e4m3  codes [..., C//2]: two E2M1 nibbles per byte, low nibble = even channel.
                 scales [..., C//16]: float8_e4m3fn bits. scale = the smallest E4M3 value s with
                 6*s >= amax (amax/6 rounded UP, so the group max never clips), capped at 448.
                 No second-level (per-tensor) scale, so the usable range is limited: groups with
                 |x| > 6*448 = 2688 saturate to +-2688, and groups with amax < 6*2^-6 get a subnormal
                 E4M3 scale (absolute error still <= 2^-11, but coarser relative precision).
  mxfp4          codes as above; scales [..., C//32]: E8M0 (biased exponent, 127 = 2^0), following the
                 OCP MX spec: shared exponent = floor(log2(amax)) - 2, clamped to [-127, 127]; values
                 x / 2^e rounded to E2M1, saturating at +-6 (the spec's clipping of amax/2^e in (6, 8)).
  fp8_e4m3_pow2  codes [..., C]: float8_e4m3fn bits. scales [..., C//32]: E8M0 exponent of the
                 smallest power of two 2^k with amax / 2^k <= 448 (k clamped to [-127, 127]).
  bf16 / fp32    codes: the raw (native little-endian) bytes, [..., 2C] / [..., 4C]; scales None.

Rounding is round-to-nearest, ties to the even code (= even mantissa LSB), and is implemented here
from the bit definitions rather than with torch's float8 casts, so the oracle does not depend on
them (the tests cross-check against torch.float8_e4m3fn / float8_e8m0fnu). The fp4 quotient x/scale
is a correctly rounded float32 division (not a multiply by a reciprocal). An all-zero group gets
scale byte 0 (E4M3 zero, or E8M0 2^-127) and codes 0. The sign bit follows signbit(x), as torch's
and the hardware's float8 casts do, so -0.0 encodes as 0x8 / 0x80. Scaled formats reject inf/NaN
input (no scale can represent it).

Dequantisation is value x scale in float32 (exact: few-bit products), rounded once to the output dtype, for
every byte, including bytes quantize never writes (the GPU kernels must agree on all of them):
  - a scale byte that decodes to NaN (E4M3 0x7F / 0xFF, E8M0 0xFF) makes its whole group NaN, whatever the
    codes (0 x NaN is NaN). The NaN's sign and payload are unspecified: this module's float math returns the
    scale's quiet NaN, CUDA arithmetic the canonical 0x7FFFFFFF, and float32 -> bf16 conversions choose their
    own; tests compare NaN positions, not NaN bits (deepinfer.testing.kernels.assert_same_bits);
  - a product beyond the output dtype is inf with the code's sign, as IEEE round-to-nearest gives it (E8M0
    scales from 2^126 up in float32, from 2^14 in fp16, from 2^126 in bf16; E4M3 products, <= 6 x 448,
    never overflow);
  - everything else is bit-exact, -0.0 and subnormal results included (no flush to zero).
"""

from __future__ import annotations

from types import MappingProxyType

import torch

from ...device_consts import device_const
from ..base import to_device

FORMATS = ("fp4_e2m1_e4m3", "mxfp4", "fp8_e4m3_pow2", "bf16", "fp32")

# Channels per scale (1 = unscaled); read-only so it cannot turn into module state.
_GROUP = MappingProxyType({"fp4_e2m1_e4m3": 16, "mxfp4": 32, "fp8_e4m3_pow2": 32, "bf16": 1, "fp32": 1})
_RAW = MappingProxyType({"bf16": torch.bfloat16, "fp32": torch.float32})

_E2M1_POS = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitudes of codes 0..7
_E2M1_MAX = 6.0
_E4M3_MAX_CODE = 126  # 0x7E = 448; 0x7F is NaN


def _check_fmt(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")


def group_size(fmt: str) -> int:
    """Channels that share one scale in ``fmt`` (1: raw formats); a row's channel count must be a multiple."""
    return _GROUP[fmt]


def _check_channels(C: int, fmt: str) -> None:
    g = _GROUP[fmt]
    if C < 0 or C % g != 0:
        raise ValueError(f"channel count C={C} must be a multiple of the {fmt} group size {g}")


def e2m1_values() -> torch.Tensor:
    """The 16 E2M1 code values in code order (bit 3 = sign, so code 8 is -0.0): [16] float32."""
    pos = torch.tensor(_E2M1_POS, dtype=torch.float32)
    return torch.cat([pos, -pos])


def _e2m1_grid(device) -> torch.Tensor:
    """_E2M1_POS on ``device``, built there (torch.tensor(list, device=cuda) would block the host); kept."""
    return device_const("e2m1_grid", device, lambda d: to_device(_E2M1_POS, torch.float32, d))


def _e4m3_table(device) -> torch.Tensor:
    """Magnitudes of float8_e4m3fn codes 0..126 (bias 7, no inf; 127 is NaN): [127] float32, ascending."""
    code = torch.arange(_E4M3_MAX_CODE + 1, device=device)
    e, m = code >> 3, (code & 7).float()
    sub = m * 2.0**-9  # e == 0: subnormal, m/8 * 2^-6
    norm = (1 + m / 8) * torch.pow(2.0, (e - 7).float())
    return torch.where(e == 0, sub, norm)


def _e4m3_positive(device) -> torch.Tensor:
    """_e4m3_table on ``device``, built once there (device_const); read only."""
    return device_const("e4m3_positive", device, _e4m3_table)


def _e4m3_decode(bits: torch.Tensor) -> torch.Tensor:
    """uint8 float8_e4m3fn bits [...] -> float32 [...] (0x7F / 0xFF -> NaN)."""
    b = bits.long()
    table = device_const("e4m3_codes", bits.device, lambda d: torch.cat([
        _e4m3_positive(d), torch.full((1,), float("nan"), device=d)]))  # [128]: code 127 is NaN
    mag = table[b & 0x7F]
    return torch.where((b & 0x80) != 0, -mag, mag)


def _e8m0_decode(bits: torch.Tensor) -> torch.Tensor:
    """uint8 E8M0 biased exponents [...] -> exact float32 2^(b-127) [...] (byte 0 is the subnormal 2^-127)."""
    b = bits.to(torch.int32)
    # Build the float32 bit pattern directly so the power of two is exact; 255 (NaN) -> 0x7F800000 is inf,
    # so map it to a quiet NaN pattern instead.
    pattern = torch.where(b == 0, torch.full_like(b, 0x00400000), b << 23)
    pattern = torch.where(b == 255, torch.full_like(b, 0x7FC00000), pattern)
    return pattern.view(torch.float32)


def _round_to_grid(a: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """Nearest code for magnitudes a [...] on an ascending grid [N], ties to the even code,
    saturating at the last code. -> int64 codes [...]."""
    mids = (grid[:-1] + grid[1:]) / 2  # exact in float32 for both grids used here
    lo = torch.searchsorted(mids, a, right=False)  # mids strictly below a
    hi = torch.searchsorted(mids, a, right=True)  # mids at or below a; hi == lo + 1 only on a tie
    return torch.where((hi != lo) & (lo % 2 == 1), hi, lo)


def _encode_signed(q: torch.Tensor, grid: torch.Tensor, sign_bit: int) -> torch.Tensor:
    """float32 q [...] -> int64 sign|magnitude codes [...]. The sign bit follows signbit(q), so -0.0
    keeps it, as the hardware float8 / fp4 conversions do."""
    code = _round_to_grid(q.abs(), grid)
    return torch.where(torch.signbit(q), code | sign_bit, code)


def _e4m3_encode(q: torch.Tensor) -> torch.Tensor:
    """float32 q [...] -> uint8 float8_e4m3fn bits [...], RNE, saturating at +-448."""
    return _encode_signed(q, _e4m3_positive(q.device), 0x80).to(torch.uint8)


def _grouped_amax(xf: torch.Tensor, g: int) -> tuple[torch.Tensor, torch.Tensor]:
    """xf [..., C] float32 -> (xg [..., C//g, g], amax [..., C//g])."""
    xg = xf.reshape(*xf.shape[:-1], xf.shape[-1] // g, g)
    return xg, xg.abs().amax(dim=-1)


def _pack_nibbles(code: torch.Tensor) -> torch.Tensor:
    """int64 codes [..., C] in 0..15 -> uint8 [..., C//2], even channel in the low nibble."""
    pairs = code.reshape(*code.shape[:-1], code.shape[-1] // 2, 2)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8)


def _unpack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [..., C//2] -> int64 codes [..., C]."""
    c = codes.long()
    return torch.stack([c & 0xF, c >> 4], dim=-1).reshape(*c.shape[:-1], c.shape[-1] * 2)


def _quantize_fp4_e4m3(xf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    xg, amax = _grouped_amax(xf, 16)  # [..., G, 16], [..., G]
    grid = _e4m3_positive(xf.device)
    # Round UP onto the E4M3 grid: the first value s with 6*s >= amax, capped at 448. Comparing
    # against 6*s (exact in float32) rather than rounding amax/6 keeps this exact, even for amax
    # near float32's subnormal floor, where amax/6 would underflow to 0.
    sbits = torch.searchsorted(grid * _E2M1_MAX, amax, right=False).clamp(max=_E4M3_MAX_CODE)
    scale = grid[sbits]  # [..., G]; 0 only for an all-zero group
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (xg / safe[..., None]).clamp(-_E2M1_MAX, _E2M1_MAX)  # [..., G, 16]
    code = _encode_signed(q, _e2m1_grid(xf.device), 0x8)
    return _pack_nibbles(code.reshape(xf.shape)), sbits.to(torch.uint8)


def _quantize_mxfp4(xf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    xg, amax = _grouped_amax(xf, 32)
    _, E = torch.frexp(amax)  # amax = m * 2^E, m in [0.5, 1): floor(log2(amax)) = E - 1, exact for subnormals
    e = (E - 1 - 2).clamp(-127, 127)  # OCP MX: minus emax of E2M1 (2)
    sbits = torch.where(amax > 0, e + 127, torch.zeros_like(e)).to(torch.uint8)
    q = (xg / _e8m0_decode(sbits)[..., None]).clamp(-_E2M1_MAX, _E2M1_MAX)  # exact: power-of-two divide
    code = _encode_signed(q, _e2m1_grid(xf.device), 0x8)
    return _pack_nibbles(code.reshape(xf.shape)), sbits


def _quantize_fp8_pow2(xf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    xg, amax = _grouped_amax(xf, 32)
    m, E = torch.frexp(amax)
    # amax = m * 2^E; amax / 2^k <= 448 = 0.875 * 2^9 first holds at k = E-9 if m <= 0.875, else E-8.
    k = torch.where(m <= 0.875, E - 9, E - 8).clamp(-127, 127)
    sbits = torch.where(amax > 0, k + 127, torch.zeros_like(k)).to(torch.uint8)
    q = xg / _e8m0_decode(sbits)[..., None]  # |q| <= 448 by construction
    return _e4m3_encode(q).reshape(xf.shape), sbits


def quantize(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [..., C] (any float dtype) -> (codes uint8, scales uint8 or None) in `fmt`'s storage layout."""
    _check_fmt(fmt)
    if not torch.is_tensor(x) or not x.is_floating_point():
        raise ValueError(f"x must be a floating-point tensor, got {type(x).__name__} "
                         f"{getattr(x, 'dtype', '')}".rstrip())
    if x.dim() < 1:
        raise ValueError("x must have at least one dimension (the channel dim C), got a 0-d tensor")
    _check_channels(x.shape[-1], fmt)
    if fmt in _RAW:
        # Cast straight from x's dtype (no float32 detour, which could double-round from float64).
        return x.to(_RAW[fmt]).contiguous().view(torch.uint8), None
    xf = x.to(torch.float32)
    if not bool(torch.isfinite(xf).all()):
        raise ValueError(f"x must be finite (in float32) for the scaled format {fmt!r}; it has inf or NaN")
    if fmt == "fp4_e2m1_e4m3":
        return _quantize_fp4_e4m3(xf)
    if fmt == "mxfp4":
        return _quantize_mxfp4(xf)
    return _quantize_fp8_pow2(xf)


def _check_codes(codes, scales, fmt) -> int:
    """Validate dtypes and shapes; return the channel count C."""
    if not torch.is_tensor(codes) or codes.dtype != torch.uint8 or codes.dim() < 1:
        raise ValueError(f"codes must be a uint8 tensor [..., bytes], got {getattr(codes, 'dtype', type(codes))}")
    nbytes = codes.shape[-1]
    if fmt in _RAW:
        if scales is not None:
            raise ValueError(f"scales must be None for {fmt!r}")
        width = 2 if fmt == "bf16" else 4
        if nbytes % width:
            raise ValueError(f"codes' last dim {nbytes} must be a multiple of {width} for {fmt!r}")
        return nbytes // width
    C = nbytes * 2 if fmt in ("fp4_e2m1_e4m3", "mxfp4") else nbytes
    _check_channels(C, fmt)
    want = (*codes.shape[:-1], C // _GROUP[fmt])
    if not torch.is_tensor(scales) or scales.dtype != torch.uint8 or tuple(scales.shape) != want:
        raise ValueError(f"scales must be uint8 of shape {want} for {fmt!r} codes of shape "
                         f"{tuple(codes.shape)}, got {getattr(scales, 'dtype', None)} "
                         f"{tuple(getattr(scales, 'shape', ()))}")
    return C


def dequantize(codes: torch.Tensor, scales: torch.Tensor | None, fmt: str,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of `quantize`: (codes, scales) -> x [..., C] in `dtype` (computed in float32)."""
    _check_fmt(fmt)
    C = _check_codes(codes, scales, fmt)
    if fmt in _RAW:
        return codes.contiguous().view(_RAW[fmt]).to(dtype)
    lead, g = codes.shape[:-1], _GROUP[fmt]
    if fmt == "fp8_e4m3_pow2":
        vals, scale = _e4m3_decode(codes), _e8m0_decode(scales)
    else:
        vals = device_const("e2m1_values", codes.device, lambda d: e2m1_values().to(d))[_unpack_nibbles(codes)]
        scale = _e4m3_decode(scales) if fmt == "fp4_e2m1_e4m3" else _e8m0_decode(scales)
    out = vals.reshape(*lead, C // g, g) * scale[..., None]  # [..., G, g]; exact (few-bit products)
    return out.reshape(*lead, C).to(dtype)


def fake_quantize(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """dequantize(quantize(x, fmt)) in x.dtype: [..., C] -> [..., C]. Identity for fmt='fp32' on
    float32 input; plain RNE bf16 rounding for fmt='bf16'."""
    codes, scales = quantize(x, fmt)
    return dequantize(codes, scales, fmt, dtype=x.dtype)


def bytes_per_token(fmt: str, channels: int) -> int:
    """Stored bytes (codes + scales) of one vector of `channels` channels in `fmt`."""
    _check_fmt(fmt)
    if isinstance(channels, bool) or not isinstance(channels, int):
        raise ValueError(f"channels must be an int, got {channels!r}")
    _check_channels(channels, fmt)
    if fmt in _RAW:
        return channels * (2 if fmt == "bf16" else 4)
    code_bytes = channels // 2 if fmt in ("fp4_e2m1_e4m3", "mxfp4") else channels
    return code_bytes + channels // _GROUP[fmt]

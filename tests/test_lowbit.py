"""Tests of the low-bit KV-cache formats: byte layouts on hand-made examples, scale choice, rounding
(ties to even, saturation), sound round-trip error bounds over random shapes and magnitudes,
idempotence, and cross-checks against torch's own float8 dtypes."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from deepinfer.backends.reference import lowbit
from deepinfer.backends.reference.lowbit import (
    FORMATS, bytes_per_token, dequantize, e2m1_values, fake_quantize, quantize,
)

FAST = settings(max_examples=60, deadline=None)
GROUP = {"fp4_e2m1_e4m3": 16, "mxfp4": 32, "fp8_e4m3_pow2": 32, "bf16": 1, "fp32": 1}
SCALED = ("fp4_e2m1_e4m3", "mxfp4", "fp8_e4m3_pow2")
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
U = 2.0**-9  # smallest E4M3 subnormal
HAS_E4M3 = hasattr(torch, "float8_e4m3fn")
HAS_E8M0 = hasattr(torch, "float8_e8m0fnu")


def e4m3_grid() -> list[float]:
    """All non-negative finite E4M3 values, ascending, from the bit definition (independent of lowbit)."""
    vals = []
    for code in range(127):
        e, m = code >> 3, code & 7
        vals.append(m / 8 * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return vals


def groups(t: torch.Tensor, g: int) -> torch.Tensor:
    return t.reshape(*t.shape[:-1], t.shape[-1] // g, g)


# ---------------------------------------------------------------- value generators


@st.composite
def tensors(draw, g: int):
    """x [*lead, G*g] float32 with mixed magnitudes: tiny (subnormal) to huge, zeros, both signs."""
    lead = draw(st.lists(st.integers(1, 3), max_size=2))
    G = draw(st.integers(1, 4))
    shape = (*lead, G * g)
    if draw(st.booleans()):  # adversarial individual floats from hypothesis
        n = math.prod(shape)
        bound = draw(st.sampled_from([2.0**-133, 2.0**-10, 1.0, 2.0**14, 2.0**127]))
        vals = draw(st.lists(st.floats(-bound, bound, width=32, allow_subnormal=True), min_size=n, max_size=n))
        return torch.tensor(vals, dtype=torch.float32).reshape(shape)
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    base = draw(st.integers(-150, 126))  # group magnitude ~ 2^base
    spread = draw(st.integers(0, 40))  # mixed magnitudes inside a group
    mant = torch.rand(shape, generator=gen, dtype=torch.float64) * 4 - 2  # (-2, 2)
    exps = base - torch.randint(0, spread + 1, shape, generator=gen)
    x = mant * torch.pow(2.0, exps.double())
    zero_frac = draw(st.sampled_from([0.0, 0.0, 0.3, 1.0]))
    x = torch.where(torch.rand(shape, generator=gen, dtype=torch.float64) < zero_frac, 0.0, x)
    return x.float()


# ---------------------------------------------------------------- code tables and torch cross-checks


def test_e2m1_values_in_code_order():
    v = e2m1_values()
    assert v.dtype == torch.float32 and v.shape == (16,)
    assert v.tolist() == E2M1 + [-a for a in E2M1]
    assert math.copysign(1.0, v[8].item()) == -1.0  # code 8 is -0
    v[0] = 99.0  # a fresh tensor each call: no shared state to corrupt
    assert e2m1_values()[0].item() == 0.0


@pytest.mark.skipif(not HAS_E4M3, reason="torch has no float8_e4m3fn")
def test_e4m3_decode_matches_torch_float8():
    bits = torch.arange(256, dtype=torch.uint8)
    ref = bits.view(torch.float8_e4m3fn).float()
    ours = lowbit._e4m3_decode(bits)
    assert torch.equal(ref.isnan(), ours.isnan())
    assert torch.equal(ref[~ref.isnan()], ours[~ours.isnan()])
    assert ours[:127].tolist() == e4m3_grid()


@pytest.mark.skipif(not HAS_E4M3, reason="torch has no float8_e4m3fn")
@FAST
@given(seed=st.integers(0, 2**31 - 1))
def test_e4m3_encode_matches_torch_cast_incl_ties(seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2000, generator=gen) * torch.pow(2.0, torch.randint(-16, 9, (2000,), generator=gen).float())
    grid = torch.tensor(e4m3_grid())
    mids = (grid[:-1] + grid[1:]) / 2
    x = torch.cat([x.clamp(-448, 448), mids, -mids, grid, -grid])
    assert torch.equal(lowbit._e4m3_encode(x), x.to(torch.float8_e4m3fn).view(torch.uint8))


@pytest.mark.skipif(not HAS_E8M0, reason="torch has no float8_e8m0fnu")
def test_e8m0_decode_matches_torch_float8():
    bits = torch.arange(255, dtype=torch.uint8)  # 255 is NaN
    assert torch.equal(lowbit._e8m0_decode(bits), bits.view(torch.float8_e8m0fnu).float())
    assert lowbit._e8m0_decode(torch.tensor([255], dtype=torch.uint8)).isnan().all()


@pytest.mark.parametrize("fmt", SCALED)
def test_dequantize_nan_scales_and_overflow(fmt):
    """The bytes quantize never writes, as the module docstring defines them: a NaN scale byte makes its whole
    group NaN (zero codes too), a product beyond the output dtype is inf with the code's sign."""
    g = GROUP[fmt]
    C = 2 * g
    nbytes = C if fmt == "fp8_e4m3_pow2" else C // 2
    codes = torch.randint(0, 256, (2, nbytes), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    if fmt == "fp8_e4m3_pow2":
        codes = torch.where(codes & 0x7F == 0x7F, codes - 1, codes)  # finite E4M3 codes only
    nan_byte = 0x7F if fmt == "fp4_e2m1_e4m3" else 0xFF
    scales = torch.tensor([[nan_byte, 0], [0, 0]], dtype=torch.uint8)
    out = dequantize(codes, scales, fmt)
    assert out[0, :g].isnan().all() and not out[0, g:].isnan().any() and not out[1].isnan().any()
    if fmt != "fp4_e2m1_e4m3":  # E8M0 2^127: every code of magnitude >= 2 overflows float32, keeping its sign
        big = dequantize(codes, torch.full((2, 2), 254, dtype=torch.uint8), fmt)
        ref = dequantize(codes, torch.full((2, 2), 127, dtype=torch.uint8), fmt).double() * 2.0**127
        assert torch.equal(big.isinf(), ref.abs() > torch.finfo(torch.float32).max)
        assert big.isinf().any() and torch.equal(big[big.isinf()].sign(), ref[big.isinf()].sign().float())


# ---------------------------------------------------------------- byte layout on hand-made examples


HAND = [0.5, -6.0, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -0.0]
HAND_BYTES = [0xF1, 0x32, 0x54, 0x76, 0x90, 0xBA, 0xDC, 0x8E]  # low nibble = even channel; -0.0 keeps its sign


def test_fp4_e4m3_hand_example():
    codes, scales = quantize(torch.tensor(HAND), "fp4_e2m1_e4m3")  # amax 6 -> scale exactly 1.0
    assert codes.tolist() == HAND_BYTES
    assert scales.tolist() == [0x38]  # E4M3 1.0 = exponent 7 (bias 7), mantissa 0
    y = dequantize(codes, scales, "fp4_e2m1_e4m3")
    assert y.tolist() == HAND and torch.equal(y.signbit(), torch.tensor(HAND).signbit())
    # doubling the input doubles only the scale byte's exponent: 2.0 = 0x40
    c2, s2 = quantize(torch.tensor(HAND) * 2, "fp4_e2m1_e4m3")
    assert c2.tolist() == HAND_BYTES and s2.tolist() == [0x40]


def test_mxfp4_hand_example():
    x = torch.tensor(HAND * 2)  # amax 6: floor(log2 6) - 2 = 0 -> biased 127
    codes, scales = quantize(x, "mxfp4")
    assert codes.tolist() == HAND_BYTES * 2 and scales.tolist() == [127]
    c4, s4 = quantize(x / 4, "mxfp4")
    assert c4.tolist() == HAND_BYTES * 2 and s4.tolist() == [125]


def test_fp8_hand_example():
    x = torch.zeros(32)
    x[:5] = torch.tensor([1.0, -2.0, 448.0, 0.5 * 2.0**-6, -0.0])
    codes, scales = quantize(x, "fp8_e4m3_pow2")  # amax 448 -> 2^0
    assert scales.tolist() == [127]
    assert codes[:5].tolist() == [0x38, 0xC0, 0x7E, 0x04, 0x80]
    codes, scales = quantize(x * 8, "fp8_e4m3_pow2")  # amax 3584 -> 2^3 -> biased 130
    assert scales.tolist() == [130] and codes[:5].tolist() == [0x38, 0xC0, 0x7E, 0x04, 0x80]


def test_raw_formats_are_native_bytes():
    x = torch.tensor([[1.0, -2.5, 3e-3, 7e30]])
    codes, scales = quantize(x, "bf16")
    assert scales is None and codes.shape == (1, 8)
    assert torch.equal(codes.view(torch.bfloat16), x.to(torch.bfloat16))
    assert codes[0, :2].tolist() == [0x80, 0x3F]  # 1.0 = 0x3F80, little-endian
    codes, scales = quantize(x, "fp32")
    assert scales is None and codes.shape == (1, 16) and torch.equal(codes.view(torch.float32), x)


# ---------------------------------------------------------------- shapes, dtypes, bytes per token


@FAST
@given(fmt=st.sampled_from(FORMATS), lead=st.lists(st.integers(0, 3), max_size=3), G=st.integers(0, 4),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64]))
def test_shapes_dtypes_and_bytes_per_token(fmt, lead, G, dtype):
    C = G * 32
    x = torch.randn(*lead, C).to(dtype)
    codes, scales = quantize(x, fmt)
    code_width = {"fp4_e2m1_e4m3": C // 2, "mxfp4": C // 2, "fp8_e4m3_pow2": C, "bf16": 2 * C, "fp32": 4 * C}[fmt]
    assert codes.dtype == torch.uint8 and codes.shape == (*lead, code_width)
    if fmt in SCALED:
        assert scales.dtype == torch.uint8 and scales.shape == (*lead, C // GROUP[fmt])
    else:
        assert scales is None
    n_scale = 0 if scales is None else scales.shape[-1]
    assert bytes_per_token(fmt, C) == codes.shape[-1] + n_scale
    y = dequantize(codes, scales, fmt, dtype=dtype)
    assert y.shape == x.shape and y.dtype == dtype
    assert fake_quantize(x, fmt).dtype == dtype


def test_bytes_per_token_values():
    assert bytes_per_token("fp4_e2m1_e4m3", 512) == 256 + 32
    assert bytes_per_token("mxfp4", 128) == 64 + 4
    assert bytes_per_token("fp8_e4m3_pow2", 512) == 512 + 16
    assert bytes_per_token("bf16", 576) == 1152 and bytes_per_token("fp32", 3) == 12


# ---------------------------------------------------------------- rounding: ties, saturation, zeros


def test_e2m1_ties_round_to_even():
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    want = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]  # the neighbour with the even code (mantissa bit 0)
    x = torch.tensor([6.0] + ties + [-t for t in ties] + [0.0])  # the 6 pins the scale to 1
    for fmt, reps in (("fp4_e2m1_e4m3", 1), ("mxfp4", 2)):
        y = fake_quantize(x.repeat(reps), fmt)[:16]
        assert y.tolist() == [6.0] + want + [-w for w in want] + [0.0], fmt
    # just off the ties, nearest wins
    off = torch.tensor([6.0, 0.2501, 0.7499, 2.5001, 4.999] + [0.0] * 11)
    assert fake_quantize(off, "fp4_e2m1_e4m3")[:5].tolist() == [6.0, 0.5, 0.5, 3.0, 4.0]


def test_saturation():
    # mxfp4: amax / 2^e lands in [4, 8); (6, 8) clips to 6
    x = torch.zeros(32)
    x[:4] = torch.tensor([7.9, -7.0, 6.5, 5.5])
    codes, scales = quantize(x, "mxfp4")
    assert scales.tolist() == [127]
    assert dequantize(codes, scales, "mxfp4")[:4].tolist() == [6.0, -6.0, 6.0, 6.0]
    # fp4_e2m1_e4m3: the E4M3 scale caps at 448, so values beyond 6 * 448 = 2688 clip
    x = torch.zeros(16)
    x[:3] = torch.tensor([1e30, -5000.0, 100.0])
    codes, scales = quantize(x, "fp4_e2m1_e4m3")
    assert scales.tolist() == [0x7E]
    assert dequantize(codes, scales, "fp4_e2m1_e4m3")[:3].tolist() == [2688.0, -2688.0, 0.0]
    # fp8: the pow2 scale follows amax up to the float32 limit, so nothing clips
    x = torch.zeros(32)
    x[:2] = torch.tensor([3e38, -1e38])
    y = fake_quantize(x, "fp8_e4m3_pow2")
    assert ((y[:2] - x[:2]).abs() <= x[:2].abs() * 2.0**-4).all()


@pytest.mark.parametrize("fmt", SCALED)
def test_zero_groups(fmt):
    g = GROUP[fmt]
    x = torch.zeros(3, 2 * g)
    x[0, 0] = 6.0  # only the first group of row 0 is non-zero (exact in every format)
    x[1, :g] = -0.0
    codes, scales = quantize(x, fmt)
    assert scales[0, 1].item() == 0 and scales[1:].eq(0).all()  # E4M3 zero / E8M0 byte 0 (2^-127)
    per_group = groups(codes, codes.shape[-1] // 2)
    assert per_group[0, 1].eq(0).all() and per_group[2].eq(0).all()
    assert per_group[1, 0].eq(0x88 if fmt != "fp8_e4m3_pow2" else 0x80).all()  # -0.0 keeps its sign
    y = dequantize(codes, scales, fmt)
    assert torch.equal(y, x) and torch.equal(y.signbit(), x.signbit())


def test_tiny_fp4_group_rounds_scale_up_to_smallest_subnormal():
    x = torch.zeros(16)
    x[0], x[1] = 1e-30, -0.3 * U
    codes, scales = quantize(x, "fp4_e2m1_e4m3")
    assert scales.tolist() == [1]  # 2^-9, not 0: the scale never rounds down below amax/6
    assert dequantize(codes, scales, "fp4_e2m1_e4m3")[:2].tolist() == [0.0, -0.5 * U]


# ---------------------------------------------------------------- exact grid values round-trip


@FAST
@given(seed=st.integers(0, 2**31 - 1), scale_code=st.integers(1, 126))
def test_fp4_e4m3_grid_values_round_trip(seed, scale_code):
    gen = torch.Generator().manual_seed(seed)
    s = e4m3_grid()[scale_code]
    want = torch.randint(0, 16, (2, 32), generator=gen)
    want[:, ::16] = 7  # a 6 per group pins the scale to s
    x = e2m1_values()[want] * s
    codes, scales = quantize(x, "fp4_e2m1_e4m3")
    assert scales.eq(scale_code).all()
    assert torch.equal(lowbit._unpack_nibbles(codes), want)  # incl. -0 (code 8)
    assert torch.equal(dequantize(codes, scales, "fp4_e2m1_e4m3"), x)


@FAST
@given(seed=st.integers(0, 2**31 - 1), e=st.integers(-124, 125), top=st.sampled_from([6, 7]))
def test_mxfp4_grid_values_round_trip(seed, e, top):
    gen = torch.Generator().manual_seed(seed)
    want = torch.randint(0, 16, (3, 32), generator=gen)
    want[:, 0] = top  # 4 or 6 -> floor(log2) - 2 == 0
    x = (e2m1_values()[want].double() * 2.0**e).float()  # e >= -124: 0.5 * 2^e stays >= 2^-149
    codes, scales = quantize(x, "mxfp4")
    assert scales.eq(e + 127).all()
    assert torch.equal(lowbit._unpack_nibbles(codes), want)
    assert torch.equal(dequantize(codes, scales, "mxfp4"), x)


@FAST
@given(seed=st.integers(0, 2**31 - 1), k=st.integers(-117, 119))
def test_fp8_grid_values_round_trip(seed, k):
    gen = torch.Generator().manual_seed(seed)
    want = torch.randint(0, 256, (2, 32), generator=gen)
    want[(want & 0x7F) == 0x7F] = 0  # no NaN
    want[:, 0] = 0x7E  # a 448 pins the exponent to k
    x = (lowbit._e4m3_decode(want.to(torch.uint8)).double() * 2.0**k).float()  # exact, finite for this k
    codes, scales = quantize(x, "fp8_e4m3_pow2")
    assert scales.eq(k + 127).all() and torch.equal(codes.long(), want)
    assert torch.equal(dequantize(codes, scales, "fp8_e4m3_pow2"), x)


# ---------------------------------------------------------------- scale choice and error bounds


def check_fp4_e4m3(x: torch.Tensor):
    codes, scales = quantize(x, "fp4_e2m1_e4m3")
    y = dequantize(codes, scales, "fp4_e2m1_e4m3").double()
    grid = e4m3_grid()
    amax = groups(x, 16).abs().amax(-1)
    sc = torch.tensor([grid[b] for b in scales.flatten().tolist()], dtype=torch.float64).reshape(scales.shape)
    for a, b, s in zip(amax.flatten().tolist(), scales.flatten().tolist(), sc.flatten().tolist()):
        if a == 0:
            assert b == 0
        else:  # smallest E4M3 value s with 6 * s >= amax (exact in float64), capped at 448
            assert 6 * grid[b - 1] < a
            if b < 126:
                assert 6 * s >= a
                # one E4M3 step up at most: relative 2^-3 when normal, absolute 2^-9 when subnormal
                assert s <= max(a / 6 * 9 / 8, a / 6 + U)
    xd, s = groups(x.double(), 16), sc[..., None]
    yd, err = groups(y, 16), (groups(x.double(), 16) - groups(y, 16)).abs()
    clipped = xd.abs() > 6 * s
    assert (~clipped | (s == 448)).all()
    assert torch.equal(yd[clipped], torch.sign(xd[clipped]) * 2688)
    # half an E2M1 step at |x|/scale: 0.25 below 2, |x|/4 above (0.5 in [2, 4), 1 in [4, 6])
    bound = torch.maximum(0.25 * s, xd.abs() / 4) * (1 + 1e-6)
    assert (err[~clipped] <= bound.expand_as(err)[~clipped]).all()
    # the same bound from amax alone (scale rounding folded in), while the scale is not capped
    t = amax.double()[..., None] / 6
    s_amax = torch.clamp(torch.maximum(t * 9 / 8, t + U), max=448)
    bound_amax = torch.maximum(0.25 * s_amax, xd.abs() / 4) * (1 + 1e-6)
    assert (err[~clipped] <= bound_amax.expand_as(err)[~clipped]).all()


def check_mxfp4(x: torch.Tensor):
    codes, scales = quantize(x, "mxfp4")
    y = dequantize(codes, scales, "mxfp4").double()
    amax = groups(x, 32).abs().amax(-1)
    for a, b in zip(amax.flatten().tolist(), scales.flatten().tolist()):
        want = 0 if a == 0 else min(max(math.frexp(a)[1] - 1 - 2 + 127, 0), 254)
        assert b == want, (a, b, want)
    s = torch.pow(2.0, scales.double() - 127)[..., None]
    xd, yd = groups(x.double(), 32), groups(y, 32)
    err = (xd - yd).abs()
    assert (yd.abs() <= 6 * s).all()
    assert (err <= torch.maximum(0.25 * s, xd.abs() / 4) * (1 + 1e-6)).all()


def check_fp8(x: torch.Tensor):
    codes, scales = quantize(x, "fp8_e4m3_pow2")
    y = dequantize(codes, scales, "fp8_e4m3_pow2").double()
    s = torch.pow(2.0, scales.double() - 127)
    amax = groups(x, 32).abs().amax(-1).double()
    assert (amax / s <= 448).all()
    assert ((scales == 0) | (amax / (s / 2) > 448)).all()  # smallest such power of two
    s = s[..., None]
    xd, yd = groups(x.double(), 32), groups(y, 32)
    err = (xd - yd).abs()
    normal = xd.abs() / s >= 2.0**-6
    assert (err[normal] <= xd.abs()[normal] * 2.0**-4 * (1 + 1e-6)).all()
    assert (err <= torch.maximum(xd.abs() * 2.0**-4, 2.0**-10 * s) * (1 + 1e-6)).all()  # subnormals: half of 2^-9


@FAST
@given(x=tensors(16))
def test_fp4_e4m3_error_bound(x):
    check_fp4_e4m3(x)


@FAST
@given(x=tensors(32))
def test_mxfp4_error_bound(x):
    check_mxfp4(x)


@FAST
@given(x=tensors(32))
def test_fp8_error_bound(x):
    check_fp8(x)


@FAST
@given(x=tensors(32))
def test_raw_formats(x):
    assert torch.equal(fake_quantize(x, "fp32"), x)
    assert torch.equal(fake_quantize(x, "bf16"), x.to(torch.bfloat16).float())
    xb = x.to(torch.bfloat16)
    assert torch.equal(fake_quantize(xb, "bf16"), xb)


@pytest.mark.skipif(not HAS_E4M3, reason="torch has no float8_e4m3fn")
@FAST
@given(x=tensors(32))
def test_float8_path_scales_and_codes_view_back(x):
    # fp4 scales are float8_e4m3fn bits of the smallest E4M3 value s with 6*s >= amax (capped at 448)
    _, scales = quantize(x, "fp4_e2m1_e4m3")
    s = scales.view(torch.float8_e4m3fn).float()
    table = torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    amax = groups(x, 16).abs().amax(-1, keepdim=True)
    want = torch.where(table * 6 >= amax, table, torch.tensor(448.0)).amin(-1)
    assert torch.equal(s, want)
    # fp8 codes are exactly torch's own cast of x / 2^k
    codes, scales = quantize(x, "fp8_e4m3_pow2")
    if HAS_E8M0:
        k = scales.view(torch.float8_e8m0fnu).float()
        assert torch.equal(k, torch.pow(2.0, scales.double() - 127).float())
    q = (groups(x, 32).double() / torch.pow(2.0, scales.double() - 127)[..., None]).float()
    assert torch.equal(codes, q.to(torch.float8_e4m3fn).view(torch.uint8).reshape(codes.shape))


# ---------------------------------------------------------------- idempotence


@FAST
@given(fmt=st.sampled_from(FORMATS), x=tensors(32))
def test_fake_quantize_idempotent(fmt, x):
    y = fake_quantize(x, fmt)
    z = fake_quantize(y, fmt)
    if fmt == "fp4_e2m1_e4m3":
        # holds while the scale is a normal E4M3 (amax >= 6 * 2^-6) or the group is zero
        amax = groups(x, 16).abs().amax(-1, keepdim=True)
        ok = ((amax == 0) | (amax >= 6 * 2.0**-6)).expand(*amax.shape[:-1], 16)
        assert torch.equal(groups(z, 16)[ok], groups(y, 16)[ok])
    else:
        assert torch.equal(z, y)


def test_fp4_e4m3_tiny_group_not_idempotent():
    # Documented limit: with a subnormal E4M3 scale (3 * 2^-9 here) the re-quantized group's max
    # can pick a smaller scale (2 * 2^-9) on which 1.5 * 2^-9 is no longer a grid point.
    x = torch.zeros(16)
    x[0], x[1] = 13.5 * U, 1.5 * U
    y = fake_quantize(x, "fp4_e2m1_e4m3")
    assert y[:2].tolist() == [12 * U, 1.5 * U]
    assert fake_quantize(y, "fp4_e2m1_e4m3")[:2].tolist() == [12 * U, 2 * U]


def test_fake_quantize_keeps_low_precision_dtypes():
    x = torch.randn(4, 64)
    for dtype in (torch.bfloat16, torch.float16):
        for fmt in SCALED:
            xl = x.to(dtype)
            y = fake_quantize(xl, fmt)
            assert y.dtype == dtype
            assert torch.equal(y, fake_quantize(xl.float(), fmt).to(dtype))


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize("fmt", SCALED)
def test_bad_channel_count_names_c_and_group(fmt):
    g = GROUP[fmt]
    with pytest.raises(ValueError, match=rf"C={g + 2}.*{fmt}.*{g}"):
        quantize(torch.zeros(2, g + 2), fmt)
    with pytest.raises(ValueError, match=rf"C={g // 2}"):
        bytes_per_token(fmt, g // 2)


def test_unknown_fmt_is_named():
    for call in (lambda: quantize(torch.zeros(32), "int4"),
                 lambda: dequantize(torch.zeros(16, dtype=torch.uint8), None, "int4"),
                 lambda: fake_quantize(torch.zeros(32), "int4"),
                 lambda: bytes_per_token("int4", 32)):
        with pytest.raises(ValueError, match="fmt.*'int4'"):
            call()


def test_other_bad_arguments():
    with pytest.raises(ValueError, match="finite"):
        quantize(torch.tensor([1.0, float("inf")] + [0.0] * 14), "fp4_e2m1_e4m3")
    with pytest.raises(ValueError, match="finite"):
        quantize(torch.full((32,), float("nan")), "mxfp4")
    with pytest.raises(ValueError, match="finite"):  # float64 beyond float32's range
        quantize(torch.full((32,), 1e300, dtype=torch.float64), "fp8_e4m3_pow2")
    with pytest.raises(ValueError, match="floating-point"):
        quantize(torch.zeros(32, dtype=torch.int32), "fp8_e4m3_pow2")
    with pytest.raises(ValueError, match="0-d"):
        quantize(torch.tensor(1.0), "fp32")
    codes, scales = quantize(torch.randn(2, 32), "mxfp4")
    with pytest.raises(ValueError, match="scales"):
        dequantize(codes, scales[:1], "mxfp4")
    with pytest.raises(ValueError, match="scales"):
        dequantize(codes, None, "mxfp4")
    with pytest.raises(ValueError, match="codes"):
        dequantize(codes.float(), scales, "mxfp4")
    with pytest.raises(ValueError, match="scales must be None"):
        dequantize(torch.zeros(4, dtype=torch.uint8), scales, "bf16")
    with pytest.raises(ValueError, match="channels"):
        bytes_per_token("bf16", 3.0)

"""The nvidia backend's host-side launch arithmetic (backends/nvidia/host_math.py) equals Triton's own
cdiv and next_power_of_2, which it replaces in host code for speed."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer.backends.nvidia.host_math import cdiv, check_knob, next_pow2

triton = pytest.importorskip("triton")


@settings(max_examples=400, derandomize=True, deadline=None)
@given(st.integers(0, 1 << 40), st.integers(1, 1 << 20))
def test_cdiv_equals_tritons(x, d):
    assert cdiv(x, d) == triton.cdiv(x, d) == -(-x // d)


@settings(max_examples=400, derandomize=True, deadline=None)
@given(st.one_of(st.integers(0, 4096), st.integers(0, 1 << 40)))
def test_next_pow2_equals_tritons(n):
    got = next_pow2(n)
    assert got == triton.next_power_of_2(n)
    assert n == 0 or (got >= n and got & (got - 1) == 0 and got // 2 < n)


@settings(max_examples=300, derandomize=True, deadline=None)
@given(st.one_of(st.integers(-4, 600), st.floats(0, 64), st.booleans(), st.none()), st.booleans())
def test_check_knob_takes_exactly_the_ints_in_range(v, pow2):
    """Accepted iff an int (not a bool) in [16, 512], and a power of two where asked; the error names the knob."""
    ok = type(v) is int and 16 <= v <= 512 and (not pow2 or bin(v).count("1") == 1)
    if ok:
        check_knob("k", "tile", v, 16, 512, pow2)
    else:
        with pytest.raises(ValueError, match=r"k: tile must be .* in \[16, 512\], got "):
            check_knob("k", "tile", v, 16, 512, pow2)

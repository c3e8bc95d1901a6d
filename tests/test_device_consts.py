"""device_const keeps a table per (key, device) and gives back the very table a fresh build gives; the code grids
and rotary frequencies the eager paths now keep are bit for bit the ones they used to rebuild at every call."""

from __future__ import annotations

import torch

from deepinfer.backends.reference import lowbit
from deepinfer.device_consts import device_const
from deepinfer.models.ced import functional as fn


def test_a_table_is_built_once_per_key_and_device():
    calls = []

    def build(d):
        calls.append(d)
        return torch.arange(3, device=d)

    a = device_const(("test_table", 1), "cpu", build)
    assert device_const(("test_table", 1), torch.device("cpu"), build) is a and len(calls) == 1
    b = device_const(("test_table", 2), "cpu", build)
    assert b is not a and len(calls) == 2 and calls == [torch.device("cpu")] * 2


def test_kept_tables_equal_fresh_builds():
    """The kept E4M3 / E2M1 grids and CED's rotary frequencies against formulas written here from their
    definitions (not the builders they cache)."""
    e4m3 = lowbit._e4m3_positive("cpu")
    want = [(m / 8) * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7) for e in range(16) for m in range(8)]
    assert e4m3.tolist() == want[:127] and lowbit._e4m3_positive("cpu") is e4m3
    assert lowbit._e2m1_grid("cpu").tolist() == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    dec = lowbit._e4m3_decode(codes)
    ref = codes.view(torch.float8_e4m3fn).float()
    assert torch.equal(dec.isnan(), ref.isnan()) and torch.equal(dec[~dec.isnan()], ref[~ref.isnan()])
    for R, theta in ((16, 10000.0), (64, 500000.0)):
        cos, sin = fn.rope_cos_sin(torch.arange(5), R, theta)
        inv = 1.0 / (theta ** (torch.arange(0, R, 2, dtype=torch.float32) / R))
        ang = torch.arange(5).float()[:, None] * inv[None, :]
        assert torch.equal(cos, ang.cos()) and torch.equal(sin, ang.sin())

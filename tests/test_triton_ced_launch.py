"""CED sparse attention's launch at wide latents (triton_ced_attention.wide_launch, chosen on the H200 by
benchmarks/ced_attn_sweep.py): the rule itself, and that a launch override changes nothing but speed (the same
function as the reference op). Without CUDA through Triton's interpreter on small shapes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, strategies as st

from deepinfer.testing.kernels import DEV, examples, skip_module_without_kernels

skip_module_without_kernels()

from deepinfer.backends.nvidia import triton_ced_attention as tca  # noqa: E402
from deepinfer.backends.reference.ops import ReferenceOps  # noqa: E402
from deepinfer.testing.attention_cases import ced_attention_case  # noqa: E402


def test_wide_launch_rule(monkeypatch):
    """The sweep's winners at the bench shape (16 heads x 512, window 128, top-K 512), fewer splits as rows grow,
    never more splits than key tiles; past 64 queries (a prefill chunk) the last regime: 4 warps, one stage, one split
    from 256 queries; nothing for narrow latents, float32 or the interpreter."""
    monkeypatch.setattr(tca, "INTERPRET", False)
    bf = torch.bfloat16
    assert tca.wide_launch(1, 16, 512, bf, 128, 512) == ({"BLOCK_N": 16, "num_warps": 8, "num_stages": 1}, 32)
    assert tca.wide_launch(16, 16, 512, bf, 128, 512) == ({"BLOCK_N": 32, "num_warps": 8, "num_stages": 1}, 8)
    assert tca.wide_launch(64, 16, 512, bf, 128, 512) == ({"BLOCK_N": 32, "num_warps": 4, "num_stages": 1}, 4)
    splits = [tca.wide_launch(T, 16, 512, bf, 128, 512)[1] for T in range(1, 65)]
    for lo, hi in ((1, 4), (5, 31), (32, 64)):  # within each regime, fewer splits as rows grow
        part = splits[lo - 1:hi]
        assert all(a >= b for a, b in zip(part, part[1:])), (lo, hi, part)
    assert all(1 <= s <= 32 for s in splits)
    assert tca.wide_launch(1, 16, 512, bf, 40, 0)[1] == 3  # 40 window keys: 3 tiles of 16, no more splits
    prefill = [tca.wide_launch(T, 16, 512, bf, 128, 512) for T in (65, 100, 255, 256, 2048)]
    assert all(p[0] == {"BLOCK_N": 32, "num_warps": 4, "num_stages": 1} for p in prefill)
    assert [p[1] for p in prefill] == [4, 3, 2, 1, 1]  # cdiv(256, T) programs' worth of splits, one from 256
    for args in ((1, 16, 256, bf), (1, 16, 512, torch.float32), (0, 16, 512, bf)):
        assert tca.wide_launch(*args, 128, 512) is None
    # Raw bf16 entries: from 32 queries the transposed products on 2 stages (RAW_TRANS), below it the FP4 choice;
    # RAW_BLOCK_N / RAW_WARPS / RAW_STAGES override the tile, each alone; RAW_TRANS = 0 gives the FP4 choice back.
    # The transposed choice's registers are capped at RAW_MAXNREG (168: three 4-warp blocks an SM).
    trans = ({"BLOCK_N": 32, "num_warps": 4, "num_stages": 2, "trans": 1, "maxnreg": 168}, 1)
    assert tca.wide_launch(2048, 16, 512, bf, 128, 512, raw=True) == trans
    assert tca.wide_launch(65, 16, 512, bf, 128, 512, raw=True) == (trans[0], 4)
    assert tca.wide_launch(16, 16, 512, bf, 128, 512, raw=True) == tca.wide_launch(16, 16, 512, bf, 128, 512)
    monkeypatch.setattr(tca, "RAW_TRANS", 0)
    assert tca.wide_launch(2048, 16, 512, bf, 128, 512, raw=True) == prefill[-1]
    monkeypatch.setattr(tca, "RAW_TRANS", True)
    assert tca.wide_launch(2048, 16, 512, bf, 128, 512, raw=True) == trans
    monkeypatch.setattr(tca, "RAW_STAGES", 3)
    assert tca.wide_launch(2048, 16, 512, bf, 128, 512, raw=True) == \
        ({"BLOCK_N": 32, "num_warps": 4, "num_stages": 3, "trans": 1, "maxnreg": 168}, 1)
    assert tca.wide_launch(2048, 16, 512, bf, 128, 512) == prefill[-1]  # (FP4 entries: untouched)
    monkeypatch.setattr(tca, "RAW_BLOCK_N", 64)
    monkeypatch.setattr(tca, "RAW_WARPS", 8)
    assert tca.wide_launch(1, 16, 512, bf, 128, 512, raw=True) == \
        ({"BLOCK_N": 64, "num_warps": 8, "num_stages": 3}, 8)  # (splits: no more than the 8 key tiles of 64)
    assert "maxnreg" not in tca.wide_launch(1, 16, 512, bf, 128, 512, raw=True)[0]  # the cap: transposed only
    monkeypatch.setattr(tca, "RAW_MAXNREG", 128)
    assert tca.wide_launch(2048, 16, 512, bf, 128, 512, raw=True)[0]["maxnreg"] == 128
    monkeypatch.setattr(tca, "RAW_MAXNREG", 0)  # 0: the compiler's choice
    assert "maxnreg" not in tca.wide_launch(2048, 16, 512, bf, 128, 512, raw=True)[0]
    for name, bad in (("RAW_BLOCK_N", 24), ("RAW_WARPS", 3), ("RAW_STAGES", 9), ("RAW_TRANS", 2),
                      ("RAW_MAXNREG", 32)):  # named early
        old = getattr(tca, name)
        monkeypatch.setattr(tca, name, bad)
        with pytest.raises(ValueError, match=f"{name} must be"):
            tca.wide_launch(2048, 16, 512, bf, 128, 512, raw=True)
        monkeypatch.setattr(tca, name, old)
    monkeypatch.setattr(tca, "INTERPRET", True)
    assert tca.wide_launch(1, 16, 512, bf, 128, 512) is None


@examples(6)
@given(T=st.integers(1, 4), block_n=st.sampled_from([16, 32]), splits=st.sampled_from([1, 2, 5]),
       seed=st.integers(0, 2**16))
def test_launch_overrides_keep_the_function(T, block_n, splits, seed):
    torch.manual_seed(seed)
    args, kw = ced_attention_case([(45, 1, 0)] * T, window=16, ring_size=20, heads=4, dim=64, topk=8,
                                  fmt="fp4_e2m1_e4m3", dtype=torch.float32, sinks=True, device=DEV, n_entries=64,
                                  full_selection=True, poison=False)
    out = tca.sparse_attention(*args, launch=dict(BLOCK_N=block_n, num_warps=4, num_stages=1), num_splits=splits,
                               **kw)
    ref = ReferenceOps(DEV).ced_sparse_attention(*args, **kw)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


def test_bad_launch_overrides_are_refused_naming_the_knob():
    """A launch override may change the tiles, never what is computed: unknown keys, a latent tile other than the
    latent's own width (a narrower one would drop channels), tiles and warps off the powers of two and split
    counts below one are refused before the kernel runs (the indexer's: tests/test_triton_ced.py)."""
    args, kw = ced_attention_case([(45, 1, 0)], window=16, ring_size=20, heads=4, dim=64, topk=8,
                                  fmt="fp4_e2m1_e4m3", dtype=torch.float32, sinks=True, device=DEV, n_entries=64,
                                  full_selection=True, poison=False)
    for launch, splits, msg in ((dict(BLOCK_M=16), None, r"unknown keys \['BLOCK_M'\]"),
                                (dict(BLOCK_D=32), None, r"BLOCK_D must be a power of two in \[64, 64\], got 32"),
                                (dict(BLOCK_N=24), None, "BLOCK_N must be a power of two"),
                                (dict(BLOCK_H=8), None, r"BLOCK_H must be a power of two in \[16, 64\]"),
                                (dict(num_warps=3), None, "num_warps"), (dict(num_stages=0), None, "num_stages"),
                                (dict(trans=2), None, r"trans must be an int in \[0, 1\], got 2"),
                                (None, 0, r"num_splits must be an int in \[1, 256\], got 0")):
        with pytest.raises(ValueError, match=msg):
            tca.sparse_attention(*args, launch=launch, num_splits=splits, **kw)

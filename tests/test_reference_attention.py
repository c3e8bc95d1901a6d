"""The reference backend's paged attention (backends/reference/attention.py) against a plain mask oracle.

Decode rows on the CPU attend to their blocks in place (block_attention); rows with several queries, other
devices and dtypes keep the padded gather (padded_attention, the previous implementation). Cases are drawn as
the engine builds them (core.inputs.build_inputs over a shuffled block pool): decode rows leading and not,
prefill chunks over cached prefixes, GQA/MQA, MLA's value view of the key cache, block sizes 1..16, pools with
unused blocks between used ones, blocks shared by two rows, sliding windows, sinks, float32 and float64.
Tolerance: |out - oracle| <= 3e-7 * max|v| * (1 + the largest possible |logit|); both paths compute the
softmax in float32 (measured worst case over 300 examples: 3e-8).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from hypothesis import given, settings

from deepinfer.backends.base import AttnMetadata
from deepinfer.backends.reference import attention
from deepinfer.backends.reference.ops import ReferenceOps
from deepinfer.core.inputs import build_inputs
from deepinfer.testing import oracles
from deepinfer.testing import strategies as st

OPS = ReferenceOps()


def call(case, fn=OPS.paged_attention, q=None):
    return fn(case.q if q is None else q, case.k_cache, case.v_cache, case.meta, case.scale, case.window,
              case.sinks)


def assert_near(out: torch.Tensor, expected: torch.Tensor, case) -> None:
    lmax = float(case.scale * case.q.norm(dim=-1).max() * case.k_cache.norm(dim=-1).max())
    tol = 3e-7 * float(case.v_cache.abs().max()) * (1 + lmax)
    err = float((out.double() - expected.double()).abs().max()) if out.numel() else 0.0
    assert out.shape == expected.shape and err <= tol, f"max error {err:.3g} > {tol:.3g}"


def block_rows(case) -> int:
    """How many leading rows paged_attention hands to block_attention."""
    if case.num_decodes:
        return case.num_decodes
    ones = [n == 1 for _, n in case.rows]
    return ones.index(False) if False in ones else len(ones)


@settings(max_examples=150, deadline=None)
@given(st.paged_cases())
def test_paged_attention_matches_the_mask(case):
    assert_near(call(case), oracles.paged_attention_by_mask(case), case)


@settings(max_examples=60, deadline=None)
@given(st.paged_cases())
def test_decode_rows_skip_the_padded_gather(case):
    """The leading one-query rows never reach padded_attention; the rest reach it once, with their own rows."""
    seen = []
    padded = attention.padded_attention

    def spy(q, k_cache, v_cache, meta, *args):
        seen.append((q.shape[0], meta.q_index.shape[0]))
        return padded(q, k_cache, v_cache, meta, *args)

    attention.padded_attention = spy
    try:
        out = call(case)
    finally:
        attention.padded_attention = padded
    nd, R = block_rows(case), len(case.rows)
    rest = sum(n for _, n in case.rows[nd:])
    assert seen == ([] if nd == R else [(rest, R - nd)])
    assert_near(out, call(case, padded), case)  # and the block path agrees with the padded one


@settings(max_examples=30, deadline=None)
@given(st.paged_cases(max_rows=3))
def test_block_path_records_autograd(case):
    """The engine may run with grad enabled: the same values, and gradients flow to q."""
    q = case.q.clone().requires_grad_(True)
    out = call(case, q=q)
    assert_near(out.detach(), call(case), case)
    out.square().sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_plan_runs_of_block_ids():
    """Runs split where more than _MAX_GAP unused ids lie between held ones; a shared block is laid out once
    per row, in a second layer of runs; the plan's rows see exactly their own blocks."""
    gap = attention._MAX_GAP
    tables = [[5, 6], [5, 7 + gap + 1], [6]]  # row 1 shares block 5 with row 0; block 7+gap+1 is far away
    bs = 2
    lens = [3, 4, 2]
    seqs = [SimpleNamespace(input_ids=lambda s, n: [0] * n, block_table=t, state_slot=0, replay_start=0,
                            prefix_replay_start=0, num_cached_tokens=0, swa_restore=None)
            for t in tables]
    batch = SimpleNamespace(seqs=seqs, start=[n - 1 for n in lens], num_tokens=[1, 1, 1], future=None)
    _, meta, _ = build_inputs(batch, [0, 1, 2], bs, "cpu", num_decodes=3)
    plan = attention.block_plan(meta)
    assert plan.runs == [(5, 7), (16, 17), (5, 7)]
    g = torch.Generator().manual_seed(0)
    slots = 20 * bs
    k, v = torch.randn(slots, 1, 8, generator=g), torch.randn(slots, 1, 8, generator=g)
    q = torch.randn(3, 2, 8, generator=g)
    case = st.PagedCase(rows=[(n - 1, 1) for n in lens], num_decodes=3, tables=tables, q=q, k_cache=k, v_cache=v,
                        meta=meta, scale=0.3, window=None, sinks=None)
    assert_near(call(case), oracles.paged_attention_by_mask(case), case)


def test_other_devices_and_dtypes_take_the_padded_path():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 8, generator=g).bfloat16()
    k = torch.randn(8, 2, 8, generator=g).bfloat16()
    bt = torch.tensor([[0, 1], [2, 3]])
    meta = AttnMetadata(positions=torch.tensor([2, 1]), slot_mapping=torch.tensor([2, 5]),
                        seq_lens=torch.tensor([3, 2]), q_index=torch.tensor([[0], [1]]), q_valid=torch.ones(2, 1, dtype=torch.bool),
                        kv_slots=torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]]), q_pos=torch.tensor([[2], [1]]),
                        block_table=bt, block_size=2)
    assert not attention.block_path_ok(q, k, k, meta)
    assert attention.block_path_ok(q.float(), k.float(), k.float(), meta)
    assert torch.equal(OPS.paged_attention(q, k, k, meta, 0.3), attention.padded_attention(q, k, k, meta, 0.3))

"""Batch invariance (issue 16): the building blocks the deterministic recipe rests on, and its guarantee.

Building blocks (backends/batch_invariant.py, reference/invariant_attention.py), drawn by hypothesis over the
batch size and a row's position: under ``batch_invariant("cpu")`` each overridden op (the matmuls, the
elementwise ops with vector tails) and each op the design relies on without overriding (softmax, log_softmax,
row sums and means, cumsum, argmax) gives a row the same bits alone and at any position of any batch, with one
or two threads. If a BLAS or a torch build breaks an assumption, these fail and name the op. Negative
controls show the same checks fail without the override. Each fast path also meets a slow oracle that shares
no code with it: the tiled GEMMs a float64 matmul, the invariant attention the mask oracle.

The guarantee (the deterministic recipe, the bundled CED demo model and a tiny Llama, float32 and bfloat16):
a target request's tokens and per-step logprobs are torch.equal alone and among 1 to 127 random requests at a
random position, with chunked prefill on and off, with a prefix-cache hit and cold, greedy and seeded, across
runs and a process restart; the same check with the throughput recipe fails (so it can fail).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from deepinfer.backends.batch_invariant import (EXACT, EXACT_POW, UNARY, _unary, batch_invariant, cpu_bmm, cpu_mm,
                                                is_active)
from deepinfer.backends.reference.invariant_attention import invariant_paged_attention
from deepinfer.core.inputs import build_inputs
from deepinfer.testing import oracles, strategies as dst
from deepinfer.testing.determinism import Output, differing, scenario_outputs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DTYPES = (torch.float32, torch.bfloat16)


@contextlib.contextmanager
def threads(n: int):
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def _w(K, N, dtype, seed=1):
    return (torch.randn(N, K, generator=torch.Generator().manual_seed(seed)) / K ** 0.5).to(dtype)


# Row functions: x [T, D] -> [T, ...]; each row's result must not depend on T or on the row's position.
BLOCKS = {
    "linear": lambda x: F.linear(x, _w(x.shape[1], 48, x.dtype)),
    "linear_bias": lambda x: F.linear(x, _w(x.shape[1], 40, x.dtype), torch.ones(40, dtype=x.dtype)),
    "matmul_3d": lambda x: (x.view(x.shape[0], 1, -1) @ _w(x.shape[1], 24, x.dtype).t()).squeeze(1),
    "einsum_bmm": lambda x: torch.einsum("thd,tkd->thk", x.view(x.shape[0], 4, -1), x.view(x.shape[0], 4, -1)),
    "einsum_groups": lambda x: torch.einsum("tgi,goi->tgo", x.view(x.shape[0], 2, -1),
                                            _w(x.shape[1] // 2, 32, x.dtype).view(2, 16, -1)),
    "softmax": lambda x: torch.softmax(x.float(), -1),
    "log_softmax": lambda x: torch.log_softmax(x.float(), -1),
    "rms": lambda x: x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6),
    "sum_middle": lambda x: x.view(x.shape[0], 4, -1).float().sum(1),
    "cumsum": lambda x: torch.softmax(x.float(), -1).cumsum(-1),
    "argmax": lambda x: x.argmax(-1, keepdim=True),
    "pow_base": lambda x: 2.0 ** x.float(),
    "silu_and_mul": lambda x: F.silu(x[:, : x.shape[1] // 2]) * x[:, x.shape[1] // 2:],
}
for _name, _overload, _ in UNARY:
    if _name == "pow":
        BLOCKS["pow_exponent"] = lambda x: x.abs() ** 1.5
    elif _name in ("log", "rsqrt", "log1p"):
        BLOCKS[_name] = (lambda f: lambda x: f(x.abs() + 0.5))(getattr(torch, _name))
    elif _name in ("silu", "gelu", "softplus"):
        BLOCKS[_name] = getattr(F, _name)
    else:
        BLOCKS[_name] = getattr(torch, _name)
# The EXACT calls (run unpadded): each exponent torch's pow loops compute exactly, on inputs where it is finite.
for _e in EXACT_POW:
    BLOCKS[f"pow_exact_{_e}"] = (lambda e: lambda x: (x.abs() + 0.5) ** e)(_e)


@settings(max_examples=120, deadline=None)
@given(name=st.sampled_from(sorted(BLOCKS)), T=st.integers(1, 70), D=st.sampled_from([8, 20, 64, 96]),
       dtype=st.sampled_from(DTYPES), nthreads=st.sampled_from([1, 2]), data=st.data())
def test_building_block_is_batch_invariant(name, T, D, dtype, nthreads, data):
    pos = data.draw(st.integers(0, T - 1), label="position")
    g = torch.Generator().manual_seed(T * 131 + D)
    x = (torch.randn(T, D, generator=g) * 3).to(dtype)
    f = BLOCKS[name]
    with threads(nthreads), batch_invariant("cpu"):
        full = f(x)
        alone = f(x[pos:pos + 1].clone())
        moved = f(torch.cat([x[pos:pos + 1], x[:pos], x[pos + 1:]]))  # the row first, then the others
    assert torch.equal(full[pos], alone[0]), f"{name} ({dtype}, T={T}, D={D}): row {pos} differs from its run alone"
    assert torch.equal(moved[0], alone[0]), f"{name} ({dtype}, T={T}, D={D}): row moved to 0 differs"


def _mismatching_rows(f, x) -> int:
    full = f(x)
    return sum(not torch.equal(full[i], f(x[i:i + 1].clone())[0]) for i in range(x.shape[0]))


@pytest.mark.parametrize("name,D", [("linear", 256), ("sigmoid", 20), ("softplus", 8)])
def test_without_the_override_rows_depend_on_the_batch(name, D):
    """Negative control: the same check fails with torch's own kernels (so the one above can fail)."""
    x = torch.randn(120, D, generator=torch.Generator().manual_seed(0)) * 3
    f = BLOCKS[name] if name != "linear" else (lambda x: F.linear(x, _w(256, 384, x.dtype)))
    with threads(2):
        assert _mismatching_rows(f, x) > 0
        with batch_invariant("cpu"):
            assert _mismatching_rows(f, x) == 0


def _unary_rows(name, args, dtype, claim):
    """Mismatching rows (of 120, 2 threads) of the UNARY override ``name`` built with the EXACT predicate
    ``claim`` (True: every call claimed exact, so unpadded), and whether EXACT itself claims the call."""
    op, out = (torch.ops.aten.pow.Tensor_Scalar, torch.ops.aten.pow.Tensor_Scalar_out) if args else \
        (torch.ops.aten.rsqrt.default, torch.ops.aten.rsqrt.out)
    x = (torch.randn(120, 20, generator=torch.Generator().manual_seed(0)).abs() * 3 + 0.5).to(dtype)
    f = _unary(op, out, exact=(lambda *a: True) if claim else EXACT[name])
    with threads(2):
        return _mismatching_rows(lambda t: f(t, *args), x), EXACT[name](x, *args)


@pytest.mark.parametrize("name,args,dtype", [("pow.Tensor_Scalar", (e,), d) for e in EXACT_POW for d in DTYPES]
                         + [("rsqrt", (), torch.float32)])
def test_exact_calls_run_unpadded_and_stay_row_invariant(name, args, dtype):
    assert _unary_rows(name, args, dtype, claim=False) == (0, True)


@pytest.mark.parametrize("name,args,dtype", [("pow.Tensor_Scalar", (1.5,), torch.float32),
                                             ("rsqrt", (), torch.bfloat16)])
def test_a_wrong_exact_claim_fails_the_check(name, args, dtype):
    """Negative control for EXACT: were pow(x, 1.5) or bf16 rsqrt claimed exact (run unpadded), rows would
    depend on the batch (their vector and scalar loops differ); EXACT does not claim them, and padded they pass."""
    assert _unary_rows(name, args, dtype, claim=True)[0] > 0
    assert _unary_rows(name, args, dtype, claim=False) == (0, False)


@settings(max_examples=40, deadline=None)
@given(B=st.integers(0, 5), M=st.integers(0, 40), K=st.integers(1, 48), N=st.integers(1, 40),
       dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16))
def test_tiled_gemms_match_a_float64_matmul(B, M, K, N, dtype, seed):
    """cpu_mm / cpu_bmm against float64 matmuls (no shared code): |err| <= c * eps * K * max|a| * max|b|."""
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(B, M, K, generator=g).to(dtype), torch.randn(B, K, N, generator=g).to(dtype)
    eps = torch.finfo(dtype).eps
    def big(t):
        return float(t.abs().max()) if t.numel() else 0.0

    def err(got, exact):
        return float((got.double() - exact).abs().max()) if got.numel() else 0.0

    tol = 4 * eps * K * max(big(a), 1) * max(big(b), 1)
    exact = torch.einsum("bmk,bkn->bmn", a.double(), b.double())
    got = cpu_bmm(a, b)
    assert got.shape == (B, M, N) and got.dtype == dtype and err(got, exact) <= tol
    if B:
        got = cpu_mm(a[0], b[0].t().contiguous().t())  # a transposed-contiguous b, as F.linear passes it
        assert got.shape == (M, N) and err(got, exact[0]) <= tol


def test_weight_copies_are_reused_and_follow_in_place_updates():
    """F.linear passes weight.t(); the tiled GEMM keeps one contiguous copy per parameter view, dropped when the
    parameter changes in place (its version), so an update is never served stale."""
    w = torch.nn.Parameter(torch.randn(24, 40), requires_grad=False)
    x = torch.randn(5, 40)
    with batch_invariant("cpu"):
        a, b = F.linear(x, w), F.linear(x, w)
        with torch.no_grad():
            w.mul_(2)
        c = F.linear(x, w)
        plain = F.linear(x, w.detach().clone())  # not a parameter: copied per call
    assert torch.equal(a, b) and torch.equal(c, 2 * a) and torch.equal(c, plain)


def test_context_installs_and_removes_the_overrides():
    x = torch.randn(3, 20)
    assert not is_active("cpu")
    with batch_invariant("cpu"):
        with batch_invariant("cpu"):  # nested: one installation
            assert is_active("cpu")
        assert is_active("cpu")
        assert torch.equal(torch.exp(torch.arange(4)), torch.arange(4).float().exp())  # ints go through
    assert not is_active("cpu")
    assert torch.equal(torch.sigmoid(x), torch.ops.aten.sigmoid.out(x, out=torch.empty_like(x)))
    with pytest.raises(ValueError, match="device 'meta' has no batch-invariant kernels"):
        with batch_invariant("meta"):
            pass


# ------------------------------------------------------------------------------------------ attention
def _assert_near(out, expected, case):
    lmax = float(case.scale * case.q.norm(dim=-1).max() * case.k_cache.norm(dim=-1).max())
    tol = 3e-6 * float(case.v_cache.abs().max()) * (1 + lmax)
    err = float((out.double() - expected.double()).abs().max()) if out.numel() else 0.0
    assert out.shape == expected.shape and err <= tol, f"max error {err:.3g} > {tol:.3g}"


def _call(q, case, meta):
    return invariant_paged_attention(q, case.k_cache, case.v_cache, meta, case.scale, case.window, case.sinks)


@settings(max_examples=80, deadline=None)
@given(dst.paged_cases(max_len=150))
def test_invariant_attention_matches_the_mask(case):
    out = _call(case.q, case, case.meta)
    assert out.dtype == case.q.dtype
    _assert_near(out, oracles.paged_attention_by_mask(case), case)


def _meta(rows, tables, bs):
    from types import SimpleNamespace

    seqs = [SimpleNamespace(input_ids=lambda st_, n_: [0] * n_, block_table=t, state_slot=0, replay_start=0,
                            prefix_replay_start=0, num_cached_tokens=0, swa_restore=None) for t in tables]
    batch = SimpleNamespace(seqs=seqs, start=[p for p, _ in rows], num_tokens=[n for _, n in rows], future=None)
    nd = 0
    while nd < len(rows) and rows[nd][1] == 1:
        nd += 1
    return build_inputs(batch, list(range(len(rows))), bs, "cpu", num_decodes=nd)[1]


@settings(max_examples=60, deadline=None)
@given(dst.paged_cases(max_len=150), st.data())
def test_invariant_attention_row_alone_and_split_gives_the_same_bits(case, data):
    """A row's queries give the same bits in the batch, alone, and computed one query at a time (decode), as a
    chunk (chunked prefill) or after the rest is cached (a prefix hit): the KV is walked in one order."""
    r = data.draw(st.integers(0, len(case.rows) - 1), label="row")
    bs = case.meta.block_size
    first = sum(n for _, n in case.rows[:r])
    p, n = case.rows[r]
    with batch_invariant("cpu"):
        full = _call(case.q, case, case.meta)[first:first + n]
        alone = _call(case.q[first:first + n], case, _meta([(p, n)], [case.tables[r]], bs))
        assert torch.equal(full, alone)
        j = data.draw(st.integers(0, n - 1), label="query")  # query j as a decode row beside the other rows
        rows = [(p + j, 1)] + [row for i, row in enumerate(case.rows) if i != r]
        tables = [case.tables[r]] + [t for i, t in enumerate(case.tables) if i != r]
        qs = [case.q[first + j: first + j + 1]] + [case.q[sum(m for _, m in case.rows[:i]):][:m]
                                                  for i, (_, m) in enumerate(case.rows) if i != r]
        one = _call(torch.cat(qs), case, _meta(rows, tables, bs))[:1]
        assert torch.equal(one, full[j:j + 1])


# ------------------------------------------------------------------------------------------ the guarantee
@pytest.fixture(scope="module")
def demo_float32():
    return scenario_outputs("deterministic", "float32", others=((1, 127), (7,)))


def test_deterministic_recipe_is_batch_invariant_float32(demo_float32):
    assert differing(demo_float32) == [], "the target's output changed with its batch"
    assert demo_float32["seeded"]["alone, cold"].token_ids != demo_float32["greedy"]["alone, cold"].token_ids


def test_deterministic_recipe_is_batch_invariant_bfloat16():
    results = scenario_outputs("deterministic", "bfloat16", others=((31,), (3,)))
    assert differing(results) == [], "the target's output changed with its batch"


def test_throughput_recipe_fails_the_same_check():
    """Negative: the same scenarios under the throughput recipe do change the target's output."""
    results = scenario_outputs("throughput", "float32", others=((31,), (3,)))
    assert differing(results), "throughput gave identical bits everywhere: the check cannot tell"


def test_same_bits_after_a_process_restart(demo_float32):
    code = ("import sys; sys.path.insert(0, %r)\n"
            "from deepinfer import LLM, SamplingParams\n"
            "from deepinfer.testing.determinism import output_of\n"
            "from deepinfer.testing.determinism import GREEDY, SEEDED, scenario_llm, target_prompt\n"
            "llm = scenario_llm('deterministic', 'float32', 'cpu')\n"
            "for kw in (GREEDY, SEEDED):\n"
            "    print(output_of(llm.generate([target_prompt()], SamplingParams(**kw), use_tqdm=False)[0]).to_json())\n"
            % ROOT)
    env = {**os.environ, "PYTHONPATH": ROOT, "DEEPINFER_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("{")]
    assert len(lines) == 2
    for kind, line in zip(("greedy", "seeded"), lines):
        assert Output.from_json(line).same(demo_float32[kind]["alone, cold"]), f"{kind} changed after a restart"


def test_output_round_trips_through_json(demo_float32):
    out = demo_float32["greedy"]["among 127, cold"]
    back = Output.from_json(out.to_json())
    assert back.same(out) and json.loads(out.to_json())["token_ids"] == list(out.token_ids)


def test_tiny_llama_is_batch_invariant(tmp_path):
    """The Llama family through the invariant paged attention (GQA), float32 and bfloat16."""
    pytest.importorskip("transformers")
    from deepinfer.testing.models import build_tiny_hf_model

    build_tiny_hf_model(tmp_path, "llama", vocab_size=300)
    for dtype in ("float32", "bfloat16"):
        results = scenario_outputs("deterministic", dtype, model=str(tmp_path), vocab=250, others=((40,), (5,)),
                                   target_len=70)
        assert differing(results) == [], dtype

"""The Triton sampling filter (no vocabulary sort) against reference.sampling.

Without CUDA the kernel runs under Triton's interpreter (TRITON_INTERPRET=1, set before triton is imported)
on tiny vocabularies; the GPU-only tests use real vocabulary sizes and a CUDA-graph capture.

The filter must keep exactly the reference's tokens, with the same values, except on rows where some
token's cumulative top-p mass lies within 1e-5 of top_p (float32 sums in another order may put it either
side); there the two may differ only in such boundary tokens. Sampling must then give the same tokens as
ReferenceOps.sample for the same generators.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, strategies as st

from deepinfer.testing.kernels import (DEV, HAS_CUDA, capture_graph, examples, gen, gpu, run_compile_script,
                                       skip_module_without_kernels)

skip_module_without_kernels()

from deepinfer.backends.nvidia import triton_sampling  # noqa: E402
from deepinfer.backends.nvidia.ops import NvidiaOps  # noqa: E402
from deepinfer.backends.reference.ops import ReferenceOps  # noqa: E402
from deepinfer.backends.reference.sampling import SamplingBatch, _filter, _penalized  # noqa: E402
from deepinfer.core.params import SamplingParams  # noqa: E402

FAST = examples(40)
TOL = 1e-5  # top-p boundary band (cumulative mass) where the kept set may differ
# Vocabulary sizes of the property tests: tiny under the interpreter, real ones (not powers of two) on a GPU.
FILTER_VOCABS = [1, 2, 5, 31, 64, 100, 200] + ([1000, 4099, 50257, 151936] if HAS_CUDA else [])
SAMPLE_VOCABS = [1000, 32000, 128256, 151936] if HAS_CUDA else [3, 50, 137]


def make_batch(temp, top_k, top_p, min_p, flags=(True, True, True)) -> SamplingBatch:
    S = len(temp)
    f32 = lambda v: torch.tensor(v, dtype=torch.float32, device=DEV)  # noqa: E731
    return SamplingBatch(temperature=f32(temp), top_k=torch.tensor(top_k, dtype=torch.int64, device=DEV),
                         top_p=f32(top_p), min_p=f32(min_p), presence_penalty=None, frequency_penalty=None,
                         repetition_penalty=None, output_counts=None, prompt_mask=None, banned=None,
                         generators=[None] * S, all_greedy=False, all_random=False, max_num_logprobs=-1,
                         use_top_k=flags[0], use_top_p=flags[1], use_min_p=flags[2])


def run_filter(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    return triton_sampling.filter_logits(logits, b.temperature, b.top_k, b.top_p, b.min_p, use_top_k=b.use_top_k,
                                         use_top_p=b.use_top_p, use_min_p=b.use_min_p)


def boundary_rows(logits: torch.Tensor, b: SamplingBatch) -> set:
    """Rows where a token's cumulative top-p mass (float64, after top-k) is within TOL of top_p."""
    if not b.use_top_p:
        return set()
    temp = torch.where(b.temperature < 1e-5, torch.ones_like(b.temperature), b.temperature)
    s = (logits.float() / temp[:, None]).double().sort(dim=-1, descending=True, stable=True).values  # [S, V]
    V = s.shape[1]
    k = torch.where(b.top_k > 0, b.top_k, V).clamp(max=V) if b.use_top_k else torch.full_like(b.top_k, V)
    s = s.masked_fill(s < s.gather(1, (k - 1)[:, None]), float("-inf"))
    probs = s.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs
    p = b.top_p.double()[:, None]
    near = ((before - p).abs() < TOL) & (p < 1.0)
    return set(near.any(dim=-1).nonzero().flatten().tolist())


def assert_filter_matches(out: torch.Tensor, ref: torch.Tensor, logits: torch.Tensor, b: SamplingBatch) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype
    loose = boundary_rows(logits, b)
    for r in range(out.shape[0]):
        if r in loose:  # kept values still exact; the kept set may differ at the boundary only
            both = out[r].isfinite() & ref[r].isfinite()
            assert torch.equal(out[r][both], ref[r][both])
        else:
            assert torch.equal(out[r], ref[r]), (r, out[r].isfinite().sum(), ref[r].isfinite().sum())


# ------------------------------------------------------------------------------------------- property tests
@st.composite
def filter_case(draw, vocab=st.sampled_from(FILTER_VOCABS)):
    S = draw(st.integers(1, 3))
    V = draw(vocab)
    g = gen(draw(st.integers(0, 2**31 - 1)))
    logits = torch.randn(S, V, generator=g) * draw(st.sampled_from([0.3, 2.0, 8.0]))
    if draw(st.booleans()):
        logits = (logits * 2).round() / 2  # many exact ties
    if draw(st.booleans()) and V > 1:
        logits[torch.rand(S, V, generator=g) < 0.2] = float("-inf")  # banned tokens
        logits[:, 0] = logits[:, 0].clamp_min(0)  # keep one finite token per row
    temp = [draw(st.sampled_from([0.0, 0.5, 1.0, 1.7])) for _ in range(S)]
    top_k = [draw(st.sampled_from([0, 1, 2, 5, max(V - 1, 1), V, V + 3])) for _ in range(S)]
    top_p = [draw(st.sampled_from([1.0, 0.9, 0.5]) | st.floats(0.02, 0.999)) for _ in range(S)]
    min_p = [draw(st.sampled_from([0.0, 0.05, 0.3])) for _ in range(S)]
    flags = draw(st.tuples(st.booleans(), st.booleans(), st.booleans()))
    return logits.to(DEV), make_batch(temp, top_k, top_p, min_p, flags)


@FAST
@given(filter_case())
def test_filter_matches_reference(case):
    logits, b = case
    x0 = logits.clone()
    out = run_filter(logits, b)
    assert torch.equal(logits, x0), "the input must not be modified"
    assert_filter_matches(out, _filter(logits, b), logits, b)


@st.composite
def sampling_case(draw, vocab=st.sampled_from(SAMPLE_VOCABS)):
    S = draw(st.integers(1, 4))
    V = draw(vocab)
    params = []
    for _ in range(S):
        params.append(SamplingParams(
            temperature=draw(st.sampled_from([0.0, 0.6, 1.0, 1.5])),
            top_k=draw(st.sampled_from([-1, 0, 1, 3, 20])),
            top_p=draw(st.sampled_from([1.0, 0.95, 0.7, 0.3])),
            min_p=draw(st.sampled_from([0.0, 0.0, 0.1])),
            seed=draw(st.sampled_from([None, 7, 1234])),
            repetition_penalty=draw(st.sampled_from([1.0, 1.0, 1.3])),
            presence_penalty=draw(st.sampled_from([0.0, 0.5])),
            min_tokens=draw(st.sampled_from([0, 0, 5])),
        ))
    seed = draw(st.integers(0, 2**31 - 1))
    g = gen(seed)
    logits = (torch.randn(S, V, generator=g) * draw(st.sampled_from([1.0, 4.0]))).to(DEV)
    prompts = [torch.randint(0, V, (3,), generator=g).tolist() for _ in range(S)]
    outputs = [torch.randint(0, V, (2,), generator=g).tolist() for _ in range(S)]
    return logits, params, prompts, outputs, seed


def build_batch(params, prompts, outputs, V):
    gens = [gen(p.seed + 11 * i, DEV) if p.seed is not None else None for i, p in enumerate(params)]
    return SamplingBatch.build(params, prompts, outputs, gens, V, [0], DEV)


@examples(12)
@given(sampling_case())
def test_sample_same_tokens_as_reference(case):
    """Penalties, bans, greedy/seeded/unseeded rows: the same generators draw the same tokens."""
    logits, params, prompts, outputs, seed = case
    V = logits.shape[1]
    b_ref, b_new = build_batch(params, prompts, outputs, V), build_batch(params, prompts, outputs, V)
    if boundary_rows(_penalized(logits, b_ref), b_ref):
        return  # a top-p boundary token: the kept sets may differ there (documented)
    g_ref, g_new = gen(seed, DEV), gen(seed, DEV)
    ops, ref = NvidiaOps(DEV), ReferenceOps(DEV)
    for _ in range(2):  # the generators advance; both sides must advance them alike
        assert torch.equal(ops.sample(logits, b_new, g_new), ref.sample(logits, b_ref, g_ref))
    assert ops.kernel_calls["sampling_filter"] == (0 if all(p.greedy for p in params) else 2)


# ------------------------------------------------------------------------------------------- ties and edges
def test_top_k_keeps_all_ties_at_kth():
    logits = torch.tensor([[3.0, 1.0, 2.0, 2.0, 2.0, 0.0, 2.0]], device=DEV)
    b = make_batch([1.0], [2], [1.0], [0.0])
    out = run_filter(logits, b)
    assert out[0].isfinite().nonzero().flatten().tolist() == [0, 2, 3, 4, 6]
    assert torch.equal(out, _filter(logits, b))


@pytest.mark.parametrize("top_p,kept", [(0.35, 4), (0.5, 2), (0.01, 1), (0.999, 10)])
def test_top_p_takes_ties_in_index_order(top_p, kept):
    """Equal logits: the reference's stable sort takes them in index order; so does the kernel."""
    V = 10 if kept != 2 else 4
    logits = torch.zeros(2, V, device=DEV)
    logits[1, ::2] = 1.0  # row 1: ties at two levels
    b = make_batch([1.0, 1.0], [0, 0], [top_p, top_p], [0.0, 0.0])
    out = run_filter(logits, b)
    assert out[0].isfinite().nonzero().flatten().tolist() == list(range(min(kept, V)))
    assert_filter_matches(out, _filter(logits, b), logits, b)


def test_top_k_and_top_p_tie_at_the_same_value():
    logits = torch.tensor([[5.0, 1.0, 1.0, 1.0, 1.0, 0.0, 1.0, -2.0]], device=DEV)
    for top_p in (0.3, 0.8, 0.9, 0.97):
        b = make_batch([1.0], [3], [top_p], [0.0])
        assert_filter_matches(run_filter(logits, b), _filter(logits, b), logits, b)


def test_edge_rows():
    ninf = float("-inf")
    logits = torch.tensor([[ninf, ninf, 0.5, ninf],  # one finite token
                           [1.0, 1.0, 1.0, 1.0],  # all tied
                           [0.0, -0.0, 0.0, -0.0],  # signed zeros compare equal
                           [1e30, -1e30, 3.0, -3.0]], device=DEV)  # extreme values
    for temp, k, p, mp in [(1.0, 2, 0.5, 0.1), (0.5, 1, 0.3, 0.0), (2.0, 0, 0.99, 0.5), (0.0, 3, 1.0, 0.0)]:
        b = make_batch([temp] * 4, [k] * 4, [p] * 4, [mp] * 4)
        assert_filter_matches(run_filter(logits, b), _filter(logits, b), logits, b)
    one = torch.tensor([[2.5]], device=DEV)  # V = 1
    b = make_batch([0.7], [1], [0.5], [0.5])
    assert torch.equal(run_filter(one, b), _filter(one, b))


def test_temperature_only_batch_and_empty_batch():
    logits = torch.randn(3, 40, generator=gen(0)).to(DEV)
    b = make_batch([0.0, 0.3, 1.9], [0, 0, 0], [1.0] * 3, [0.0] * 3, flags=(False, False, False))
    assert torch.equal(run_filter(logits, b), _filter(logits, b))
    e = make_batch([], [], [], [])
    assert run_filter(torch.empty(0, 40, device=DEV), e).shape == (0, 40)


def test_bad_inputs_name_the_argument():
    x = torch.randn(2, 8, device=DEV)
    b = make_batch([1.0, 1.0], [0, 0], [1.0, 1.0], [0.0, 0.0])
    with pytest.raises(ValueError, match="logits"):
        triton_sampling.filter_logits(x.double(), b.temperature, b.top_k, b.top_p, b.min_p)
    with pytest.raises(ValueError, match="logits"):
        triton_sampling.filter_logits(x[0], b.temperature, b.top_k, b.top_p, b.min_p)
    with pytest.raises(ValueError, match="top_k"):
        triton_sampling.filter_logits(x, b.temperature, b.top_k[:1], b.top_p, b.min_p)
    with pytest.raises(ValueError, match="top_k"):
        triton_sampling.filter_logits(x, b.temperature, b.top_k.float(), b.top_p, b.min_p)
    with pytest.raises(ValueError, match="min_p"):
        triton_sampling.filter_logits(x, b.temperature, b.top_k, b.top_p, b.min_p[None])


def test_ops_dispatch_and_fallbacks():
    ops = NvidiaOps(DEV)
    V = 30
    logits = torch.randn(2, V, generator=gen(1)).to(DEV)
    greedy = SamplingBatch.build([SamplingParams(temperature=0.0)] * 2, [[], []], [[], []], [None, None], V, [], DEV)
    assert torch.equal(ops.sample(logits, greedy), logits.argmax(-1))
    assert ops.kernel_calls["sampling_filter"] == 0  # all greedy: argmax, no filter
    params = [SamplingParams(top_k=3, seed=5), SamplingParams(top_p=0.5, seed=6)]

    def batch():
        return SamplingBatch.build(params, [[], []], [[], []], [gen(5, DEV), gen(6, DEV)], V, [], DEV)

    assert torch.equal(ops.sample(logits, batch()), ReferenceOps(DEV).sample(logits, batch()))
    assert ops.kernel_calls["sampling_filter"] == 1
    # float64 logits: the penalised logits are float32 anyway, so the kernel still runs.
    assert torch.equal(ops.sample(logits.double(), batch()), ReferenceOps(DEV).sample(logits.double(), batch()))
    assert ops.kernel_calls["sampling_filter"] == 2


# ------------------------------------------------------------------------------------------- GPU only
def mixed_batch(S: int) -> SamplingBatch:
    temp = [[0.0, 0.6, 1.0, 1.3][i % 4] for i in range(S)]
    top_k = [[0, 20, 50, 1000, 1][i % 5] for i in range(S)]
    top_p = [[1.0, 0.9, 0.95, 0.5, 0.99, 0.8][i % 6] for i in range(S)]
    min_p = [[0.0, 0.0, 0.05][i % 3] for i in range(S)]
    return make_batch(temp, top_k, top_p, min_p)


def lm_like_logits(S: int, V: int, g: torch.Generator) -> torch.Tensor:
    """Heavy-tailed rows like a language model's: a few strong candidates over a broad low background."""
    x = torch.randn(S, V, generator=g) * 2.0
    top = torch.randint(0, V, (S, 40), generator=g)
    x.scatter_(1, top, torch.randn(S, 40, generator=g) * 3 + 12)
    return x.to(DEV)


@gpu
@pytest.mark.parametrize("V", [128256, 129280, 151936])  # Llama-3.1, DeepSeek-V3, Qwen3 vocabularies
def test_gpu_filter_real_vocab(V):
    g = gen(V)
    for S in (1, 7, 256):
        logits = lm_like_logits(S, V, g)
        b = mixed_batch(S)
        assert_filter_matches(run_filter(logits, b), _filter(logits, b), logits, b)
        flat = torch.randn(S, V, generator=g).to(DEV) * 0.3  # flat rows: most of the vocabulary is a candidate
        assert_filter_matches(run_filter(flat, b), _filter(flat, b), flat, b)


@gpu
def test_gpu_seeded_sampling_same_tokens_and_timing():
    V, S = 151936, 128
    g = gen(3)
    params = [SamplingParams(temperature=[0.0, 0.7, 1.0][i % 3], top_k=[0, 20, 50][i % 3],
                             top_p=[0.95, 1.0, 0.8, 0.9][i % 4], min_p=[0.0, 0.05][i % 2],
                             seed=1000 + i if i % 2 else None) for i in range(S)]
    logits = lm_like_logits(S, V, g)

    def batch():
        gens = [gen(p.seed, DEV) if p.seed is not None else None for p in params]
        return SamplingBatch.build(params, [[]] * S, [[]] * S, gens, V, [], DEV)

    ops, ref = NvidiaOps(DEV), ReferenceOps(DEV)
    b = batch()
    same = torch.ones(S, dtype=torch.bool)
    same[sorted(boundary_rows(logits, b))] = False  # rows with a token at the top-p boundary may differ
    got, want = ops.sample(logits, b, gen(9, DEV)), ref.sample(logits, batch(), gen(9, DEV))
    assert torch.equal(got.cpu()[same], want.cpu()[same]) and int(same.sum()) > S // 2
    times = {}
    for name, fn in (("triton", lambda: run_filter(logits, b)), ("reference", lambda: _filter(logits, b))):
        fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            fn()
        end.record()
        torch.cuda.synchronize()
        times[name] = start.elapsed_time(end) / 10
    print(f"\nsampling filter [{S}, {V}]: triton {times['triton']:.3f} ms, reference sort {times['reference']:.3f} ms")


@gpu
def test_gpu_filter_in_cuda_graph():
    """No host sync inside: capture once, replay with new logits and new per-row parameters."""
    S, V = 16, 129280
    g = gen(4)
    logits = lm_like_logits(S, V, g)
    b = mixed_batch(S)

    def run():
        return run_filter(logits, b)

    graph, out = capture_graph(run)
    for step in range(3):
        logits.copy_(lm_like_logits(S, V, g))
        b.top_k.copy_(torch.randint(0, 100, (S,), generator=g).to(DEV))
        b.top_p.copy_((torch.rand(S, generator=g) * 0.9 + 0.1).to(DEV))
        graph.replay()
        torch.cuda.synchronize()
        assert_filter_matches(out, _filter(logits, b), logits, b)


# ------------------------------------------------------------------------------------------- compiled path
_COMPILE_SCRIPT = r'''
import json
from deepinfer.backends.nvidia import triton_sampling as ts
from deepinfer.testing.kernels import compile_sm90, sass_counts

assert not ts.INTERPRET
sig = dict(x_ptr="*fp32", out_ptr="*fp32", temp_ptr="*fp32", topk_ptr="*i64", topp_ptr="*fp32", logminp_ptr="*fp32",
           stride_x="i32", stride_o="i32", V="i32", margin="fp32")
cfg = ts.launch_config(151936)
report = {}
for flags in ((True, True, True), (False, False, False), (True, False, True), (False, True, False)):
    const = dict(HAS_TOP_K=flags[0], HAS_TOP_P=flags[1], HAS_MIN_P=flags[2], BLOCK=cfg["BLOCK"], CHUNK=cfg["CHUNK"],
                 NPIV=ts.NP, N_ROUNDS=ts.ROUNDS, NB_B=ts.NB, LOOP=0)
    k = compile_sm90(ts._filter_kernel, sig, const, ("stride_x", "stride_o", "V"), num_warps=cfg["num_warps"])
    row = sass_counts(k, r"\b(LDG\.E\.128|STL|LDL)\b") or {}
    report["".join("1" if f else "0" for f in flags)] = row
print(json.dumps(report))
'''


def test_filter_kernel_compiles_for_hopper():
    """The compiled path (CPU CI only runs the interpreter): every flag combination compiles for sm_90,
    without local-memory spills."""
    report = run_compile_script(_COMPILE_SCRIPT)
    assert len(report) == 4
    for name, sass in report.items():
        assert sass.get("STL", 0) == 0 and sass.get("LDL", 0) == 0, f"{name}: local-memory spills: {sass}"

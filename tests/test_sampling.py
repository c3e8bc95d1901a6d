"""Tests of the reference backend's batched sampler against slow per-row oracles."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from deepinfer.backends.reference.sampling import (
    SamplingBatch,
    apply_penalties,
    compute_logprobs,
    process_logits,
    sample,
)
from deepinfer.core.params import SamplingParams

CPU = torch.device("cpu")
FAST = settings(max_examples=60, deadline=None)


def build(params, vocab, prompts=None, outputs=None, gens=None, eos=()):
    S = len(params)
    return SamplingBatch.build(
        params,
        prompts if prompts is not None else [[] for _ in range(S)],
        outputs if outputs is not None else [[] for _ in range(S)],
        gens if gens is not None else [None] * S,
        vocab,
        eos,
        CPU,
    )


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------- slow oracles


def oracle_support(row: torch.Tensor, p: SamplingParams, tol: float = 1e-4) -> tuple[set, set]:
    """(required, allowed) token sets of one random row after temperature, top-k, top-p, min-p.

    Tokens within `tol` of a top-p / min-p boundary are allowed but not required,
    since float32 rounding may put them either side.
    """
    # Temperature in float32 like the sampler, so ties created or kept by rounding agree.
    x = (row.float() / torch.tensor(p.temperature, dtype=torch.float32)).tolist()
    V = len(x)
    order = sorted(range(V), key=lambda i: (-x[i], i))
    alive = set(range(V))
    if p.effective_top_k > 0:
        kth = x[order[min(p.effective_top_k, V) - 1]]
        alive = {i for i in alive if x[i] >= kth}
    required, allowed = set(alive), set(alive)
    if p.top_p < 1.0:
        xmax = max(x[i] for i in alive)
        z = sum(math.exp(x[i] - xmax) for i in alive)
        mass = 0.0
        for i in order:
            if i not in alive:
                continue
            if mass > p.top_p - tol:
                required.discard(i)
            if mass > p.top_p + tol:
                allowed.discard(i)
            mass += math.exp(x[i] - xmax) / z
    if p.min_p > 0.0:
        xmax = max(x[i] for i in alive)
        for i in list(allowed):
            ratio = math.exp(x[i] - xmax)
            if ratio < p.min_p * (1 + tol):
                required.discard(i)
            if ratio < p.min_p * (1 - tol):
                allowed.discard(i)
    return required, allowed


def oracle_penalties(row: list, prompt: list, output: list, p: SamplingParams) -> list:
    out = list(row)
    for t in range(len(out)):
        if t in prompt or t in output:
            out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
        c = output.count(t)
        out[t] -= p.frequency_penalty * c
        out[t] -= p.presence_penalty * (1 if c > 0 else 0)
    return out


# ---------------------------------------------------------------- strategies


@st.composite
def random_params(draw):
    return SamplingParams(
        temperature=draw(st.floats(0.05, 2.0)),
        top_k=draw(st.sampled_from([-1, 0, 1, 2, 3, 5, 50])),
        top_p=draw(st.sampled_from([1.0, 0.95, 0.5, 0.1]) | st.floats(0.01, 1.0)),
        min_p=draw(st.sampled_from([0.0, 0.0, 0.05, 0.5]) | st.floats(0.0, 1.0)),
    )


@st.composite
def logits_case(draw, params_strategy):
    S = draw(st.integers(1, 5))
    V = draw(st.integers(1, 40))
    seed = draw(st.integers(0, 2**31 - 1))
    scale = draw(st.sampled_from([0.1, 1.0, 5.0]))
    logits = torch.randn(S, V, generator=gen(seed)) * scale  # [S, V]
    if draw(st.booleans()):
        logits = logits.round()  # many exact ties
    params = [draw(params_strategy) for _ in range(S)]
    return logits, params


# ---------------------------------------------------------------- greedy


@given(logits_case(st.just(SamplingParams(temperature=0.0))))
@FAST
def test_greedy_equals_argmax(case):
    logits, params = case
    batch = build(params, logits.shape[1])
    assert batch.all_greedy and not batch.all_random
    assert torch.equal(sample(logits, batch), logits.argmax(-1))


def test_mixed_batch_greedy_rows_take_argmax():
    logits = torch.randn(6, 30, generator=gen(0))
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.0) for i in range(6)]
    batch = build(params, 30)
    assert not batch.all_greedy and not batch.all_random
    for s in range(5):
        tokens = sample(logits, batch, gen(s))
        assert torch.equal(tokens[1::2], logits[1::2].argmax(-1))


# ---------------------------------------------------------------- filters


@given(logits_case(random_params()))
@FAST
def test_filters_leave_oracle_support(case):
    logits, params = case
    batch = build(params, logits.shape[1])
    support = torch.isfinite(process_logits(logits, batch))  # [S, V]
    for s, p in enumerate(params):
        required, allowed = oracle_support(logits[s], p)
        got = set(torch.nonzero(support[s]).flatten().tolist())
        assert required <= got <= allowed, (s, p, sorted(required), sorted(got), sorted(allowed))
        assert got  # at least one token always survives


@pytest.mark.parametrize(
    "kw",
    [dict(top_k=1), dict(top_k=2), dict(top_p=0.3), dict(top_p=0.6), dict(min_p=0.3), dict(top_k=3, top_p=0.8)],
)
def test_each_filter_exact_on_distinct_logits(kw):
    # Log-probs of 0.4, 0.3, 0.2, 0.1 exactly known: expected supports can be written by hand.
    probs = torch.tensor([0.1, 0.4, 0.2, 0.3])
    logits = probs.log().unsqueeze(0)
    expect = {
        "top_k=1": {1}, "top_k=2": {1, 3}, "top_p=0.3": {1}, "top_p=0.6": {1, 3},
        "min_p=0.3": {1, 3, 2}, "top_k=3,top_p=0.8": {1, 3, 2},
    }[",".join(f"{k}={v}" for k, v in kw.items())]
    batch = build([SamplingParams(**kw)], 4)
    got = set(torch.nonzero(torch.isfinite(process_logits(logits, batch)[0])).flatten().tolist())
    assert got == expect
    # The sampler never leaves the support.
    tokens = sample(logits.expand(500, 4), build([SamplingParams(**kw)] * 500, 4), gen(1))
    assert set(tokens.tolist()) <= expect


def test_top_k_keeps_ties_at_boundary():
    logits = torch.tensor([[3.0, 1.0, 1.0, 0.0, 1.0]])
    batch = build([SamplingParams(top_k=2)], 5)
    support = torch.isfinite(process_logits(logits, batch))[0]
    assert support.tolist() == [True, True, True, False, True]


def test_top_p_one_keeps_tiny_tokens():
    logits = torch.tensor([[0.0, -80.0, -90.0, 20.0]])
    batch = build([SamplingParams(top_p=1.0, top_k=-1)], 4)
    assert torch.isfinite(process_logits(logits, batch)).all()


# ---------------------------------------------------------------- distribution


def chi_square(tokens: torch.Tensor, target: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=target.numel()).double()
    expected = target.double() * tokens.numel()
    nz = expected > 0
    assert counts[~nz].sum() == 0, "sampled a token of probability 0"
    return float(((counts[nz] - expected[nz]) ** 2 / expected[nz]).sum())


# 99.9% quantiles of chi-square with df degrees of freedom.
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52}


@pytest.mark.parametrize(
    "kw, target",
    [
        (dict(temperature=1.0), [0.05, 0.15, 0.2, 0.25, 0.35]),
        (dict(temperature=1.0, top_k=3), [0.0, 0.0, 0.2 / 0.8, 0.25 / 0.8, 0.35 / 0.8]),
        (dict(temperature=1.0, top_p=0.55), [0.0, 0.0, 0.0, 0.25 / 0.6, 0.35 / 0.6]),
        (dict(temperature=1.0, min_p=0.5), [0.0, 0.0, 0.2 / 0.8, 0.25 / 0.8, 0.35 / 0.8]),
    ],
)
@pytest.mark.parametrize("seeded", [False, True])
def test_empirical_frequencies_match_target(kw, target, seeded):
    base = torch.tensor([0.05, 0.15, 0.2, 0.25, 0.35])
    target = torch.tensor(target)
    N = 3000 if seeded else 20000
    logits = base.log().expand(N, 5)  # [N, 5]
    gens = [gen(1000 + i) for i in range(N)] if seeded else None
    batch = build([SamplingParams(**kw)] * N, 5, gens=gens)
    tokens = sample(logits, batch, gen(7))
    df = int((target > 0).sum()) - 1
    assert chi_square(tokens, target) < CHI2_999[df]


def test_temperature_reshapes_distribution():
    base = torch.tensor([0.1, 0.2, 0.3, 0.4])
    T = 0.5
    target = (base.log() / T).softmax(-1)
    N = 20000
    tokens = sample(base.log().expand(N, 4), build([SamplingParams(temperature=T)] * N, 4), gen(3))
    assert chi_square(tokens, target) < CHI2_999[3]


def test_batched_generator_reproducible():
    logits = torch.randn(8, 50, generator=gen(0))
    batch = build([SamplingParams()] * 8, 50)
    assert torch.equal(sample(logits, batch, gen(5)), sample(logits, batch, gen(5)))


# ---------------------------------------------------------------- seeded rows


def seeded_run(position: int, others: list, steps: int = 12) -> list:
    """Tokens the seeded row (seed 123) draws over `steps` steps at `position` among `others`."""
    V = 64
    target = torch.randn(V, generator=gen(99)) * 0.5  # flat-ish so tokens vary
    p_seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=123)
    params = list(others)
    params.insert(position, p_seeded)
    g = gen(123)
    engine_gen = gen(position * 31 + len(others))
    out = []
    for step in range(steps):
        logits = torch.randn(len(params), V, generator=gen(step + 17 * len(others)))
        logits[position] = target + 0.1 * step
        gens = [gen(7 + i) if q.seed is not None else None for i, q in enumerate(params)]
        gens[position] = g
        batch = build(params, V, gens=gens)
        out.append(int(sample(logits, batch, engine_gen)[position]))
    return out


def test_seeded_row_independent_of_batch():
    alone = seeded_run(0, [])
    assert len(set(alone)) > 1  # the check below is meaningful only if tokens vary
    mixes = [
        (0, [SamplingParams()] * 3),
        (2, [SamplingParams(temperature=0.0), SamplingParams(top_k=5), SamplingParams(seed=4)]),
        (3, [SamplingParams(seed=9)] * 3 + [SamplingParams(min_p=0.2)] * 2),
        (1, [SamplingParams(temperature=0.0)]),
    ]
    for pos, others in mixes:
        assert seeded_run(pos, others) == alone, (pos, others)


def test_greedy_rows_do_not_consume_their_generator():
    g = gen(5)
    state = g.get_state()
    batch = build([SamplingParams(temperature=0.0, seed=5), SamplingParams()], 10, gens=[g, None])
    assert batch.generators == [None, None]
    sample(torch.randn(2, 10), batch)
    assert torch.equal(g.get_state(), state)


# ---------------------------------------------------------------- penalties


@st.composite
def penalty_case(draw):
    S = draw(st.integers(1, 4))
    V = draw(st.integers(1, 20))
    ids = st.lists(st.integers(0, V - 1), max_size=12)
    params = [
        SamplingParams(
            presence_penalty=draw(st.sampled_from([0.0, 0.5, -1.0]) | st.floats(-2, 2)),
            frequency_penalty=draw(st.sampled_from([0.0, 0.3]) | st.floats(-2, 2)),
            repetition_penalty=draw(st.sampled_from([1.0, 1.3, 0.7]) | st.floats(0.1, 10)),
        )
        for _ in range(S)
    ]
    seed = draw(st.integers(0, 2**31 - 1))
    logits = torch.randn(S, V, generator=gen(seed)) * 3
    return logits, params, [draw(ids) for _ in range(S)], [draw(ids) for _ in range(S)]


@given(penalty_case())
@FAST
def test_penalties_match_oracle(case):
    logits, params, prompts, outputs = case
    V = logits.shape[1]
    batch = build(params, V, prompts, outputs)
    before = logits.clone()
    got = apply_penalties(logits, batch)
    assert torch.equal(logits, before)  # input untouched
    if not any(p.needs_penalties for p in params):
        assert batch.output_counts is None and torch.equal(got, logits)
        return
    for s, p in enumerate(params):
        want = torch.tensor(oracle_penalties(logits[s].tolist(), prompts[s], outputs[s], p))
        torch.testing.assert_close(got[s], want.float(), rtol=1e-5, atol=1e-5)


def test_penalties_steer_greedy():
    logits = torch.tensor([[2.0, 1.9, 0.0]])
    p = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    batch = build([p], 3, prompts=[[0]], outputs=[[]])
    assert sample(logits, batch).item() == 1
    batch = build([SamplingParams(temperature=0.0, presence_penalty=0.5)], 3, outputs=[[0, 2]])
    assert sample(logits, batch).item() == 1


def test_build_without_penalties_or_bans_leaves_none():
    params = [SamplingParams(), SamplingParams(temperature=0.0, min_tokens=2, logprobs=3)]
    batch = build(params, 10, prompts=[[1, 2], [3]], outputs=[[4], [5, 6]], eos=[9])
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty",
                 "output_counts", "prompt_mask", "banned"):
        assert getattr(batch, name) is None, name
    assert batch.max_num_logprobs == 3
    assert build([SamplingParams()], 10).max_num_logprobs == -1


def test_build_penalty_tensors():
    params = [SamplingParams(frequency_penalty=0.5), SamplingParams()]
    batch = build(params, 6, prompts=[[1, 1, 5], [2]], outputs=[[3, 3, 4], [0]])
    assert batch.output_counts.tolist() == [[0, 0, 0, 2, 1, 0], [0] * 6]  # neutral row left empty
    assert batch.prompt_mask[0].tolist() == [False, True, False, False, False, True]
    assert batch.output_counts.dtype == torch.float32 and batch.prompt_mask.dtype == torch.bool


# ---------------------------------------------------------------- banned tokens


def test_min_tokens_bans_eos_and_stop_ids_until_reached():
    V, eos = 8, 7
    logits = torch.zeros(1, V)
    logits[0, eos] = 10.0
    logits[0, 3] = 9.0
    p = SamplingParams(temperature=1.0, min_tokens=3, stop_token_ids=[3])
    for n_out in range(3):
        batch = build([p] * 400, V, outputs=[[0] * n_out] * 400, eos=[eos])
        assert batch.banned is not None
        tokens = sample(logits.expand(400, V), batch, gen(n_out))
        assert not ((tokens == eos) | (tokens == 3)).any()
    reached = build([p], V, outputs=[[0, 0, 0]], eos=[eos])
    assert reached.banned is None
    assert sample(logits, build([SamplingParams(temperature=0.0, min_tokens=3)], V, outputs=[[0] * 3], eos=[eos])).item() == eos


def test_ignore_eos_does_not_ban_eos():
    batch = build([SamplingParams(min_tokens=5, ignore_eos=True, stop_token_ids=[2])], 6, eos=[5])
    assert batch.banned[0].tolist() == [False, False, True, False, False, False]


def test_banned_in_greedy_batch():
    logits = torch.tensor([[5.0, 4.0, 1.0], [5.0, 4.0, 1.0]])
    params = [SamplingParams(temperature=0.0, min_tokens=1), SamplingParams(temperature=0.0)]
    batch = build(params, 3, outputs=[[], []], eos=[0])
    assert sample(logits, batch).tolist() == [1, 0]


# ---------------------------------------------------------------- logprobs


@given(
    st.integers(1, 5), st.integers(1, 30), st.integers(0, 2**31 - 1), st.integers(0, 8), st.booleans()
)
@FAST
def test_compute_logprobs_matches_oracle(S, V, seed, num_top, ties):
    g = gen(seed)
    logits = torch.randn(S, V, generator=g) * 3
    if ties:
        logits = logits.round()
    token_ids = torch.randint(0, V, (S,), generator=g)
    out = compute_logprobs(logits, token_ids, num_top)
    n = min(num_top, V)
    assert out.top_ids.shape == (S, n) and out.top_logprobs.shape == (S, n)
    assert out.token_ranks.dtype == torch.int64 and out.top_ids.dtype == torch.int64
    for s in range(S):
        row = logits[s].double().tolist()
        m = max(row)
        lse = m + math.log(sum(math.exp(v - m) for v in row))
        lp = [v - lse for v in row]
        t = int(token_ids[s])
        assert out.token_logprobs[s].item() == pytest.approx(lp[t], abs=1e-5)
        # vLLM rank: number of tokens at least as likely as the chosen one. Compare on the
        # raw logits, where ties are exact.
        assert out.token_ranks[s].item() == sum(1 for v in logits[s].tolist() if v >= logits[s, t].item())
        want_top = sorted(lp, reverse=True)[:n]
        assert out.top_logprobs[s].tolist() == pytest.approx(want_top, abs=1e-5)
        for i, v in zip(out.top_ids[s].tolist(), out.top_logprobs[s].tolist()):
            assert lp[i] == pytest.approx(v, abs=1e-5)
        assert len(set(out.top_ids[s].tolist())) == n


def test_logprobs_are_raw_and_greedy_rank_is_one():
    logits = torch.randn(4, 100, generator=gen(2))
    out = compute_logprobs(logits, logits.argmax(-1), 0)
    assert out.token_ranks.tolist() == [1, 1, 1, 1]
    torch.testing.assert_close(out.token_logprobs, logits.log_softmax(-1).max(-1).values)


# ---------------------------------------------------------------- dtypes


def test_bfloat16_logits():
    logits = (torch.randn(5, 40, generator=gen(4)) * 3).bfloat16()
    as_f32 = logits.float()
    greedy = build([SamplingParams(temperature=0.0)] * 5, 40)
    assert torch.equal(sample(logits, greedy), as_f32.argmax(-1))
    params = [SamplingParams(seed=i, top_k=10, top_p=0.9, min_p=0.05, frequency_penalty=0.2) for i in range(5)]
    mk = lambda: build(params, 40, outputs=[[1, 2]] * 5, gens=[gen(i) for i in range(5)])  # noqa: E731
    got = sample(logits, mk())
    assert got.dtype == torch.int64 and got.shape == (5,)
    assert torch.equal(got, sample(as_f32, mk()))
    lp = compute_logprobs(logits, got, 2)
    assert lp.token_logprobs.dtype == torch.float32 and lp.top_logprobs.dtype == torch.float32


# ------------------------------------------------- logit bias, allowed tokens, bad words, logits processors


def with_bad_words(p: SamplingParams, *ids) -> SamplingParams:
    """p as admission leaves it for bad words tokenized to `ids` (token tuples)."""
    import attrs

    return attrs.evolve(p, _bad_words_token_ids=tuple(ids))


def test_logit_bias_steers_its_row_only():
    logits = torch.tensor([[3.0, 1.0, 0.0, 0.0]] * 2)
    params = [SamplingParams(temperature=0.0, logit_bias={2: 5.0}), SamplingParams(temperature=0.0)]
    batch = build(params, 4)
    assert sample(logits, batch).tolist() == [2, 0]
    want = logits.clone()
    want[0, 2] += 5.0
    torch.testing.assert_close(process_logits(logits, batch), want)  # temperature 1 for greedy rows


def test_allowed_token_ids_bound_every_draw():
    V = 50
    logits = torch.randn(2, V, generator=gen(3))
    allowed = [7, 11, 40]
    params = [SamplingParams(allowed_token_ids=allowed, seed=1), SamplingParams(temperature=0.0, allowed_token_ids=[9])]
    for seed in range(30):
        got = sample(logits, build(params, V, gens=[gen(seed), None]))
        assert got[0].item() in allowed and got[1].item() == 9
    support = torch.isfinite(process_logits(logits, build(params, V)))
    assert torch.nonzero(support[0]).flatten().tolist() == allowed


def test_bad_word_last_token_banned_only_after_its_prefix():
    logits = torch.tensor([[0.0, 0.0, 0.0, 5.0, 9.0, 1.0]])  # greedy: 4, then 3
    p = with_bad_words(SamplingParams(temperature=0.0), (2, 4), (5,))
    assert sample(logits, build([p], 6, outputs=[[1]])).item() == 4  # prefix (2,) not at the tail
    assert sample(logits, build([p], 6, outputs=[[4, 2]])).item() == 3  # ...now it is: 4 would complete it
    assert sample(logits, build([p], 6, outputs=[[2, 1]])).item() == 4  # only the tail counts
    banned = build([p], 6, outputs=[[]]).banned
    assert banned[0].tolist() == [False] * 5 + [True]  # a one-token bad word is always banned


def test_logits_processors_get_the_row_and_run_before_temperature():
    seen = []

    def two(out, row):
        seen.append(("two", list(out), row.shape))
        row = row.clone()
        row[1] = 100.0
        return row

    def three(prompt, out, row):
        seen.append(("three", list(prompt), list(out)))
        return row * 2

    logits = torch.zeros(2, 4)
    params = [SamplingParams(temperature=0.5, logits_processors=[two, three]), SamplingParams(temperature=0.5)]
    batch = build(params, 4, prompts=[[1, 2], [3]], outputs=[[3], [0]])
    before = logits.clone()
    got = process_logits(logits, batch)
    assert torch.equal(logits, before)  # the input is untouched
    assert seen == [("two", [3], (4,)), ("three", [1, 2], [3])]
    assert got[0].tolist() == [0.0, 400.0, 0.0, 0.0]  # (100 * 2) / temperature 0.5
    assert got[1].tolist() == [0.0] * 4
    bad = build([SamplingParams(logits_processors=[lambda out, row: row[:2]]),
                 SamplingParams(logits_processors=[two])], 4)
    got = process_logits(logits, bad)  # a bad row keeps its logits and is recorded; the others go on
    assert got[0].tolist() == [0.0] * 4 and got[1, 1].item() == 100.0
    assert list(bad.processor_errors) == [0] and "not a tensor of shape (4,)" in bad.processor_errors[0]


def test_bias_comes_before_penalties():
    # Token 0 is in the prompt: repetition_penalty divides a positive logit and multiplies a negative one, so
    # the order matters; vLLM adds the bias first (1 - 2 = -1, then * 2).
    logits = torch.tensor([[1.0, 0.0]])
    p = SamplingParams(repetition_penalty=2.0, logit_bias={0: -2.0})
    got = process_logits(logits, build([p], 2, prompts=[[0]]))
    assert got[0, 0].item() == -2.0


def test_nvidia_sampler_applies_the_logit_controls():
    pytest.importorskip("triton")
    from deepinfer.backends.nvidia.ops import INTERPRET, NvidiaOps
    from deepinfer.backends.reference.ops import ReferenceOps
    from deepinfer.testing.kernels import DEV, HAS_CUDA

    if not HAS_CUDA and not INTERPRET:
        pytest.skip("no CUDA and no Triton interpreter")
    V = 40
    logits = torch.randn(4, V, generator=gen(5)).to(DEV)
    params = [SamplingParams(top_k=5, seed=1, logit_bias={3: 4.0}),
              SamplingParams(top_p=0.9, seed=2, allowed_token_ids=[1, 2, 30]),
              with_bad_words(SamplingParams(min_p=0.1, seed=3), (6, 8)),
              SamplingParams(top_k=3, seed=4, logits_processors=[lambda out, row: row.flip(0)])]

    def batch():
        gens = [torch.Generator(DEV).manual_seed(s) for s in range(4)]
        return SamplingBatch.build(params, [[1]] * 4, [[6]] * 4, gens, V, [], DEV)

    ops = NvidiaOps(DEV)
    got = ops.sample(logits, batch())
    assert ops.kernel_calls["sampling_filter"] == 1  # the Triton filter ran, after the controls
    assert torch.equal(got, ReferenceOps(DEV).sample(logits, batch()))
    assert got[1].item() in (1, 2, 30) and got[2].item() != 8

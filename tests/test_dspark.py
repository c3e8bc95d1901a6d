"""DSpark (models/ced/dspark.py, stages/dspark_draft.py): the engine keeps the target's hidden states the drafter
reads (checked against the training path's decoder), greedy output equals plain decoding whatever the drafter
proposes, sampled drafts are verified against their own distributions, bad setups fail clearly, and the
drafter shipped beside the demo model is small and was trained."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.models.ced import train as ced_train
from deepinfer.models.ced.dspark import DSpark, DSparkConfig, load_dspark, save_dspark
from deepinfer.models.loader import resolve_model_path
from deepinfer.testing.ced import REPLAY_CONFIG, build_ced_checkpoint
from deepinfer.testing.compare import NEAR_TIE, assert_same_or_near_tie
from deepinfer.testing.models import build_tiny_hf_model

DEMO_DRAFTER = Path(resolve_model_path(None)) / "dspark"


@pytest.fixture(scope="module")
def ced(tmp_path_factory):
    d = tmp_path_factory.mktemp("dspark_ced")
    cfg = build_ced_checkpoint(d, seed=11, **REPLAY_CONFIG)
    net = DSpark(DSparkConfig(target_hidden=cfg.hidden_size, vocab_size=cfg.vocab_size, hidden=32, num_blocks=1,
                              num_heads=2, ffn=64))
    net.init_weights(1, std=0.2)
    save_dspark(net, d / "dspark")
    return str(d), cfg


def spec(k=2, **kw):
    return {"method": "dspark", "num_speculative_tokens": k, **kw}


def test_kept_hidden_states_are_the_decoders(ced):
    """What the drafter reads: the last 3 decoder layers' outputs at the position that produced each last token."""
    path, cfg = ced
    # On the CPU: the oracle below runs the reference ops; on a GPU the engine's Triton kernels (TF32 dots, fused
    # FP8 rounding) differ from it by more than the 1e-4 this test holds the kept rows to.
    llm = LLM(path, num_kv_blocks=64, block_size=4, speculative_config=spec(), device="cpu")
    model = llm.engine.model
    prompt = [5, 9, 13, 17, 21]  # within the window: no replay cut, so every position is exact
    out = llm.generate([prompt], SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True),
                       use_tqdm=False)[0]
    seq_tokens = prompt + list(out.outputs[0].token_ids)
    # The oracle: the training path's batched decoder (no paging, no rings) over the whole sequence.
    ids = torch.tensor([seq_tokens], device=model.embed.weight.device)
    h_enc, ctx = ced_train.encode(model, ids)
    kept: list = []
    N = ids.shape[1]
    zero = torch.zeros(1, dtype=torch.long, device=ids.device)
    ced_train.decode(model, h_enc, h_enc, torch.arange(N, device=ids.device)[None], zero, zero, ctx, collect=kept)
    want = torch.cat(kept[-3:], dim=-1)[0]  # [N, 3d]
    seq = llm.engine.requests.get(out.request_id)
    # The finished sequence's context is the one its last step kept: the position that produced its last token
    # was N - 2 (its last token was sampled there), unless a verified row accepted further.
    got = model.captured_hidden
    assert got is not None and got.shape[-1] == 3 * cfg.hidden_size
    assert seq is None  # finished and reported
    ctx_pos = want[N - 2]
    scale = want.abs().max()
    assert any((row - ctx_pos).abs().max() <= 1e-4 * scale for row in got), "no kept row matches position N - 2"


def test_greedy_dspark_equals_plain_decoding(ced):
    path, _ = ced
    ps = [[5, 9, 13, 17, 21, 25, 29, 33], [40, 41, 42, 43, 40, 41, 42]]
    sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in LLM(path, num_kv_blocks=64, block_size=4).generate(ps, sp, use_tqdm=False)]
    fast = LLM(path, num_kv_blocks=64, block_size=4, speculative_config=spec())
    got = [o.outputs[0].token_ids for o in fast.generate(ps, sp, use_tqdm=False)]
    assert got == plain
    assert fast.spec_stats()["draft_tokens"] > 0


def test_sampled_dspark_repeats_with_a_seed_and_checks_its_drafts(ced):
    path, _ = ced
    sp = SamplingParams(max_tokens=20, temperature=1.0, seed=9, ignore_eos=True)
    runs = []
    for _ in range(2):
        llm = LLM(path, num_kv_blocks=64, block_size=4, speculative_config=spec())
        runs.append(llm.generate([[5, 9, 13, 17]], sp, use_tqdm=False)[0].outputs[0].token_ids)
    assert runs[0] == runs[1] and len(runs[0]) == 20
    st = llm.spec_stats()
    assert st["draft_tokens"] > 0 and st["accepted_tokens"] <= st["draft_tokens"]


def test_bad_dspark_setups_fail_clearly(ced, tmp_path):
    path, cfg = ced
    with pytest.raises(FileNotFoundError, match="config.json is missing"):
        LLM(path, num_kv_blocks=64, block_size=4, speculative_config=spec(drafter=str(tmp_path / "none")))
    wrong = DSpark(DSparkConfig(target_hidden=cfg.hidden_size + 8, vocab_size=cfg.vocab_size, hidden=32,
                                num_blocks=1, num_heads=2, ffn=64))
    save_dspark(wrong, tmp_path / "wrong")
    with pytest.raises(ValueError, match="trained for hidden size 56"):
        LLM(path, num_kv_blocks=64, block_size=4, speculative_config=spec(model=str(tmp_path / "wrong")))
    llama = tmp_path / "llama"
    build_tiny_hf_model(llama, "llama")
    with pytest.raises(ValueError, match="needs a CED target"):
        LLM(str(llama), num_kv_blocks=64, block_size=4, speculative_config=spec(drafter=str(tmp_path / "wrong")))
    with pytest.raises(ValueError, match="hidden=30 is not a multiple of num_heads=4"):
        DSparkConfig(target_hidden=8, vocab_size=8, hidden=30)


@pytest.mark.skipif(not (DEMO_DRAFTER / "model.safetensors").is_file(), reason="no drafter shipped beside the demo")
def test_the_demo_drafter_is_small_trained_and_speeds_acceptance():
    ev = json.loads((DEMO_DRAFTER / "eval.json").read_text())
    assert (DEMO_DRAFTER / "model.safetensors").stat().st_size <= 5 * 10**6
    assert ev["top1_agreement_by_position"][0] > 0.3  # far from a random drafter's ~0
    net = load_dspark(DEMO_DRAFTER, "cpu")
    assert net.config.positions == 5
    sp = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    ps = ["import os\n\n\ndef ", "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self"]
    plain = LLM().generate(ps, SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True, logprobs=2),
                           use_tqdm=False)
    fast = LLM(speculative_config={"method": "dspark", "num_speculative_tokens": 4})
    for a, b in zip(fast.generate(ps, sp, use_tqdm=False), plain):
        dtype = "bfloat16" if torch.cuda.is_available() else "float32"
        assert_same_or_near_tie(a.outputs[0].token_ids, b.outputs[0].token_ids, b.outputs[0].logprobs,
                                NEAR_TIE[dtype])
    assert fast.spec_stats()["acceptance_rate"] > 0.1  # a random drafter: ~0 (test_greedy_dspark_equals_plain...)


# ----------------------------------------------------------------------------------------------------------
# Dynamic draft lengths (CED.md's scheduler): the greedy admission against a brute-force optimum.

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as hst  # noqa: E402

from deepinfer.core.speculative import SpeculativeConfig, StepTime, choose_lengths  # noqa: E402


def _survivals():
    row = hst.lists(hst.floats(0.0, 1.0), min_size=0, max_size=3).map(lambda cs: [
        float(torch.tensor(cs).cumprod(0)[i]) for i in range(len(cs))])
    return hst.lists(row, min_size=1, max_size=3)


@settings(max_examples=150, deadline=None)
@given(_survivals(), hst.floats(0.1, 10.0), hst.floats(0.001, 2.0))
def test_chosen_lengths_are_optimal(survival, a, b):
    import itertools

    T = lambda n: a + b * n  # noqa: E731

    def value(ks):
        return sum(1 + sum(s[:k]) for s, k in zip(survival, ks)) / T(sum(1 + k for k in ks))

    best = max(value(ks) for ks in itertools.product(*[range(len(s) + 1) for s in survival]))
    got = choose_lengths(survival, T)
    assert all(0 <= k <= len(s) for k, s in zip(got, survival))
    assert value(got) >= best * (1 - 1e-9)


@pytest.mark.parametrize("rows", [1, 4, 32])
def test_low_confidences_draft_nothing_high_ones_everything(rows):
    """Each extra token costs 2% of a step (T = 1 + 0.02 n): drafts predicted to stand 1% of the time are not
    verified (k = 0), drafts predicted to stand 99% of the time all are (k = 5); under a flat T(n) every draft
    with any chance is verified (it costs nothing)."""
    T = lambda n: 1.0 + 0.02 * n  # noqa: E731
    low = [[0.01 ** (i + 1) for i in range(5)]] * rows
    high = [[0.99 ** (i + 1) for i in range(5)]] * rows
    assert choose_lengths(low, T) == [0] * rows
    assert choose_lengths(high, T) == [5] * rows
    assert choose_lengths(low, lambda n: 1.0) == [5] * rows
    assert choose_lengths(high, lambda n: 1.0) == [5] * rows


def test_step_time_through_one_token_count_keeps_the_measured_time():
    """All samples at one n (a step that always verifies): T(n) there is what was measured, the prior's shape
    elsewhere (the slope cannot be fitted from one point)."""
    st = StepTime(prior_s=0.5)
    for _ in range(20):
        st.record(80, 0.03)
    assert st(80) == pytest.approx(0.03)
    assert st(16) < st(80)


def test_step_time_fits_the_recorded_steps():
    st = StepTime(prior_s=0.5)
    assert st(10) == pytest.approx(0.5 + 0.5 / 64 * 10)  # the prior before enough steps
    for n in range(1, 40, 3):
        st.record(n, 0.02 + 0.001 * n)
    assert st.coefficients() == pytest.approx((0.02, 0.0, 0.001), rel=1e-6)


def test_step_time_tells_a_rows_cost_from_a_tokens_cost():
    """Verify steps (R rows x 5 tokens) and plain ones (R x 1) at several R: the fit recovers a + b R + c n, so
    a plain step of 128 rows is priced as one, not as 128/640 of a verify step (a fit in tokens alone)."""
    a, b, c = 0.003, 2e-5, 5e-6
    st = StepTime()
    for R in (1, 16, 64):
        st.record(5 * R, a + b * R + c * 5 * R, R)
    for _ in range(8):
        st.record(5 * 64, a + b * 64 + c * 320, 64)
    assert not st.separates()  # every sample a verify step of width 5
    assert st(128, 128) < 0.8 * (a + b * 128 + c * 128)  # the tokens-alone fit underprices a plain step
    st.record(128, a + b * 128 + c * 128, 128)  # one plain step
    assert st.separates()
    assert st.coefficients() == pytest.approx((a, b, c), rel=1e-6)
    assert st(128, 128) == pytest.approx(a + b * 128 + c * 128, rel=1e-6)
    st2 = StepTime()
    for R in (1, 2, 4, 8, 16, 32, 64, 128):  # ragged steps at one row count: tokens alone, exact at those rows
        st2.record(R + 7, a + b * 8 + c * (R + 7), 8)
    assert st2.separates() and st2(50, 8) == pytest.approx(a + b * 8 + c * 50, rel=1e-6)


@settings(max_examples=60, deadline=None)
@given(hst.lists(hst.tuples(hst.integers(1, 256), hst.integers(1, 6)), min_size=8, max_size=40),
       hst.floats(1e-4, 1e-2), hst.floats(0.0, 1e-4), hst.floats(0.0, 1e-4))
def test_step_time_fit_matches_a_least_squares_oracle(steps, a, b, c):
    """Against torch.linalg.lstsq on [1, R, n] in float64 (an independent solver) whenever the samples separate
    rows from tokens and the exact coefficients are non-negative: the fit reproduces every recorded time."""
    st = StepTime()
    rows = [(w * R, R) for R, w in steps]
    for n, R in rows:
        st.record(n, a + b * R + c * n, R)
    X = torch.tensor([[1.0, R, n] for n, R in rows], dtype=torch.float64)
    y = X @ torch.tensor([a, b, c], dtype=torch.float64)
    if st.separates() and torch.linalg.matrix_rank(X) == 3:
        sol = torch.linalg.lstsq(X, y.unsqueeze(1)).solution.squeeze(1)
        fitted = torch.tensor([st(n, R) for n, R in rows], dtype=torch.float64)
        assert torch.allclose(fitted, X @ sol, rtol=1e-6, atol=1e-9 * float(y.abs().max()))


def test_step_time_running_sums_follow_the_window():
    """The fit from the running sums (steps added and dropped one at a time, over many windows) equals the fit of
    a fresh StepTime holding only the window's steps."""
    import random

    rng = random.Random(5)
    st = StepTime(window=64)
    for _ in range(1000):
        R = rng.randint(1, 128)
        n = R * rng.choice((1, 5))
        st.record(n, 0.002 + 3e-5 * R + 4e-6 * n + rng.uniform(0, 1e-4), R)
    fresh = StepTime(window=64)
    for x in st.samples:
        fresh.record(*x)
    assert len(st.samples) == 64
    assert st.coefficients() == pytest.approx(fresh.coefficients(), rel=1e-9, abs=1e-15)
    assert st.separates() == fresh.separates() is True


def test_step_time_file_seeds_the_fit_and_bad_files_are_named(tmp_path):
    st = StepTime()
    for n in range(1, 40, 3):
        st.record(n, 0.02 + 0.001 * n)
    st.save(tmp_path / "t.json")
    again = StepTime.load(tmp_path / "t.json")
    assert again.coefficients() == pytest.approx((0.02, 0.0, 0.001), rel=1e-6)
    again.record(100, 10.0)  # refreshed online: a new step moves the fit
    assert again.coefficients()[2] > 0.01
    (tmp_path / "rows.json").write_text('{"samples": [[5, 0.01, 1], [10, 0.02, 2], [3, 0.01]]}')
    assert StepTime.load(tmp_path / "rows.json").samples == [(5, 0.01, 1), (10, 0.02, 2), (3, 0.01, None)]
    old = StepTime.load(tmp_path / "t.json")  # an older file's samples (no rows): a fit in tokens alone
    assert len(old.samples) >= 8 and not old.separates()
    (tmp_path / "bad.json").write_text('{"samples": [[0, 1.0]]}')
    (tmp_path / "junk.json").write_text("not json")
    for name, match in (("missing.json", "no file"), ("bad.json", "fewer than 1 token"),
                        ("junk.json", "not a StepTime.save file")):
        with pytest.raises(ValueError, match=match):
            StepTime.load(tmp_path / name)
    with pytest.raises(ValueError, match="step_time=3 is invalid"):
        SpeculativeConfig.parse({"method": "dspark", "num_speculative_tokens": 2, "step_time": 3})
    spec = SpeculativeConfig.parse({"method": "dspark", "num_speculative_tokens": 2, "step_time": tmp_path / "t.json"})
    assert spec.step_time == str(tmp_path / "t.json") and "step_time" not in spec.options


def test_dynamic_needs_a_drafter_that_reports_confidences(ced):
    pytest.importorskip("deepinfer_ngram", reason="the n-gram example plugin is not installed (CI installs it)")
    with pytest.raises(ValueError, match="dynamic=True needs a drafter that reports confidences"):
        LLM(ced[0], num_kv_blocks=64, block_size=4, speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                                                         "dynamic": True})


def test_dynamic_dspark_keeps_greedy_output_and_optional_drafters(ced, tmp_path):
    path, _ = ced
    ps = [[5, 9, 13, 17, 21, 25, 29, 33], [40, 41, 42, 43, 40, 41, 42]]
    sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in LLM(path, num_kv_blocks=64, block_size=4).generate(ps, sp, use_tqdm=False)]
    fast = LLM(path, num_kv_blocks=64, block_size=4, speculative_config=spec(dynamic=True))
    assert [o.outputs[0].token_ids for o in fast.generate(ps, sp, use_tqdm=False)] == plain
    assert len(fast.engine.step_time.samples) > 0
    fast.engine.step_time.save(tmp_path / "steps.json")
    seeded = LLM(path, num_kv_blocks=64, block_size=4,
                 speculative_config={**spec(dynamic=True), "step_time": str(tmp_path / "steps.json")})
    assert seeded.engine.step_time.samples == fast.engine.step_time.samples
    llama = tmp_path / "llama"
    build_tiny_hf_model(llama, "llama")
    llm = LLM(str(llama), num_kv_blocks=64, block_size=4, speculative_config=spec(optional=True))
    assert llm.spec_stats() == {"enabled": False}  # no drafter for this model: plain decoding


# ----------------------------------------------------------------------------------------------------------
# The engine's batched drafting (DSparkDraft.propose_batch) against one sequence at a time (propose).

@pytest.fixture(scope="module")
def drafter(ced):
    return LLM(ced[0], num_kv_blocks=64, block_size=4, speculative_config=spec()).engine.drafter  # any k below


@settings(max_examples=20, deadline=None)
@given(hst.lists(hst.tuples(hst.integers(1, 12), hst.integers(1, 7), hst.sampled_from([None, 0.0, 1.0, 0.7])),
                 min_size=1, max_size=6), hst.integers(0, 99), hst.sampled_from(["tensors", "one step", "two steps"]))
def test_batched_drafting_equals_one_sequence_at_a_time(drafter, rows, seed, kept):
    """Each sequence (its own length, room, greedy or seeded sampling, or no kept context: None) gets the drafts,
    draft distributions and survival from propose_batch that propose gives it alone, and its generator is left
    where propose leaves it. The batch's contexts are tensors, or rows of a step's kept states as the engine
    keeps them (layout.HiddenRow: of one step, gathered at once, or of two)."""
    from deepinfer.core.state import Sequence
    from deepinfer.layout import HiddenRow

    net = drafter.drafter_net
    dev, width, V = net.anchor.weight.device, net.context.in_features, net.config.vocab_size
    g = torch.Generator().manual_seed(seed)

    def batch():
        out = []
        for i, (n, _, temp) in enumerate(rows):
            sp = SamplingParams(temperature=temp or 0.0, seed=seed + i)
            s = Sequence(seq_id=i, request_id=str(i), index=0, token_ids=torch.randint(0, V, (n,), generator=g)
                         .tolist(), num_prompt_tokens=n, params=sp, arrival=i)
            s.draft_context = None if temp is None else (torch.randn(width, generator=g) * 3).to(dev)
            s.generator = None if sp.greedy else torch.Generator(dev).manual_seed(seed + i)
            out.append(s)
        return out

    state = g.get_state()
    alone = batch()
    g.set_state(state)
    together = batch()
    if kept != "tensors":  # each context becomes a row, in shuffled order among junk rows, of one or two tables
        have = [s for s in together if s.draft_context is not None]
        tables = [have[0::2], have[1::2]] if kept == "two steps" else [have]
        for part in tables:
            if not part:
                continue
            order = torch.randperm(2 * len(part), generator=g).tolist()
            table = torch.randn(2 * len(part), width, generator=g).to(dev)
            for s, at in zip(part, order):
                table[at] = s.draft_context
                s.draft_context = HiddenRow(table, at)
    ks = [k for _, k, _ in rows]
    want = [drafter.propose(s, k) for s, k in zip(alone, ks)]
    got = drafter.propose_batch(together, ks)
    assert got == want
    for i, (a, b) in enumerate(zip(alone, together)):
        if a.draft_context is None:
            continue
        assert len(got[i]) == min(ks[i], net.config.positions)
        if a.params.greedy:  # verified by argmax alone: no distributions kept
            assert a.draft_probs is None and b.draft_probs is None, i
        else:
            assert b.draft_probs.shape == (len(got[i]), V), i
            tol = 1e-5 * max(1.0, float(a.draft_probs.abs().max())) if a.draft_probs.numel() else 0.0
            torch.testing.assert_close(b.draft_probs, a.draft_probs, rtol=1e-4, atol=tol, msg=f"sequence {i}")
        assert b.draft_survival == pytest.approx(a.draft_survival, rel=1e-5, abs=1e-7), i
        if a.generator is not None:  # a seeded row's generator advanced by its own draws only
            assert torch.equal(b.generator.get_state(), a.generator.get_state()), i

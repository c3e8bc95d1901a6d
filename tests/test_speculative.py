"""Speculative decoding (core/speculative.py) with the n-gram draft plugin (plugins/deepinfer-ngram): greedy
output equals plain decoding on the Llama family and CED (whose rejected drafts roll back SWA rings and
compressor tails), the rejection scheme keeps the target distribution, accounting adds up, bad configs fail."""

from __future__ import annotations

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.core.speculative import SpeculativeConfig, accept_row
from deepinfer.testing.ced import REPLAY_CONFIG, build_ced_checkpoint
from deepinfer.testing.compare import NEAR_TIE, assert_same_or_near_tie

pytest.importorskip("deepinfer_ngram", reason="the n-gram draft plugin: pip install -e plugins/deepinfer-ngram")

NGRAM = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=None)


def prompts(vocab: int) -> list:
    g = torch.Generator().manual_seed(5)
    motif = torch.randint(3, vocab, (6,), generator=g).tolist()
    return [motif * 4 + [7, 8], torch.randint(3, vocab, (23,), generator=g).tolist(), motif[:3] * 3]


@pytest.fixture(scope="module")
def ced(tmp_path_factory):
    d = tmp_path_factory.mktemp("spec_ced")
    build_ced_checkpoint(d, seed=11, **REPLAY_CONFIG)
    return str(d)


def greedy_runs(path, spec, sp=GREEDY, **kw):
    plain = LLM(path, num_kv_blocks=128, block_size=4, **kw)
    fast = LLM(path, num_kv_blocks=128, block_size=4, speculative_config=spec, **kw)
    ps = prompts(plain.engine.model.vocab_size)
    ref = plain.generate(ps, SamplingParams(**{**attrs_of(sp), "logprobs": 2}), use_tqdm=False)
    got = fast.generate(ps, sp, use_tqdm=False)
    return ref, got, fast


def attrs_of(sp):
    return {k: getattr(sp, k) for k in ("max_tokens", "temperature", "ignore_eos", "seed")}


@pytest.mark.parametrize("which", ["llama", "ced"])
def test_greedy_speculation_reproduces_plain_decoding(which, spec_llama, ced):
    ref, got, fast = greedy_runs(spec_llama if which == "llama" else ced, NGRAM)
    for i, (a, b) in enumerate(zip(got, ref)):
        assert a.error is None, a.error
        assert_same_or_near_tie(a.outputs[0].token_ids, b.outputs[0].token_ids, b.outputs[0].logprobs,
                                NEAR_TIE["float32"], what=f"{which} prompt {i}")
    st = fast.spec_stats()
    # The motif prompts repeat: drafts are proposed, some stand, some are rejected (rolled back).
    assert st["draft_tokens"] > 0 and 0 < st["accepted_tokens"] < st["draft_tokens"], st
    assert st["tokens_per_verified_row"] == pytest.approx(1 + st["accepted_tokens"] / st["verified_rows"], abs=1e-3)


@pytest.mark.parametrize("penalties", [False, True])
def test_penalties_and_logprobs_under_speculation_match_plain_decoding(spec_llama, penalties):
    """Penalties count each draft before the next position; logprobs are each token's own position's."""
    pen = dict(presence_penalty=0.05, frequency_penalty=0.02, repetition_penalty=1.01) if penalties else {}
    sp = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, logprobs=3, **pen)
    ps = prompts(512)
    ref = LLM(spec_llama, num_kv_blocks=128, block_size=4).generate(ps, sp, use_tqdm=False)
    fast = LLM(spec_llama, num_kv_blocks=128, block_size=4, speculative_config=NGRAM)
    got = fast.generate(ps, sp, use_tqdm=False)
    st = fast.spec_stats()
    assert st["accepted_tokens"] > 0, st  # drafts stood, so the counts after them matter
    for i, (a, b) in enumerate(zip(got, ref)):
        a, b = a.outputs[0], b.outputs[0]
        step = assert_same_or_near_tie(a.token_ids, b.token_ids, b.logprobs, NEAR_TIE["float32"], what=f"prompt {i}")
        n = len(a.token_ids) if step is None else step
        assert len(a.logprobs) == len(a.token_ids)
        for j in range(n):
            t = a.token_ids[j]
            assert set(a.logprobs[j]) == set(b.logprobs[j]), j
            assert abs(a.logprobs[j][t].logprob - b.logprobs[j][t].logprob) <= 1e-4 * max(1, abs(b.logprobs[j][t].logprob))
            assert a.logprobs[j][t].rank == b.logprobs[j][t].rank


def test_seeded_sampling_with_speculation_repeats(spec_llama):
    sp = SamplingParams(max_tokens=30, temperature=0.8, top_k=20, top_p=0.9, seed=1234, ignore_eos=True)
    runs = []
    for _ in range(2):
        llm = LLM(spec_llama, num_kv_blocks=128, block_size=4, speculative_config=NGRAM)
        runs.append([o.outputs[0].token_ids for o in llm.generate(prompts(512), sp, use_tqdm=False)])
    assert runs[0] == runs[1]
    assert llm.spec_stats()["draft_tokens"] > 0


def test_requests_that_cannot_speculate_decode_one_token_at_a_time(spec_llama):
    llm = LLM(spec_llama, num_kv_blocks=128, block_size=4, speculative_config=NGRAM)
    out = llm.generate(prompts(512)[:1], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                                        logit_bias={5: 0.5}), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 12 and llm.spec_stats()["draft_tokens"] == 0


def test_max_tokens_is_never_exceeded(spec_llama):
    llm = LLM(spec_llama, num_kv_blocks=128, block_size=4, speculative_config={**NGRAM, "num_speculative_tokens": 4})
    for n in (1, 2, 5, 9):
        out = llm.generate(prompts(512)[:1], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True),
                           use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) == n and out.outputs[0].finish_reason == "length"


# ----------------------------------------------------------------------------------------------------------
# The rejection scheme against the distribution it must keep (an oracle written from the definition).

def frequencies(draws, V) -> torch.Tensor:
    return torch.bincount(torch.tensor(draws), minlength=V).double() / len(draws)


@pytest.mark.parametrize("with_q", [False, True])
def test_accepted_or_resampled_tokens_follow_the_target(with_q):
    V, N = 6, 12000
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0], [0.0, 0.3, 2.0, -1.0, 1.0, 0.0],
                           [1.0, 1.0, 1.0, 1.0, 1.0, 1.0]])  # the third row: the bonus position
    p = logits.softmax(-1).double()
    drafts = [1, 4]
    q = torch.tensor([[0.1, 0.5, 0.1, 0.1, 0.1, 0.1], [0.05, 0.05, 0.05, 0.05, 0.75, 0.05]]) if with_q else None
    gen, dgen = torch.Generator().manual_seed(7), torch.Generator().manual_seed(8)
    first, second = [], []
    for _ in range(N):
        if with_q:  # a drafter with a distribution draws its drafts from it: the scheme is exact only then
            drafts = [int(torch.multinomial(q[j], 1, generator=dgen)) for j in range(2)]
        out = accept_row(logits[:2], drafts[:1], q[:1] if with_q else None, False, gen)
        first.append(out[0])
        out = accept_row(logits, drafts, q, False, gen)
        if len(out) > 1:  # the first draft stood: the next token is position two's
            second.append(out[1])
    for draws, target in ((first, p[0]), (second, p[1])):
        f = frequencies(draws, V)
        bound = 5 * (target * (1 - target) / len(draws)).sqrt() + 1e-3
        assert ((f - target).abs() <= bound).all(), (f, target)


def test_greedy_acceptance_keeps_drafts_while_they_are_the_argmax():
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 1.0], [0.0, 0.0, 9.0]])
    assert accept_row(logits, [1, 0], None, True, None) == [1, 0, 2]  # both stand, then the bonus
    assert accept_row(logits, [1, 2], None, True, None) == [1, 0]  # the second is replaced by the argmax
    assert accept_row(logits, [2, 0], None, True, None) == [1]


# ----------------------------------------------------------------------------------------------------------
# Configuration errors name what was wrong.

def test_bad_speculative_configs_fail_clearly(spec_llama, ced):
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(spec_llama, num_kv_blocks=64, block_size=4, speculative_config={"method": "ngram", "num_speculative_tokens": 0})
    with pytest.raises(ValueError, match="lacks 'method'"):
        SpeculativeConfig.parse({"num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="dynamic=True"):
        LLM(spec_llama, num_kv_blocks=64, block_size=4, speculative_config={**NGRAM, "dynamic": True})
    with pytest.raises(ValueError, match="unknown stage 'eagle'.*ngram"):
        LLM(spec_llama, num_kv_blocks=64, block_size=4, speculative_config={**NGRAM, "method": "eagle"})
    with pytest.raises(ValueError, match="'sample' stage, not a draft stage"):
        LLM(spec_llama, num_kv_blocks=64, block_size=4, speculative_config={**NGRAM, "method": "sampler"})
    with pytest.raises(ValueError, match="can roll back \\(2"):
        LLM(ced, num_kv_blocks=64, block_size=4, speculative_config={**NGRAM, "num_speculative_tokens": 3})
    with pytest.raises(ValueError, match="prompt_lookup_min=3 is larger"):
        LLM(spec_llama, num_kv_blocks=64, block_size=4, speculative_config={**NGRAM, "prompt_lookup_min": 3,
                                                                        "prompt_lookup_max": 2})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the NVIDIA backend needs a GPU")
@pytest.mark.parametrize("which", ["llama", "ced"])
def test_greedy_speculation_on_the_gpu(which, spec_llama, ced):
    """Drafted rows run eagerly beside CUDA-graph decode steps; greedy output stays plain decoding's."""
    kw = dict(device="cuda", dtype="float32", backend="nvidia", enforce_eager=False)
    ref, got, fast = greedy_runs(spec_llama if which == "llama" else ced, NGRAM, **kw)
    for i, (a, b) in enumerate(zip(got, ref)):
        assert a.error is None, a.error
        assert_same_or_near_tie(a.outputs[0].token_ids, b.outputs[0].token_ids, b.outputs[0].logprobs,
                                NEAR_TIE["bfloat16"], what=f"{which} prompt {i} on the GPU")
    assert fast.spec_stats()["accepted_tokens"] > 0


def test_structured_outputs_speculate_with_a_mask_per_drafted_position():
    """A constrained request drafts too: each drafted position is masked by the grammar after the drafts before
    it, so greedy output is plain constrained decoding's and always matches the pattern."""
    pytest.importorskip("xgrammar")
    import re

    from deepinfer import StructuredOutputsParams

    rx = r"(ab|cd){3,12}e"
    sp = SamplingParams(max_tokens=40, temperature=0.0, structured_outputs=StructuredOutputsParams(regex=rx))
    ps = ["x = ", "def f():", "abab"]
    plain = LLM(max_model_len=256, threads=1).generate(ps, sp, use_tqdm=False)
    fast = LLM(max_model_len=256, threads=1, speculative_config={**NGRAM, "num_speculative_tokens": 3})
    got = fast.generate(ps, sp, use_tqdm=False)
    for a, b in zip(got, plain):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert re.fullmatch(rx, a.outputs[0].text), a.outputs[0].text
    st = fast.spec_stats()
    assert st["draft_tokens"] > 0 and st["accepted_tokens"] > 0, st

"""Speculative decoding at its edges, as a user would probe it: configs that must fail naming the key, and
requests whose output must not depend on their neighbours (seeded rows among rows that draft more or less)."""

from __future__ import annotations

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.core.spec_accept import draw_noise

pytest.importorskip("deepinfer_ngram", reason="the n-gram draft plugin: pip install -e plugins/deepinfer-ngram")

NGRAM = {"method": "ngram", "num_speculative_tokens": 4}


class LengthDrafter:
    """Drafts its sequence's last token repeated: one for a request with a seed, k for the others, so a
    verify step mixes rows of different draft lengths."""

    def propose(self, seq, k: int) -> list:
        return [seq.token_ids[-1]] * (1 if seq.params.seed is not None else k)


def _llm(path, **kw):
    llm = LLM(path, num_kv_blocks=128, block_size=4, seed=0, speculative_config=NGRAM, **kw)
    llm.engine.drafter = LengthDrafter()
    return llm


def test_seeded_row_draws_only_its_own_drafts_noise():
    """draw_noise with lens: a seeded row's generator gives the same numbers whatever K its neighbours make."""
    alone = draw_noise(1, 1, 7, [torch.Generator().manual_seed(4)], None, "cpu", [1])
    mixed = draw_noise(2, 4, 7, [torch.Generator().manual_seed(4), None], torch.Generator().manual_seed(0),
                       "cpu", [1, 4])
    assert torch.equal(alone[0][0, :1], mixed[0][0, :1]) and torch.equal(alone[1][0], mixed[1][0])


def test_seeded_sampled_request_is_the_same_beside_rows_with_longer_drafts(spec_llama):
    """A seeded sampled request's output is the same alone and beside greedy rows that verify more drafts per
    step (its acceptance uniforms were drawn K = the step's longest draft at a time, so its generator
    advanced with its neighbours' draft lengths)."""
    seeded = SamplingParams(temperature=1.0, seed=7, max_tokens=24, ignore_eos=True)
    other = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    llm = _llm(spec_llama)
    prompt, neighbour = [5, 9, 13, 17, 21], [40, 41, 42, 43, 40, 41, 42]
    alone = llm.generate([prompt], seeded, use_tqdm=False)[0].outputs[0].token_ids
    both = llm.generate([prompt, neighbour], [seeded, other], use_tqdm=False)[0].outputs[0].token_ids
    assert llm.spec_stats()["verified_rows"] > 0
    assert both == alone


def test_a_seeded_first_token_does_not_depend_on_how_the_prompt_was_chunked(spec_llama):
    """A prompt's last chunk is one token or more depending on the step budget and the batch; drafting there drew
    a seeded request's first token through acceptance instead of plain sampling. Now only decoding rows draft, so
    its tokens are the same at any budget and beside a one-token neighbour."""
    prompt = [(i * 37) % 500 + 5 for i in range(64)] + [5]  # 65 tokens, the last one seen before (n-gram hit)
    seeded = SamplingParams(max_tokens=8, temperature=1.0, seed=7, ignore_eos=True)
    ngram = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1, "prompt_lookup_max": 1}
    runs = []
    for budget in (4096, 32, 33):  # 33: alone 33 + 32 tokens; beside a 1-token prompt 32 + 32 + 1
        llm = LLM(spec_llama, max_model_len=256, speculative_config=ngram, max_num_batched_tokens=budget,
                  enable_prefix_caching=False)
        runs.append(llm.generate([prompt], seeded, use_tqdm=False)[0].outputs[0].token_ids)
    greedy = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    runs.append(llm.generate([[9], prompt], [greedy, seeded], use_tqdm=False)[1].outputs[0].token_ids)
    assert all(r == runs[0] for r in runs), runs


def test_unknown_method_names_the_key_and_the_draft_stages(spec_llama):
    with pytest.raises(ValueError, match=r"speculative_config method='nope': unknown stage 'nope'; "
                                         r"registered draft stages: .*ngram"):
        LLM(spec_llama, speculative_config={"method": "nope", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match=r"speculative_config method='dspark': the dspark drafter needs a CED"):
        LLM(spec_llama, speculative_config={"method": "dspark", "num_speculative_tokens": 2})


class FailingDrafter:
    """Raises for the request whose prompt starts with token 5; returns None (not a list) for token 6."""

    def propose(self, seq, k: int) -> list:
        if seq.token_ids[0] == 5:
            raise RuntimeError("drafter bug")
        return None if seq.token_ids[0] == 6 else [seq.token_ids[-1]] * k


@pytest.mark.parametrize("first", [5, 6])
def test_a_failing_drafter_costs_drafts_not_requests(spec_llama, first):
    """Decision: drafts only save steps, so a drafter that raises (or returns no token list) for one sequence
    leaves that step without drafts (logged once) and every request still gets plain decoding's output; it
    used to raise out of LLM.generate and fail the whole batch."""
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [[40, 41, 42, 43, 40, 41, 42], [first, 9, 13, 17]]
    ref = LLM(spec_llama, num_kv_blocks=128, block_size=4).generate(prompts, greedy, use_tqdm=False)
    llm = _llm(spec_llama)
    llm.engine.drafter = FailingDrafter()
    got = llm.generate(prompts, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
    assert all(o.outputs[0].finish_reason == "length" for o in got)


class ConfidentDrafter:
    """k copies of the last token with survival 0.5, 0.25, ... (what dynamic lengths read)."""

    def propose(self, seq, k: int) -> list:
        seq.draft_survival = [0.5 ** (i + 1) for i in range(k)]
        return [seq.token_ids[-1]] * k


class FixedStepTime:
    def __init__(self, a: float, b: float):
        self.a, self.b = a, b

    def record(self, tokens: int, seconds: float, rows=None) -> None:
        pass

    def __call__(self, tokens: int, rows=None) -> float:
        return self.a + self.b * tokens


def test_seeded_request_repeats_under_dynamic_lengths(spec_llama):
    """Dynamic lengths follow measured step times, which change from run to run; a seeded request verifies
    every draft it has, so its output is the same whatever the step-time curve says (a curve under which
    drafts are cheap, and one under which they are not), while an unseeded neighbour's drafts are cut."""
    import attrs

    seeded = SamplingParams(temperature=1.0, seed=7, max_tokens=16, ignore_eos=True)
    other = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = [[5, 9, 13, 17, 21], [40, 41, 42, 43, 40, 41, 42]]
    outs, drafted = [], []
    for a, b in ((1.0, 1e-6), (1e-6, 1.0)):
        llm = _llm(spec_llama, enforce_eager=True)  # ragged verification cuts lengths per row (padded graphs do not)
        llm.engine.drafter, llm.engine.step_time = ConfidentDrafter(), FixedStepTime(a, b)
        llm.engine.spec = attrs.evolve(llm.engine.spec, dynamic=True)
        got = llm.generate(prompts, [seeded, other], use_tqdm=False)
        outs.append(got[0].outputs[0].token_ids)
        drafted.append(llm.spec_stats()["draft_tokens"])
    assert outs[0] == outs[1]
    assert drafted[0] > drafted[1] > 0  # the curves did change the (unseeded row's) lengths


@pytest.mark.parametrize("extra, match", [
    ({"bogus": 1}, r"speculative_config 'bogus': not an option of the 'ngram' drafter \(its options: "
                   r"prompt_lookup_max, prompt_lookup_min\)"),
    ({"dynamic": True}, "dynamic=True needs a drafter that reports confidences"),
    ({"method": "nope"}, "method='nope': unknown stage")])
def test_optional_does_not_hide_a_wrong_config(spec_llama, extra, match):
    """optional turns speculation off where the drafter is unavailable here (tests/test_dspark.py, test_mtp.py);
    a misspelt option, dynamic with a drafter without confidences or an unknown method still fail, naming the
    key (they used to leave speculation off silently, with an info line)."""
    with pytest.raises(ValueError, match=match):
        LLM(spec_llama, num_kv_blocks=64, block_size=4, speculative_config={**NGRAM, "optional": True, **extra})

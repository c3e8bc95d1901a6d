"""The host side of a speculative step, batched: a step's verified rows read back from one host conversion
(SpecLaunch.all_rows), their draft accounting recorded at once (SpecStats.record_many), and their further
accepted tokens folded through the host stages one call per position (Engine._fold_extra), each held to its
one-row oracle (row, record, _fold_forced per token)."""

from __future__ import annotations

import random

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.core.spec_step import SpecLaunch
from deepinfer.core.speculative import SpecStats


@pytest.mark.parametrize("seed", range(5))
def test_record_many_equals_record_per_row(seed):
    rng = random.Random(seed)
    one, many = SpecStats(), SpecStats()
    for _ in range(4):
        drafted = [rng.randint(0, 6) for _ in range(rng.randint(0, 12))]
        accepted = [rng.randint(0, k) for k in drafted]
        for k, a in zip(drafted, accepted):
            one.record(k, a)
        many.record_many(drafted, accepted)
    assert attrs_dict(many) == attrs_dict(one)
    assert many.summary() == one.summary()


def attrs_dict(st: SpecStats) -> dict:
    return {"steps": st.steps, "draft": st.draft_tokens, "acc": st.accepted_tokens, "emit": st.emitted_tokens,
            "proposed_at": dict(st.proposed_at), "accepted_at": dict(st.accepted_at)}


def test_all_rows_equals_row():
    K = 4
    acc = torch.tensor([0, 2, 4, 1])
    tokens = torch.full((4, K + 1), -1)
    for n, a in enumerate(acc.tolist()):
        tokens[n, :a + 1] = torch.arange(10 * n, 10 * n + a + 1)
    launch = SpecLaunch([(n, n) for n in range(4)], K, torch.cat([acc[:, None], tokens], 1))
    assert launch.all_rows() == [launch.row(n) for n in range(4)]
    assert all(isinstance(a, int) and all(isinstance(t, int) for t in e) for a, e in launch.all_rows())


def _fold_extra_per_token(self, extra, spec_logprobs, sample_seqs, touched):
    """The loop _fold_extra replaced: every further token through the host stages on its own."""
    for r, tokens in extra.items():
        seq, lps = sample_seqs[r], spec_logprobs.get(r)
        for j, tok in enumerate(tokens, start=1):
            if seq.finished:
                break
            if lps is not None:
                self._append_logprobs(seq, tok, *lps[j])
            if not self._fold_forced(seq, tok, touched):
                break


def _run(per_token: bool, monkeypatch, params, prompts):
    from deepinfer.core.engine import Engine

    with monkeypatch.context() as m:
        if per_token:
            m.setattr(Engine, "_fold_extra", _fold_extra_per_token)
        llm = LLM(device="cpu", seed=3, speculative_config={"method": "dspark", "num_speculative_tokens": 4})
        outs = llm.generate(prompts, params, use_tqdm=False)
    got = [[(c.token_ids, c.text, c.finish_reason, c.stop_reason,
             None if c.logprobs is None else [sorted((t, round(l.logprob, 5)) for t, l in d.items())
                                              for d in c.logprobs])
            for c in o.outputs] for o in outs]
    return got, llm.spec_stats()


def test_fold_extra_equals_folding_each_token(monkeypatch):
    """Greedy and sampled rows, several samples of a request, stop tokens and strings that land among a verified
    row's further tokens, logprobs: the same outputs and acceptance whichever way the tokens are folded."""
    prompts = [[5, 9, 13, 17, 21, 25, 29, 33], [40, 41, 42, 43, 40, 41, 42], [7, 7, 8, 9, 300, 301, 302]]
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    plain = LLM(device="cpu").generate(prompts, greedy, use_tqdm=False)
    stops = [o.outputs[0].token_ids[k] for o, k in zip(plain, (9, 17, 25))]
    cases = [
        SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop_token_ids=stops),
        SamplingParams(max_tokens=30, temperature=0.8, seed=5, n=2, ignore_eos=True, logprobs=1),
        SamplingParams(max_tokens=37, temperature=0.0, stop=[plain[1].outputs[0].text[12:15]]),
    ]
    runs = []
    for params in cases:
        batched, st_b = _run(False, monkeypatch, params, prompts)
        each, st_e = _run(True, monkeypatch, params, prompts)
        assert batched == each, params
        assert st_b == st_e
        assert st_b["accepted_tokens"] > 0
        runs.append(batched)
    # Greedy with speculation is greedy decoding, stops included.
    got = runs[1]  # the loop's speculative run of cases[1]
    want = LLM(device="cpu").generate(prompts, cases[1], use_tqdm=False)
    assert [g[0][0] for g in got] == [o.outputs[0].token_ids for o in want]
    assert any(o.outputs[0].finish_reason == "stop" for o in want)

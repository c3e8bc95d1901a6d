"""The persistent sampling state (slots on the device, counts grown on the device) gives the SamplingBatch
that the from-scratch builder (SamplingBatch.build over token lists, the oracle) gives, step after step,
while sequences join, sample, leave, and come back in other slots (preemption)."""

from __future__ import annotations

import random

import torch
from hypothesis import given, settings, strategies as st

from deepinfer.core.params import SamplingParams
from deepinfer.core.sampling_state import SamplingState
from deepinfer.core.state import Sequence
from deepinfer.layout import SamplingBatch

V, SLOTS, EOS = 40, 6, (2,)
TENSORS = ("temperature", "top_k", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
           "output_counts", "prompt_mask", "banned", "logit_bias")
FLAGS = ("all_greedy", "all_random", "max_num_logprobs", "use_top_k", "use_top_p", "use_min_p")

params_st = st.builds(
    SamplingParams, temperature=st.sampled_from([0.0, 0.7, 1.3]), top_k=st.sampled_from([-1, 0, 3]),
    top_p=st.sampled_from([1.0, 0.8]), min_p=st.sampled_from([0.0, 0.1]),
    presence_penalty=st.sampled_from([0.0, 0.5]), frequency_penalty=st.sampled_from([0.0, -0.3]),
    repetition_penalty=st.sampled_from([1.0, 1.2]), min_tokens=st.sampled_from([0, 3]),
    logprobs=st.sampled_from([None, 2]), logit_bias=st.sampled_from([None, {5: 1.5, 7: -2.0}]),
    allowed_token_ids=st.sampled_from([None, [3, 4, 5, 9]]))


def same(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and torch.equal(a, b)


@settings(max_examples=60, deadline=None)
@given(params=st.lists(params_st, min_size=1, max_size=8), steps=st.integers(1, 12), seed=st.integers(0, 2**16))
def test_persistent_state_matches_the_builder(params, steps, seed):
    rng = random.Random(seed)
    state = SamplingState(SLOTS, V, EOS, "cpu")
    seqs = [Sequence(seq_id=i, request_id=str(i), index=0, token_ids=[rng.randrange(V) for _ in range(rng.randint(1, 6))],
                     num_prompt_tokens=0, params=p, arrival=i) for i, p in enumerate(params)]
    for s in seqs:
        s.num_prompt_tokens = len(s.token_ids)
    for _ in range(steps):
        # Some sequences hold slots this step (a random subset, in random slots: joins, leaves, preemptions).
        rows = rng.sample(seqs, min(len(seqs), rng.randint(1, SLOTS)))
        slots = rng.sample(range(SLOTS), len(rows))
        for s, slot in zip(rows, slots):
            if s.state_slot != slot:
                s.state_slot = slot  # a sequence in a new slot (after a preemption, say)
        # Any other sequence that held one of these slots has left it.
        got = state.batch(rows)
        want = SamplingBatch.build([s.params for s in rows], [s.prompt_token_ids for s in rows],
                                   [s.output_token_ids for s in rows], [s.generator for s in rows], V, EOS, "cpu")
        for f in TENSORS:
            assert same(getattr(got, f), getattr(want, f)), f
        for f in FLAGS:
            assert getattr(got, f) == getattr(want, f), f
        tokens = torch.tensor([rng.randrange(V) for _ in rows])
        state.record(tokens)
        for s, t in zip(rows, tokens.tolist()):
            s.token_ids.append(t)


def test_a_repeated_batch_reuses_its_gather_and_a_join_refreshes_it():
    """A decode stream's steps repeat one batch: its slots are gathered once; a sequence taking one of those
    slots (or a reordered batch) gathers anew, and every batch still equals the builder's."""
    ps = [SamplingParams(temperature=0.7, top_k=3), SamplingParams(temperature=0.0), SamplingParams(top_p=0.8)]
    seqs = [Sequence(seq_id=i, request_id=str(i), index=0, token_ids=[1, 2], num_prompt_tokens=2, params=p,
                     arrival=i) for i, p in enumerate(ps)]
    for s, slot in zip(seqs, (0, 1, 2)):
        s.state_slot = slot
    state = SamplingState(SLOTS, V, EOS, "cpu")

    def check(rows):
        got = state.batch(rows)
        want = SamplingBatch.build([s.params for s in rows], [s.prompt_token_ids for s in rows],
                                   [s.output_token_ids for s in rows], [s.generator for s in rows], V, EOS, "cpu")
        for f in TENSORS:
            assert same(getattr(got, f), getattr(want, f)), f
        return got

    a = check(seqs[:2])
    b = check(seqs[:2])
    assert b.temperature.data_ptr() == a.temperature.data_ptr()  # reused, not gathered again
    c = check([seqs[1], seqs[0]])  # another order: gathered anew
    assert c.temperature.tolist() == torch.tensor([0.0, 0.7]).tolist()
    seqs[2].state_slot = 1  # a new sequence takes slot 1 (its old owner left)
    d = check([seqs[0], seqs[2]])
    assert d.top_p.tolist() == torch.tensor([1.0, 0.8]).tolist()

"""Batched speculative acceptance (core/spec_accept.py) against its per-row oracle (core/speculative.py):
on hypothesis-drawn batches of draft lengths, temperatures, top-k/top-p/min-p, penalties, drafter
distributions and seeds, the batch emits exactly the oracle's tokens for every row."""

from __future__ import annotations

import torch
from hypothesis import given, settings, strategies as hs

from deepinfer.backends.reference.sampling import SamplingBatch
from deepinfer.core.params import SamplingParams
from deepinfer.core.spec_accept import accept_batch, draw_noise, process_rows
from deepinfer.core.speculative import accept_row, sampling_rows

FAST = settings(max_examples=40, deadline=None)


@hs.composite
def cases(draw):
    R, K, V = draw(hs.integers(1, 5)), draw(hs.integers(1, 4)), draw(hs.integers(2, 12))
    rows = []
    for _ in range(R):
        greedy = draw(hs.booleans())
        kw = {} if greedy else dict(temperature=draw(hs.sampled_from([0.3, 0.7, 1.0, 1.8])),
                                    top_k=draw(hs.sampled_from([0, 1, 3, V])),
                                    top_p=draw(hs.sampled_from([1.0, 0.9, 0.5])),
                                    min_p=draw(hs.sampled_from([0.0, 0.1])))
        if draw(hs.booleans()):
            kw.update(presence_penalty=0.3, frequency_penalty=0.2, repetition_penalty=1.3)
        rows.append(dict(params=SamplingParams(temperature=0.0, **kw) if greedy else SamplingParams(**kw),
                         k=draw(hs.integers(0, K)), seed=draw(hs.one_of(hs.none(), hs.integers(0, 99)))))
    return dict(R=R, K=K, V=V, rows=rows, with_q=draw(hs.booleans()), seed=draw(hs.integers(0, 2**16)),
                argmax_drafts=draw(hs.booleans()))


def build_case(c):
    R, K, V = c["R"], c["K"], c["V"]
    g = torch.Generator().manual_seed(c["seed"])
    raw = torch.randn(R, K + 1, V, generator=g) * 2
    if c["argmax_drafts"]:  # drafts that the target likes, so rows accept several (not only the first)
        drafts = raw[:, :K].argmax(-1)
    else:
        drafts = torch.randint(0, V, (R, K), generator=g)
    lens = torch.tensor([r["k"] for r in c["rows"]])
    q = None
    if c["with_q"]:
        q = torch.rand(R, K, V, generator=g).softmax(-1)
        q.scatter_(2, drafts[:, :, None], 0.0)  # some drafts the drafter could not have drawn (q = 0 there)
        q[:, :, 0] += 0.2
        q = q / q.sum(-1, keepdim=True)
    params = [r["params"] for r in c["rows"]]
    outs = [torch.randint(0, V, (3,), generator=g).tolist() for _ in range(R)]
    gens = [None if r["seed"] is None else torch.Generator().manual_seed(r["seed"]) for r in c["rows"]]
    batch = SamplingBatch.build(params, [[0, 1]] * R, outs, gens, V, [], "cpu")
    return raw, drafts, lens, q, batch


@FAST
@given(cases())
def test_batched_acceptance_equals_the_per_row_oracle(c):
    R, K, V = c["R"], c["K"], c["V"]
    raw, drafts, lens, q, batch = build_case(c)
    rows = torch.arange(R)
    greedy = batch.temperature < 1e-5
    logits = process_rows(raw, batch, rows, drafts, lens)
    noise = draw_noise(R, K, V, batch.generators, torch.Generator().manual_seed(1), "cpu")
    tokens, acc = accept_batch(logits, drafts, lens, q, greedy, noise, all_greedy=bool(greedy.all()))
    for r in range(R):
        k = int(lens[r])
        d = drafts[r, :k].tolist()
        want_logits = sampling_rows(batch, r, d).process(raw[r, :k + 1])  # the oracle's own processing
        assert torch.equal(logits[r, :k + 1], want_logits), f"row {r}: processed logits differ"
        want = accept_row(want_logits, d, None if q is None else q[r, :k], bool(greedy[r]), None,
                          noise=(noise[0][r], noise[1][r]))
        got = tokens[r, :int(acc[r]) + 1].tolist()
        assert got == want, f"row {r} (k={k}, greedy={bool(greedy[r])}): batch {got} vs oracle {want}"
        assert (tokens[r, int(acc[r]) + 1:] == -1).all()


def test_seeded_rows_draw_their_own_noise():
    """A seeded row's numbers come from its generator whatever its neighbours are, so it repeats."""
    a = draw_noise(3, 2, 5, [None, torch.Generator().manual_seed(4), None], torch.Generator().manual_seed(0), "cpu")
    b = draw_noise(1, 2, 5, [torch.Generator().manual_seed(4)], None, "cpu")
    assert torch.equal(a[0][1], b[0][0]) and torch.equal(a[1][1], b[1][0])
    assert (a[1] > 0).all() and ((a[0] >= 0) & (a[0] < 1)).all()


def test_batched_acceptance_follows_the_target():
    """The batch's accepted-or-resampled first token has the target's distribution (point-mass drafts)."""
    V, N = 5, 6000
    logits = torch.tensor([[1.5, 0.2, -0.5, 0.8, 0.0], [0.0] * 5]).expand(N, 2, V).contiguous()
    drafts = torch.full((N, 1), 3)
    noise = draw_noise(N, 1, V, [None] * N, torch.Generator().manual_seed(3), "cpu")
    tokens, acc = accept_batch(logits, drafts, torch.ones(N, dtype=torch.long), None,
                               torch.zeros(N, dtype=torch.bool), noise)
    f = torch.bincount(tokens[:, 0], minlength=V).double() / N
    p = logits[0, 0].softmax(-1).double()
    assert ((f - p).abs() <= 5 * (p * (1 - p) / N).sqrt() + 1e-3).all(), (f, p)
    assert 0 < int(acc.sum()) < N

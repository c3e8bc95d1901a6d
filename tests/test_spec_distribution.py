"""Speculative sampling keeps the target's distribution (core/spec_accept.accept_batch, the engine's acceptance):
a chi-square goodness-of-fit test on a tiny vocabulary over many seeded rows, vLLM's style of distance test (the
empirical distribution's distance to the target shrinks with the samples as a direct sampler's does), and the
same tests failing once the residual draw is replaced by a draw from the target (the mistake they exist for).
Every draw is seeded: the tests are deterministic."""

from __future__ import annotations

import math

import pytest
import torch

from deepinfer.core import spec_accept
from deepinfer.core.spec_accept import accept_batch, draw_noise

V, K = 7, 2  # 7 tokens: a chi-square of 6 degrees of freedom, whose tail has a closed form
LOGITS = torch.tensor([[1.2, 0.1, -0.4, 0.9, 0.0, -1.5, 0.5],
                       [0.0, 0.8, 1.6, -0.7, 0.3, 0.2, -1.0],
                       [0.4, 0.4, 0.4, 0.4, 0.4, 0.4, 0.4]])  # the target at the 2 drafted positions and the bonus
Q = torch.tensor([[0.05, 0.45, 0.05, 0.05, 0.3, 0.05, 0.05],  # the drafter's distributions: far from the target
                  [0.3, 0.05, 0.05, 0.4, 0.1, 0.05, 0.05]])


def chi2_sf_df6(x: float) -> float:
    """P(X > x) for a chi-square of 6 degrees of freedom: exp(-x/2) (1 + x/2 + (x/2)^2 / 2)."""
    h = x / 2
    return math.exp(-h) * (1 + h + h * h / 2)


def p_value(draws: torch.Tensor, p: torch.Tensor) -> float:
    observed = torch.bincount(draws, minlength=V).double()
    expected = p.double() * len(draws)
    return chi2_sf_df6(float(((observed - expected) ** 2 / expected).sum()))


def speculate(n: int, seed: int, draft_probs: bool = True) -> tuple:
    """n rows, each drafting K tokens from Q (or a point mass at a fixed draft) and accepting against LOGITS.
    Returns (first emitted token [n], second emitted token of the rows whose first draft stood)."""
    g = torch.Generator().manual_seed(seed)
    if draft_probs:
        drafts = torch.stack([torch.multinomial(Q[j], n, replacement=True, generator=g) for j in range(K)], 1)
        q = Q.expand(n, K, V).contiguous()
    else:
        drafts, q = torch.tensor([[1, 3]]).expand(n, K).contiguous(), None
    noise = draw_noise(n, K, V, [None] * n, g, "cpu")
    tokens, acc = accept_batch(LOGITS.expand(n, K + 1, V).contiguous(), drafts, torch.full((n,), K), q,
                               torch.zeros(n, dtype=torch.bool), noise)
    return tokens[:, 0], tokens[acc >= 1, 1]


P = LOGITS.softmax(-1)


@pytest.mark.parametrize("draft_probs", [True, False])
def test_chi_square_the_emitted_tokens_follow_the_target(draft_probs):
    first, second = speculate(40000, seed=11, draft_probs=draft_probs)
    assert p_value(first, P[0]) > 1e-4
    assert len(second) > 2000 and p_value(second, P[1]) > 1e-4


def l1(draws: torch.Tensor, p: torch.Tensor) -> float:
    return float((torch.bincount(draws, minlength=V).double() / len(draws) - p.double()).abs().sum())


def test_distance_to_the_target_shrinks_as_a_direct_sampler_s_does():
    """vLLM's form: at each sample count the speculative draws lie about as close to the target as draws taken
    from the target itself (within 2x + 1e-3, averaged over 8 seeds), and both shrink like 1 / sqrt(n)."""
    spec, direct = [], []
    for n in (1000, 8000, 64000):
        d_spec = sum(l1(speculate(n, seed=s)[0], P[0]) for s in range(8)) / 8
        direct_draws = [torch.multinomial(P[0], n, replacement=True, generator=torch.Generator().manual_seed(100 + s))
                        for s in range(8)]
        d_direct = sum(l1(d, P[0]) for d in direct_draws) / 8
        spec.append(d_spec)
        direct.append(d_direct)
        assert d_spec <= 2 * d_direct + 1e-3, (n, d_spec, d_direct)
    assert spec[0] > spec[1] > spec[2] and spec[2] < spec[0] / 4  # 64x the samples: ~1/8 the distance


def test_the_tests_fail_without_the_residual_draw(monkeypatch):
    """A sampler that, where a draft is rejected, draws from the target instead of the residual max(p - q, 0)
    over-weights the drafter's favourite tokens: the chi-square test rejects it, and its distance to the target
    stops shrinking."""
    monkeypatch.setattr(spec_accept, "residual", lambda p, q: p)
    first, _ = speculate(40000, seed=11)
    assert p_value(first, P[0]) < 1e-12
    far = [l1(speculate(n, seed=3)[0], P[0]) for n in (8000, 64000)]
    assert far[1] > 0.05 and far[1] > 0.5 * far[0]  # a bias, not noise


def test_greedy_rows_are_untouched_by_the_sampling_path():
    """A greedy row beside sampled ones emits the target's argmaxes while the drafts match them."""
    n = 8
    logits = LOGITS.expand(n, K + 1, V).contiguous()
    best = LOGITS.argmax(-1)
    drafts = best[:K].expand(n, K).contiguous()
    greedy = torch.tensor([True, False] * (n // 2))
    noise = draw_noise(n, K, V, [None] * n, torch.Generator().manual_seed(0), "cpu")
    tokens, acc = accept_batch(logits, drafts, torch.full((n,), K), None, greedy, noise)
    assert (acc[greedy] == K).all() and (tokens[greedy] == best).all()

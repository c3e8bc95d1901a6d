"""Comparisons that hold on every machine: float results against a reference with a bound scaled to the
magnitude of what is compared, and greedy token sequences that may part only at a near-tie of the reference.

- ``assert_logits_close(actual, expected, factor=...)``: per row (the last dim), max|a - b| <= factor * eps(dtype)
  * max|b|, eps the float epsilon of the less precise dtype of the two (or ``dtype``). A fixed absolute
  tolerance is tight for rows of large logits and loose for small ones, and another CPU (another BLAS
  blocking, another vector width) moves the rounding by a few eps of the magnitude: the bound must move with it.
  The factor is the caller's statement of the accumulation depth (layers, inner dims) the two computations
  round differently over.
- ``assert_same_or_near_tie(actual, expected, ref_scores, bound)``: two greedy token sequences are equal, or
  the first step where they part is one where the reference's top two scores lie within ``bound`` and the
  other run took a token within ``bound`` of the reference's best: two correct float implementations may break
  a near-tie differently, and after that the sequences legitimately diverge; anything else is a failure.
  ``assert_greedy_matches`` applies it to a batch; ``hf_greedy`` gives transformers' side (tokens and the
  logits of each step); an engine run's side is its ``logprobs=2`` output.
- ``assert_same_routing(x, gate, bias, got, want)``: two CED routings of the same rows agree by the float64 scores
  of what each side chose and by their weights (``ced_router_case`` draws a gate and bias).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

_LOW_FIRST = (torch.float16, torch.bfloat16, torch.float32, torch.float64)  # by precision, least first

# The factor of float32 logits (or hidden states) of two implementations of one tiny test model (2-4 layers,
# widths <= 128, |logit| < 10), in eps of the row's largest |value|: the worst seen over the parity tests is 25 eps
# (qwen2-moe's engine prefill against transformers, on two Intel Xeons; the AMD EPYC run of the old test was
# about 20), so 128 leaves 5x for other CPUs' BLAS blockings and vector widths. Bugs land far above it: a dropped
# bias or norm weight, a skipped MLP or the other rope layout puts logits 1e6 eps off, a rope base, norm eps or
# softmax scale off by 0.1% 200 to 20000 eps.
MODEL_FACTOR = 128

# Near-ties of greedy decoding, in nats (a difference of logprobs is one of logits), for the tiny test models whose
# top logits lie in [2, 8). float32: two correct runs' logits differ by at most ~25 eps x max|logit| < 3e-5 (above),
# so the argmax can flip only where the top two are within ~6e-5; the reference runs' median top-two margin is
# 0.15-0.27 nats and their smallest 2.4e-5 (qwen3 on the H200: a real near-tie). bfloat16: two bf16 ulps of a logit
# in [2, 4), the step bf16 runs' margins come in (their 5th percentile is one ulp, 0.0156).
NEAR_TIE = {"float32": 1e-4, "bfloat16": 2 ** -5}


def eps(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).eps)


def _less_precise(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    known = [d for d in (a, b) if d in _LOW_FIRST]
    if not known:
        raise ValueError(f"no float epsilon for {a} and {b}: pass dtype=")
    return min(known, key=_LOW_FIRST.index)


def logits_bound(expected: torch.Tensor, factor: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The per-row bound of ``assert_logits_close``: factor * eps(dtype) * max|expected| over the last dim
    (at least the dtype's smallest normal), float64 with the leading shape of ``expected``."""
    mag = expected.detach().double().cpu()
    mag = torch.where(torch.isfinite(mag), mag.abs(), torch.zeros_like(mag))
    mag = mag.amax(dim=-1) if mag.ndim else mag
    return factor * eps(dtype) * mag.clamp_min(torch.finfo(dtype).tiny)


def assert_logits_close(actual: torch.Tensor, expected: torch.Tensor, *, factor: float,
                        dtype: Optional[torch.dtype] = None, what: str = "") -> None:
    """Fail unless, in every row (last dim) of ``expected``, max|actual - expected| <= factor * eps(dtype) *
    max|expected|. ``dtype`` defaults to the less precise of the two tensors' dtypes. Non-finite entries of
    ``expected`` (masked logits) must be matched exactly. The message names the worst element (row, column,
    both values), its row's magnitude and the bound."""
    if dtype is None:
        dtype = _less_precise(actual.dtype, expected.dtype)
    label = f"{what}: " if what else ""
    assert actual.shape == expected.shape, f"{label}shape {tuple(actual.shape)} != expected {tuple(expected.shape)}"
    if expected.numel() == 0:
        return
    shape = tuple(expected.shape) or (1,)  # a scalar is one row of one
    a, b = (t.detach().double().cpu().reshape(-1, shape[-1]) for t in (actual, expected))
    fin = torch.isfinite(b)
    odd = (~fin & ~(a == b)) | (fin & ~torch.isfinite(a))
    if bool(odd.any()):
        r, c = (int(i) for i in odd.nonzero()[0])
        raise AssertionError(f"{label}non-finite mismatch at row {r}, column {c}: actual {float(a[r, c])}, "
                             f"expected {float(b[r, c])}")
    diff = torch.where(fin, (a - b).abs(), torch.zeros_like(a))
    err, col = diff.max(dim=-1)
    bound = logits_bound(b, factor, dtype)
    over = err / bound  # > 1: the row fails
    row = int(over.argmax())
    if float(over[row]) <= 1.0:
        return
    idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(row), shape[:-1])) if len(shape) > 1 else ()
    c = int(col[row])
    mag = float(bound[row]) / (factor * eps(dtype))
    raise AssertionError(
        f"{label}{int((over > 1).sum())} of {len(over)} rows exceed the bound; worst at {idx + (c,)}: "
        f"actual {float(a[row, c]):.9g}, expected {float(b[row, c]):.9g}, |diff| {float(err[row]):.3g} = "
        f"{float(err[row]) / eps(dtype) / max(mag, 1e-300):.1f} eps x the row's max|expected| {mag:.4g}; "
        f"bound {float(bound[row]):.3g} ({factor:g} eps of {dtype} x {mag:.4g})")


def ced_router_case(g: torch.Generator, device, E: int = 12, d: int = 96) -> tuple:
    """A CED router's float32 gate [E, d] (scaled by d^-1/2) and selection bias [E], drawn from ``g``."""
    gate = torch.randn(E, d, generator=g).to(device) * d ** -0.5
    return gate, (torch.randn(E, generator=g) * 0.1).to(device)


def assert_same_routing(x: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor, got: tuple, want: tuple) -> None:
    """Two CED routings (weights, ids) of the rows x agree: by the float64 biased sqrt-softplus scores of the
    experts each side chose (a near tie may pick either expert) and by the chosen weights, never by copying one
    side's choice into the other."""
    logits = x.double() @ gate.double().T
    score = torch.sqrt(torch.nn.functional.softplus(logits)) + bias.double()
    (w, ids), (rw, rids) = got, want
    mine, ref = score.gather(1, ids).sort(1).values, score.gather(1, rids).sort(1).values
    torch.testing.assert_close(mine, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w.sort(1).values, rw.sort(1).values, rtol=1e-5, atol=1e-6)


def _step_scores(ref_scores, i: int) -> dict:
    """Step i of the reference's scores as {token: score}: from a [steps, V] tensor of logits or logprobs,
    or a list of per-step {token: float or Logprob} dicts (the engine's top-n logprobs)."""
    s = ref_scores[i]
    if isinstance(s, torch.Tensor):
        return dict(enumerate(s.detach().double().cpu().tolist()))
    return {int(t): float(getattr(v, "logprob", v)) for t, v in s.items()}


def assert_same_or_near_tie(actual: Sequence[int], expected: Sequence[int], ref_scores, bound: float,
                            what: str = "") -> Optional[int]:
    """Greedy tokens ``actual`` equal the reference run's ``expected``, or part only at a near-tie: at the first
    differing step the reference's top two scores (``ref_scores[step]``, logits or logprobs, one entry per
    step of ``expected``, holding at least the top two) are within ``bound`` of each other and ``actual`` took a token within ``bound`` of
    the reference's best. Returns that step, or None when the sequences are equal."""
    label = f"{what}: " if what else ""
    actual, expected = list(actual), list(expected)
    step = next((i for i, (x, y) in enumerate(zip(actual, expected)) if x != y), None)
    if step is None:
        assert len(actual) == len(expected), f"{label}one sequence is a prefix of the other: {len(actual)} " \
                                             f"vs {len(expected)} tokens"
        return None
    assert step < len(ref_scores), f"{label}no reference scores for step {step} ({len(ref_scores)} given)"
    scores = _step_scores(ref_scores, step)
    top = sorted(scores.items(), key=lambda kv: -kv[1])
    (best, s1), (second, s2) = top[0], top[1]
    if scores.get(expected[step]) != s1:
        raise AssertionError(f"{label}the reference scores do not belong to the expected run: at step {step} its "
                             f"token {expected[step]} is not the best ({best}, {s1:.6g})")
    margin = s1 - s2
    got = scores.get(actual[step])
    gap = None if got is None else s1 - got
    if gap is None or margin > bound or gap > bound:
        shown = "not among the reference's scored tokens" if got is None else f"{gap:.3g} below the best"
        raise AssertionError(
            f"{label}sequences part at step {step}, which is no near-tie of the reference: reference took "
            f"{expected[step]} ({s1:.6g}), runner-up {second} ({s2:.6g}), margin {margin:.3g} (bound {bound:.3g}); "
            f"the other run took {actual[step]}, {shown}. Prefix {expected[:step]}")
    return step


def assert_greedy_matches(got: Sequence, ref: Sequence, ref_scores: Sequence, bound: float = NEAR_TIE["float32"],
                          what: str = "") -> list:
    """``assert_same_or_near_tie`` for each sequence of a batch (ref_scores: one entry per sequence of ``ref``);
    returns, per sequence, the step where it parted at a near-tie, or None."""
    got, ref = list(got), list(ref)
    assert len(got) == len(ref) == len(ref_scores), f"{what}: {len(got)} sequences, {len(ref)} references"
    return [assert_same_or_near_tie(g, r, s, bound, what=f"{what}{', ' if what else ''}sequence {i}")
            for i, (g, r, s) in enumerate(zip(got, ref, ref_scores))]


def generated(llm, prompts, params) -> list:
    """``llm.generate`` with every request asserted to have finished without an error."""
    out = llm.generate(prompts, params, use_tqdm=False)
    assert all(o.error is None for o in out), [o.error for o in out]
    return out


def assert_outputs_match(got: Sequence, ref: Sequence, bound: float = NEAR_TIE["float32"]) -> None:
    """Two runs' RequestOutputs (first completion each): the same greedy tokens, or parted at a near-tie of
    ``ref``'s logprobs (its requests asked for some)."""
    assert_greedy_matches([o.outputs[0].token_ids for o in got], [o.outputs[0].token_ids for o in ref],
                          [o.outputs[0].logprobs for o in ref], bound)


def hf_greedy(hf, prompt: Sequence[int], n: int) -> tuple:
    """transformers' greedy continuation of one unpadded prompt for exactly ``n`` steps (its generation_config must
    not stop at EOS) and the logits of each step, [n, V] float32: the reference side of ``assert_greedy_matches``."""
    ids = torch.tensor([list(prompt)])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                          pad_token_id=hf.config.pad_token_id, output_logits=True, return_dict_in_generate=True)
    new = out.sequences[0, len(prompt):].tolist()
    assert len(new) == n, "transformers stopped early; the reference must run every step"
    return new, torch.cat(out.logits).float()


__all__ = ["MODEL_FACTOR", "NEAR_TIE", "assert_greedy_matches", "assert_logits_close", "assert_same_or_near_tie", "eps",
           "hf_greedy", "logits_bound"]

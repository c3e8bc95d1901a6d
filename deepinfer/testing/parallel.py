"""Comparisons of a parallel engine's outputs with the single-process engine's (tests/test_parallel*.py).

Greedy tokens must be equal; top logprobs (float32) equal within ``LOGPROB_RTOL`` of their magnitude (at least
1): the ranks sum the experts' outputs and gather rows in another order than one process does, which moves the
last bits, and a real error (a wrong expert, a row from another sequence) moves them by far more.
"""

from __future__ import annotations

LOGPROB_RTOL = 3e-5


def logprob_close(a: float, b: float) -> bool:
    return abs(a - b) <= LOGPROB_RTOL * max(1.0, abs(a))


def assert_same_outputs(ref: list, out: list) -> None:
    """Each RequestOutput of ``out`` has the tokens of ``ref``'s, the same top logprob tokens at every position
    with close values, and close prompt logprobs."""
    assert len(ref) == len(out), f"{len(out)} outputs for {len(ref)} requests"
    for i, (r, o) in enumerate(zip(ref, out)):
        assert o.error is None, o.error
        assert o.outputs[0].token_ids == r.outputs[0].token_ids, f"request {i}"
        for pos, (x, y) in enumerate(zip(r.outputs[0].logprobs or [], o.outputs[0].logprobs or [])):
            assert x.keys() == y.keys(), f"request {i} position {pos}: top tokens {list(x)} vs {list(y)}"
            bad = {t: (x[t].logprob, y[t].logprob) for t in x if not logprob_close(x[t].logprob, y[t].logprob)}
            assert not bad, f"request {i} position {pos}: logprobs differ {bad}"
        assert len(r.prompt_logprobs or []) == len(o.prompt_logprobs or []), f"request {i}: prompt logprobs"
        for x, y in zip(r.prompt_logprobs or [], o.prompt_logprobs or []):
            if x is not None:
                assert all(logprob_close(x[t].logprob, y[t].logprob) for t in x), f"request {i}: prompt logprobs"

"""A prefix-cache hit against cold prefill: with exact reuse (the Llama family, every bit of state in the paged
blocks) a request whose prefix is cached computes the logits it computes cold.

The contract (``make_llm(enable_prefix_caching: bool) -> LLM``, or anything with the same ``generate``,
``reset_prefix_cache`` and RequestOutput fields). The oracle sends ``prefix + suffix_a`` to a caching engine
(the prefix's blocks are now cached), then ``prefix + suffix_b`` (a hit: ``num_cached_tokens > 0``, else the
check fails as vacuous), and ``prefix + suffix_b`` to an engine without caching; the greedy continuations must
have the same tokens and their decode logprobs (``SamplingParams(logprobs=K)``) must agree within ``atol``.
Decode logprobs, not prompt_logprobs: a request with prompt_logprobs does not use the prefix cache.
CED with bounded replay is not exact on a hit by design (CED.md); see ``deepinfer check yoco`` for it.
"""

from __future__ import annotations

from typing import Callable

import attrs
from hypothesis import strategies as st


@attrs.frozen
class PrefixCase:
    prefix: list
    suffix_a: list
    suffix_b: list
    max_tokens: int


def prefix_cases(vocab_size: int, block_size: int, max_blocks: int = 4, max_suffix: int = 6):
    """A strategy of PrefixCase: a prefix of 1..max_blocks full blocks plus 0..block_size - 1 tokens, two
    suffixes of 1..max_suffix tokens, 2..4 tokens to generate. Token ids avoid 0..3 (special tokens)."""
    tok = st.integers(4, vocab_size - 1)

    @st.composite
    def draw(d) -> PrefixCase:
        n = d(st.integers(1, max_blocks)) * block_size + d(st.integers(0, block_size - 1))
        return PrefixCase(prefix=d(st.lists(tok, min_size=n, max_size=n)),
                          suffix_a=d(st.lists(tok, min_size=1, max_size=max_suffix)),
                          suffix_b=d(st.lists(tok, min_size=1, max_size=max_suffix)),
                          max_tokens=d(st.integers(2, 4)))

    return draw()


def check_prefix_hit(make_llm: Callable, case: PrefixCase, logprobs: int = 5, atol: float = 1e-5) -> None:
    from ...core.params import SamplingParams

    sp = SamplingParams(max_tokens=case.max_tokens, temperature=0.0, logprobs=logprobs, ignore_eos=True)
    prompt = {"prompt_token_ids": case.prefix + case.suffix_b}
    warm = make_llm(True)
    warm.reset_prefix_cache()
    warm.generate([{"prompt_token_ids": case.prefix + case.suffix_a}], SamplingParams(max_tokens=1), use_tqdm=False)
    hit = warm.generate([prompt], sp, use_tqdm=False)[0]
    assert hit.error is None, hit.error
    assert hit.num_cached_tokens > 0, (f"no prefix-cache hit for a cached prefix of {len(case.prefix)} tokens: "
                                       "the comparison would be vacuous")
    cold = make_llm(False).generate([prompt], sp, use_tqdm=False)[0]
    assert cold.error is None, cold.error
    a, b = hit.outputs[0], cold.outputs[0]
    assert list(a.token_ids) == list(b.token_ids), (f"greedy tokens after a hit of {hit.num_cached_tokens} tokens "
                                                    f"{list(a.token_ids)}, cold {list(b.token_ids)}")
    for step, (da, db) in enumerate(zip(a.logprobs, b.logprobs)):
        for tok in set(da) & set(db):
            d = abs(da[tok].logprob - db[tok].logprob)
            assert d <= atol, (f"decode step {step}: logprob of token {tok} after a hit of {hit.num_cached_tokens} "
                               f"tokens differs from cold prefill by {d:.3g}")

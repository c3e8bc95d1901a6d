"""N-gram (prompt lookup) drafting as a DeepInfer draft-stage plugin.

For a sequence whose last n tokens (n from ``prompt_lookup_max`` down to ``prompt_lookup_min``) also occur
earlier in its prompt or output, the drafter proposes the tokens that followed their most recent earlier
occurrence, up to k of them. Code, documents being edited, and answers that quote their context repeat
themselves, and then most drafts stand. It gives no probabilities: the engine verifies its tokens as point
masses (greedy rows keep a draft while it is the target's argmax; sampled rows keep it with the target's
probability of it), so the output distribution is the target model's whatever the drafter proposes.

Select it with ``LLM(..., speculative_config={"method": "ngram", "num_speculative_tokens": 4,
"prompt_lookup_min": 2, "prompt_lookup_max": 4})``.
"""

from __future__ import annotations

from array import array

import attrs

from deepinfer import Stage, hookimpl

__all__ = ["NgramDrafter", "propose_ngram", "deepinfer_register_stages"]


def _positive(inst, attribute, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"ngram: {attribute.name}={value!r} is invalid: must be an int >= 1")


def propose_ngram(tokens: list, k: int, n_min: int, n_max: int) -> list:
    """Up to k tokens that followed the most recent earlier occurrence of the longest suffix of ``tokens`` of
    length n_min..n_max; [] when none occurs."""
    L = len(tokens)
    packed = array("l", tokens).tobytes()  # a bytes search runs in C; matches must fall on item boundaries
    size = array("l").itemsize
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        tail = packed[(L - n) * size:]
        end = (L - 1) * size  # a match must end before the last token: not the suffix itself
        while True:
            at = packed.rfind(tail, 0, end)
            if at < 0:
                break
            if at % size == 0:
                start = at // size
                return list(tokens[start + n:start + n + k])
            end = at + len(tail) - 1  # misaligned: a match starting further left
    return []


@attrs.define(eq=False)
class NgramDrafter(Stage):
    name = "ngram"
    kind = "draft"
    reads = ()
    writes = ()

    prompt_lookup_min: int = attrs.field(default=1, validator=_positive)
    prompt_lookup_max: int = attrs.field(default=4, validator=_positive)

    def __attrs_post_init__(self) -> None:
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"ngram: prompt_lookup_min={self.prompt_lookup_min} is larger than "
                             f"prompt_lookup_max={self.prompt_lookup_max}")

    def propose(self, seq, k: int) -> list:
        """The engine's call before a step: up to k draft tokens for this decoding sequence."""
        return propose_ngram(seq.token_ids, k, self.prompt_lookup_min, self.prompt_lookup_max)

    def __call__(self, state) -> None:  # a draft stage is asked through propose(), not run on the step state
        raise TypeError("the ngram draft stage is called through propose(seq, k) by the engine")


@hookimpl
def deepinfer_register_stages(register) -> None:
    register.stage(kind=NgramDrafter.kind, name=NgramDrafter.name, factory=NgramDrafter)

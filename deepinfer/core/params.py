"""SamplingParams: what one request asks of the sampler and the stop logic.

Names and meanings follow vLLM's SamplingParams. Every field is validated when
the object is built; an invalid value raises ValueError naming the field.
"""

from __future__ import annotations

from typing import Optional, Union

import attrs


def _check(cond: bool, field: str, value, why: str) -> None:
    if not cond:
        raise ValueError(f"SamplingParams.{field}={value!r} is invalid: {why}")


_M64 = (1 << 64) - 1


def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def completion_seed(seed: int, index: int) -> int:
    """The generator seed of completion ``index`` of a request seeded ``seed``.

    Completion 0 keeps ``seed`` (so an n=1 request draws what it always drew); completion i > 0 takes a
    splitmix64 mix of (seed, i) in 63 bits, so nearby seeds share no stream (with ``seed + i``, completion 1
    of seed 42 was completion 0 of seed 43).
    """
    if index == 0:
        return seed
    return _splitmix64(_splitmix64(seed & _M64) ^ index) >> 1


def _as_tuple(v) -> tuple:
    if v is None:
        return ()
    if isinstance(v, (str, int)):
        return (v,)
    return tuple(v)


@attrs.frozen
class SamplingParams:
    n: int = 1
    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: Optional[int] = None
    stop: tuple = attrs.field(default=(), converter=_as_tuple)
    stop_token_ids: tuple = attrs.field(default=(), converter=_as_tuple)
    ignore_eos: bool = False
    logprobs: Optional[int] = None  # top-n per generated token (the sampled one is always added)
    prompt_logprobs: Optional[int] = None  # top-n per prompt token
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def __attrs_post_init__(self) -> None:
        num = (int, float)
        _check(isinstance(self.n, int) and not isinstance(self.n, bool) and self.n >= 1, "n", self.n, "must be an int >= 1")
        _check(self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
               "max_tokens", self.max_tokens, "must be None or an int >= 1")
        _check(isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens", self.min_tokens, "must be an int >= 0")
        if self.max_tokens is not None:
            _check(self.min_tokens <= self.max_tokens, "min_tokens", self.min_tokens,
                   f"must be <= max_tokens ({self.max_tokens})")
        _check(isinstance(self.temperature, num) and self.temperature >= 0 and self.temperature == self.temperature
               and self.temperature != float("inf"), "temperature", self.temperature, "must be a finite number >= 0")
        _check(isinstance(self.top_p, num) and 0 < self.top_p <= 1, "top_p", self.top_p, "must be in (0, 1]")
        _check(isinstance(self.top_k, int) and not isinstance(self.top_k, bool) and self.top_k >= -1,
               "top_k", self.top_k, "must be an int: -1 or 0 (disabled) or >= 1")
        _check(isinstance(self.min_p, num) and 0 <= self.min_p <= 1, "min_p", self.min_p, "must be in [0, 1]")
        _check(self.seed is None or (isinstance(self.seed, int) and not isinstance(self.seed, bool)
                                     and -2**63 <= self.seed < 2**64),
               "seed", self.seed, "must be None or an int in [-2**63, 2**64)")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", self.stop, "must be non-empty strings")
        _check(all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids),
               "stop_token_ids", self.stop_token_ids, "must be non-negative ints")
        _check(isinstance(self.ignore_eos, bool), "ignore_eos", self.ignore_eos, "must be a bool")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            _check(v is None or (isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 20),
                   name, v, "must be None or an int in [0, 20]")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            _check(isinstance(v, num) and -2 <= v <= 2, name, v, "must be in [-2, 2]")
        _check(isinstance(self.repetition_penalty, num) and 0 < self.repetition_penalty <= 10,
               "repetition_penalty", self.repetition_penalty, "must be in (0, 10]")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def effective_top_k(self) -> int:
        return 0 if self.top_k in (-1, 0) else self.top_k

    @property
    def needs_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1.0


PromptType = Union[str, list, dict]

"""SamplingParams: what one request asks of the sampler and the stop logic.

Names and meanings follow vLLM's SamplingParams. Every field is validated when
the object is built; an invalid value raises ValueError naming the field.
"""

from __future__ import annotations

import json as _json
import math
import struct
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


FLOAT32_MAX = 3.4028234663852886e38
MIN_REPETITION_PENALTY = 1e-6
MAX_LOGIT_BIAS = 1e6


def _f32(v: float) -> float:
    """v as float32 holds it (the sampler's dtype): 1e-50 becomes 0."""
    return struct.unpack("f", struct.pack("f", v))[0] if abs(v) <= FLOAT32_MAX else math.copysign(math.inf, v)


def _as_tuple(v) -> tuple:
    if v is None:
        return ()
    if isinstance(v, (str, int)) or callable(v):
        return (v,)
    if isinstance(v, (dict, bytes, bytearray)):  # (a dict's keys, a bytes' ints: not what the caller meant)
        return (v,)  # left whole for the validator to name
    return tuple(v)


def _opt_tuple(v) -> Optional[tuple]:
    return None if v is None else _as_tuple(v)


def _opt_dict(v) -> Optional[dict]:
    return dict(v) if isinstance(v, dict) else v


def _is_id(t) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and t >= 0


def _check_ids(field: str, ids, vocab_size: int) -> None:
    bad = [t for t in ids if t >= vocab_size]
    _check(not bad, field, bad[:5], f"token id(s) outside the model's vocabulary [0, {vocab_size})")


def bad_words_token_ids(words, tokenizer) -> tuple:
    """Token sequences of each bad word, as vLLM finds them: the word alone and, when that gives another
    first token but as many tokens, the word after a space (how it is spelled mid-sentence)."""
    out: list = []
    for word in words:
        for prefix in ("", " "):
            ids = tuple(tokenizer.encode(prefix + word.lstrip(), add_special_tokens=False))
            if ids and (not prefix or not out or (ids[0] != out[-1][0] and len(ids) == len(out[-1]))):
                out.append(ids)
    return tuple(out)


def _so_check(cond: bool, field: str, value, why: str) -> None:
    if not cond:
        raise ValueError(f"StructuredOutputsParams.{field}={value!r} is invalid: {why}")


def _structured(v):
    if isinstance(v, dict):
        unknown = sorted(set(v) - {f.name for f in attrs.fields(StructuredOutputsParams)}, key=str)
        _check(not unknown, "structured_outputs", v, f"has unknown field(s) {unknown}")
        return StructuredOutputsParams(**v)
    return v


def _list_as_tuple(v):
    return tuple(v) if isinstance(v, list) else v  # any other type is left for the validator to name


STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@attrs.frozen
class StructuredOutputsParams:
    """What a request's output must match, as vLLM's StructuredOutputsParams: exactly one of ``json`` (a JSON
    schema, a dict or its JSON text), ``regex``, ``choice`` (a list of strings), ``grammar`` (EBNF as xgrammar
    reads it) or ``json_object=True`` (any JSON object). ``disable_any_whitespace``: JSON is written with
    xgrammar's fixed separators (", " and ": ") and no other whitespace. ``jump_forward``: when the grammar
    admits exactly one continuation, append it without a model step (off by default). Every field is
    validated when the object is built; an invalid value raises ValueError naming the field."""

    json: Optional[Union[dict, str]] = attrs.field(default=None, hash=False)
    regex: Optional[str] = None
    choice: Optional[tuple] = attrs.field(default=None, converter=_list_as_tuple)
    grammar: Optional[str] = None
    json_object: Optional[bool] = None
    disable_any_whitespace: bool = False
    jump_forward: bool = False

    def __attrs_post_init__(self) -> None:
        js = self.json
        if isinstance(js, str):
            _so_check(js.strip() != "", "json", js, "must be a JSON schema: a dict, or its JSON text (not empty)")
            try:
                parsed = _json.loads(js)
            except ValueError as exc:
                raise ValueError(f"StructuredOutputsParams.json={js!r} is invalid: not JSON ({exc})") from None
            _so_check(isinstance(parsed, dict), "json", js, "must be a JSON schema (a JSON object)")
        else:
            _so_check(js is None or isinstance(js, dict), "json", js, "must be a JSON schema: a dict, or its JSON text")
            if js is not None:
                try:
                    _json.dumps(js)
                except (TypeError, ValueError) as exc:
                    raise ValueError(f"StructuredOutputsParams.json={js!r} is invalid: not JSON data ({exc})") from None
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            _so_check(v is None or (isinstance(v, str) and v.strip() != ""), name, v, "must be a non-empty string")
        c = self.choice
        _so_check(c is None or isinstance(c, tuple), "choice", c, "must be a list of strings")
        if c is not None:
            _so_check(len(c) > 0, "choice", list(c), "must be a non-empty list of strings")
            _so_check(all(isinstance(x, str) and x != "" for x in c), "choice", list(c),
                      "must hold non-empty strings")
        _so_check(self.json_object is None or isinstance(self.json_object, bool), "json_object", self.json_object,
                  "must be None or a bool")
        for name in ("disable_any_whitespace", "jump_forward"):
            _so_check(isinstance(getattr(self, name), bool), name, getattr(self, name), "must be a bool")
        given = [k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            what = "none is set" if not given else f"{' and '.join(given)} are {'both' if len(given) == 2 else 'all'} set"
            raise ValueError(f"StructuredOutputsParams needs exactly one of json, regex, choice, grammar or "
                             f"json_object=True: {what}")

    @property
    def kind(self) -> str:
        """Which constraint this is: json, regex, choice, grammar or json_object."""
        return next(k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> tuple:
        """(kind, text, whitespace): what a compiled grammar depends on (the cache key, with the tokenizer). A
        schema's text keeps its key order (xgrammar writes properties in schema order)."""
        kind = self.kind
        if kind == "json":
            text = self.json if isinstance(self.json, str) else _json.dumps(self.json)
            text = _json.dumps(_json.loads(text))  # one spelling per schema, whatever the whitespace
        elif kind == "choice":
            text = _json.dumps(list(self.choice))
        elif kind == "json_object":
            text = ""
        else:
            text = getattr(self, kind)
        return kind, text, kind in ("json", "json_object") and self.disable_any_whitespace


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
    # Logit processing, applied to the raw logits before penalties and temperature (logprobs stay raw).
    logit_bias: Optional[dict] = attrs.field(default=None, converter=_opt_dict, hash=False)  # {token id: added}
    allowed_token_ids: Optional[tuple] = attrs.field(default=None, converter=_opt_tuple)  # only these sampled
    bad_words: tuple = attrs.field(default=(), converter=_as_tuple)  # never completed (last token banned)
    truncate_prompt_tokens: Optional[int] = None  # k: keep the last k prompt tokens; -1: max_model_len - 1
    # fn(output_token_ids, logits[V]) -> logits[V] (or fn(prompt_token_ids, output_token_ids, logits)), per
    # row in Python, so slower than the batched fields.
    logits_processors: tuple = attrs.field(default=(), converter=_as_tuple)
    # The output must match this (a JSON schema, regex, choice or EBNF grammar); a dict is read as its fields.
    structured_outputs: Optional[StructuredOutputsParams] = attrs.field(default=None, converter=_structured)
    # Filled at admission (for_model): the token sequences of bad_words.
    _bad_words_token_ids: tuple = attrs.field(default=(), alias="_bad_words_token_ids", repr=False)

    def __attrs_post_init__(self) -> None:
        def num(v) -> bool:  # a real number (not a bool); the sampler holds these as float32
            return isinstance(v, (int, float)) and not isinstance(v, bool)

        def integer(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        _check(integer(self.n) and self.n >= 1, "n", self.n, "must be an int >= 1")
        _check(self.max_tokens is None or (integer(self.max_tokens) and self.max_tokens >= 1),
               "max_tokens", self.max_tokens, "must be None or an int >= 1")
        _check(integer(self.min_tokens) and self.min_tokens >= 0, "min_tokens", self.min_tokens, "must be an int >= 0")
        if self.max_tokens is not None:
            _check(self.min_tokens <= self.max_tokens, "min_tokens", self.min_tokens,
                   f"must be <= max_tokens ({self.max_tokens})")
        _check(num(self.temperature) and 0 <= self.temperature <= FLOAT32_MAX, "temperature", self.temperature,
               "must be a finite number >= 0 (finite in float32: at most 3.4e38)")
        _check(num(self.top_p) and 0 < self.top_p <= 1 and _f32(self.top_p) > 0, "top_p", self.top_p,
               "must be in (0, 1] (and nonzero in float32: at least 1.4e-45)")
        _check(integer(self.top_k) and self.top_k >= -1,
               "top_k", self.top_k, "must be an int: -1 or 0 (disabled) or >= 1")
        _check(num(self.min_p) and 0 <= self.min_p <= 1, "min_p", self.min_p, "must be in [0, 1]")
        _check(self.seed is None or (isinstance(self.seed, int) and not isinstance(self.seed, bool)
                                     and -2**63 <= self.seed < 2**64),
               "seed", self.seed, "must be None or an int in [-2**63, 2**64)")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", self.stop, "must be non-empty strings")
        _check(all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids),
               "stop_token_ids", self.stop_token_ids, "must be non-negative ints")
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            _check(isinstance(getattr(self, name), bool), name, getattr(self, name), "must be a bool")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            _check(v is None or _is_id(v), name, v, "must be None or an int >= 0 (at most LLM(max_logprobs=...))")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            _check(num(v) and -2 <= v <= 2, name, v, "must be in [-2, 2]")
        # A positive logit is divided by it: below 1e-6 a float32 logit could overflow to inf.
        _check(num(self.repetition_penalty) and MIN_REPETITION_PENALTY <= self.repetition_penalty <= 10,
               "repetition_penalty", self.repetition_penalty, f"must be in [{MIN_REPETITION_PENALTY:g}, 10]")
        bias = self.logit_bias
        _check(bias is None or (isinstance(bias, dict) and all(_is_id(t) for t in bias)
                                and all(num(b) and abs(b) <= MAX_LOGIT_BIAS for b in bias.values())),
               "logit_bias", bias, f"must be None or a dict {{token id (int >= 0): number in [-{MAX_LOGIT_BIAS:g}, "
               f"{MAX_LOGIT_BIAS:g}]}} (OpenAI's API allows [-100, 100]; larger would overflow float32 logits "
               "once divided by a temperature)")
        allowed = self.allowed_token_ids
        _check(allowed is None or (allowed and all(_is_id(t) for t in allowed)), "allowed_token_ids", allowed,
               "must be None or a non-empty list of token ids (ints >= 0)")
        _check(all(isinstance(w, str) and w.strip() for w in self.bad_words), "bad_words", self.bad_words,
               "must be strings with a non-space character")
        t = self.truncate_prompt_tokens
        _check(t is None or (isinstance(t, int) and not isinstance(t, bool) and (t >= 1 or t == -1)),
               "truncate_prompt_tokens", t, "must be None, -1 (max_model_len - 1) or an int >= 1")
        _check(all(callable(f) for f in self.logits_processors), "logits_processors", self.logits_processors,
               "must be callables fn(output_token_ids, logits) -> logits")
        so = self.structured_outputs
        _check(so is None or isinstance(so, StructuredOutputsParams), "structured_outputs", so,
               "must be None or a StructuredOutputsParams")
        _check(so is None or not so.jump_forward or self.logprobs is None, "structured_outputs", so,
               "jump_forward=True cannot be combined with logprobs (jumped tokens are not sampled: they have none)")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def effective_top_k(self) -> int:
        """0 (disabled) or k, capped where it already keeps every token of any vocabulary (int32 range)."""
        return 0 if self.top_k in (-1, 0) else min(self.top_k, 2**31 - 1)

    @property
    def needs_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1.0

    @property
    def needs_output_tokens(self) -> bool:
        """The sampler reads this row's output tokens on the host (so they must be known, not pending, when it
        runs). Penalties do not: their token counts grow on the device (core/sampling_state.py)."""
        return bool(self.bad_words) or bool(self.logits_processors) or self.jump_forward

    @property
    def jump_forward(self) -> bool:
        """Structured outputs with jump-forward: tokens the grammar forces are appended between steps, so the
        engine learns this row's tokens before it launches the next step."""
        return self.structured_outputs is not None and self.structured_outputs.jump_forward

    @property
    def bad_words_token_ids(self) -> tuple:
        return self._bad_words_token_ids

    def for_model(self, tokenizer, vocab_size: int, max_logprobs: int) -> "SamplingParams":
        """These params checked against one model and made ready to sample: token ids inside its vocabulary,
        logprobs within max_logprobs (-1: no limit), bad_words tokenized. Raises ValueError naming the field;
        the engine then fails the request alone."""
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            _check(v is None or max_logprobs < 0 or v <= max_logprobs, name, v,
                   f"more than max_logprobs={max_logprobs} (raise it with LLM(max_logprobs=...))")
        _check_ids("logit_bias", self.logit_bias or (), vocab_size)
        _check_ids("allowed_token_ids", self.allowed_token_ids or (), vocab_size)
        if not self.bad_words:
            return self
        _check(tokenizer is not None, "bad_words", self.bad_words, "need a tokenizer")
        return attrs.evolve(self, _bad_words_token_ids=bad_words_token_ids(self.bad_words, tokenizer))

    def truncate(self, prompt_token_ids: list, max_model_len: int) -> list:
        """The prompt after truncate_prompt_tokens: its last k tokens (vLLM's left truncation)."""
        k = self.truncate_prompt_tokens
        if k is None:
            return prompt_token_ids
        k = max_model_len - 1 if k == -1 else k
        return prompt_token_ids[-k:] if len(prompt_token_ids) > k else prompt_token_ids


PromptType = Union[str, list, dict]

"""SamplingParams and EngineConfig validation: every invalid value raises ValueError naming the field."""

import pytest

from deepinfer import SamplingParams
from deepinfer.core.config import EngineConfig
from deepinfer.core.params import completion_seed

BAD = [
    ("n", 0), ("n", 1.5), ("n", True), ("max_tokens", 0), ("max_tokens", -3), ("max_tokens", 2.0),
    ("min_tokens", -1), ("temperature", -0.1), ("temperature", float("nan")), ("temperature", float("inf")),
    ("temperature", "hot"), ("top_p", 0.0), ("top_p", 1.01), ("top_k", -2), ("top_k", 2.5), ("min_p", -0.01),
    ("min_p", 1.5), ("seed", 1.5), ("seed", "x"), ("seed", 2**64), ("seed", -2**63 - 1), ("stop", [""]), ("stop", [3]),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", ["a"]), ("ignore_eos", "yes"), ("logprobs", -1), ("logprobs", 2.0), ("prompt_logprobs", -1),
    ("presence_penalty", 2.5), ("frequency_penalty", -2.5), ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0), ("logit_bias", {-1: 1.0}), ("logit_bias", {"5": 1.0}), ("logit_bias", {5: "x"}),
    ("logit_bias", {5: float("inf")}), ("logit_bias", [1, 2]), ("allowed_token_ids", []), ("allowed_token_ids", [-1]),
    ("allowed_token_ids", ["a"]), ("bad_words", [""]), ("bad_words", ["  "]), ("bad_words", [3]),
    ("truncate_prompt_tokens", 0), ("truncate_prompt_tokens", -2), ("truncate_prompt_tokens", 1.5),
    ("logits_processors", [3]),
    # Finite or nonzero as Python floats, but not as the sampler's float32 (1e39 -> inf, 1e-50 -> 0).
    ("temperature", 1e39), ("top_p", 1e-50), ("repetition_penalty", 1e-50), ("logit_bias", {5: 1e39}),
    # Bools are not numbers here, and a dict or bytes is not a list of stop strings.
    ("temperature", True), ("top_p", True), ("min_p", False), ("max_tokens", True), ("min_tokens", True),
    ("presence_penalty", True), ("repetition_penalty", True), ("logit_bias", {5: True}),
    ("stop", {"a": 1}), ("stop", b"x"), ("skip_special_tokens", "no"), ("include_stop_str_in_output", 0),
    ("structured_outputs", {"jsonn": {}}),
]


@pytest.mark.parametrize("field,value", BAD)
def test_invalid_value_names_field(field, value):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}="):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=5, max_tokens=3)


def test_defaults_and_conversions():
    p = SamplingParams(stop="###", stop_token_ids=7, top_k=-1, temperature=0)
    assert p.stop == ("###",) and p.stop_token_ids == (7,)
    assert p.effective_top_k == 0 and p.greedy and not p.needs_penalties
    assert SamplingParams(repetition_penalty=1.2).needs_penalties
    assert SamplingParams(max_tokens=None).max_tokens is None


@pytest.mark.parametrize("field,value", [("block_size", 0), ("max_num_seqs", -1), ("dtype", "int8"),
                                         ("max_num_batched_tokens", 0), ("kv_cache_memory_gb", 0),
                                         ("num_kv_blocks", 0), ("max_model_len", 1.5)])
def test_engine_config_invalid(field, value):
    with pytest.raises(ValueError, match=rf"EngineConfig\.{field}="):
        EngineConfig(**{field: value})


def test_completion_seeds_of_nearby_seeds_do_not_overlap():
    seeds = range(-64, 64)
    derived = [completion_seed(s, i) for s in seeds for i in range(1, 16)]
    assert [completion_seed(s, 0) for s in seeds] == list(seeds)  # completion 0 keeps the seed: n=1 unchanged
    assert len(set(derived)) == len(derived) and not set(derived) & set(seeds)
    assert all(0 <= d < 2**63 for d in derived)
    assert completion_seed(2**64 - 1, 3) == completion_seed(-1, 3)  # torch's seeds are taken mod 2**64


def test_float32_edges_that_stay_valid():
    """The largest float32-finite temperature, the smallest float32-nonzero top_p, and top_k past int64."""
    assert SamplingParams(temperature=3.4e38).temperature == 3.4e38
    assert SamplingParams(top_p=1e-40).top_p == 1e-40  # a float32 subnormal: still > 0 on the device
    assert SamplingParams(logit_bias={5: -1e6}).logit_bias == {5: -1e6}
    assert SamplingParams(top_k=2**70).effective_top_k == 2**31 - 1  # keeps every token of any vocabulary

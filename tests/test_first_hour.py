"""Issue 11, the first hour of a vLLM user: vLLM's LLM keywords, the logit controls of SamplingParams
(logit_bias, allowed_token_ids, bad_words, truncate_prompt_tokens, logits_processors, max_logprobs), chat's
prompt text, and the thread count. On the bundled demo model (and a tiny llama where a checkpoint is edited)."""

import json
import logging

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.core.kv_sizing import MemoryProfile, plan_kv
from deepinfer.core.config import EngineConfig
from deepinfer.testing.models import build_tiny_hf_model

PROMPT = "def fib(n):"
GREEDY = dict(max_tokens=6, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    return LLM(max_model_len=256)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama")
    build_tiny_hf_model(d, "llama")
    return d


def gen(llm, prompts, params):
    return llm.generate(prompts, params, use_tqdm=False)


def tokens(llm, prompt=PROMPT, **kw):
    return gen(llm, [prompt], SamplingParams(**{**GREEDY, **kw}))[0].outputs[0].token_ids


# --------------------------------------------------------------------------------------- LLM keywords


def test_vllm_keywords_that_carry_over_are_accepted(tiny, caplog):
    with caplog.at_level(logging.WARNING, logger="deepinfer.core.llm"):
        llm = LLM(str(tiny), num_kv_blocks=32, gpu_memory_utilization=0.5, enable_prefix_caching=True,
                  kv_cache_dtype="auto", tensor_parallel_size=1, speculative_config=None, quantization=None,
                  trust_remote_code=False, swap_space=0, enable_chunked_prefill=True, max_logprobs=3)
    assert llm.cache_stats()["enabled"]
    assert llm.config.gpu_memory_utilization == 0.5 and llm.config.max_logprobs == 3
    out = gen(llm, ["a b", "c d"], [SamplingParams(max_tokens=2, logprobs=3), SamplingParams(max_tokens=2, logprobs=4)])
    assert out[0].error is None and len(out[0].outputs[0].logprobs) == 2
    assert out[1].outputs[0].finish_reason == "error" and "max_logprobs=3" in out[1].error  # fails alone


@pytest.mark.parametrize("kw,match", [
    (dict(gpu_memory_utilization=1.5), r"gpu_memory_utilization=1.5 is invalid"),
    (dict(gpu_memory_utilization=0), r"gpu_memory_utilization=0 is invalid"),
    (dict(speculative_config={"model": "x", "num_speculative_tokens": 3}), r"speculative_config lacks 'method'"),
    (dict(kv_cache_dtype="fp8"), r"kv_cache_dtype='fp8' is not supported: only 'auto'"),
    (dict(tensor_parallel_size=2, data_parallel_size=2), r"data_parallel_size=2 with tensor_parallel_size=2 is not"),
    (dict(quantization="awq"), r"quantization='awq' is not supported"),
    (dict(max_logprobs=-2), r"max_logprobs=-2 is invalid"),
    (dict(enable_prefix_caching="yes"), r"enable_prefix_caching='yes' is invalid"),
    (dict(trust_remote_code=True), r"trust_remote_code=True.*never runs code"),
    (dict(swap_space=4), r"swap_space=4.*recompute"),
    (dict(enable_chunked_prefill=False), r"enable_chunked_prefill=False.*max_num_batched_tokens"),
    (dict(pipeline_parallel_size=2), r"pipeline_parallel_size=2"),
    (dict(cpu_offload_gb=4), r"cpu_offload_gb=4"),
    (dict(num_gpu_blocks_override=10), r"use num_kv_blocks"),
    (dict(revision="main"), r"hf download"),
])
def test_vllm_keywords_refused_with_what_to_do(tiny, kw, match):
    with pytest.raises(ValueError, match=match):
        LLM(str(tiny), num_kv_blocks=8, **kw)


def test_unknown_keyword_lists_the_accepted_ones(tiny):
    with pytest.raises(TypeError, match=r"unknown argument\(s\) \['not_a_setting'\].*gpu_memory_utilization"):
        LLM(str(tiny), not_a_setting=1)


def test_quantization_fp8_needs_an_fp8_checkpoint(tiny, tmp_path):
    with pytest.raises(ValueError, match="quantization='fp8' needs an FP8 checkpoint"):
        LLM(str(tiny), num_kv_blocks=8, quantization="fp8")
    build_tiny_hf_model(tmp_path, "llama")
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [32, 32]}  # no FP8 tensors needed
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert LLM(str(tmp_path), num_kv_blocks=8, quantization="fp8").config.quantization == "fp8"


def test_kv_budget_from_gpu_memory_utilization():
    """The share is of the device's total memory, less what is in use after loading and the profiled peak
    (the arithmetic; core/kv_sizing.py and tests/test_kv_sizing.py hold the rest)."""
    GiB = 2**30
    prof = MemoryProfile(total=100 * GiB, in_use=20 * GiB, peak_step=0, graph_reserve=0)
    assert plan_kv(EngineConfig(gpu_memory_utilization=0.9, max_num_seqs=10**6), GiB, 0, 16, False,
                   prof).num_blocks == 70
    with pytest.raises(ValueError, match=r"cache holds 0"):
        plan_kv(EngineConfig(gpu_memory_utilization=0.2), GiB, 0, 16, False, prof)


def test_threads_keyword_and_environment(tiny, monkeypatch):
    before = torch.get_num_threads()
    try:
        LLM(str(tiny), num_kv_blocks=8, threads=2)
        assert torch.get_num_threads() == 2
        monkeypatch.setenv("DEEPINFER_NUM_THREADS", "1")
        LLM(str(tiny), num_kv_blocks=8)
        assert torch.get_num_threads() == 1
        for bad in ("0", "two", "-1"):
            monkeypatch.setenv("DEEPINFER_NUM_THREADS", bad)
            with pytest.raises(ValueError, match=f"DEEPINFER_NUM_THREADS='?{bad}'?"):
                LLM(str(tiny), num_kv_blocks=8)
        with pytest.raises(ValueError, match="threads=0"):
            LLM(str(tiny), num_kv_blocks=8, threads=0)  # the keyword wins over the environment
    finally:
        torch.set_num_threads(before)


# -------------------------------------------------------------------------------- outputs and chat


def test_chat_output_carries_the_rendered_prompt(llm):
    msgs = [{"role": "user", "content": "hi"}]
    out = llm.chat(msgs, SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert out.prompt == llm.get_tokenizer().apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert out.num_cached_tokens == 0
    assert gen(llm, [{"prompt": "x = 1"}], SamplingParams(max_tokens=1))[0].prompt == "x = 1"
    assert gen(llm, [[5, 6, 7]], SamplingParams(max_tokens=1))[0].prompt is None


def test_get_tokenizer_is_transformers_shaped(llm):
    tok = llm.get_tokenizer()
    ids = tok(PROMPT)["input_ids"]
    assert ids == tok.encode(PROMPT) and tok(PROMPT)["attention_mask"] == [1] * len(ids)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True) == tok.encode(
        tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True),
        add_special_tokens=False)
    assert tok.eos_token_id == 1 and tok.pad_token_id == 2 and len(tok) == tok.vocab_size == 4096


# ----------------------------------------------------------------------------- SamplingParams controls


def test_logit_bias_steers_and_logprobs_stay_raw(llm):
    base = gen(llm, [PROMPT], SamplingParams(**GREEDY, logprobs=1))[0].outputs[0]
    t = 300
    biased = gen(llm, [PROMPT], SamplingParams(**GREEDY, logprobs=1, logit_bias={t: 100.0}))[0].outputs[0]
    assert biased.token_ids == [t] * 6
    raw = torch.log_softmax(llm.engine.model.forward_full(torch.tensor(llm.tokenizer.encode(PROMPT)))[-1].float(), -1)
    assert biased.logprobs[0][t].logprob == pytest.approx(raw[t].item(), abs=1e-4)  # the unbiased distribution
    assert base.logprobs[0][base.token_ids[0]].logprob == pytest.approx(raw.max().item(), abs=1e-4)


def test_allowed_token_ids_bound_sampling(llm):
    allowed = [10, 20, 30, 300]
    out = gen(llm, [PROMPT], SamplingParams(max_tokens=8, temperature=1.5, seed=3, ignore_eos=True,
                                            allowed_token_ids=allowed))[0].outputs[0]
    assert len(out.token_ids) == 8 and set(out.token_ids) <= set(allowed)


def test_ids_outside_the_vocab_fail_their_request_alone(llm):
    V = llm.engine.model.vocab_size
    outs = gen(llm, [PROMPT] * 4, [SamplingParams(**GREEDY, logit_bias={V: 1.0}),
                                   SamplingParams(**GREEDY, allowed_token_ids=[1, V + 3]),
                                   SamplingParams(**GREEDY, logprobs=21),
                                   SamplingParams(**GREEDY)])
    for o, what in zip(outs, (f"logit_bias=[{V}]", "allowed_token_ids", "max_logprobs=20")):
        assert o.outputs[0].finish_reason == "error" and what in o.error, o.error
    assert outs[3].error is None and outs[3].outputs[0].token_ids == tokens(llm)
    assert llm.engine.pool.num_free == llm.engine.pool.num_blocks


@pytest.mark.parametrize("overlap", [False, True])
def test_bad_words_are_never_completed(overlap):
    llm = LLM(max_model_len=256, overlap_scheduling=overlap)
    base = tokens(llm, max_tokens=8)
    word = llm.tokenizer.decode(base[1:3])  # " return f" in the demo model's greedy output
    out = gen(llm, [PROMPT], SamplingParams(**{**GREEDY, "max_tokens": 8}, bad_words=[word]))[0].outputs[0]
    seqs = SamplingParams(bad_words=[word]).for_model(llm.tokenizer, 4096, 20).bad_words_token_ids
    assert tuple(base[1:3]) in seqs
    assert out.token_ids[:2] == base[:2] and out.token_ids[2] != base[2]  # steered off at the word's last token
    for s in seqs:
        assert all(tuple(out.token_ids[i:i + len(s)]) != s for i in range(len(out.token_ids)))
    one_token = llm.tokenizer.decode(base[1:2]).strip()  # "return": banned as " return" (one token) too
    assert (base[1],) in SamplingParams(bad_words=[one_token]).for_model(llm.tokenizer, 4096, 20).bad_words_token_ids
    assert base[1] not in tokens(llm, max_tokens=8, bad_words=[one_token])


def test_truncate_prompt_tokens_keeps_the_tail(llm):
    ids = llm.tokenizer.encode("import os\nimport sys\ndef main(argv):\n    return 0\n")
    out = gen(llm, [ids], SamplingParams(**GREEDY, truncate_prompt_tokens=5))[0]
    assert out.prompt_token_ids == ids[-5:]
    assert out.outputs[0].token_ids == tokens(llm, ids[-5:])
    long = (ids * 40)[:300]  # longer than max_model_len (256)
    out = gen(llm, [long, long], [SamplingParams(**GREEDY, truncate_prompt_tokens=-1), SamplingParams(**GREEDY)])
    assert out[0].error is None and out[0].prompt_token_ids == long[-255:]
    assert out[1].outputs[0].finish_reason == "error"  # without it, too long


@pytest.mark.parametrize("overlap", [False, True])
def test_logits_processors_see_the_known_output(overlap):
    llm = LLM(max_model_len=256, overlap_scheduling=overlap)
    seen = []

    def force(out, logits):  # vLLM v0's two-argument form
        seen.append(list(out))
        forced = torch.full_like(logits, float("-inf"))
        forced[40 + len(out)] = 0.0
        return forced

    def with_prompt(prompt, out, logits):
        assert prompt == llm.tokenizer.encode(PROMPT)
        return logits

    outs = gen(llm, [PROMPT, PROMPT], [SamplingParams(**GREEDY, logits_processors=[with_prompt, force]),
                                       SamplingParams(**GREEDY)])
    assert outs[0].outputs[0].token_ids == [40, 41, 42, 43, 44, 45]
    assert seen == [[40, 41, 42, 43, 44, 45][:i] for i in range(6)]  # never a pending placeholder
    assert outs[1].outputs[0].token_ids == tokens(llm)


def test_a_failing_logits_processor_fails_its_request_alone(llm):
    def broken(out, logits):
        if len(out) == 2:
            raise RuntimeError("boom")
        return logits

    outs = gen(llm, [PROMPT, PROMPT, "x = 1"], [SamplingParams(**GREEDY),
                                               SamplingParams(**GREEDY, logits_processors=[broken]),
                                               SamplingParams(**GREEDY, logits_processors=[lambda out, lg: lg[:3]])])
    assert outs[0].error is None and outs[0].outputs[0].token_ids == tokens(llm)
    assert outs[1].outputs[0].finish_reason == "error" and "RuntimeError: boom" in outs[1].error
    assert outs[2].outputs[0].finish_reason == "error" and "not a tensor of shape" in outs[2].error
    assert llm.engine.pool.num_free == llm.engine.pool.num_blocks

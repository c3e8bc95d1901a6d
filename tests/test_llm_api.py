"""The offline API end to end on a tiny real checkpoint: prompt forms, n, seeds, logprobs, stops, errors."""

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.testing.models import build_tiny_hf_model

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama")
    build_tiny_hf_model(d, "llama")
    return LLM(str(d), num_kv_blocks=96, max_model_len=128)


def gen(llm, prompts, params=GREEDY):
    return llm.generate(prompts, params, use_tqdm=False)


def test_prompt_forms_agree_and_order_kept(llm):
    ids = llm.tokenizer.encode("def fib(n):")
    outs = gen(llm, ["def fib(n):", ids, {"prompt_token_ids": ids}, "x = 1"])
    assert [o.request_id for o in outs] == sorted((o.request_id for o in outs), key=int)
    assert outs[0].prompt_token_ids == ids
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids == outs[2].outputs[0].token_ids
    assert all(len(o.outputs[0].token_ids) == 12 and o.outputs[0].finish_reason == "length" for o in outs)
    assert outs[0].outputs[0].text == llm.tokenizer.decode(outs[0].outputs[0].token_ids)


def test_one_params_per_prompt(llm):
    outs = gen(llm, ["a", "b"], [SamplingParams(max_tokens=3, ignore_eos=True), SamplingParams(max_tokens=5, ignore_eos=True)])
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 5]
    with pytest.raises(ValueError, match="SamplingParams"):
        gen(llm, ["a", "b"], [SamplingParams()])


def test_n_completions_and_seed_independent_of_batch(llm):
    sp = SamplingParams(n=3, max_tokens=10, temperature=1.0, seed=11, ignore_eos=True)
    alone = gen(llm, ["hello"], sp)[0]
    assert [c.index for c in alone.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in alone.outputs}) > 1  # different seeds per completion
    mixed = gen(llm, ["other prompt", "hello", "x" * 20],
                [SamplingParams(max_tokens=7, temperature=0.7, ignore_eos=True), sp, GREEDY])[1]
    assert [c.token_ids for c in mixed.outputs] == [c.token_ids for c in alone.outputs]


def test_completions_of_nearby_seeds_differ(llm):
    sp = dict(max_tokens=10, temperature=1.0, ignore_eos=True)
    s42 = gen(llm, ["hello"], SamplingParams(n=2, seed=42, **sp))[0].outputs
    s43 = gen(llm, ["hello"], SamplingParams(n=2, seed=43, **sp))[0].outputs
    assert s42[1].token_ids != s43[0].token_ids  # with seed + i they were the same draw
    one = gen(llm, ["hello"], SamplingParams(seed=42, **sp))[0].outputs[0]
    assert one.token_ids == s42[0].token_ids  # completion 0 keeps the seed itself


def test_logprobs_and_cumulative(llm):
    out = gen(llm, ["def f"], SamplingParams(max_tokens=6, temperature=0, logprobs=3, ignore_eos=True))[0].outputs[0]
    assert len(out.logprobs) == 6
    for tok, d in zip(out.token_ids, out.logprobs):
        assert tok in d and d[tok].rank == 1  # greedy picks the top token
        assert len(d) == 3  # the sampled token is among the top 3
        assert max(lp.logprob for lp in d.values()) == d[tok].logprob
        assert all(isinstance(lp.decoded_token, str) for lp in d.values())
    assert out.cumulative_logprob == pytest.approx(sum(d[t].logprob for t, d in zip(out.token_ids, out.logprobs)))


def test_prompt_logprobs_match_full_forward(llm):
    ids = llm.tokenizer.encode("def fib(n): return n")
    out = gen(llm, [ids], SamplingParams(max_tokens=1, prompt_logprobs=2))[0]
    plp = out.prompt_logprobs
    assert len(plp) == len(ids) and plp[0] is None
    with torch.no_grad():
        ref = torch.log_softmax(llm.engine.model.forward_full(torch.tensor(ids)), -1)
    for p in range(1, len(ids)):
        assert ids[p] in plp[p]
        assert plp[p][ids[p]].logprob == pytest.approx(ref[p - 1, ids[p]].item(), abs=1e-4)
        assert len(plp[p]) in (2, 3)


def test_prompt_logprobs_with_chunked_prefill(tmp_path):
    build_tiny_hf_model(tmp_path, "llama")
    a = LLM(str(tmp_path), num_kv_blocks=64, max_num_batched_tokens=5)
    b = LLM(str(tmp_path), num_kv_blocks=64)
    sp = SamplingParams(max_tokens=2, prompt_logprobs=0, temperature=0)
    text = "the quick brown fox jumps over the lazy dog"
    pa, pb = gen(a, [text], sp)[0].prompt_logprobs, gen(b, [text], sp)[0].prompt_logprobs
    assert len(pa) == len(pb) > 5
    for x, y in zip(pa[1:], pb[1:]):
        assert x.keys() == y.keys()
        assert all(x[k].logprob == pytest.approx(y[k].logprob, abs=1e-4) for k in x)


def test_stop_string_excluded_and_reason(llm):
    base = gen(llm, ["print("])[0].outputs[0]
    assert len(base.text) > 6
    stop = base.text[3:5]
    out = gen(llm, ["print("], SamplingParams(max_tokens=12, temperature=0, stop=[stop], ignore_eos=True))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == base.text[: base.text.index(stop)]
    assert stop not in out.text


def test_stop_token_ids_and_min_tokens(llm):
    base = gen(llm, ["while True:"])[0].outputs[0].token_ids
    stop_id = base[2]
    out = gen(llm, ["while True:"], SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[stop_id],
                                                    ignore_eos=True))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    assert out.token_ids == base[: base.index(stop_id) + 1]
    k = base.index(stop_id) + 2
    late = gen(llm, ["while True:"], SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[stop_id],
                                                     min_tokens=k, ignore_eos=True))[0].outputs[0]
    assert stop_id not in late.token_ids[:k]  # banned until min_tokens


def test_bad_requests_fail_alone(llm):
    good = gen(llm, ["def g():"])[0].outputs[0].token_ids
    outs = gen(llm, ["def g():", "y" * 400, [], [llm.engine.model.vocab_size + 5], "def g():"])
    assert outs[0].outputs[0].token_ids == good == outs[4].outputs[0].token_ids
    for o, what in zip(outs[1:4], ("max_model_len", "empty", "out of range")):
        assert o.finished and o.error and what in o.error
        assert o.outputs[0].finish_reason == "error"
    assert llm.engine.pool.num_free == llm.engine.pool.num_blocks  # nothing leaked


def test_extreme_sampling_values_fail_alone_or_sample_sanely(llm):
    """top_k past int64 (once an overflow that failed the whole step) keeps every token; a logits processor that
    returns NaN, +inf or nothing finite fails its request alone (NaN probabilities would pick token 0); {"prompt":
    ""} is an empty prompt. The greedy batch-mate's tokens are those it gets alone."""
    good = gen(llm, ["def g():"])[0].outputs[0].token_ids
    seeded = SamplingParams(max_tokens=12, temperature=0.8, seed=3, ignore_eos=True)
    alone = gen(llm, ["x = 1"], seeded)[0].outputs[0].token_ids
    nan = SamplingParams(max_tokens=4, logits_processors=[lambda out, lg: lg * float("nan")])
    inf = SamplingParams(max_tokens=4, logits_processors=[lambda out, lg: lg.fill_(float("inf"))])
    none_left = SamplingParams(max_tokens=4, logits_processors=[lambda out, lg: torch.full_like(lg, float("-inf"))])
    huge_k = SamplingParams(max_tokens=12, temperature=0.8, seed=3, top_k=2**63, ignore_eos=True)
    outs = gen(llm, ["def g():", "a", "b", "c", {"prompt": ""}, "x = 1"],
               [GREEDY, nan, inf, none_left, GREEDY, huge_k])
    assert outs[0].outputs[0].token_ids == good
    for o in outs[1:4]:
        assert o.outputs[0].finish_reason == "error" and "NaN or +inf, or with no finite entry" in o.error
    assert outs[4].error and "non-empty string" in outs[4].error
    import numpy as np

    as_numpy = gen(llm, [list(np.array(llm.tokenizer.encode("def g():")))])[0]  # numpy ints are ids too
    assert as_numpy.error is None and as_numpy.outputs[0].token_ids == good
    for bad, why in (({"prompt_token_ids": 5}, "must be a list of token ids"), ("a\ud800b", "could not be tokenized")):
        assert why in gen(llm, [bad])[0].error
    assert outs[5].error is None and outs[5].outputs[0].token_ids == alone  # top_k beyond V: no top-k at all
    assert llm.engine.pool.num_free == llm.engine.pool.num_blocks


def test_bad_argument_types_raise_clearly(llm):
    with pytest.raises(TypeError, match="prompts must be"):
        gen(llm, 123)
    with pytest.raises(TypeError, match="sampling_params must be"):
        gen(llm, ["a"], "greedy")
    out = gen(llm, ["", "ok"])
    assert out[0].error and "empty" in out[0].error and out[1].error is None


def test_max_model_len_stops_with_length(llm):
    ids = list(range(10, 10 + 120))
    out = gen(llm, [ids], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))[0].outputs[0]
    assert out.finish_reason == "length" and len(ids) + len(out.token_ids) == 128


def test_stream_yields_growing_text(llm):
    seen = list(llm.stream("for i in", SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)))
    assert seen[-1].finished and not any(s.finished for s in seen[:-1])
    lens = [len(s.outputs[0].token_ids) for s in seen]
    assert lens == sorted(lens) and lens[-1] == 5
    assert seen[-1].outputs[0].token_ids == gen(llm, ["for i in"], SamplingParams(max_tokens=5, temperature=0,
                                                                                 ignore_eos=True))[0].outputs[0].token_ids


@pytest.mark.parametrize("cut", [(5, 8), (3, 9), (10, 12)])
def test_stream_never_shows_text_a_stop_string_takes_back(llm, cut):
    """With a stop string, a streamed text that ends in the stop's first characters holds them back: every
    streamed text is a prefix of the final one (it once showed a stop's start, then dropped it)."""
    p = "The quick brown fox"
    full = gen(llm, [p], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))[0].outputs[0].text
    stop = full[cut[0]:cut[1]]
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop=[stop])
    texts = [o.outputs[0].text for o in llm.stream(p, params)]
    final = gen(llm, [p], params)[0].outputs[0].text
    assert texts[-1] == final and stop not in final
    assert all(final.startswith(t) for t in texts), (stop, texts)


def test_chat_uses_template(llm):
    msgs = [{"role": "user", "content": "hi"}]
    out = llm.chat(msgs, GREEDY, use_tqdm=False)[0]
    text = llm.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert out.prompt_token_ids == llm.tokenizer.encode(text)
    assert len(llm.chat([msgs, msgs], GREEDY, use_tqdm=False)) == 2
    parts = [{"role": "user", "content": [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]}]
    joined = llm.chat([{"role": "user", "content": "h\ni"}], GREEDY, use_tqdm=False)[0]
    assert llm.chat(parts, GREEDY, use_tqdm=False)[0].prompt_token_ids == joined.prompt_token_ids


@pytest.mark.parametrize("messages, match", [
    ([{"role": "wizard", "content": "hi"}], r"messages\[0\]\.role='wizard' is invalid"),
    ([{"content": "hi"}], r"messages\[0\]\.role=None is invalid"),
    ([{"role": "user"}], r"messages\[0\] needs 'content'"),
    ([{"role": "user", "content": 5}], r"messages\[0\]\.content must be a string"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}], "only text parts"),
    ([[{"role": "user", "content": "hi"}], []], r"messages\[1\] must be a non-empty list"),
])
def test_chat_names_a_bad_message(llm, messages, match):
    with pytest.raises(ValueError, match=match):
        llm.chat(messages, GREEDY, use_tqdm=False)


def test_tqdm_default_on(llm, capsys):
    llm.generate(["a"], SamplingParams(max_tokens=2))
    assert "generate" in capsys.readouterr().err


def test_unknown_engine_argument(llm):
    with pytest.raises(TypeError, match="unknown argument"):
        LLM(llm.model_path, not_a_setting=1)


def test_generation_config_supplies_sampling_defaults(tmp_path):
    import json

    build_tiny_hf_model(tmp_path, "llama")
    gen = json.loads((tmp_path / "generation_config.json").read_text())
    gen.update(temperature=0.0, top_k=5, do_sample=True)  # only vLLM's keys are read
    (tmp_path / "generation_config.json").write_text(json.dumps(gen))
    llm = LLM(str(tmp_path), num_kv_blocks=32)
    d = llm.get_default_sampling_params()
    assert d.temperature == 0.0 and d.top_k == 5 and d.max_tokens == 16
    default = llm.generate(["a b c"], use_tqdm=False)[0].outputs[0].token_ids
    assert default == llm.generate(["a b c"], SamplingParams(temperature=0), use_tqdm=False)[0].outputs[0].token_ids
    gen["temperature"] = -1  # invalid: ignored with a warning, not fatal
    (tmp_path / "generation_config.json").write_text(json.dumps(gen))
    assert LLM(str(tmp_path), num_kv_blocks=32).get_default_sampling_params().temperature == 1.0


def test_leaving_a_stream_early_then_generate(llm):
    sp = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    for _ in llm.stream("for i in", sp):
        break  # the dropped iterator aborts its request
    assert llm.engine.pool.num_free == llm.engine.pool.num_blocks  # its blocks are back at once
    outs = gen(llm, ["def g():", "x = 1"])
    assert [len(o.outputs[0].token_ids) for o in outs] == [12, 12]
    assert llm.engine.pool.num_free == llm.engine.pool.num_blocks
    assert not llm.engine.requests  # the aborted request was reported and dropped, not left behind


def test_paused_stream_survives_generate(llm):
    sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    want = gen(llm, ["for i in"], sp)[0].outputs[0].token_ids
    it = llm.stream("for i in", sp)
    first = next(it)
    outs = gen(llm, ["def g():"])  # 12 tokens: the paused stream's request finishes meanwhile
    assert len(outs[0].outputs[0].token_ids) == 12
    rest = list(it)  # resumes with the latest output of its request
    assert len(first.outputs[0].token_ids) == 1 and len(rest) == 1 and rest[0].finished
    assert rest[0].outputs[0].token_ids == want
    assert llm.engine.pool.num_free == llm.engine.pool.num_blocks


def test_interleaved_streams(llm):
    long, short = (SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (8, 3))
    want = [o.outputs[0].token_ids for o in gen(llm, ["a b", "c d"], [long, short])]
    a, b = llm.stream("a b", long), llm.stream("c d", short)
    next(a), next(b)
    last_a = list(a)[-1]  # its steps finish b too: b's outputs are kept for b
    last_b = list(b)[-1]
    assert last_a.finished and last_b.finished
    assert [last_a.outputs[0].token_ids, last_b.outputs[0].token_ids] == want

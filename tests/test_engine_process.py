"""AsyncLLM with the engine in its own process (entrypoints/engine_process.py): what crosses the wire comes back
the same, streams equal the in-process engine's outputs, aborts free the KV, a bad request fails alone, and a
dead engine process ends every stream with EngineDeadError instead of a hang."""

from __future__ import annotations

import asyncio
import time

import pytest

from deepinfer import LLM, AsyncLLM, SamplingParams
from deepinfer.entrypoints import EngineDeadError
from deepinfer.testing.engine import wait_idle
from deepinfer.entrypoints.engine_process import DeltaReader, DeltaWriter, params_from_wire, params_to_wire
from deepinfer.outputs import CompletionOutput, Logprob, RequestOutput

KW = dict(model=None, threads=1, num_kv_blocks=64, max_model_len=256)


def test_sampling_params_cross_the_wire_unchanged():
    import json

    cases = [SamplingParams(),
             SamplingParams(n=2, temperature=0.7, top_p=0.9, top_k=5, min_p=0.1, seed=3, stop=["\n", "x"],
                            stop_token_ids=[2], logprobs=3, prompt_logprobs=1, presence_penalty=0.5,
                            logit_bias={7: -2.5, 300: 1.0}, allowed_token_ids=[5, 6, 7], bad_words=["foo"],
                            max_tokens=9, min_tokens=2, include_stop_str_in_output=True),
             SamplingParams(structured_outputs={"json": {"type": "object"}, "disable_any_whitespace": True}),
             SamplingParams(structured_outputs={"choice": ["yes", "no"]})]
    for p in cases:
        assert params_from_wire(json.loads(json.dumps(params_to_wire(p)))) == p
    with pytest.raises(ValueError, match="logits_processors"):
        params_to_wire(SamplingParams(logits_processors=[lambda ids, logits: logits]))


def test_deltas_rebuild_every_cumulative_output():
    """The child sends each output as news since the last; the front end rebuilds the cumulative outputs,
    including a text that changed behind what was told (a stop string trimmed) and logprobs."""
    lp = lambda t: {t: Logprob(-0.5 * t, 1, f"t{t}")}  # noqa: E731
    texts = ["a", "ab", "abc", "abX"]  # the last rewrites the told text
    seq = []
    for k, text in enumerate(texts):
        ids = list(range(1, k + 2))
        comp = [CompletionOutput(0, text, ids, -float(k), [lp(t) for t in ids], "stop" if k == 3 else None),
                CompletionOutput(1, text[:1] * (k + 1), ids[:1], None, None, None)]
        seq.append(RequestOutput("r", "p", [9, 8], comp, k == 3, prompt_logprobs=[None, lp(8)],
                                 metrics={"k": k}, num_cached_tokens=k))
    w, r = DeltaWriter(), DeltaReader()
    kept = []
    for out in seq:
        got = r.apply(_json_round_trip(w.delta(out)))
        assert got == out
        kept.append(got)
    assert kept == seq  # later deltas left the outputs already handed out as they were
    assert not w.told and not r.state  # finished requests leave nothing behind


def _json_round_trip(d):
    import json

    return json.loads(json.dumps(d))


@pytest.fixture(scope="module")
def remote():
    eng = AsyncLLM(engine_process=True, **KW)
    yield eng
    eng.shutdown()
    assert eng.engine.proc.poll() is not None  # the engine process is gone


def collect(eng, prompt, params):
    async def run():
        return [o async for o in eng.generate(prompt, params)]

    return asyncio.run(run())


def test_streams_equal_the_in_process_engine(remote):
    """One request at a time (so the batches match): tokens, text, logprobs, finish reasons and prompt logprobs
    equal LLM.generate's in this process, and each stream's outputs only grow."""
    llm = LLM(**KW)
    cases = [("def f():", SamplingParams(max_tokens=10, temperature=0.0, logprobs=2, prompt_logprobs=1)),
             ("import os", SamplingParams(n=2, max_tokens=8, temperature=0.8, seed=5, stop=["\n"])),
             ("class A:", SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))]
    for prompt, params in cases:
        want = llm.generate([prompt], params, use_tqdm=False)[0]
        outs = collect(remote, prompt, params)
        got = outs[-1]
        assert got.finished and got.prompt_token_ids == want.prompt_token_ids
        assert got.prompt_logprobs == want.prompt_logprobs
        for a, b in zip(got.outputs, want.outputs):
            assert (a.token_ids, a.text, a.finish_reason, a.logprobs) == (b.token_ids, b.text, b.finish_reason,
                                                                          b.logprobs)
        for prev, nxt in zip(outs, outs[1:]):
            assert all(len(y.token_ids) >= len(x.token_ids) for x, y in zip(prev.outputs, nxt.outputs))
    assert remote.tokenizer.decode(got.outputs[0].token_ids) == got.outputs[0].text
    assert remote.max_model_len == llm.engine.max_model_len
    assert remote.engine.model.vocab_size == llm.engine.model.vocab_size


def test_abort_frees_blocks_and_a_bad_request_fails_alone(remote):
    async def main():
        async def leave_early():
            n = 0
            async for out in remote.generate("x", SamplingParams(max_tokens=200, ignore_eos=True)):
                n = len(out.outputs[0].token_ids)
                if n >= 2:
                    break  # leaving the iterator aborts the request in the engine process
            return n

        async def last(prompt, params):
            out = None
            async for out in remote.generate(prompt, params):
                pass
            return out

        too_long = {"prompt_token_ids": [5] * 400}
        return await asyncio.gather(
            leave_early(), last(too_long, SamplingParams(max_tokens=4)),
            last("def f():", SamplingParams(max_tokens=5, logits_processors=[lambda ids, x: x])),
            last("def f():", SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)))

    n, long_out, proc_out, good = asyncio.run(main())
    assert n >= 2
    assert long_out.error and "256" in long_out.error  # the context length, named
    assert proc_out.error and "logits_processors" in proc_out.error
    assert good.error is None and len(good.outputs[0].token_ids) == 5
    st = wait_idle(remote)
    assert st["requests"] == 0 and st["kv_blocks_free"] == st["kv_blocks_total"]


def test_a_dead_engine_process_ends_streams_with_an_error():
    eng = AsyncLLM(engine_process=True, **KW)
    try:
        async def run():
            async for out in eng.generate("x", SamplingParams(max_tokens=500, ignore_eos=True)):
                if len(out.outputs[0].token_ids) == 2:
                    eng.engine.proc.kill()

        with pytest.raises(EngineDeadError, match="engine process"):
            asyncio.run(run())
        idle = AsyncLLM(engine_process=True, **KW)  # a death while idle shows too (the server's /health)
        idle.engine.proc.kill()
        idle.engine.proc.wait(10)
        assert not idle.is_alive
        idle.shutdown()
        deadline = time.monotonic() + 10
        while eng.is_alive and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not eng.is_alive
    finally:
        eng.shutdown()

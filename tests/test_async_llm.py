"""AsyncLLM from Python: streams from asyncio, concurrent requests, abort on leaving the loop, a failing request
alone, shutdown."""

from __future__ import annotations

import asyncio
import time

import pytest

from deepinfer import AsyncLLM, SamplingParams
from deepinfer.entrypoints import EngineDeadError
from deepinfer.testing.engine import wait_idle


GREEDY6 = SamplingParams(max_tokens=6, temperature=0.0)


@pytest.fixture(scope="module")
def engine():
    from deepinfer import LLM

    llm = LLM(None, threads=1, num_kv_blocks=64, max_model_len=512)
    offline = llm.generate(["def f():", "import os"], GREEDY6, use_tqdm=False)  # before the engine thread owns it
    eng = AsyncLLM(llm=llm)
    eng.offline = [o.outputs[0].token_ids for o in offline]
    yield eng
    eng.shutdown()


def test_stream_concurrent_abort_and_a_failing_request(engine):
    async def collect(prompt, n_tokens):
        outs = [o async for o in engine.generate(prompt, SamplingParams(max_tokens=n_tokens, ignore_eos=True,
                                                                        temperature=0.0))]
        return outs

    async def leave_early():
        got = 0
        async for out in engine.generate("x = ", SamplingParams(max_tokens=400, ignore_eos=True)):
            got = len(out.outputs[0].token_ids)
            if got >= 2:
                break  # aborts the request
        return got

    async def main():
        return await asyncio.gather(collect("def f():", 5), collect("import os", 3), leave_early(),
                                    collect("y" * 3000, 4))

    a, b, left, bad = asyncio.run(main())
    assert [len(o.outputs[0].token_ids) for o in a] == list(range(1, 6))  # cumulative, one token a step
    assert a[-1].finished and a[-1].outputs[0].finish_reason == "length" and len(b[-1].outputs[0].token_ids) == 3
    assert 2 <= left < 400
    assert bad[-1].error and "max_model_len" in bad[-1].error  # fails alone
    st = wait_idle(engine)
    assert st["kv_blocks_free"] == st["kv_blocks_total"] == 64 and st["running"] == st["waiting"] == 0


def test_same_greedy_output_as_the_offline_api(engine):
    async def final(prompt):
        outs = [o async for o in engine.generate(prompt, GREEDY6, stream=False)]
        assert len(outs) == 1  # not streamed: only the final output
        return outs[0].outputs[0].token_ids

    async def main():
        return await asyncio.gather(final("def f():"), final("import os"))

    assert asyncio.run(main()) == engine.offline


def test_shutdown_ends_streams_and_refuses_new_requests():
    eng = AsyncLLM(model=None, threads=1, num_kv_blocks=32, max_model_len=256)

    async def long_one():
        last = None
        async for last in eng.generate("x", SamplingParams(max_tokens=200, ignore_eos=True)):
            if len(last.outputs[0].token_ids) == 1:
                await asyncio.get_running_loop().run_in_executor(None, eng.shutdown)
        return last

    last = asyncio.run(long_one())
    assert last.finished and last.outputs[0].finish_reason == "abort"
    assert not eng.is_alive

    async def after():
        async for _ in eng.generate("x", SamplingParams(max_tokens=2)):
            pass

    with pytest.raises(EngineDeadError, match="shut down"):
        asyncio.run(after())


def test_speculative_decoding_counts_reach_the_stats():
    eng = AsyncLLM(model=None, threads=1, num_kv_blocks=32, max_model_len=256,
                   speculative_config={"method": "dspark", "num_speculative_tokens": 2})
    try:
        async def run():
            return [o async for o in eng.generate("def f():", SamplingParams(max_tokens=8, temperature=0.0,
                                                                              ignore_eos=True))][-1]

        out = asyncio.run(run())
        assert len(out.outputs[0].token_ids) == 8
        st = wait_idle(eng)
        assert st["spec_draft_tokens"] > 0 and 0 <= st["spec_accepted_tokens"] <= st["spec_draft_tokens"]
        assert st["spec_acceptance_rate"] == st["spec_accepted_tokens"] / st["spec_draft_tokens"]
    finally:
        eng.shutdown()


def test_stream_interval_groups_tokens(engine):
    async def counts():
        return [len(o.outputs[0].token_ids) async for o in engine.generate(
            "def f():", SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.0))]

    engine.stream_interval = 4  # read by the engine thread at each delivery
    try:
        got = asyncio.run(counts())
    finally:
        engine.stream_interval = 1
    assert got == [1, 5, 9, 10]  # the first token at once, then every 4, the end at once
    assert asyncio.run(counts()) == list(range(1, 11))
    with pytest.raises(ValueError, match="stream_interval=0"):
        AsyncLLM(llm=engine.llm, stream_interval=0)


def test_gil_switch_interval_is_lowered_never_raised(engine):
    """The engine thread shares the GIL with the event loop: AsyncLLM lowers the switch interval (so a busy loop
    holds the engine's next launch back briefly), never raises it, and refuses a value that is not seconds."""
    import sys

    from deepinfer.entrypoints.async_llm import lower_switch_interval

    before = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.005)
        for bad in (0, -1, 2, "fast", True):
            with pytest.raises(ValueError, match=f"gil_switch_interval={bad!r}"):
                AsyncLLM(llm=engine.llm, gil_switch_interval=bad)  # refused before any engine thread starts
        assert sys.getswitchinterval() == pytest.approx(0.005)
        lower_switch_interval(0.0005)
        assert sys.getswitchinterval() == pytest.approx(0.0005)
        lower_switch_interval(0.002)  # never raised
        assert sys.getswitchinterval() == pytest.approx(0.0005)
    finally:
        sys.setswitchinterval(before)

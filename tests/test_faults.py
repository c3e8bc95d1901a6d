"""Faults stay with their requests: a stage that raises RowError, or non-finite logits in one row, fails only
that request (the others finish with the tokens they have alone); an error that cannot be traced to a row
fails its step's requests and the engine keeps serving. The faults come from a test plugin
(deepinfer.testing.faults), with and without overlap scheduling, mixed prefill + decode steps included."""

from __future__ import annotations

import pytest

from deepinfer import LLM, Pipeline, SamplingParams
from deepinfer.core.plugins import get_registry
from deepinfer.testing import faults
from deepinfer.testing.models import build_tiny_hf_model

PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13, 14, 15, 16, 17, 18], [3, 4, 5, 6]]
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama")
    build_tiny_hf_model(d, "llama")
    return str(d)


def make(ckpt, overlap: bool, stage: str = None, after: str = "verify", **args):
    reg = get_registry()
    faults.register(reg)
    pipe = Pipeline.from_recipe("reference", registry=reg)
    if stage == "inject_fault":
        pipe = pipe.insert(stage, after=after, **args)
    elif stage == "inject_host_fault":
        pipe = pipe.insert(stage, after="detokenize", **args)
    # A token budget of 8: the long prompt is chunked while the others decode (mixed steps).
    return LLM(ckpt, pipeline=pipe, overlap_scheduling=overlap, num_kv_blocks=32, block_size=4, max_model_len=64,
               max_num_batched_tokens=8, device="cpu", backend="reference")


@pytest.fixture(scope="module")
def clean(ckpt):
    return [o.outputs[0].token_ids for o in make(ckpt, False).generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("stage,mode,text", [("inject_fault", "nan", "non-finite logits"),
                                             ("inject_fault", "row_error", "injected row fault"),
                                             ("inject_host_fault", None, "injected host fault")])
def test_a_row_fault_fails_its_request_alone(ckpt, clean, overlap, stage, mode, text):
    bad = "2"  # the third prompt: the chunked one, so its faults land in mixed steps
    args = {"request_ids": (bad,)} | ({"mode": mode} if mode else {})
    llm = make(ckpt, overlap, stage, **args)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    for i, o in enumerate(outs):
        if o.request_id == bad:
            assert o.outputs[0].finish_reason == "error" and text in o.error
        else:
            assert o.error is None and o.outputs[0].token_ids == clean[i]
    assert llm.engine.pool.num_free == llm.engine.pool.num_blocks


@pytest.mark.parametrize("after", ["verify", "grammar"])
def test_the_guard_runs_after_every_writer_that_changed_the_logits(ckpt, clean, after, monkeypatch):
    """The grammar stage with no constrained request leaves the logits as they were and says so
    (state.logits_kept): the engine guards once a step after verify, not again after it; a writer that does
    not say so is guarded, wherever it runs (here NaN logits put after verify, or after the grammar stage)."""
    from deepinfer.core import engine as engine_mod

    calls = []
    real = engine_mod._guard_logits
    monkeypatch.setattr(engine_mod, "_guard_logits", lambda state, ops: (calls.append(1), real(state, ops)))
    llm = make(ckpt, False)
    llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert len(calls) == llm.engine.stats["steps"] > 0
    calls.clear()
    faulty = make(ckpt, False, "inject_fault", after=after, request_ids=("2",))
    outs = faulty.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert len(calls) == 2 * faulty.engine.stats["steps"]  # verify's guard and the fault stage's, every step
    for i, o in enumerate(outs):
        if o.request_id == "2":
            assert o.outputs[0].finish_reason == "error" and "non-finite logits" in o.error
        else:
            assert o.error is None and o.outputs[0].token_ids == clean[i]


@pytest.mark.parametrize("overlap", [False, True])
def test_an_untraceable_fault_fails_its_step_and_the_engine_goes_on(ckpt, clean, overlap):
    llm = make(ckpt, overlap, "inject_fault", mode="crash", request_ids=("1",))
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    failed = [o for o in outs if o.error is not None]
    assert any(o.request_id == "1" for o in failed)
    assert all("injected crash" in o.error for o in failed)
    # The engine keeps serving: new requests (ids "4".."7", none faulty) give the clean tokens.
    again = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == clean
    assert llm.engine.pool.num_free == llm.engine.pool.num_blocks

"""Numerical parity with transformers on every tiny architecture of the Llama family (float32, CPU).

For each architecture (llama, llama-tied, mistral, qwen2, qwen3) one random-weight checkpoint is written and
the transformers model that wrote it is the reference:

* prefill logits of the engine path (paged KV, ragged batch, chunked, non-contiguous blocks) and of the
  full-sequence path (``forward_full``) match transformers' logits for the same ids;
* greedy generation of 32 tokens equals ``generate(do_sample=False)`` per prompt, for one prompt and for a
  batch of 8 prompts of different lengths, also with chunked prefill and with preemption forced;
* seeded sampling gives the same tokens whether or not sequences are preempted and recomputed.

Prompts and outputs are longer than the sliding windows of mistral (12) and qwen2 (10), so the window
masks are exercised in prefill and in decode.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.testing.compare import MODEL_FACTOR, assert_greedy_matches, assert_logits_close, hf_greedy, logits_bound
from deepinfer.testing.engine import paged_prefill_logits
from deepinfer.testing.models import TINY, build_tiny_hf_model

ARCHS = ["llama", "llama-tied", "mistral", "qwen2", "qwen3"]
NEW_TOKENS = 32
PROMPT_LENS = [13, 2, 27, 40, 6, 19, 33, 24]  # the batch of 8; every output runs past the windows


class Tiny:
    """One architecture's checkpoint, its transformers model and the reference results."""

    def __init__(self, name, path, hf):
        self.name, self.path, self.hf = name, str(path), hf
        g = torch.Generator().manual_seed(1234)
        vocab = hf.config.vocab_size
        # Ids from 5 up: clear of the special tokens, so nothing here depends on EOS handling.
        self.prompts = [torch.randint(5, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]
        with torch.no_grad():
            self.hf_logits = [hf(torch.tensor([p])).logits[0].float() for p in self.prompts]
        # transformers' greedy tokens and the logits of each step (where ours may part only at a near-tie)
        self.hf_greedy, self.hf_scores = map(list, zip(*(hf_greedy(hf, p, NEW_TOKENS) for p in self.prompts)))


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request, tmp_path_factory) -> Tiny:
    path = tmp_path_factory.mktemp(request.param)
    hf = build_tiny_hf_model(path, request.param, random_norms_and_biases=True)
    # No EOS stop on the reference side (ours uses ignore_eos=True). Unlike min_new_tokens, this does not
    # change the logits, so the argmax stays comparable.
    hf.generation_config.eos_token_id = None
    return Tiny(request.param, path, hf)


def logprob_tol(logits: torch.Tensor) -> torch.Tensor:
    """Per row: a logprob is a logit minus the row's log-sum-exp, each off by at most the logits' bound."""
    return 2 * logits_bound(logits, MODEL_FACTOR)


def greedy(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, **kw)


def run(llm: LLM, prompts: list, params) -> list:
    outs = llm.generate(prompts, params, use_tqdm=False)
    for o in outs:
        assert o.error is None and o.finished
        assert o.outputs[0].finish_reason == "length"
    return [o.outputs[0].token_ids for o in outs]


# Prefill logits.

def test_windows_are_exercised(tiny):
    """The sliding-window architectures really run with a window shorter than the long prompts."""
    net = LLM(tiny.path, num_kv_blocks=64, block_size=4).engine.model
    windows = [w for w in net.config.windows if w is not None]
    if tiny.name in ("mistral", "qwen2"):
        assert windows and max(windows) == TINY[tiny.name]["sliding_window"] < max(PROMPT_LENS)
    else:
        assert not windows


def test_forward_full_matches_hf(tiny):
    net = LLM(tiny.path, num_kv_blocks=64, block_size=4).engine.model
    assert next(net.parameters()).dtype == torch.float32
    for p, ref in zip(tiny.prompts, tiny.hf_logits):
        with torch.no_grad():
            ours = net.forward_full(torch.tensor(p))
        assert ours.dtype == torch.float32 and ours.shape == ref.shape
        assert_logits_close(ours, ref, factor=MODEL_FACTOR, what=f"{tiny.name}, prompt of {len(p)}")


@pytest.mark.parametrize("block_size,chunk", [(4, 64), (3, 7), (16, 5), (1, 11)])
def test_engine_prefill_matches_hf(tiny, block_size, chunk):
    net = LLM(tiny.path, num_kv_blocks=64, block_size=4).engine.model
    ours = paged_prefill_logits(net, tiny.prompts, block_size, chunk, seed=block_size)
    for p, got, ref in zip(tiny.prompts, ours, tiny.hf_logits):
        assert_logits_close(got, ref, factor=MODEL_FACTOR, what=f"{tiny.name}, prompt of {len(p)}")


def test_prompt_logprobs_of_one_token_chunks(tiny):
    """Budget 3 with two one-token prompts decoding beside a 10-token prompt: its chunks are single tokens."""
    b = tiny.prompts[3][:10]
    llm = LLM(tiny.path, num_kv_blocks=256, block_size=4, max_num_batched_tokens=3)
    outs = llm.generate([[7], [8], b], SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=0),
                        use_tqdm=False)
    with torch.no_grad():
        logits = tiny.hf(torch.tensor([b])).logits[0].float()
    ref, tol = torch.log_softmax(logits, dim=-1), logprob_tol(logits)
    got = outs[2].prompt_logprobs
    assert len(got) == len(b)
    for t in range(1, len(b)):
        assert got[t][b[t]].logprob == pytest.approx(float(ref[t - 1, b[t]]), abs=float(tol[t - 1]))


def test_logprobs_through_the_stages_match_hf(tiny):
    """Prompt logprobs (prefill stage, chunked) and sample logprobs (decode) against transformers' log-softmax."""
    llm = LLM(tiny.path, num_kv_blocks=256, block_size=4, max_num_batched_tokens=7)
    outs = llm.generate(tiny.prompts, greedy(logprobs=2, prompt_logprobs=2), use_tqdm=False)
    for i, (p, out) in enumerate(zip(tiny.prompts, outs)):
        comp = out.outputs[0]
        assert_greedy_matches([comp.token_ids], [tiny.hf_greedy[i]], [tiny.hf_scores[i]], what=f"prompt {i}")
        seq = p + comp.token_ids
        with torch.no_grad():
            logits = tiny.hf(torch.tensor([seq])).logits[0].float()
        ref, tol = torch.log_softmax(logits, dim=-1), logprob_tol(logits)
        # Position t is predicted by logits at t - 1; prompt_logprobs[0] is None (nothing predicts it).
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(p)
        assert len(comp.logprobs) == NEW_TOKENS
        entries = list(zip(range(1, len(p)), out.prompt_logprobs[1:])) + \
            list(zip(range(len(p), len(seq)), comp.logprobs))
        for t, entry in entries:
            row, abs_tol = ref[t - 1], float(tol[t - 1])
            assert entry[seq[t]].logprob == pytest.approx(float(row[seq[t]]), abs=abs_tol)
            top2 = torch.topk(row, 2)
            for rank, (tid, lp) in enumerate(zip(top2.indices.tolist(), top2.values.tolist()), 1):
                assert tid in entry and entry[tid].logprob == pytest.approx(lp, abs=abs_tol)
                assert entry[tid].rank == rank
        assert comp.cumulative_logprob == pytest.approx(
            sum(float(ref[t - 1, seq[t]]) for t in range(len(p), len(seq))), abs=float(tol[len(p) - 1:-1].sum()))


# Greedy generation.

def test_greedy_single_prompt(tiny):
    llm = LLM(tiny.path, num_kv_blocks=64, block_size=4, max_num_batched_tokens=64)
    i = PROMPT_LENS.index(max(PROMPT_LENS))
    assert_greedy_matches(run(llm, [tiny.prompts[i]], greedy()), [tiny.hf_greedy[i]], [tiny.hf_scores[i]])


# name -> (engine settings, whether preemption must happen)
SETTINGS = {
    "default": (dict(num_kv_blocks=256, block_size=16), False),
    "chunked": (dict(num_kv_blocks=256, block_size=4, max_num_batched_tokens=7), False),
    # 20 blocks of 4 hold the longest sequence (40 + 32 tokens) but only about two of the eight at a time.
    "preempt": (dict(num_kv_blocks=20, block_size=4, max_num_batched_tokens=64), True),
    "preempt-chunked": (dict(num_kv_blocks=20, block_size=4, max_num_batched_tokens=7), True),
}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_greedy_batch(tiny, setting):
    kw, must_preempt = SETTINGS[setting]
    llm = LLM(tiny.path, **kw)
    got = run(llm, tiny.prompts, greedy())
    assert_greedy_matches(got, tiny.hf_greedy, tiny.hf_scores, what=f"{tiny.name} under {setting}")
    preemptions = llm.engine.scheduler.num_preemptions
    if must_preempt:
        assert preemptions > 0
    else:
        assert preemptions == 0
    assert llm.engine.pool.num_free == llm.engine.pool.num_blocks  # every block came back


# Seeded sampling.

def test_seeded_sampling_survives_preemption(tiny):
    params = [SamplingParams(max_tokens=NEW_TOKENS, temperature=0.8, seed=100 + i, ignore_eos=True)
              for i in range(len(tiny.prompts))]
    roomy = LLM(tiny.path, num_kv_blocks=256, block_size=4)
    ref = run(roomy, tiny.prompts, params)
    assert roomy.engine.scheduler.num_preemptions == 0
    tight = LLM(tiny.path, num_kv_blocks=20, block_size=4, max_num_batched_tokens=16)
    got = run(tight, tiny.prompts, params)
    assert tight.engine.scheduler.num_preemptions > 0
    assert got == ref
    # It really sampled: some row left the greedy path.
    assert any(r != g for r, g in zip(ref, tiny.hf_greedy))

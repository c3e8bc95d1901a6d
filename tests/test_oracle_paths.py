"""Full recompute versus cached decode, on generated models and batch mixes.

For a random tiny Llama-family model (architecture, layer count, GQA grouping, head size, sliding windows,
tied head, RoPE base, random norm weights and biases) written as a checkpoint, and a random batch (prompt
lengths, staggered arrivals, block size, token budget, KV pool size tight enough to preempt), the engine's
greedy decode over the paged cache must equal, at every step, the argmax of ``forward_full`` recomputed over
the whole sequence so far, and the logits the engine sampled from must agree with the recomputed ones to
MODEL_FACTOR float32 eps of the row's largest logit (deepinfer.testing.compare).
"""

from __future__ import annotations

import json
import shutil

import attrs
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from deepinfer import LLM, Pipeline, SamplingParams, Stage
from deepinfer.backends.reference.ops import ReferenceOps
from deepinfer.core.graph import StageSpec
from deepinfer.core.kv_cache import blocks_needed
from deepinfer.models.llama import LlamaForCausalLM
from deepinfer.testing.compare import MODEL_FACTOR, assert_logits_close, logits_bound
from deepinfer.testing.tokenizers import build_test_tokenizer

VOCAB = 300


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A tokenizer to copy into every generated checkpoint, and room for the checkpoints."""
    root = tmp_path_factory.mktemp("oracle")
    tok = build_test_tokenizer(root / "tokenizer", vocab_size=VOCAB)
    assert tok.vocab_size <= VOCAB
    return root


@attrs.define(eq=False)
class CaptureLogits(Stage):
    """Records, for every sampling row, (number of known tokens, the logits the sampler sees)."""

    name = "capture_logits"
    kind = "observe"
    reads = ("batch", "logits")
    writes = ()

    sink: dict

    def __call__(self, state) -> None:
        for r, i in enumerate(state.sample_rows):
            seq, b = state.batch.seqs[i], state.batch
            known = b.start[i] + b.num_tokens[i]  # the step's view (seq.num_tokens also counts pending tokens)
            self.sink.setdefault(seq.request_id, []).append((known, state.logits[r].detach().clone()))


def capture_pipeline(sink: dict) -> Pipeline:
    base = Pipeline.from_recipe("reference")
    spec = StageSpec(name="capture_logits", kind="observe", factory=CaptureLogits, plugin="tests",
                     args={"sink": sink})
    return Pipeline(base.specs + [spec], recipe=base.recipe, config=base.config, registry=base.registry)


# Generated cases.

@st.composite
def cases(draw) -> dict:
    arch = draw(st.sampled_from(["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]))
    layers = draw(st.integers(1, 2))
    kv_heads = draw(st.integers(1, 2))
    cfg = dict(architectures=[arch], vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
               num_hidden_layers=layers, num_key_value_heads=kv_heads,
               num_attention_heads=kv_heads * draw(st.sampled_from([1, 2])), head_dim=draw(st.sampled_from([8, 16])),
               rms_norm_eps=1e-6, max_position_embeddings=256,
               tie_word_embeddings=draw(st.booleans()),
               rope_parameters={"rope_type": "default", "rope_theta": draw(st.sampled_from([10000.0, 100.0]))})
    window = draw(st.one_of(st.none(), st.integers(1, 12)))
    if arch == "MistralForCausalLM":
        cfg["sliding_window"] = window
    elif arch == "Qwen2ForCausalLM" and window is not None:
        cfg.update(use_sliding_window=True, sliding_window=window, max_window_layers=draw(st.integers(0, layers)))
    elif arch == "LlamaForCausalLM":
        cfg["attention_bias"] = draw(st.booleans())
    n = draw(st.integers(1, 5))
    prompt_lens = draw(st.lists(st.integers(1, 24), min_size=n, max_size=n))
    max_tokens = draw(st.lists(st.integers(1, 10), min_size=n, max_size=n))
    arrive = sorted(draw(st.lists(st.integers(0, 6), min_size=n, max_size=n)))
    block_size = draw(st.sampled_from([1, 2, 3, 4, 8, 16]))
    longest = max(blocks_needed(p + m, block_size) for p, m in zip(prompt_lens, max_tokens))
    total = sum(blocks_needed(p + m, block_size) for p, m in zip(prompt_lens, max_tokens))
    return dict(hf=cfg, prompt_lens=prompt_lens, max_tokens=max_tokens, arrive=arrive, block_size=block_size,
                num_kv_blocks=draw(st.integers(longest, max(longest, total))),  # low end: room for one at a time
                max_num_batched_tokens=draw(st.integers(1, 48)), max_num_seqs=draw(st.integers(1, 6)),
                seed=draw(st.integers(0, 2**16)))


def build_checkpoint(case: dict, root) -> tuple:
    """Random weights (norms and biases included) written as a checkpoint; returns (dir, the model)."""
    d = root / f"case{len(list(root.iterdir()))}"
    shutil.copytree(root / "tokenizer", d)
    (d / "config.json").write_text(json.dumps(case["hf"]))
    with torch.device("cpu"):
        net = LlamaForCausalLM(case["hf"], ReferenceOps("cpu"), arch=case["hf"]["architectures"][0])
    g = torch.Generator().manual_seed(case["seed"])
    with torch.no_grad():
        for name, p in net.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=g))
    save_file(net.hf_state_dict(), str(d / "model.safetensors"))
    return d, net.eval()


def run_engine(llm: LLM, prompts: list, case: dict) -> dict:
    """Add requests at their arrival steps and step to completion; request id -> output token ids."""
    engine, outs, step = llm.engine, {}, 0
    pending = list(zip(range(len(prompts)), prompts, case["max_tokens"], case["arrive"]))
    while pending or engine.has_unfinished():
        while pending and pending[0][3] <= step:
            i, p, m, _ = pending.pop(0)
            engine.add_request(str(i), p, SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True))
        for out in engine.step():
            assert out.error is None
            if out.finished:
                outs[out.request_id] = out.outputs[0].token_ids
        step += 1
        assert step < 2000, "the engine made no progress"
    return outs


def check_against_recompute(net, prompts: list, outs: dict, sink: dict, case: dict) -> None:
    for i, prompt in enumerate(prompts):
        rid, toks = str(i), outs[str(i)]
        assert len(toks) == case["max_tokens"][i]
        with torch.no_grad():
            full = net.forward_full(torch.tensor(prompt + toks))  # [P + n, V], no cache
        steps = sink[rid]
        # One sampled step per generated token, each predicting the next position (none repeated on recompute).
        assert [n for n, _ in steps] == list(range(len(prompt), len(prompt) + len(toks)))
        for j, ((n, got), tok) in enumerate(zip(steps, toks)):
            ref = full[n - 1]
            assert_logits_close(got, ref, factor=MODEL_FACTOR, what=f"request {i}, step {j}: cached vs recompute")
            best = int(ref.argmax())
            # The greedy token is the recomputed argmax (a tie inside twice the bound may go either way).
            tie = 2 * float(logits_bound(ref, MODEL_FACTOR))
            assert tok == best or float(ref[best] - ref[tok]) <= tie, (i, j, tok, best)


def check_case(case: dict, workdir) -> LLM:
    path, net = build_checkpoint(case, workdir)
    g = torch.Generator().manual_seed(case["seed"] + 1)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in case["prompt_lens"]]
    sink: dict = {}
    llm = LLM(str(path), pipeline=capture_pipeline(sink), block_size=case["block_size"],
              num_kv_blocks=case["num_kv_blocks"], max_num_batched_tokens=case["max_num_batched_tokens"],
              max_num_seqs=case["max_num_seqs"])
    outs = run_engine(llm, prompts, case)
    check_against_recompute(net, prompts, outs, sink, case)
    assert llm.engine.pool.num_free == llm.engine.pool.num_blocks
    return llm


# Hand-picked corners that always run: block size 1 with a one-token budget; a pool that holds one sequence
# at a time (so preemption happens) with a sliding window shorter than the prompts.
CORNERS = [
    dict(hf=dict(architectures=["Qwen3ForCausalLM"], vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                 num_hidden_layers=2, num_key_value_heads=1, num_attention_heads=2, head_dim=16, rms_norm_eps=1e-6,
                 max_position_embeddings=256, tie_word_embeddings=False,
                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
         prompt_lens=[5, 1, 9], max_tokens=[4, 6, 3], arrive=[0, 0, 2], block_size=1, num_kv_blocks=40,
         max_num_batched_tokens=1, max_num_seqs=4, seed=1),
    dict(hf=dict(architectures=["MistralForCausalLM"], vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                 num_hidden_layers=2, num_key_value_heads=1, num_attention_heads=2, head_dim=16, rms_norm_eps=1e-6,
                 max_position_embeddings=256, tie_word_embeddings=True, sliding_window=5,
                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
         prompt_lens=[17, 12, 20, 9], max_tokens=[10, 10, 8, 10], arrive=[0, 0, 1, 1], block_size=4,
         num_kv_blocks=8, max_num_batched_tokens=16, max_num_seqs=4, seed=2),
]


@pytest.mark.parametrize("case", CORNERS, ids=["bs1-budget1", "preempt-swa"])
def test_corner_cases(case, workdir):
    llm = check_case(case, workdir)
    if case["num_kv_blocks"] == 8:
        assert llm.engine.scheduler.num_preemptions > 0


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases())
def test_cached_decode_equals_full_recompute(case, workdir):
    check_case(case, workdir)

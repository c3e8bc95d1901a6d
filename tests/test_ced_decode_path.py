"""CED decode on the device (models/ced/decode_path.py) against the host path it replaces (engine_path.Pass),
its slow twin: the same requests, greedy, generate the same tokens with the same log-probabilities, on
hypothesis-drawn configs (every layer mode, compression ratios with incomplete groups, bounded and exact
replay, block sizes, batches mixing decode rows with prefill chunks)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deepinfer import LLM, SamplingParams
from deepinfer.core.kv_cache import blocks_needed
from deepinfer.models.ced import decode_path
from deepinfer.testing.ced import block_sizes_for, build_ced_checkpoint, ced_configs
from deepinfer.testing.compare import NEAR_TIE, assert_same_or_near_tie


@st.composite
def cases(draw) -> dict:
    ov = draw(ced_configs())
    W = ov["n_win"]
    lens = draw(st.lists(st.integers(1, 3 * W + 3), min_size=2, max_size=4))
    return dict(ov=ov, seed=draw(st.integers(0, 2**16)), block_size=draw(block_sizes_for(ov)), lens=lens,
                budget=draw(st.sampled_from([3, 8, 512])), exact=draw(st.booleans()))


def generate(path: str, case: dict, prompts: list, device_decode: bool, max_tokens: int):
    blocks = sum(blocks_needed(len(p) + max_tokens, case["block_size"]) for p in prompts) + 1
    llm = LLM(path, block_size=case["block_size"], num_kv_blocks=blocks, max_num_batched_tokens=case["budget"],
              max_num_seqs=4, hf_overrides={"replay_mode": "exact"} if case["exact"] else None, device="cpu")
    llm.engine.model.device_decode = device_decode
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=1)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids,
                                                                          o.outputs[0].logprobs)]) for o in outs]


@settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=cases())
def test_device_decode_equals_host_path(case, tmp_path_factory, monkeypatch):
    d = tmp_path_factory.mktemp("ced_decode")
    # Lossless caches: the two paths then differ by float rounding alone, far from any greedy near-tie.
    ov = dict(case["ov"], global_kv_format="fp32", index_k_format="fp32", swa_kv_format="fp32")
    cfg = build_ced_checkpoint(d, seed=case["seed"], **ov)
    g = torch.Generator().manual_seed(case["seed"])
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in case["lens"]]
    calls: list = []
    seen = decode_path.forward_decode
    monkeypatch.setattr(decode_path, "forward_decode", lambda *a: calls.append(1) or seen(*a))
    max_tokens = 2 * cfg.n_win + 3  # past the replay cut and the window
    fast = generate(str(d), case, prompts, True, max_tokens)
    assert calls, "no decode step took the device path"
    n = len(calls)
    slow = generate(str(d), case, prompts, False, max_tokens)
    assert len(calls) == n, "the host path took the device path"
    for (ft, fl), (st_, sl) in zip(fast, slow):
        assert ft == st_
        scale = max(1.0, max(abs(x) for x in sl))
        assert max(abs(a - b) for a, b in zip(fl, sl)) <= 1e-4 * scale


# ----------------------------------------------------------------------------------------------------------
# On a GPU: the decode forward holds no host synchronisation, and CUDA graphs replay it.

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CED decode kernels and CUDA graphs need a GPU")
GPU_CFG = dict(num_layers=6, num_encoder_layers=3, layer_modes=("swa", "full", "reuse", "full", "reindex", "reuse"),
               hidden_size=64, num_heads=2, head_dim=64, rope_dim=16, n_win=8, swa_allowance=2, encoder_ratio=2,
               index_topk=4, pool_block=2, pool_blocks=3, index_head_dim=32, index_heads=2, q_lora_rank=32,
               out_group_dim=32, moe_intermediate_size=32, n_routed_experts=4, n_shared_experts=1, decoder_ratio=1,
               max_position_embeddings=512)


@cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graph_decode_matches_eager(tmp_path, dtype):
    build_ced_checkpoint(tmp_path, seed=5, **GPU_CFG)
    prompts = [list(range(5, 5 + n)) for n in (3, 17, 40, 9, 26)]  # 5 rows: padded to the 8-row bucket
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2)
    kw = dict(device="cuda", dtype=dtype, num_kv_blocks=96, block_size=4, backend="nvidia")
    graphs = LLM(str(tmp_path), enforce_eager=False, **kw)
    eager = LLM(str(tmp_path), enforce_eager=True, **kw)
    assert graphs.engine.decode_graphs is not None, "CED decode was not captured"
    a = [o.outputs[0].token_ids for o in graphs.generate(prompts, sp, use_tqdm=False)]
    b = [o.outputs[0] for o in eager.generate(prompts, sp, use_tqdm=False)]
    assert graphs.engine.decode_graphs.num_replays > 0
    for i, (x, y) in enumerate(zip(a, b)):
        assert_same_or_near_tie(x, y.token_ids, y.logprobs, NEAR_TIE[dtype], what=f"CED {dtype}, prompt {i}")


@cuda
def test_decode_forward_never_syncs(tmp_path, monkeypatch):
    build_ced_checkpoint(tmp_path, seed=6, **GPU_CFG)
    llm = LLM(str(tmp_path), device="cuda", dtype="bfloat16", num_kv_blocks=96, block_size=4, backend="nvidia",
              enforce_eager=True)
    seen = decode_path.forward_decode
    calls = []

    def strict(*a):  # any synchronising call inside the forward raises
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            return seen(*a)
        finally:
            torch.cuda.set_sync_debug_mode(0)
            calls.append(1)

    monkeypatch.setattr(decode_path, "forward_decode", strict)
    out = llm.generate([list(range(5, 25)), list(range(7, 12))],
                       SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), use_tqdm=False)
    assert all(o.error is None and len(o.outputs[0].token_ids) == 12 for o in out), [o.error for o in out]
    assert calls

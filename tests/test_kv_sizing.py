"""KV sizing: the bytes a block costs measured from the model's own cache (meta device), the plan's arithmetic
(profile numbers -> blocks; an explicit max_model_len that cannot fit one sequence is an error with the
numbers; a default one is capped), and the profile's dummy step running on every architecture (on the CPU
here; the CUDA memory measurement around it runs in the GPU suite)."""

from __future__ import annotations

import logging

import pytest
import torch

from deepinfer.backends.reference.ops import ReferenceOps
from deepinfer.core.config import EngineConfig
from deepinfer.core.kv_sizing import GiB, MemoryProfile, cache_layout, plan_kv, run_dummy_step, tensor_bytes
from deepinfer.core.plugins import get_registry
from deepinfer.models import loader
from deepinfer.testing.ced import build_ced_checkpoint
from deepinfer.testing.models import build_tiny_hf_model

OPS = ReferenceOps("cpu")


def _net(path):
    cfg = loader.load_config(path)
    return loader.build_model(path, cfg, OPS, torch.float32, OPS.device, get_registry(), "auto")


@pytest.fixture(scope="module", params=["llama", "mixtral", "deepseek_v3", "ced"])
def net(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    if request.param == "ced":
        build_ced_checkpoint(d)
    else:
        build_tiny_hf_model(d, request.param)
    return _net(str(d))


def test_layout_matches_the_allocated_cache(net):
    per_block, fixed = cache_layout(net, torch.float32, 16, max_seqs=3)
    real = tensor_bytes(net.allocate_kv_cache(5 * 16, torch.float32, "cpu", block_size=16, max_seqs=3))
    assert real == fixed + 5 * per_block
    if type(net).__name__ == "CEDForCausalLM":
        from deepinfer.models.ced.cache import CEDCache

        # The formula (CED.md): FP4 KV + MXFP4 indexer K of the full layers, 1/m per token; the engine's
        # kv_bytes_per_token rounds it up to whole bytes.
        assert per_block == CEDCache.exact_bytes_per_token(net.config) * 16
        assert fixed > 0  # SWA rings and compressor tails, per sequence
        # Linear in the sequences (plus a scratch slot of the rings and tails, for a CUDA graph's padded rows).
        f6, f9 = (cache_layout(net, torch.float32, 16, max_seqs=n)[1] for n in (6, 9))
        assert f9 - f6 == f6 - fixed > 0
    else:
        assert per_block == net.kv_bytes_per_token(torch.float32) * 16  # the paged formula the engine reports
        assert fixed == 0


def test_the_dummy_step_runs(net):
    kv = run_dummy_step(net, OPS, torch.float32, 16, num_tokens=40, max_model_len=24, sample_rows=5,
                        vocab_size=net.vocab_size)
    assert kv > 0
    run_dummy_step(net, OPS, torch.float32, 16, num_tokens=3, max_model_len=24, sample_rows=3,
                   vocab_size=net.vocab_size, decode_rows=3)


def test_plan_from_a_profile():
    cfg = EngineConfig(block_size=16, max_num_seqs=1000, gpu_memory_utilization=0.5)
    prof = MemoryProfile(total=100 * GiB, in_use=20 * GiB, peak_step=3 * GiB, graph_reserve=1 * GiB)
    plan = plan_kv(cfg, bytes_per_block=2**20, fixed_bytes=GiB, max_model_len=4096, explicit_len=False, profile=prof)
    assert plan.num_blocks == (50 - 20 - 3 - 1 - 1) * 1024  # util x total - in use - peak - graphs - fixed
    assert plan.tokens == plan.num_blocks * 16 and plan.max_concurrency == plan.tokens / 4096
    assert "KV cache: 25600 blocks, 409600 tokens" in plan.describe() and "max concurrency 100.00" in plan.describe()
    default = plan_kv(EngineConfig(block_size=16, max_num_seqs=1000), 2**20, 0, 4096, False, prof)
    assert default.num_blocks == (90 - 20 - 3 - 1) * 1024  # gpu_memory_utilization defaults to 0.9


def test_plan_caps_at_what_max_num_seqs_can_use():
    cfg = EngineConfig(block_size=16, max_num_seqs=2, kv_cache_memory_gb=1.0)
    assert plan_kv(cfg, 1024, 0, 160, True).num_blocks == 2 * 10


def test_an_explicit_length_that_cannot_fit_is_an_error_with_the_numbers():
    cfg = EngineConfig(block_size=16, num_kv_blocks=10)
    with pytest.raises(ValueError, match=r"max_model_len 1000 needs 63 KV blocks of 16 tokens, but the cache holds 10"):
        plan_kv(cfg, 1024, 0, 1000, explicit_len=True)
    prof = MemoryProfile(total=10 * GiB, in_use=9 * GiB, peak_step=GiB, graph_reserve=0)
    with pytest.raises(ValueError, match="holds 0"):
        plan_kv(EngineConfig(), 1024, 0, 100, explicit_len=False, profile=prof)  # nothing left at all


def test_a_default_length_is_capped(caplog):
    with caplog.at_level(logging.WARNING):
        plan = plan_kv(EngineConfig(block_size=16, num_kv_blocks=10), 1024, 0, 1000, explicit_len=False)
    assert plan.max_model_len == 160 and "capping max_model_len at 160" in caplog.text


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the profile run measures CUDA memory")
def test_profile_run_on_cuda(tmp_path, caplog):
    from deepinfer import LLM, SamplingParams

    build_tiny_hf_model(tmp_path, "llama")
    with caplog.at_level(logging.INFO):
        llm = LLM(str(tmp_path), device="cuda", max_num_seqs=32, gpu_memory_utilization=0.5)
    plan = llm.kv_plan
    p = plan.profile
    assert plan.source.startswith("profile") and p is not None and p.peak_step > 0 and p.graph_reserve > 0
    # The pool fits in the share: in use after loading + peak + graphs + cache <= 0.5 x total.
    cache = plan.num_blocks * plan.bytes_per_block + plan.fixed_bytes
    assert p.in_use + p.peak_step + p.graph_reserve + cache <= 0.5 * p.total
    assert "KV cache:" in caplog.text and "max concurrency" in caplog.text
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4

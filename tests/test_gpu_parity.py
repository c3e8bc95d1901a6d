"""On a GPU: every architecture through the nvidia backend matches the CPU reference backend (float32 greedy
tokens) and transformers (bfloat16 prefill logits within bf16 tolerance). Skipped without CUDA."""

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.testing.ced import build_ced_checkpoint
from deepinfer.testing.compare import NEAR_TIE, assert_greedy_matches
from deepinfer.testing.models import TINY, build_tiny_hf_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PROMPTS = [list(range(5, 5 + n)) for n in (13, 2, 27, 40)]
GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, logprobs=2)  # the top two of each step
MOE = {"mixtral", "qwen2-moe", "qwen3-moe", "deepseek_v2", "deepseek_v2-qlora", "deepseek_v3"}


def assert_gpu_matches_cpu(gpu: LLM, cpu: LLM, what: str) -> None:
    """Every prompt's greedy tokens on the GPU equal the CPU reference's, or part only at a near-tie of the
    reference's top two logits (the two sum in other orders)."""
    a, b = ([o.outputs[0] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] for llm in (gpu, cpu))
    assert_greedy_matches([x.token_ids for x in a], [y.token_ids for y in b], [y.logprobs for y in b],
                          NEAR_TIE["float32"], what=what)


@pytest.mark.parametrize("name", sorted(TINY))
def test_nvidia_float32_greedy_matches_cpu_reference(tmp_path, name):
    build_tiny_hf_model(tmp_path, name)
    gpu = LLM(str(tmp_path), device="cuda", backend="nvidia", dtype="float32", num_kv_blocks=128)
    cpu = LLM(str(tmp_path), device="cpu", backend="reference", num_kv_blocks=128)
    assert_gpu_matches_cpu(gpu, cpu, name)


def test_ced_float32_greedy_matches_cpu_reference(tmp_path):
    build_ced_checkpoint(tmp_path, n_win=8, swa_allowance=2, index_topk=6, pool_block=2, pool_blocks=3)
    gpu = LLM(str(tmp_path), device="cuda", backend="nvidia", dtype="float32", num_kv_blocks=128, block_size=4)
    cpu = LLM(str(tmp_path), device="cpu", backend="reference", num_kv_blocks=128, block_size=4)
    assert_gpu_matches_cpu(gpu, cpu, "ced")


@pytest.mark.parametrize("name", sorted(TINY))
def test_nvidia_bf16_prefill_logits_match_transformers(tmp_path, name):
    hf = build_tiny_hf_model(tmp_path, name)
    llm = LLM(str(tmp_path), device="cuda", backend="nvidia", dtype="bfloat16", num_kv_blocks=128)
    ids = PROMPTS[3]
    with torch.no_grad():
        ref32 = hf(torch.tensor([ids])).logits[0].float()
        ref = hf.to(torch.bfloat16)(torch.tensor([ids])).logits[0].float()  # transformers in bf16, on the CPU
        out = llm.engine.model.forward_full(torch.tensor(ids, device="cuda")).float().cpu()
    # A tiny random model's own bf16 error can be large (transformers' DeepSeek-V2 in bf16 is 0.17 of
    # max|logit| from its float32), and MoE routers flip near-tied experts under bf16 in either direction, so
    # the check takes the nearer of transformers' bf16 and float32 results (the float32 test above is exact).
    scale = ref32.abs().max()
    err = min(float((out - ref).abs().max() / scale), float((out - ref32).abs().max() / scale))
    tol = 1.2e-1 if name in MOE else 3e-2
    print(f"{name}: ours (bf16, GPU) vs transformers: {err:.3g} of max|logit| (tolerance {tol})")
    assert err < tol, f"{name}: bf16 logits differ from transformers by {err:.3g} of max|logit|"
    # And the engine's own (paged) path in bf16 agrees with its full path on the prompt tokens' logprobs.
    # MLA's engine path is the absorbed form (another order of bf16 roundings than the full path's
    # unabsorbed one): up to 0.075 nats on the CPU for the tiny DeepSeek-V2 with q LoRA; others match exactly.
    lp = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0].prompt_logprobs
    full_lp = torch.log_softmax(out, -1)
    errs = [abs(lp[p][ids[p]].logprob - full_lp[p - 1, ids[p]].item()) for p in range(1, len(ids))]
    worst, mean = max(errs), sum(errs) / len(errs)
    print(f"{name}: paged vs full: worst {worst:.3g} nats, mean {mean:.3g}")
    if name in MOE:
        # A bf16 difference in attention can flip a near-tied expert of the tiny random router for one token
        # (measured on the CPU for DeepSeek-V3 with the nvidia kernels: worst 0.14, mean 0.0095; with either
        # the fused MoE or the flash prefill swapped for the reference op, worst 0.02): bound the mean tightly
        # and the worst loosely. The float32 test above holds the paths together exactly.
        assert mean < 3e-2 and worst < 6e-1, f"{name}: paged vs full worst {worst:.3g}, mean {mean:.3g} nats"
    else:
        assert worst < 5e-2, f"{name}: paged vs full {worst:.3g} nats"

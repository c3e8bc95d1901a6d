"""One-call GPU benchmark: rooflines, a Llama-3.1-8B shape, HF transformers beside it, a Qwen3-30B-A3B shape MoE
and the CED bench config, all with random weights (``load_format="dummy"``), under one time budget.

    python benchmarks/gpu_bench.py --out $OUT/gpu_bench.jsonl --commit <sha>   # the device run (budget 380 s)
    python benchmarks/gpu_bench.py --tiny --out /tmp/gpu_bench_tiny.jsonl  # CPU smoke: tiny shapes, a few tokens
    python benchmarks/plot_rows.py $OUT/gpu_bench.jsonl --png $OUT/gpu_bench.png   # table + plot from the rows

Phases, in this order, each under a share of what is left of ``--budget-s`` (a phase that gets too little is
skipped, and the output says so; every row is appended to the JSONL file and flushed as soon as it is measured,
so a killed run keeps what it did):

1. ``roofline``: device copy bandwidth (bytes read + written / time) and the bf16 matmul rate (8192^3) on random
   data, CUDA events, warm-up, median. These are the ceilings the later rows are compared with.
2. ``llama``: Llama-3.1-8B shape (d 4096, 32 layers, 32/8 heads of 128, F 14336, vocab 128256, llama3 RoPE),
   bf16, in DeepInfer: decode at batch 1/16/64/256 (128 random prompt tokens, 128 output tokens, greedy,
   ignore_eos), prefill at 4K/16K/64K batch tokens (prompts of 2048 tokens, max_tokens=1, one step).
3. ``hf``: transformers ``generate`` on the same shape (``from_config``, random bf16 weights, built on the GPU),
   batch 1/16/64, greedy, min_new_tokens = max_new_tokens = 128.
4. ``moe``: Qwen3-30B-A3B shape (d 2048, 48 layers, 32/4 heads, 128 experts top-8 of F 768, vocab 151936):
   decode at batch 1 and 64, prefill at 4K.
5. ``ced``: the CED ``bench`` config: the bytes per token of each cache as the engine allocates it beside
   CED.md's formula (ced_cache_formula), one prompt of 4K and 16K tokens prefilled in bounded and in exact
   replay mode (their ratio), decode at batch 1, 16 and 64.

Definitions. Decode tokens/s is steady decode: the tokens generated after every sequence of the batch has its
first token, over the time from that moment to the last token. Per-user tokens/s is decode steps per second
(each running sequence gets one token per step). TTFT is first token minus arrival, all prompts arriving at
once (so it is the batch's prefill). ``output_tok_s`` is every output token over the whole wall time.
``decode_tok_per_cpu_s``: the steady decode's tokens over this process's CPU time in that window (on a shared
CPU, the figure other load disturbs least; on a GPU, the host's share).
A decode measurement that reaches ``--max-measure-s`` stops there (``truncated``: its steady figures are from the
steps it ran). Rooflines: bytes per decode step = the weights read (all but the embedding table; for an MoE the
expected distinct experts hit by B tokens under uniform routing) + the KV cache read (B x the mean context x KV
bytes per token) and written; FLOPs = 2 x active matmul parameters per token (+ causal attention for the Llama
family); the floor of a step is max(bytes / copy bandwidth, FLOPs / matmul rate). (Counting all 8.03B Llama
parameters, as the issue's anchor of 268 tokens/s does, gives a floor about 7% lower than this one's ~285.)
Prefill FLOPs count the LM head for the sampled token only; CED prefill FLOPs come from the tokens each layer
actually ran (bounded mode: the decoder over the last n_win tokens), with the full layers' compressors over every
prompt token and the sparse attention and indexer scores counted (ced_prefill_flops; the weights-only fraction
beside it). CED decode reads what CED.md says a step reads, not every cached token: the routed experts the steps
touched (the engine's expert load), the SWA windows, the selected top-K entries and the indexer keys scored
(ced_decode_cache_bytes); its HBM roofline is B / (those bytes / copy bandwidth).

Budget: each phase gets (time left) x its weight / (weights of the phases still to run); below a minimum it is
skipped. Inside a phase, a measurement that is predicted not to fit is skipped with a row saying so, a decode run
stops at ``--max-measure-s``, and a SIGALRM ``--grace-s`` after the phase's share ends the phase (backstop).
One failing measurement writes an error row and the phase goes on. Pass ``--commit`` where the tree has no .git.

Random prompt ids are drawn below the model's vocab; the small test tokenizer (512 tokens) only detokenizes.
Nothing is downloaded and no remote code runs; everything is seeded.
"""

from __future__ import annotations

import time

_T0 = time.perf_counter()  # the budget counts from process start, imports included

import argparse  # noqa: E402
import contextlib  # noqa: E402
import datetime  # noqa: E402
import gc  # noqa: E402
import importlib.metadata  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import traceback  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from deepinfer.bench import append_jsonl, free_memory, machine_info, random_ids, sync  # noqa: E402

# --- shapes --------------------------------------------------------------------------------------------------

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}

SHAPES = {
    "llama-3.1-8b": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, intermediate_size=14336, vocab_size=128256,
        rms_norm_eps=1e-5, max_position_embeddings=131072, rope_theta=500000.0, rope_scaling=LLAMA3_ROPE,
        tie_word_embeddings=False, attention_bias=False, mlp_bias=False, hidden_act="silu", torch_dtype="bfloat16"),
    "qwen3-30b-a3b": dict(
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=2048, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, intermediate_size=6144,
        moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], vocab_size=151936, rms_norm_eps=1e-6,
        max_position_embeddings=40960, rope_theta=1000000.0, tie_word_embeddings=False, attention_bias=False,
        hidden_act="silu", torch_dtype="bfloat16"),
    # --tiny: the same architectures, a few thousand parameters (vocab above the 512-token test tokenizer's).
    "llama-tiny": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128, vocab_size=1024,
        rms_norm_eps=1e-5, max_position_embeddings=4096, rope_theta=500000.0, rope_scaling=LLAMA3_ROPE,
        tie_word_embeddings=False, attention_bias=False, mlp_bias=False, hidden_act="silu", torch_dtype="bfloat16"),
    "qwen3-moe-tiny": dict(
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128, moe_intermediate_size=32,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        vocab_size=1024, rms_norm_eps=1e-6, max_position_embeddings=4096, rope_theta=1000000.0,
        tie_word_embeddings=False, attention_bias=False, hidden_act="silu", torch_dtype="bfloat16"),
}

PHASES = ("roofline", "llama", "hf", "moe", "ced")
# Share of the time left that each phase may use (what an early phase leaves flows on to the later ones).
PHASE_WEIGHTS = {"roofline": 0.04, "llama": 0.34, "hf": 0.22, "moe": 0.20, "ced": 0.20}
# Below this many seconds a phase is skipped rather than started (model build, warm-up and one measurement).
PHASE_MIN_S = {"roofline": 3.0, "llama": 25.0, "hf": 20.0, "moe": 25.0, "ced": 15.0}
PHASE_MIN_S_TINY = {p: 0.5 for p in PHASES}


def defaults(tiny: bool) -> dict:
    """Workload settings; --tiny shrinks every one of them for a CPU smoke run."""
    if tiny:
        return dict(device="cpu", dtype="float32", llama_shape="llama-tiny", moe_shape="qwen3-moe-tiny",
                    ced_size="toy", batches=[1, 4], input_len=16, output_len=8, prefill_tokens=[64, 128],
                    prefill_prompt_len=32, hf_batches=[1, 4], moe_batches=[1, 4], moe_prefill_tokens=[64],
                    ced_prefill_tokens=[64, 128], ced_batches=[1, 2], copy_mib=32, matmul_n=256, repeats=5,
                    max_measure_s=20.0)
    return dict(device=None, dtype="bfloat16", llama_shape="llama-3.1-8b", moe_shape="qwen3-30b-a3b",
                ced_size="bench", batches=[1, 16, 64, 256], input_len=128, output_len=128,
                prefill_tokens=[4096, 16384, 65536], prefill_prompt_len=2048, hf_batches=[1, 16, 64],
                moe_batches=[1, 64], moe_prefill_tokens=[4096], ced_prefill_tokens=[4096, 16384],
                ced_batches=[1, 16, 64], copy_mib=2048, matmul_n=8192, repeats=20, max_measure_s=30.0)


# --- time budget ---------------------------------------------------------------------------------------------

class OutOfTime(BaseException):
    """Raised by the hard deadline alarm. A BaseException, so the engine's per-step ``except Exception`` (which
    fails a batch and keeps serving) does not swallow it."""


@contextlib.contextmanager
def hard_deadline(seconds: float):
    """Raise OutOfTime in the main thread after ``seconds`` (a backstop for one step that runs far too long)."""
    usable = hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()
    if not usable or seconds is None:
        yield
        return

    def fire(signum, frame):
        raise OutOfTime(f"hard deadline of {seconds:.1f} s reached")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.01))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


class Phase:
    """One phase's deadline and the predicates measurements use to decide whether they still fit."""

    def __init__(self, name: str, deadline: float, share: float = 0.0):
        self.name, self.deadline, self.share = name, deadline, share

    def left(self) -> float:
        return self.deadline - time.perf_counter()

    def fits(self, predicted_s) -> bool:
        return predicted_s is None or self.left() > 1.2 * predicted_s


# --- device helpers ------------------------------------------------------------------------------------------

def memory_gib(device) -> dict:
    if torch.device(device).type != "cuda":
        return {}
    free, total = torch.cuda.mem_get_info()
    return {"gpu_mem_allocated_gib": torch.cuda.memory_allocated() / 2**30,
            "gpu_mem_reserved_gib": torch.cuda.memory_reserved() / 2**30,
            "gpu_mem_free_gib": free / 2**30, "gpu_mem_total_gib": total / 2**30}


def time_fn(fn, device, warmup: int, repeats: int) -> list:
    """Seconds per call of fn: CUDA events on a GPU, perf_counter (after a sync) elsewhere; after warm-up."""
    for _ in range(warmup):
        fn()
    sync(device)
    out = []
    cuda = torch.device(device).type == "cuda"
    for _ in range(repeats):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return out


def versions() -> dict:
    def ver(pkg):
        try:
            return importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            return None

    return {"triton_version": ver("triton"), "transformers_version": ver("transformers"),
            "cuda_version": torch.version.cuda,
            "device_name": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


# --- model accounting ----------------------------------------------------------------------------------------

def shape_fields(cfg: dict) -> dict:
    keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
            "intermediate_size", "moe_intermediate_size", "num_experts", "num_experts_per_tok", "vocab_size",
            "num_encoder_layers", "n_routed_experts", "n_win", "num_heads", "num_layers")
    out = {k: cfg[k] for k in keys if k in cfg}
    if "rope_scaling" in cfg:
        out["rope_type"] = cfg["rope_scaling"].get("rope_type")
    return out


def weight_stats(model, hf_config: dict) -> dict:
    """Parameter counts and bytes, split into embedding table, LM head, routed experts and the rest."""
    from torch import nn

    emb = [m.weight for m in model.modules() if isinstance(m, nn.Embedding)]
    emb_ids = {id(p) for p in emb}
    lm = getattr(model, "lm_head", None)
    lm_p = lm.weight if isinstance(lm, nn.Linear) else lm if isinstance(lm, torch.Tensor) else None
    tied = lm_p is None
    if tied and emb:
        lm_p = emb[0]
    E = hf_config.get("num_experts") or hf_config.get("num_local_experts") or hf_config.get("n_routed_experts")
    k = hf_config.get("num_experts_per_tok")
    s = dict(params_total=0, embedding_params=0, lm_head_params=0, expert_params=0, dense_params=0,
             embedding_bytes=0, lm_head_bytes=0, expert_bytes=0, dense_bytes=0)
    for name, p in model.named_parameters():
        n, b = p.numel(), p.numel() * p.element_size()
        s["params_total"] += n
        if lm_p is not None and p is lm_p:
            s["lm_head_params"] += n
            s["lm_head_bytes"] += b
        elif id(p) in emb_ids:
            s["embedding_params"] += n
            s["embedding_bytes"] += b
        elif E and p.dim() == 3 and name.split(".")[-1] in ("w13", "w2") and p.shape[0] == E:
            s["expert_params"] += n
            s["expert_bytes"] += b
        else:
            s["dense_params"] += n
            s["dense_bytes"] += b
    s["tied_embeddings"] = tied
    s["num_experts"], s["experts_per_token"] = E, k
    frac = (k / E) if E and k else 1.0
    # Matmul parameters one token multiplies by (dense + LM head + its top-k experts): 2x this = FLOPs/token.
    s["active_params_per_token"] = s["dense_params"] + s["lm_head_params"] + s["expert_params"] * frac
    s["hidden_size"] = hf_config.get("hidden_size")
    return s


def experts_hit(E, k, tokens: int) -> float:
    """Expected distinct experts (per MoE layer) that `tokens` tokens hit when each picks k of E uniformly."""
    if not E or not k:
        return 0.0
    return E * (1.0 - (1.0 - k / E) ** tokens)


def attention_flops(hf_config: dict, contexts_sum: float) -> float:
    """QK^T and PV FLOPs for queries whose attended lengths add up to contexts_sum (Llama family; 0 otherwise)."""
    if hf_config.get("architectures", [""])[0] == "CEDForCausalLM":
        return 0.0  # compressed / sparse attention: not modelled
    L, H = hf_config.get("num_hidden_layers"), hf_config.get("num_attention_heads")
    D = hf_config.get("head_dim") or (hf_config["hidden_size"] // H)
    return 4.0 * L * H * D * contexts_sum


def decode_roofline(ws: dict, hf_config: dict, B: int, ctx_mean: float, kv_bytes_per_token: float, ceil: dict,
                    cache_bytes: float = None, experts_touched: float = None):
    """Bytes and FLOPs of one decode step of B sequences at mean context ctx_mean, and the step's floor.

    Weights read: every parameter but the embedding table and the routed experts (attention, norms, shared
    experts, router, LM head), plus the routed experts touched (``experts_touched`` per MoE layer when measured,
    else the expected distinct experts B tokens hit under uniform routing) and B embedding rows. Caches:
    ``cache_bytes`` (read + written by the whole batch) when given, else B x (ctx_mean + 1) x kv_bytes_per_token
    (every cached token read, the new one written). floor = max(bytes / copy bandwidth, FLOPs / matmul rate);
    the HBM roofline is B / (bytes / copy bandwidth)."""
    E, k = ws["num_experts"], ws["experts_per_token"]
    weights = ws["dense_bytes"] + ws["lm_head_bytes"]
    hit = None
    if ws["expert_params"]:
        hit = experts_hit(E, k, B) if experts_touched is None else experts_touched
        weights += ws["expert_bytes"] * hit / E
    emb_rows = B * (ws["embedding_bytes"] / max(ws["embedding_params"], 1)) * (ws["hidden_size"] or 0)
    kv = B * ctx_mean * kv_bytes_per_token + B * kv_bytes_per_token if cache_bytes is None else cache_bytes
    total = weights + emb_rows + kv
    flops = 2.0 * B * ws["active_params_per_token"] + attention_flops(hf_config, B * ctx_mean)
    out = {"bytes_per_step": total, "weight_bytes_per_step": weights, "embedding_row_bytes_per_step": emb_rows,
           "kv_bytes_per_step": kv,
           "flops_per_step": flops, "expected_experts_hit": experts_hit(E, k, B) if ws["expert_params"] else None,
           "experts_counted": hit}
    bw, rate = ceil.get("copy_bytes_per_s"), ceil.get("matmul_flop_per_s")
    if bw and rate:
        t_mem, t_cmp = total / bw, flops / rate
        floor = max(t_mem, t_cmp)
        out.update(step_floor_s=floor, step_floor_bound="memory" if t_mem >= t_cmp else "compute",
                   roofline_tok_s=B / floor, roofline_per_user_tok_s=1.0 / floor, hbm_roofline_tok_s=B / t_mem)
    return out


def prefill_roofline(ws: dict, hf_config: dict, num_seqs: int, prompt_len: int, ceil: dict):
    N = num_seqs * prompt_len
    lm = ws["lm_head_params"]
    flops = (2.0 * N * (ws["active_params_per_token"] - lm) + 2.0 * num_seqs * lm
             + attention_flops(hf_config, num_seqs * prompt_len * (prompt_len + 1) / 2))
    out = {"flops": flops, "flops_per_token": flops / N}
    rate = ceil.get("matmul_flop_per_s")
    if rate:
        out.update(floor_s=flops / rate, roofline_tok_s=N / (flops / rate))
    return out


# --- CED accounting, from CED.md (the engine's own figures are read beside these, never used to derive them) ---

# Bits per channel of each cache format as CED.md defines it (values + their share of the scale bytes), written
# here and not taken from reference.lowbit, so what the engine allocates is checked against the spec.
CED_FORMAT_BITS = {"fp4_e2m1_e4m3": 4 + 8 / 16,  # E2M1 values, one E4M3 scale per 16 channels
                   "mxfp4": 4 + 8 / 32,  # E2M1 values, one E8M0 scale per 32 channels
                   "fp8_e4m3_pow2": 8 + 8 / 32,  # E4M3 values, one power-of-two (E8M0) scale per 32 channels
                   "bf16": 16.0, "fp32": 32.0}
CED_CACHES = ("global_kv", "indexer_k", "swa_ring", "score_ring", "pending")


def ced_vec_bytes(fmt: str, channels: int) -> float:
    """Bytes of one vector of ``channels`` channels in a CED cache format (CED_FORMAT_BITS)."""
    return channels * CED_FORMAT_BITS[fmt] / 8


def ced_cache_formula(c, dtype_bytes: int) -> dict:
    """Bytes of each CED cache from CED.md alone: {cache: {format, layers, bytes_per_token, bytes_per_seq,
    slots_per_seq}}, with vec(fmt, C) = ced_vec_bytes and m_l the compression ratio of layer l:

      global_kv   paged, per token: sum over full layers of vec(global_kv_format, head_dim) / m_l
      indexer_k   paged, per token: sum over full layers of vec(index_k_format, index_head_dim) / m_l
      swa_ring    per sequence: num_layers x (n_win + swa_allowance) slots x vec(swa_kv_format, head_dim)
      score_ring  per sequence: decoder layers x n_win slots x vec(swa_kv_format, head_dim)
      pending     per sequence: sum over full layers with m_l > 1 of (m_l - 1) x hidden_size x dtype_bytes (the
                  inputs of an incomplete trailing group, which is not emitted until it completes)

    A per-sequence cache's bytes_per_token is its bytes per slot, over all its layers."""
    full = [l for l, mode in enumerate(c.layer_modes) if mode == "full"]
    dec = list(range(c.num_encoder_layers, c.num_layers))
    tail = [l for l in full if c.ratio(l) > 1]
    swa = ced_vec_bytes(c.swa_kv_format, c.head_dim)
    ring = c.n_win + c.swa_allowance
    return {
        "global_kv": {"format": c.global_kv_format, "layers": full, "slots_per_seq": None, "bytes_per_seq": None,
                      "bytes_per_token": sum(ced_vec_bytes(c.global_kv_format, c.head_dim) / c.ratio(l) for l in full)},
        "indexer_k": {"format": c.index_k_format, "layers": full, "slots_per_seq": None, "bytes_per_seq": None,
                      "bytes_per_token": sum(ced_vec_bytes(c.index_k_format, c.index_head_dim) / c.ratio(l)
                                             for l in full)},
        "swa_ring": {"format": c.swa_kv_format, "layers": list(range(c.num_layers)), "slots_per_seq": ring,
                     "bytes_per_token": c.num_layers * swa, "bytes_per_seq": c.num_layers * ring * swa},
        "score_ring": {"format": c.swa_kv_format, "layers": dec, "slots_per_seq": c.n_win,
                       "bytes_per_token": len(dec) * swa, "bytes_per_seq": len(dec) * c.n_win * swa},
        "pending": {"format": f"{dtype_bytes * 8}-bit activations", "layers": tail,
                    "slots_per_seq": max((c.ratio(l) - 1 for l in tail), default=0),
                    "bytes_per_token": len(tail) * c.hidden_size * dtype_bytes,
                    "bytes_per_seq": sum((c.ratio(l) - 1) * c.hidden_size * dtype_bytes for l in tail)},
    }


def ced_cache_engine(cache) -> dict:
    """The same figures read off the tensors the engine's CEDCache allocated: a paged store's bytes over the tokens
    its rows cover (entries x m), a per-sequence store's bytes over its sequence rows (``seq_rows``, the slots
    allocated, scratch rows included) and over its slots. ``alloc_bytes``: all of the store's tensors."""
    c = cache.c

    def nbytes(ts):
        return sum(t.numel() * t.element_size() for t in (ts if isinstance(ts, (tuple, list)) else (ts,)))

    def first(ts):
        return ts[0] if isinstance(ts, (tuple, list)) else ts

    out = {}
    for name, store in (("global_kv", cache.kv), ("indexer_k", cache.ik)):
        out[name] = {"layers": sorted(store), "alloc_bytes": sum(nbytes(v) for v in store.values()),
                     "bytes_per_token": sum(nbytes(v) / (first(v).shape[0] * c.ratio(l)) for l, v in store.items()),
                     "bytes_per_seq": None, "slots_per_seq": None, "seq_rows": None}
    for name, store in (("swa_ring", cache.ring), ("score_ring", cache.score_ring),
                        ("pending", getattr(cache, "pending", {}))):
        rows = first(next(iter(store.values()))).shape[0] if store else 0
        out[name] = {"layers": sorted(store), "alloc_bytes": sum(nbytes(v) for v in store.values()), "seq_rows": rows,
                     "bytes_per_seq": sum(nbytes(v) for v in store.values()) / rows if rows else 0.0,
                     "slots_per_seq": max((first(v).shape[1] for v in store.values()), default=0),
                     "bytes_per_token": sum(nbytes(v) / rows / first(v).shape[1] for v in store.values())
                     if rows else 0.0}
    return out


def ced_decode_cache_bytes(c, ctx: float, dtype_bytes: int) -> dict:
    """Cache bytes one sequence's decode step reads and writes with ctx tokens in context (the new one included),
    from CED.md, with vec(fmt, C) = ced_vec_bytes, m_l the layer's compression ratio and V_l = floor(ctx / m_l)
    the entries visible to the new token:

      swa_read      sum over all layers of min(ctx, n_win) x vec(swa_kv_format, head_dim)  (window keys = values)
      entries_read  sum over full, reindex and reuse layers of min(index_topk, V_l) x vec(global_kv_format, head_dim)
      index_read    vec(index_k_format, index_head_dim) x (sum over full layers of V_l (every visible key scored)
                    + decoder reindex layers: min(V_l, pool_blocks x pool_block) (the pool's candidates only)
                    + encoder reindex layers: V_l)
      tail_read     sum over full layers with m_l > 1 of (m_l - 1) x hidden_size x dtype_bytes (the pending group)
      written       num_layers x vec(swa_kv_format, head_dim) + sum over full layers of
                    (vec(global_kv_format, head_dim) + vec(index_k_format, index_head_dim)) / m_l
    ``total`` is their sum."""
    swa = ced_vec_bytes(c.swa_kv_format, c.head_dim)
    entry = ced_vec_bytes(c.global_kv_format, c.head_dim)
    key = ced_vec_bytes(c.index_k_format, c.index_head_dim)
    out = dict(swa_read=c.num_layers * min(ctx, c.n_win) * swa, entries_read=0.0, index_read=0.0, tail_read=0.0,
               written=c.num_layers * swa)
    for l, mode in enumerate(c.layer_modes):
        if mode == "swa":
            continue
        m, decoder = c.ratio(l), l >= c.num_encoder_layers
        vis = math.floor(ctx / m)
        out["entries_read"] += min(c.index_topk, vis) * entry
        if mode == "full":
            out["index_read"] += vis * key
            out["tail_read"] += (m - 1) * c.hidden_size * dtype_bytes
            out["written"] += (entry + key) / m
        elif mode == "reindex":
            out["index_read"] += (min(vis, c.pool_blocks * c.pool_block) if decoder else vis) * key
    out["total"] = sum(out.values())
    return out


def experts_touched(expert_load, steps: int):
    """Distinct routed experts that got a token, per MoE layer and step, averaged over the last ``steps`` engine
    steps (at most the load's window) from ExpertLoad's per-step counts; None when none were recorded."""
    n = min(steps, expert_load.window, expert_load.num_steps)
    if n <= 0 or expert_load.steps is None:
        return None
    rows = [(expert_load.num_steps - 1 - j) % expert_load.window for j in range(n)]
    return float((expert_load.steps[rows] > 0).sum(-1).double().mean())


def ced_attention_flops(c, N: int, s: int) -> dict:
    """Matmul FLOPs of CED attention and of the indexer in one prefill of N tokens with replay start s (0: exact),
    from CED.md. Encoder layers run queries 0..N-1; decoder layers queries s..N-1, their SWA cut at s. A query i
    of layer l attends min(i + 1 - cut, n_win) window keys plus, outside SWA-only layers, min(index_topk, V) of
    the V = floor((i + 1) / m_l) visible entries: 4 x heads x head_dim FLOPs per key (QK and PV over the shared
    latent). Its indexer scores V entries in full layers (and encoder reindex layers), min(V, pool_blocks x
    pool_block) in decoder reindex layers: 2 x index_heads x index_head_dim FLOPs each."""
    attn = index = 0.0
    for l, mode in enumerate(c.layer_modes):
        decoder = l >= c.num_encoder_layers
        cut = s if decoder else 0
        q = torch.arange(cut, N, dtype=torch.float64)
        keys = (q + 1 - cut).clamp(max=c.n_win)
        vis = torch.floor((q + 1) / c.ratio(l))
        if mode != "swa":
            keys = keys + vis.clamp(max=c.index_topk)
        attn += 4.0 * c.num_heads * c.head_dim * float(keys.sum())
        if mode == "full" or (mode == "reindex" and not decoder):
            index += 2.0 * c.index_heads * c.index_head_dim * float(vis.sum())
        elif mode == "reindex":
            index += 2.0 * c.index_heads * c.index_head_dim * float(vis.clamp(max=c.pool_blocks * c.pool_block).sum())
    return {"attention_flops": attn, "indexer_flops": index}


COMPRESSOR_WEIGHTS = ("wkv", "wik", "wz", "wzi")  # a full layer's entry projections: every prompt token


def ced_prefill_flops(model, counters: dict) -> dict:
    """Matmul FLOPs of one CED prefill (no prefix hit) from the tokens each layer ran (counters["layer_tokens"];
    bounded mode runs the decoder layers over the last n_win tokens only, so its replay start is the prompt
    length minus the decoder's tokens):

      weight_flops  2 x the layer's active parameters (routed experts at top-k / E) x its tokens, except a full
                    layer's compressor projections (COMPRESSOR_WEIGHTS), which run over every prompt token (the
                    decoder's full layer projects the global KV from the final encoder state for all of them, in
                    bounded mode too); plus the LM head for the one sampled token
      attention_flops, indexer_flops   ced_attention_flops

    ``flops`` is their sum: the work the matmul rate is compared with."""
    c = model.config
    frac = c.num_experts_per_tok / c.n_routed_experts
    tokens = list(counters["layer_tokens"])
    N = tokens[0]  # the encoder runs every prompt token
    total = 0.0
    for layer, n in zip(model.layers, tokens):
        for name, p in layer.named_parameters():
            scale = frac if name in ("w13", "w2") else 1.0
            run = max(n, N) if layer.mode == "full" and name in COMPRESSOR_WEIGHTS else n
            total += 2.0 * p.numel() * scale * run
    head = model.embed.weight if model.lm_head is None else model.lm_head
    out = {"weight_flops": total + 2.0 * head.numel(), **ced_attention_flops(c, N, N - tokens[-1])}
    out["flops"] = out["weight_flops"] + out["attention_flops"] + out["indexer_flops"]
    return out


# --- checkpoints (config + tokenizer only) --------------------------------------------------------------------

def write_model_dir(d: Path, cfg: dict) -> None:
    from deepinfer.testing.tokenizers import build_test_tokenizer

    build_test_tokenizer(d, vocab_size=512)
    (d / "config.json").write_text(json.dumps(cfg, indent=1))


def ced_config(size: str, max_len: int) -> dict:
    from deepinfer.models.ced.config import SIZES, CEDConfig

    base = dict(SIZES[size])
    base["max_position_embeddings"] = max(base.get("max_position_embeddings", 4096), max_len)
    return CEDConfig(**base).to_hf()


def estimated_params(cfg: dict) -> float:
    """Parameters from a Llama-family config (a rough count, to size the build before it happens)."""
    d, L, V = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    H, Hk = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    D = cfg.get("head_dim") or d // H
    attn = d * (H + 2 * Hk) * D + H * D * d
    if cfg.get("num_experts"):
        mlp = cfg["num_experts"] * 3 * d * cfg["moe_intermediate_size"] + cfg["num_experts"] * d
    else:
        mlp = 3 * d * cfg["intermediate_size"]
    return L * (attn + mlp) + V * d * (1 if cfg.get("tie_word_embeddings") else 2)


@contextlib.contextmanager
def default_dtype(dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def build_llm(path: Path, args, hf_config: dict, **kw):
    """LLM(load_format="dummy"). The loader materialises parameters in the default dtype (float32) before casting;
    when that would not fit in free GPU memory (a 30B model: 122 GB), build with the default dtype set to the
    target dtype instead (``--build-in-dtype``)."""
    from deepinfer import LLM

    dtype = getattr(torch, args.dtype)
    dev = torch.device(args.device)
    in_dtype = args.build_in_dtype == "always"
    if args.build_in_dtype == "auto" and dev.type == "cuda" and "hidden_size" in hf_config \
            and "num_hidden_layers" in hf_config and "num_attention_heads" in hf_config:
        need = 4 * estimated_params(hf_config)
        in_dtype = need > 0.8 * torch.cuda.mem_get_info(dev)[0]
    ctx = default_dtype(dtype) if in_dtype and dtype.is_floating_point else contextlib.nullcontext()
    with ctx:
        llm = LLM(str(path), load_format="dummy", dtype=args.dtype, device=args.device, backend=args.backend, **kw)
    return llm, in_dtype


# --- measurements --------------------------------------------------------------------------------------------

def _abort_all(engine, rids) -> None:
    for rid in rids:
        engine.abort(rid)
        engine.requests.pop(rid, None)


_REQ_COUNTER = [0]


def measure_decode(llm, B: int, in_len: int, out_len: int, stop_at: float, seed: int, vocab: int) -> dict:
    """Submit B prompts at once and step the engine; time the steady decode (see the module docstring)."""
    from deepinfer import SamplingParams

    eng = llm.engine
    rng = random.Random(seed * 1_000_003 + B)
    prompts = [random_ids(rng, vocab, in_len) for _ in range(B)]
    sp = SamplingParams(max_tokens=out_len, ignore_eos=True, temperature=0.0)
    gc.collect()  # not empty_cache: the warm-up's cached blocks stay, so no cudaMalloc is timed
    _REQ_COUNTER[0] += 1
    rids = [f"d{_REQ_COUNTER[0]}-{i}" for i in range(B)]
    steps0, pre0 = eng.stats["steps"], eng.scheduler.num_preemptions
    t0 = time.perf_counter()
    reqs = [eng.add_request(rid, {"prompt_token_ids": p}, sp) for rid, p in zip(rids, prompts)]
    steps, t_first, tok_first, step_first, truncated = 0, None, 0, 0, False
    try:
        while eng.has_unfinished():
            eng.step()
            steps += 1
            now = time.perf_counter()
            if t_first is None and all(r.first_token_time is not None for r in reqs):
                t_first, step_first, cpu_first = now, steps, time.process_time()
                tok_first = sum(len(s.output_token_ids) for r in reqs for s in r.seqs)
            if now > stop_at and eng.has_unfinished():
                truncated = True
                break
        t_end, cpu_end = time.perf_counter(), time.process_time()
        errors = [r.error for r in reqs if r.error]
        if errors:
            raise RuntimeError(f"{len(errors)} request(s) failed, first: {errors[0]}")
        tok_end = sum(len(s.output_token_ids) for r in reqs for s in r.seqs)
    finally:
        _abort_all(eng, rids)
    ttft = [r.first_token_time - r.arrival_time for r in reqs if r.first_token_time is not None]
    res = {"batch": B, "input_len": in_len, "output_len": out_len, "wall_s": t_end - t0, "steps": steps,
           "output_tokens": tok_end, "output_tok_s": tok_end / (t_end - t0), "truncated": truncated,
           "preemptions": eng.scheduler.num_preemptions - pre0, "engine_steps": eng.stats["steps"] - steps0,
           "ttft_mean_s": statistics.fmean(ttft) if ttft else None, "ttft_max_s": max(ttft) if ttft else None,
           "prefill_steps": step_first or None}
    if t_first is not None and steps > step_first and t_end > t_first:
        dt = t_end - t_first
        res.update(decode_s=dt, decode_steps=steps - step_first, decode_tokens=tok_end - tok_first,
                   decode_tok_s=(tok_end - tok_first) / dt, per_user_tok_s=(steps - step_first) / dt,
                   step_ms=1e3 * dt / (steps - step_first),
                   ctx_mean=in_len + (tok_first + tok_end) / (2.0 * B), decode_cpu_s=cpu_end - cpu_first)
        if cpu_end > cpu_first:  # per second of this process's CPU time: what other load on the machine leaves be
            res["decode_tok_per_cpu_s"] = (tok_end - tok_first) / (cpu_end - cpu_first)
    else:
        res["note"] = "no steady decode measured (stopped before every sequence had its first token)"
    return res


def measure_prefill(llm, num_seqs: int, prompt_len: int, seed: int, vocab: int) -> dict:
    """num_seqs prompts of prompt_len tokens, max_tokens=1: the time to the first (only) token of all."""
    from deepinfer import SamplingParams

    eng = llm.engine
    rng = random.Random(seed * 7919 + num_seqs * 31 + prompt_len)
    prompts = [random_ids(rng, vocab, prompt_len) for _ in range(num_seqs)]
    sp = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0)
    gc.collect()  # not empty_cache: the warm-up's cached blocks stay, so no cudaMalloc is timed
    steps0 = eng.stats["steps"]
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    wall = time.perf_counter() - t0
    errors = [o.error for o in outs if o.error]
    if errors:
        raise RuntimeError(f"{len(errors)} request(s) failed, first: {errors[0]}")
    return {"seconds": wall, "steps": eng.stats["steps"] - steps0}


def warm(llm, vocab: int, B: int = 2, in_len: int = 16, out_len: int = 4) -> None:
    """A short run so allocator growth, kernel selection and lazy imports are not timed."""
    from deepinfer import SamplingParams

    rng = random.Random(12345 + B)
    outs = llm.generate([{"prompt_token_ids": random_ids(rng, vocab, in_len)} for _ in range(B)],
                        SamplingParams(max_tokens=out_len, ignore_eos=True, temperature=0.0), use_tqdm=False)
    errors = [o.error for o in outs if o.error]
    if errors:
        raise RuntimeError(f"warm-up: {len(errors)} request(s) failed, first: {errors[0]}")


# --- the run -------------------------------------------------------------------------------------------------

def pass_graph_stats(llm) -> dict:
    """The CED engine's bounded decoder-pass graphs (models/ced/pass_graphs.py): captures, replays, failed keys."""
    g = getattr(llm.engine.kv_cache, "pass_graphs", None)
    if g is None:
        return {"pass_graphs": None}
    return {"pass_graphs": {"captures": g.captures, "replays": g.replays, "failed": len(g.failed)}}


class GcClock:
    """Seconds Python's cyclic garbage collector ran inside the ``with`` block (gc.callbacks): a collection of
    the oldest generation walks every tracked object, so in a process holding two engines it can stall a
    host-bound step for milliseconds."""

    def __init__(self):
        self.seconds, self._t = 0.0, None

    def _cb(self, phase, info) -> None:
        if phase == "start":
            self._t = time.perf_counter()
        elif self._t is not None:
            self.seconds += time.perf_counter() - self._t
            self._t = None

    def __enter__(self):
        gc.callbacks.append(self._cb)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._cb)


class Runner:
    def __init__(self, args):
        self.args = args
        self.rows: list = []
        self.ceil: dict = {}
        self.machine = {**machine_info(), **versions()}
        if args.commit:
            self.machine["git_commit"] = args.commit
        self.run_id = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ") + f"-{os.getpid()}"
        self.deadline = _T0 + args.budget_s

    def emit(self, row: dict) -> dict:
        row = {"bench": "benchmarks/gpu_bench.py", "run_id": self.run_id, "seed": self.args.seed,
               "tiny": self.args.tiny, "budget_s": self.args.budget_s,
               "elapsed_s": round(time.perf_counter() - _T0, 3), **row, **self.ceil_fields(), **self.machine}
        self.rows.append(row)
        if self.args.out:
            append_jsonl(self.args.out, [row])
        print("row " + one_line(row), flush=True)
        return row

    def attempt(self, row: dict, fn):
        """fn(), or None after emitting ``row`` with the error: one failed measurement (a step that ran out of
        memory fails its requests, not the engine) does not end its phase."""
        try:
            return fn()
        except Exception as exc:
            tb = traceback.format_exc()
            traceback.clear_frames(exc.__traceback__)
            print(f"   measurement FAILED: {type(exc).__name__}: {str(exc)[:500]}", flush=True)
            self.emit({**row, "error": f"{type(exc).__name__}: {exc}"[:2000], "traceback": tb[-3000:]})
            free_memory(self.args.device)
            return None

    def ceil_fields(self) -> dict:
        return {"ceiling_copy_gb_s": self.ceil.get("copy_bytes_per_s", 0) / 1e9 or None,
                "ceiling_matmul_tflop_s": self.ceil.get("matmul_flop_per_s", 0) / 1e12 or None}

    def run(self) -> int:
        phases = [p for p in PHASES if p in self.args.phases]
        mins = PHASE_MIN_S_TINY if self.args.tiny else PHASE_MIN_S
        for i, name in enumerate(phases):
            left = self.deadline - time.perf_counter()
            weight = PHASE_WEIGHTS[name] / sum(PHASE_WEIGHTS[p] for p in phases[i:])
            share = left * weight
            if share < mins[name]:
                msg = (f"SKIPPED phase {name}: {share:.1f} s of the budget for it ({left:.1f} s left in all) "
                       f"< {mins[name]:.0f} s needed")
                print(msg, flush=True)
                self.emit({"phase": name, "measurement": "skipped", "skipped": True, "reason": msg})
                continue
            print(f"== phase {name}: {share:.1f} s (of {left:.1f} s left)", flush=True)
            phase = Phase(name, time.perf_counter() + share, share)
            t0 = time.perf_counter()
            try:
                # The alarm is the backstop only: measurements check the phase deadline themselves.
                with hard_deadline(share + self.args.grace_s):
                    getattr(self, "phase_" + name)(phase)
            except OutOfTime as exc:
                msg = f"phase {name} stopped by its hard deadline ({exc}); the rest of it is skipped"
                print(msg, flush=True)
                self.emit({"phase": name, "measurement": "stopped", "skipped": True, "reason": msg})
            except Exception as exc:  # a failing phase is reported; the others still run
                tb = traceback.format_exc()
                traceback.clear_frames(exc.__traceback__)
                print(f"phase {name} FAILED: {type(exc).__name__}: {exc}\n{tb}", flush=True)
                self.emit({"phase": name, "measurement": "error", "error": f"{type(exc).__name__}: {exc}",
                           "traceback": tb[-4000:]})
            finally:
                free_memory(self.args.device)
            print(f"== phase {name} done in {time.perf_counter() - t0:.1f} s", flush=True)
        self.compare_hf()
        print()
        print(summary_table(self.rows))
        print(f"\n{len(self.rows)} rows{' in ' + str(self.args.out) if self.args.out else ''}; "
              f"{time.perf_counter() - _T0:.1f} s of the {self.args.budget_s:.0f} s budget used", flush=True)
        return 0

    def compare_hf(self) -> None:
        """DeepInfer over HF on the same shape and batch: one row per batch both measured."""
        def pick(engine):
            return {r["batch"]: r for r in self.rows if r.get("measurement") == "decode" and r.get("engine") == engine
                    and r.get("model") == self.args.llama_shape and r.get("decode_tok_s")}

        di, hf = pick("deepinfer"), pick("hf")
        for B in sorted(set(di) & set(hf)):
            d, h = di[B], hf[B]
            self.emit({"phase": "compare", "measurement": "deepinfer_over_hf", "model": self.args.llama_shape,
                       "batch": B, "input_len": d.get("input_len"), "output_len": d.get("output_len"),
                       "deepinfer_backend": d.get("backend"), "hf_backend": h.get("backend"),
                       "decode_tok_s_ratio": d["decode_tok_s"] / h["decode_tok_s"],
                       "output_tok_s_ratio": d["output_tok_s"] / h["output_tok_s"],
                       "ttft_ratio": (d["ttft_mean_s"] / h["ttft_mean_s"]) if d.get("ttft_mean_s")
                       and h.get("ttft_mean_s") else None,
                       "deepinfer_decode_tok_s": d["decode_tok_s"], "hf_decode_tok_s": h["decode_tok_s"],
                       "deepinfer_output_tok_s": d["output_tok_s"], "hf_output_tok_s": h["output_tok_s"]})

    # 1. rooflines
    def phase_roofline(self, phase: Phase) -> None:
        a = self.args
        dev = torch.device(a.device)
        g = torch.Generator(device=dev).manual_seed(a.seed)
        n = a.copy_mib * 2**20 // 2
        src = torch.randn(n, generator=g, device=dev, dtype=torch.bfloat16)
        dst = torch.empty_like(src)
        ts = time_fn(lambda: dst.copy_(src), dev, warmup=3, repeats=a.repeats)
        assert torch.equal(dst[:1024], src[:1024]) and torch.equal(dst[-1024:], src[-1024:])
        nbytes = 2 * src.numel() * src.element_size()
        med = statistics.median(ts)
        self.ceil["copy_bytes_per_s"] = nbytes / med
        del src, dst
        free_memory(dev)
        self.emit({"phase": "roofline", "measurement": "copy_bandwidth", "device": str(dev), "dtype": "bfloat16",
                   "bytes_read_plus_written": nbytes, "median_s": med, "min_s": min(ts), "repeats": len(ts),
                   "gb_s": nbytes / med / 1e9, "gb_s_best": nbytes / min(ts) / 1e9})
        N = a.matmul_n
        mdt = torch.bfloat16 if dev.type == "cuda" or not a.tiny else getattr(torch, a.dtype)
        sets = [(torch.randn(N, N, generator=g, device=dev, dtype=mdt),
                 torch.randn(N, N, generator=g, device=dev, dtype=mdt)) for _ in range(3)]
        out = torch.empty(N, N, device=dev, dtype=mdt)
        k = [0]

        def mm():
            x, y = sets[k[0] % 3]
            k[0] += 1
            torch.matmul(x, y, out=out)

        ts = time_fn(mm, dev, warmup=5, repeats=a.repeats)
        x, y = sets[0]
        ref = x[:64].double() @ y.double()
        rel = float((torch.matmul(x[:64], y).double() - ref).norm() / ref.norm())
        med = statistics.median(ts)
        flops = 2.0 * N ** 3
        self.ceil["matmul_flop_per_s"] = flops / med
        del sets, out
        self.emit({"phase": "roofline", "measurement": "matmul", "device": str(dev),
                   "dtype": str(mdt).removeprefix("torch."), "n": N, "flops": flops, "median_s": med,
                   "min_s": min(ts), "repeats": len(ts), "tflop_s": flops / med / 1e12,
                   "tflop_s_best": flops / min(ts) / 1e12, "rel_err_vs_float64": rel})

    # 2. and 4. DeepInfer on a Llama-family shape
    def _deepinfer_shape(self, phase: Phase, shape: str, batches, prefill_tokens) -> None:
        a = self.args
        cfg = dict(SHAPES[shape])
        plen = a.prefill_prompt_len
        prefills = [(max(1, N // plen), min(plen, N)) for N in prefill_tokens]
        max_len = max([a.input_len + a.output_len] + [p for _, p in prefills]) + 8
        need_tokens = max([B * (a.input_len + a.output_len) for B in batches]
                          + [s * p for s, p in prefills] + [64])
        mnbt = max([B * a.input_len for B in batches] + [s * p for s, p in prefills] + [64])
        max_seqs = max(list(batches) + [s for s, _ in prefills] + [4])
        with tempfile.TemporaryDirectory(prefix="deepinfer-gpu-bench-") as d:
            write_model_dir(Path(d), cfg)
            t0 = time.perf_counter()
            block = a.block_size or 16
            kw = dict(max_model_len=max_len, max_num_seqs=max_seqs, max_num_batched_tokens=mnbt,
                      num_kv_blocks=math.ceil(need_tokens / block) + max_seqs + 16)
            if a.block_size:
                kw["block_size"] = a.block_size
            llm, in_dtype = build_llm(Path(d), a, cfg, **kw)
            try:
                self._measure_engine(phase, llm, shape, cfg, batches, prefills, time.perf_counter() - t0, in_dtype)
            finally:
                llm.engine.kv_cache = None
                del llm
                free_memory(a.device)

    def _settings(self, llm, shape, cfg, ws, build_s, in_dtype) -> dict:
        eng = llm.engine
        return {"model": shape, "arch": cfg["architectures"][0], "shape": shape_fields(cfg), "engine": "deepinfer",
                "backend": llm.backend_name, "device": str(eng.device),
                "dtype": str(next(eng.model.parameters()).dtype).removeprefix("torch."),
                "block_size": llm.config.block_size, "num_kv_blocks": eng.pool.num_blocks,
                "max_num_seqs": llm.config.max_num_seqs, "max_num_batched_tokens": llm.config.max_num_batched_tokens,
                "max_model_len": eng.max_model_len, "kv_bytes_per_token": eng.kv_bytes_per_token,
                "recipe": llm.pipeline.recipe, "load_format": "dummy", "build_s": build_s,
                "built_in_target_dtype": in_dtype, **{k: v for k, v in ws.items() if k != "hidden_size"}}

    def _measure_engine(self, phase, llm, shape, cfg, batches, prefills, build_s, in_dtype) -> None:
        a = self.args
        vocab = llm.engine.model.vocab_size
        ws = weight_stats(llm.engine.model, cfg)
        base = {"phase": phase.name, **self._settings(llm, shape, cfg, ws, build_s, in_dtype)}
        print(f"   {shape}: {ws['params_total'] / 1e9:.3f} B parameters, backend {llm.backend_name}, "
              f"built in {build_s:.1f} s", flush=True)
        t0 = time.perf_counter()
        warm(llm, vocab)
        warm_s = time.perf_counter() - t0
        kvb = llm.engine.kv_bytes_per_token
        reserve = 0.2 * phase.share if prefills else 0.0  # decode leaves this much of the phase to prefill
        last = None  # (batch, seconds) of the previous decode, to predict the next
        for B in batches:
            left = phase.left() - reserve
            if left < 2.0 or (last and left < 1.2 * min(last[1] * B / last[0], a.max_measure_s)):
                self.emit({**base, "measurement": "decode", "batch": B, "skipped": True,
                           "reason": f"budget: {phase.left():.1f} s left in phase {phase.name}"})
                continue

            def one(B=B):
                if not a.no_warmup_each:
                    warm(llm, vocab, B=B, in_len=a.input_len, out_len=3)
                stop = min(phase.deadline - reserve, time.perf_counter() + a.max_measure_s)
                return measure_decode(llm, B, a.input_len, a.output_len, stop, a.seed, vocab)

            r = self.attempt({**base, "measurement": "decode", "batch": B}, one)
            if r is None:
                continue
            last = (B, r["wall_s"])
            roof = decode_roofline(ws, cfg, B, r.get("ctx_mean", a.input_len + a.output_len / 2), kvb, self.ceil)
            if r.get("decode_tok_s") and roof.get("roofline_tok_s"):
                roof["fraction_of_roofline"] = r["decode_tok_s"] / roof["roofline_tok_s"]
            self.emit({**base, "measurement": "decode", **r, **roof, "warmup_s": warm_s, **memory_gib(a.device)})
        lastp = None  # (tokens, seconds)
        for num_seqs, plen in prefills:
            N = num_seqs * plen
            pred = lastp[1] * N / lastp[0] * (plen / max(lastp[2], 1)) if lastp else None
            if phase.left() < 2.0 or not phase.fits(pred):
                self.emit({**base, "measurement": "prefill", "batch_tokens": N, "batch": num_seqs, "prompt_len": plen,
                           "skipped": True, "reason": f"budget: {phase.left():.1f} s left in phase {phase.name}, "
                                                      f"predicted {pred or 0:.1f} s"})
                continue
            times, steps = [], []

            def repeats(num_seqs=num_seqs, plen=plen):
                for rep in range(a.prefill_repeats):
                    if times and not phase.fits(statistics.median(times)):
                        break
                    m = measure_prefill(llm, num_seqs, plen, a.seed + rep, vocab)
                    times.append(m["seconds"])
                    steps.append(m["steps"])
                return True

            row = {**base, "measurement": "prefill", "batch_tokens": N, "batch": num_seqs, "prompt_len": plen}
            if self.attempt(row, repeats) is None or not times:
                continue
            med = statistics.median(times)
            lastp = (N, med, plen)
            roof = prefill_roofline(ws, cfg, num_seqs, plen, self.ceil)
            if roof.get("roofline_tok_s"):
                roof["fraction_of_roofline"] = (N / med) / roof["roofline_tok_s"]
            self.emit({**base, "measurement": "prefill", "batch_tokens": N, "batch": num_seqs, "prompt_len": plen,
                       "prefill_s": med, "prefill_s_min": min(times), "prefill_s_all": times, "engine_steps": steps,
                       "prefill_tok_s": N / med, "ttft_s": med, **roof, **memory_gib(a.device)})

    def phase_llama(self, phase: Phase) -> None:
        self._deepinfer_shape(phase, self.args.llama_shape, self.args.batches, self.args.prefill_tokens)

    def phase_moe(self, phase: Phase) -> None:
        self._deepinfer_shape(phase, self.args.moe_shape, self.args.moe_batches, self.args.moe_prefill_tokens)

    # 3. HF transformers on the Llama shape
    def phase_hf(self, phase: Phase) -> None:
        a = self.args
        import transformers
        from transformers import AutoConfig, AutoModelForCausalLM, LogitsProcessorList, StoppingCriteria, \
            StoppingCriteriaList

        transformers.logging.set_verbosity_error()
        shape = a.llama_shape
        cfg = dict(SHAPES[shape])
        model_type = cfg.pop("model_type")
        for key in ("architectures", "torch_dtype"):
            cfg.pop(key, None)
        if "rope_scaling" in cfg:  # transformers 5 spelling: one rope_parameters dict holding the theta
            cfg["rope_parameters"] = {**cfg.pop("rope_scaling"), "rope_theta": cfg.pop("rope_theta")}
        dev = torch.device(a.device)
        dtype = getattr(torch, a.dtype)
        hf_cfg = AutoConfig.for_model(model_type, **cfg)
        torch.manual_seed(a.seed)
        t0 = time.perf_counter()
        with torch.device(dev):
            model = AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype)
        model.eval()
        build_s = time.perf_counter() - t0
        full = dict(SHAPES[shape])
        ws = weight_stats(model, full)
        attn = getattr(model.config, "_attn_implementation", None)
        base = {"phase": "hf", "model": shape, "arch": full["architectures"][0], "shape": shape_fields(full),
                "engine": "hf", "backend": f"transformers {transformers.__version__} ({attn})", "device": str(dev),
                "dtype": str(dtype).removeprefix("torch."), "build_s": build_s,
                "kv_bytes_per_token": 2 * full["num_hidden_layers"] * full["num_key_value_heads"]
                * full["head_dim"] * torch.empty(0, dtype=dtype).element_size(),
                "batching": "one generate() call per batch, equal-length prompts, no padding",
                **{k: v for k, v in ws.items() if k != "hidden_size"}}
        print(f"   HF {shape}: {ws['params_total'] / 1e9:.3f} B parameters, {attn}, built in {build_s:.1f} s",
              flush=True)
        cuda = dev.type == "cuda"

        class Clock:  # a logits processor that only records when each step's logits exist
            def __init__(self):
                self.times = []

            def __call__(self, input_ids, scores):
                if cuda:
                    torch.cuda.synchronize()
                self.times.append(time.perf_counter())
                return scores

        class Deadline(StoppingCriteria):
            def __init__(self, at):
                self.at, self.hit = at, False

            def __call__(self, input_ids, scores, **kw):
                self.hit = time.perf_counter() > self.at
                return torch.full((input_ids.shape[0],), self.hit, dtype=torch.bool, device=input_ids.device)

        eos = [1]  # the test tokenizer's EOS; masked by min_new_tokens anyway
        vocab = full["vocab_size"]

        def generate(B, in_len, out_len, stop_at):
            rng = random.Random(a.seed * 1_000_003 + B)
            ids = torch.tensor([random_ids(rng, vocab, in_len) for _ in range(B)], device=dev)
            clock, dl = Clock(), Deadline(stop_at)
            with torch.inference_mode(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                sync(dev)
                t0 = time.perf_counter()
                out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                     max_new_tokens=out_len, min_new_tokens=out_len, pad_token_id=0,
                                     eos_token_id=eos, logits_processor=LogitsProcessorList([clock]),
                                     stopping_criteria=StoppingCriteriaList([dl]), temperature=None, top_p=None,
                                     top_k=None)
                sync(dev)
                wall = time.perf_counter() - t0
            new = out.shape[1] - in_len
            res = {"batch": B, "input_len": in_len, "output_len": out_len, "wall_s": wall, "steps": len(clock.times),
                   "output_tokens": B * new, "output_tok_s": B * new / wall, "truncated": dl.hit,
                   "ttft_mean_s": clock.times[0] - t0 if clock.times else None}
            res["ttft_max_s"] = res["ttft_mean_s"]
            n = len(clock.times)
            if n >= 2:
                dt = clock.times[-1] - clock.times[0]
                res.update(decode_s=dt, decode_steps=n - 1, decode_tokens=B * (n - 1), decode_tok_s=B * (n - 1) / dt,
                           per_user_tok_s=(n - 1) / dt, step_ms=1e3 * dt / (n - 1),
                           ctx_mean=in_len + n / 2.0)
            return res

        try:
            t0 = time.perf_counter()
            generate(1, 16, 4, time.perf_counter() + 60)  # warm-up
            warm_s = time.perf_counter() - t0
            last = None
            for B in a.hf_batches:
                if phase.left() < 2.0 or (last and not phase.fits(min(last[1] * (1 + B / last[0]) / 2,
                                                                        a.max_measure_s))):
                    self.emit({**base, "measurement": "decode", "batch": B, "skipped": True,
                               "reason": f"budget: {phase.left():.1f} s left in phase hf"})
                    continue
                r = self.attempt({**base, "measurement": "decode", "batch": B},
                                 lambda B=B: generate(B, a.input_len, a.output_len,
                                                      min(phase.deadline, time.perf_counter() + a.max_measure_s)))
                if r is None:
                    continue
                last = (B, r["wall_s"])
                roof = decode_roofline(ws, full, B, r.get("ctx_mean", a.input_len + a.output_len / 2),
                                       base["kv_bytes_per_token"], self.ceil)
                if r.get("decode_tok_s") and roof.get("roofline_tok_s"):
                    roof["fraction_of_roofline"] = r["decode_tok_s"] / roof["roofline_tok_s"]
                self.emit({**base, "measurement": "decode", **r, **roof, "warmup_s": warm_s, **memory_gib(dev)})
        finally:
            del model
            free_memory(dev)

    # 5. CED bench config: bounded vs exact prefill, decode
    def phase_ced(self, phase: Phase) -> None:
        a = self.args
        lengths = list(a.ced_prefill_tokens)
        max_len = max(lengths + [a.input_len + a.output_len]) + 8
        cfg = ced_config(a.ced_size, max_len)
        block = a.block_size or 16
        max_seqs = max(list(a.ced_batches) + [4])
        need = max(lengths) + 8 + max_seqs * (a.input_len + a.output_len + block)
        # No prefix caching: every prefill of a length repeats one prompt, and a cache hit would skip it.
        kw = dict(max_model_len=max_len, max_num_seqs=max_seqs,
                  max_num_batched_tokens=max(lengths + [max_seqs * a.input_len, 64]),
                  num_kv_blocks=math.ceil(need / block) + max_seqs + 16, enable_prefix_caching=False)
        if a.block_size:
            kw["block_size"] = a.block_size
        shape = f"ced-{a.ced_size}"
        llms = {}
        with tempfile.TemporaryDirectory(prefix="deepinfer-gpu-bench-ced-") as d:
            write_model_dir(Path(d), cfg)
            try:
                builds = {}
                for mode in ("bounded", "exact"):
                    t0 = time.perf_counter()
                    llms[mode], in_dtype = build_llm(Path(d), a, cfg, hf_overrides={"replay_mode": mode}, **kw)
                    builds[mode] = time.perf_counter() - t0
                vocab = llms["bounded"].engine.model.vocab_size
                if a.gc_freeze:
                    gc.collect()
                    gc.freeze()
                ws = weight_stats(llms["bounded"].engine.model, cfg)
                bases = {m: {"phase": "ced", **self._settings(llms[m], shape, cfg, ws, builds[m], in_dtype),
                             "replay_mode": m, "n_win": cfg["n_win"]} for m in llms}
                print(f"   {shape}: {ws['params_total'] / 1e9:.3f} B parameters, backend "
                      f"{llms['bounded'].backend_name}", flush=True)
                self._ced_cache_rows(llms["bounded"], bases["bounded"])
                for m in llms:
                    warm(llms[m], vocab, B=1, in_len=min(64, max_len - 8), out_len=2)
                best: dict = {}
                prev = None  # (length, slowest mode's seconds)
                reserve = 0.3 * phase.share if a.ced_batches else 0.0  # prefill leaves this much to decode
                for n in lengths:
                    pred = None if prev is None else 2 * prev[1] * (n / prev[0]) ** 1.5
                    left = phase.left() - reserve
                    if left < 2.0 or (pred is not None and left < 1.2 * pred):
                        self.emit({**bases["bounded"], "measurement": "ced_prefill", "prompt_len": n, "skipped": True,
                                   "reason": f"budget: {phase.left():.1f} s left, predicted {pred or 0:.1f} s"})
                        continue
                    rng = torch.Generator().manual_seed(a.seed + n)
                    prompt = torch.randint(0, vocab, (n,), generator=rng).tolist()
                    times = {m: [] for m in llms}
                    gcs = {m: [] for m in llms}

                    def repeats(prompt=prompt, times=times, gcs=gcs):
                        for m in llms:  # untimed: the first prefill of a length compiles its kernels
                            self._ced_prefill(llms[m], prompt)
                        for rep in range(a.ced_repeats):
                            if rep and phase.left() - reserve < 1.2 * sum(statistics.median(t) for t in times.values()):
                                break
                            for m in (("bounded", "exact") if rep % 2 == 0 else ("exact", "bounded")):
                                times[m].append(self._ced_prefill(llms[m], prompt))
                                gcs[m].append(Runner.gc_seconds[-1])
                        return True

                    row = {**bases["bounded"], "measurement": "ced_prefill", "prompt_len": n, "batch": 1}
                    if self.attempt(row, repeats) is None or not all(times.values()):
                        continue
                    for m in llms:
                        model = llms[m].engine.model
                        c = model.counters
                        med = statistics.median(times[m])
                        best[m, n] = med
                        roof = {**ced_prefill_flops(model, c), "attention_flops_counted": True}
                        rate = self.ceil.get("matmul_flop_per_s")
                        if rate:
                            roof["floor_s"] = roof["flops"] / rate
                            roof["roofline_tok_s"] = n / roof["floor_s"]
                            roof["fraction_of_roofline"] = roof["floor_s"] / med
                            # the weights alone, as rows before issue 12 counted (attention and indexer left out)
                            roof["fraction_of_roofline_weights_only"] = roof["weight_flops"] / rate / med
                        self.emit({**bases[m], "measurement": "ced_prefill", "prompt_len": n, "batch": 1,
                                   "batch_tokens": n, "prefill_s": med, "prefill_s_all": times[m],
                                   "prefill_tok_s": n / med, "ttft_s": med, "encoder_tokens": c["layer_tokens"][0],
                                   "decoder_tokens": c["layer_tokens"][-1], "layer_tokens": list(c["layer_tokens"]),
                                   "gc_s_all": gcs[m], **pass_graph_stats(llms[m]), **roof, **memory_gib(a.device)})
                    ratio = best["exact", n] / best["bounded", n]
                    per_rep = [e / b for e, b in zip(times["exact"], times["bounded"])]
                    self.emit({**bases["bounded"], "measurement": "ced_prefill_ratio", "prompt_len": n,
                               "exact_s": best["exact", n], "bounded_s": best["bounded", n],
                               "exact_over_bounded": ratio, "ratio_per_repeat": per_rep,
                               "predicted_ratio_long_prompts": cfg["num_layers"] / cfg["num_encoder_layers"]})
                    prev = (n, max(best["exact", n], best["bounded", n]))
                # decode, bounded mode (the default)
                del llms["exact"]
                free_memory(a.device)
                llm = llms["bounded"]
                last = None
                for B in a.ced_batches:
                    if phase.left() < 2.0 or (last and not phase.fits(min(last[1] * B / last[0], a.max_measure_s))):
                        self.emit({**bases["bounded"], "measurement": "decode", "batch": B, "skipped": True,
                                   "reason": f"budget: {phase.left():.1f} s left in phase ced"})
                        continue
                    def one(B=B):
                        if not a.no_warmup_each:
                            warm(llm, vocab, B=B, in_len=a.input_len, out_len=3)
                        stop = min(phase.deadline, time.perf_counter() + a.max_measure_s)
                        return measure_decode(llm, B, a.input_len, a.output_len, stop, a.seed, vocab)

                    r = self.attempt({**bases["bounded"], "measurement": "decode", "batch": B}, one)
                    if r is None:
                        continue
                    last = (B, r["wall_s"])
                    self.emit({**bases["bounded"], "measurement": "decode", **r,
                               **self._ced_decode_roofline(llm, ws, cfg, r), **memory_gib(a.device)})
            finally:
                for m in list(llms):
                    llms[m].engine.kv_cache = None
                llms.clear()
                free_memory(a.device)

    def _ced_decode_roofline(self, llm, ws: dict, cfg: dict, r: dict) -> dict:
        """decode_roofline with CED's reads: the routed experts the decode steps touched (ExpertLoad) and the
        caches as ced_decode_cache_bytes counts them, at the measurement's mean context, for the whole batch."""
        a, B = self.args, r["batch"]
        model = llm.engine.model
        c = model.config
        ctx = r.get("ctx_mean", a.input_len + a.output_len / 2)
        dtype_bytes = next(model.parameters()).element_size()
        cache = ced_decode_cache_bytes(c, ctx, dtype_bytes)
        touched = experts_touched(model.expert_load, r.get("decode_steps") or 0)
        roof = decode_roofline(ws, cfg, B, ctx, llm.engine.kv_bytes_per_token, self.ceil,
                               cache_bytes=B * cache["total"], experts_touched=touched)
        roof.update({f"cache_{k}_bytes_per_step": B * v for k, v in cache.items() if k != "total"},
                    experts_touched_per_layer=touched,
                    kv_read_model="ced_decode_cache_bytes: SWA window + selected entries + indexer keys scored")
        if r.get("decode_tok_s") and roof.get("roofline_tok_s"):
            roof["fraction_of_roofline"] = r["decode_tok_s"] / roof["roofline_tok_s"]
            roof["fraction_of_hbm_roofline"] = r["decode_tok_s"] / roof["hbm_roofline_tok_s"]
        return roof

    def _ced_cache_rows(self, llm, base: dict) -> None:
        """One row per CED cache: bytes per token (and per sequence) as the engine allocated them, beside
        ced_cache_formula, and their ratio (per sequence for the per-sequence caches, else per token); then the
        paged total beside the engine's own kv_bytes_per_token."""
        eng = llm.engine
        c = eng.model.config
        dtype_bytes = next(eng.model.parameters()).element_size()
        spec, got = ced_cache_formula(c, dtype_bytes), ced_cache_engine(eng.kv_cache)
        for name in CED_CACHES:
            f, g = spec[name], got[name]
            per = "bytes_per_seq" if f["bytes_per_seq"] is not None else "bytes_per_token"  # what memory it takes
            self.emit({**base, "measurement": "ced_cache_bytes", "cache": name, "format": f["format"],
                       "layers": f["layers"], "engine_layers": g["layers"],
                       "engine_bytes_per_token": g["bytes_per_token"], "formula_bytes_per_token": f["bytes_per_token"],
                       "engine_bytes_per_seq": g["bytes_per_seq"], "formula_bytes_per_seq": f["bytes_per_seq"],
                       "engine_slots_per_seq": g["slots_per_seq"], "formula_slots_per_seq": f["slots_per_seq"],
                       "engine_seq_rows": g["seq_rows"], "engine_alloc_bytes": g["alloc_bytes"],
                       "engine_over_formula": g[per] / f[per] if f[per] else None, "ratio_of": per})
        paged = spec["global_kv"]["bytes_per_token"] + spec["indexer_k"]["bytes_per_token"]
        self.emit({**base, "measurement": "ced_cache_bytes", "cache": "paged_total", "format": "global_kv + indexer_k",
                   "engine_bytes_per_token": got["global_kv"]["bytes_per_token"] + got["indexer_k"]["bytes_per_token"],
                   "formula_bytes_per_token": paged, "engine_reported_bytes_per_token": eng.kv_bytes_per_token,
                   "engine_over_formula": (got["global_kv"]["bytes_per_token"] + got["indexer_k"]["bytes_per_token"])
                   / paged if paged else None})

    gc_seconds: list = []  # Python's garbage collection inside each timed CED prefill (GcClock), in order

    @staticmethod
    def _ced_prefill(llm, prompt: list) -> float:
        from deepinfer import SamplingParams

        llm.engine.model.reset_counters()
        gc.collect()
        with GcClock() as clock:
            t0 = time.perf_counter()
            outs = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1, ignore_eos=True,
                                                                               temperature=0.0), use_tqdm=False)
            dt = time.perf_counter() - t0
        Runner.gc_seconds.append(clock.seconds)
        if outs[0].error:
            raise RuntimeError(f"CED prefill failed: {outs[0].error}")
        return dt


# --- output --------------------------------------------------------------------------------------------------

def _f(v, fmt="{:.1f}") -> str:
    if v is None or (isinstance(v, float) and v != v):
        return "-"
    return fmt.format(v)


def one_line(r: dict) -> str:
    keys = ("phase", "measurement", "engine", "model", "batch", "batch_tokens", "prompt_len", "replay_mode",
            "decode_tok_s", "per_user_tok_s", "ttft_mean_s", "prefill_tok_s", "prefill_s", "exact_over_bounded",
            "roofline_tok_s", "fraction_of_roofline", "gb_s", "tflop_s", "cache", "engine_bytes_per_token",
            "formula_bytes_per_token", "truncated", "skipped", "error")
    parts = []
    for k in keys:
        v = r.get(k)
        if v is None or v is False:
            continue
        parts.append(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}")
    return " ".join(parts)


def summary_table(rows: list) -> str:
    """Markdown tables: one line per measured row (decode, prefill, CED ratio, rooflines); then the CED caches."""
    head = ["phase", "engine", "model", "what", "batch", "tokens", "tok/s", "per-user tok/s", "TTFT ms",
            "roofline tok/s", "% roofline", "note"]
    body = []
    for r in rows:
        m = r.get("measurement")
        if m == "ced_cache_bytes":
            continue  # their own table below
        note = "skipped: " + r.get("reason", "") if r.get("skipped") else r.get("error") or ""
        if r.get("truncated"):
            note = (note + " truncated").strip()
        if m == "copy_bandwidth":
            body.append([r["phase"], "-", "-", "copy GB/s", "-",
                         _f(r.get("bytes_read_plus_written") and r["bytes_read_plus_written"] / 1e9, "{:.3g} GB"),
                         _f(r.get("gb_s")), "-", "-", "-", "-", note])
        elif m == "matmul":
            body.append([r["phase"], "-", "-", f"{r.get('dtype')} matmul TFLOP/s", "-", f"{r.get('n')}^3",
                         _f(r.get("tflop_s")), "-", "-", "-", "-", note])
        elif m == "decode":
            toks = f"{r.get('input_len', '?')}/{r.get('output_len', '?')}" if r.get("input_len") else "-"
            body.append([r["phase"], str(r.get("engine", "-")), str(r.get("model", "-")), "decode",
                         str(r.get("batch", "-")), toks, _f(r.get("decode_tok_s")), _f(r.get("per_user_tok_s")),
                         _f(r.get("ttft_mean_s") and 1e3 * r["ttft_mean_s"]), _f(r.get("roofline_tok_s")),
                         _f(r.get("fraction_of_roofline") and 100 * r["fraction_of_roofline"]), note])
        elif m in ("prefill", "ced_prefill"):
            what = "prefill" + (f" ({r['replay_mode']})" if r.get("replay_mode") else "")
            body.append([r["phase"], str(r.get("engine", "-")), str(r.get("model", "-")), what,
                         str(r.get("batch", "-")), str(r.get("batch_tokens") or r.get("prompt_len", "-")),
                         _f(r.get("prefill_tok_s")), "-", _f(r.get("ttft_s") and 1e3 * r["ttft_s"]),
                         _f(r.get("roofline_tok_s")),
                         _f(r.get("fraction_of_roofline") and 100 * r["fraction_of_roofline"]), note])
        elif m == "deepinfer_over_hf":
            body.append([r["phase"], "deepinfer / hf", str(r.get("model", "-")), "decode tok/s ratio",
                         str(r.get("batch")), f"{r.get('input_len', '?')}/{r.get('output_len', '?')}",
                         _f(r.get("decode_tok_s_ratio"), "{:.2f}x"), "-", _f(r.get("ttft_ratio"), "{:.2f}x"), "-", "-",
                         f"output tok/s ratio {_f(r.get('output_tok_s_ratio'), '{:.2f}x')}"])
        elif m == "ced_prefill_ratio":
            body.append([r["phase"], "deepinfer", str(r.get("model", "-")), "exact / bounded prefill", "1",
                         str(r.get("prompt_len")), _f(r.get("exact_over_bounded"), "{:.2f}x"), "-", "-", "-", "-",
                         f"exact {_f(r.get('exact_s'), '{:.3f}')} s, bounded {_f(r.get('bounded_s'), '{:.3f}')} s"])
        else:  # skipped / stopped / error rows of a whole phase
            body.append([r.get("phase", "-"), "-", "-", m or "-", "-", "-", "-", "-", "-", "-", "-", note[:120]])
    caches = [r for r in rows if r.get("measurement") == "ced_cache_bytes"]
    if not body and not caches:
        return "(no rows)"
    out = [_markdown(head, body)] if body else []
    if caches:
        out.append(_markdown(
            ["CED cache", "format", "layers", "engine B/token", "CED.md B/token", "engine B/seq", "CED.md B/seq",
             "slots engine / CED.md", "engine / CED.md"],
            [[r["cache"], str(r.get("format")), ",".join(map(str, r.get("layers") or [])) or "-",
              _f(r.get("engine_bytes_per_token"), "{:.2f}"), _f(r.get("formula_bytes_per_token"), "{:.2f}"),
              _f(r.get("engine_bytes_per_seq"), "{:.0f}"), _f(r.get("formula_bytes_per_seq"), "{:.0f}"),
              f"{_f(r.get('engine_slots_per_seq'), '{}')} / {_f(r.get('formula_slots_per_seq'), '{}')}",
              _f(r.get("engine_over_formula"), "{:.3f}")] for r in caches]))
    return "\n\n".join(out)


def _markdown(head: list, body: list) -> str:
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(head), sep] + [line(b) for b in body])


# --- command line --------------------------------------------------------------------------------------------

def parse_args(argv=None):
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--tiny", action="store_true")
    tiny = pre.parse_known_args(argv)[0].tiny
    d = defaults(tiny)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ints = dict(type=int, nargs="+")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU, a few tokens (smoke test)")
    ap.add_argument("--out", default="gpu_bench.jsonl", help="JSONL file to append rows to ('' = none)")
    ap.add_argument("--budget-s", type=float, default=380.0, help="total seconds, counted from process start")
    ap.add_argument("--grace-s", type=float, default=15.0, help="a phase's hard stop comes this long after its share")
    ap.add_argument("--phases", default=",".join(PHASES), help=f"comma-separated subset of {','.join(PHASES)}")
    ap.add_argument("--device", default=d["device"], help="default: cuda when available, else cpu")
    ap.add_argument("--dtype", default=d["dtype"], choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--backend", default=None, help="DeepInfer backend (default: the device's, as LLM() picks)")
    ap.add_argument("--block-size", type=int, default=None, help="KV block size (default: the engine's)")
    ap.add_argument("--build-in-dtype", default="auto", choices=["auto", "always", "never"],
                    help="build parameters directly in --dtype (auto: when a float32 build would not fit)")
    ap.add_argument("--llama-shape", default=d["llama_shape"], choices=sorted(SHAPES))
    ap.add_argument("--moe-shape", default=d["moe_shape"], choices=sorted(SHAPES))
    ap.add_argument("--ced-size", default=d["ced_size"])
    ap.add_argument("--batches", default=d["batches"], **ints)
    ap.add_argument("--input-len", type=int, default=d["input_len"])
    ap.add_argument("--output-len", type=int, default=d["output_len"])
    ap.add_argument("--prefill-tokens", default=d["prefill_tokens"], **ints, help="batch tokens per prefill")
    ap.add_argument("--prefill-prompt-len", type=int, default=d["prefill_prompt_len"])
    ap.add_argument("--prefill-repeats", type=int, default=3)
    ap.add_argument("--hf-batches", default=d["hf_batches"], **ints)
    ap.add_argument("--moe-batches", default=d["moe_batches"], **ints)
    ap.add_argument("--moe-prefill-tokens", default=d["moe_prefill_tokens"], type=int, nargs="*")
    ap.add_argument("--ced-prefill-tokens", default=d["ced_prefill_tokens"], **ints)
    ap.add_argument("--ced-batches", default=d["ced_batches"], type=int, nargs="*",
                    help="CED decode batch sizes (none: the ced phase measures prefill only)")
    ap.add_argument("--gc-freeze", action="store_true",
                    help="phase ced: gc.freeze() once its engines are built (their objects out of the collector's "
                         "walks, as a one-engine server could do); each prefill's GC time is in its row either way")
    ap.add_argument("--ced-repeats", type=int, default=2)
    ap.add_argument("--max-measure-s", type=float, default=d["max_measure_s"],
                    help="a decode measurement stops (truncated) after this many seconds")
    ap.add_argument("--no-warmup-each", action="store_true", help="skip the short warm-up before each batch size")
    ap.add_argument("--copy-mib", type=int, default=d["copy_mib"])
    ap.add_argument("--matmul-n", type=int, default=d["matmul_n"])
    ap.add_argument("--repeats", type=int, default=d["repeats"], help="timed repeats of the roofline kernels")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    ap.add_argument("--commit", default=None, help="git commit to record (default: git rev-parse, if a repo)")
    args = ap.parse_args(argv)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    args.phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    bad = [p for p in args.phases if p not in PHASES]
    if bad:
        ap.error(f"unknown phase(s) {bad}; expected a subset of {PHASES}")
    return args


def main(argv=None) -> int:
    global _T0
    if argv is not None:  # called in-process (tests): the budget counts from here
        _T0 = time.perf_counter()
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    print("gpu_bench: " + " ".join(sys.argv if argv is None else ["gpu_bench.py", *argv]), flush=True)
    print(f"device {args.device} ({torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU'}), "
          f"dtype {args.dtype}, torch {torch.__version__}, budget {args.budget_s:.0f} s, phases {args.phases}",
          flush=True)
    return Runner(args).run()


if __name__ == "__main__":
    sys.exit(main())

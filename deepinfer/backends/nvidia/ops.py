"""NvidiaOps: the reference backend with its hot ops replaced by Triton kernels.

A kernel runs when its inputs are CUDA tensors (or CPU tensors while the kernels were built for Triton's
interpreter, TRITON_INTERPRET=1) and it supports their dtype and shape; otherwise the reference op
runs, so every call gives the reference's function. Decode attention (one query per row, paged KV with
a block table) runs the Triton decode kernel; every other paged step (prefill chunks with or without a
cached prefix, mixed prefill/decode batches) runs the Triton flash-attention prefill kernel over the same
block table, given the metadata's cu_q/max_q.
"""

from __future__ import annotations

import collections
from functools import partial
from typing import Optional

import torch

from ...pair_sum import PairSum, dense
from ..base import AttnMetadata
from ..reference import lowbit
from ..reference.ops import ReferenceOps
from . import kernel_choice, triton_act, triton_attention, triton_gemv, triton_kvquant, triton_norm, triton_splitk
from . import triton_router_logits

INTERPRET = triton_norm.INTERPRET  # the kernels were decorated for the interpreter (decided at import)


def kernel_device_ok(*tensors: torch.Tensor) -> bool:
    """All tensors are where the kernels can run: CUDA, or the CPU under the interpreter."""
    for t in tensors:  # (is_cuda / is_cpu: a tenth of the time of building t.device, ~200 calls a prefill pass)
        if t is None or t.is_cuda or (INTERPRET and t.is_cpu):
            continue
        return False
    return True


INVARIANT_MOE_BLOCK_M = 16  # batch-invariant mode: the fused MoE's one M-block size (its K step follows from it)
# CED's router: up to this many tokens the gate GEMV runs inside the router kernel, past it cuBLAS's GEMV then the
# router kernel on the logits. benchmarks/ced_route_bench.py on the H200 (bench shape): cuBLAS + router faster at
# every count, 7.9 vs 13.8 us at 1 token, 1.1-1.2x from 8 to 256; so 0 (the in-kernel GEMV stays, tested, unused)
CED_ROUTE_GEMV_MAX_ROWS = 0
# CED's router logits (x.float() @ gate.T, gate float32) by triton_gemv's kernel up to this many rows (its
# tensor-core variant past triton_gemv.MAX_ROWS, at most DOT_ROWS): one launch where cuBLAS's float32 path takes
# three at one row (x's cast, the dot and its reduction) and a cast and a SIMT float32 GEMM at more.
# benchmarks/gemv_bench.py's router rows on the H200 (14th session; 32 x 2048, 16 calls a step): cuBLAS / kernel
# 93.4 / 26.4 us a step at 1 row, 151.0 / 34.0 at 2, 151.1 / 46.9 at 4, 159.4 / 75.1 at 8; the tensor-core variant
# 677 at 16 (its 16-row MMA tiles leave a 32-wide output a handful of programs). So 8: the CUDA-core kernel only.
CED_ROUTE_LOGITS_GEMV_MAX_ROWS = 8
# Past that and up to this many rows the logits take triton_splitk (the float32 gate as three exact bf16 terms on
# the tensor cores: one launch where x's cast and a SIMT float32 GEMM ran), with these knobs. gemv_bench's router
# "splitk" rows on the H200 (19th session, docs/benchmarks.md), us a step (16 layers) cuBLAS / splitk: 153 / 53 at 4
# rows, 161 / 54 at 16, 166 / 84 at 32, 171 / 136 at 64; 0 keeps cuBLAS.
CED_ROUTE_LOGITS_SPLITK_MAX_ROWS = 64
CED_ROUTE_LOGITS_SPLITK_KNOBS = dict(block_n=32)  # 32 experts: one column tile, more K splits fill the GPU
# Past that (prefill sizes), the logits in one launch (triton_router_logits: x read once as bf16, the float32 gate as
# three exact bf16 terms on the tensor cores) instead of x's float32 cast and cuBLAS's float32 GEMM on the CUDA
# cores (~1.5 ms of the 16K bounded prefill on the H100, 32nd session's profile). On since the 33rd session: the
# kernel 0.67 ms over 8 calls where the cast and the SIMT GEMM took 0.88 + 0.74 (H100); with the indexer's key
# table (triton_ced_scores.TABLE) the 16K bounded prefill 71.3 / 70.2 ms against 73.6 / 74.1, alternating.
CED_ROUTE_LOGITS_TILED = True
# Epilogues that save a launch a layer each, tested, shipped off: the router on its logits product's last program
# (triton_ced_route.Tail, the GEMV and split-K logits above), CED's query RoPE on W_q_b's GEMV (Ops.ced_linear_rope),
# the residual add + FFN norm on W_o_b's last program (Ops.ced_linear_add_rms). The three on against 0d6fa03's path
# (H100, 23rd session, profile_decode graph replay, two alternating runs each): batch 1 1.356 / 1.352 against
# 1.323 / 1.325 ms, 16 2.964 / 2.963 against 2.963 / 2.956, 64 3.680 / 3.676 against 3.628 / 3.633: 48 fewer
# launches a batch-1 step, yet slower. Under PDL a launch's overhead is mostly hidden already; what a small kernel
# costs is its serial latency (read, reduce, write), which a tail keeps on the critical path and adds a ticket to
# every program of the product (1024 of them for W_o_b at one row). profile_decode --knob turns each on for an A/B.
CED_ROUTE_TAIL = False
CED_QUERY_ROPE_GEMV = False
CED_OUT_ADD_RMS_GEMV = False
# The query latent's RMSNorm in W_q_b's GEMV prologue (Ops.ced_query: each program sums its rows' squares, then
# normalises them as it reads them; where the layer keeps no cq, i.e. has no indexer): a serial step off the chain
# rather than into a tail. Off: on the H100 (24th session) no faster (replay 1.323 against 1.313 ms at batch 1,
# 2.915 / 2.924 at 16), the GEMV now waiting for the squares' sum before its first weight load.
CED_QUERY_NORM_GEMV = False
# The routed experts of a few tokens: up to this many (token, expert) pairs triton_moe_pairs.pair_experts (a GEMV
# per pair, two launches) instead of fused_experts (sort by expert, two GEMMs, k-sum: five). Never in batch-invariant
# mode (fused_experts' one M-block size there). benchmarks/moe_pairs_bench.py on the H200 (bench shape: 32 experts,
# top-4, d 2048, F 512; 13th session, after the pair kernels took GEMV-sized tiles): bf16 pairs / fused 0.63 / 0.67 /
# 0.89 / 0.98 / 1.33 at 1 / 2 / 4 / 8 / 16 tokens (15.8 against 25.3 us at one), so 16 pairs (4 tokens of top-4);
# FP8 weights (128-wide K steps for their scales) 1.55 / 1.26 at 1 / 2 tokens, 0.85-0.97 from 4 to 16: too uneven
# to take at a few tokens, so 0 for them.
MOE_PAIRS_MAX = 16
MOE_PAIRS_MAX_FP8 = 0
# A shared expert on the pair kernels (moe_experts_shared: two launches for routed + shared where five ran).
# benchmarks/moe_pairs_bench.py --shared on the H200 (14th session, bench shape): 17.4 against 21.1 us at one token,
# 24.7 / 30.1 at 2, 38.9 / 46.0 at 4 (0.82-0.85x). Shipped off in the 14th session: three GPU twin-run tests parted
# with it on. Their cause (15th session, scripts/diag_shared_pairs.py on the H200: every eager call as accurate
# against a float64 oracle as the unfused path): those tests run bf16 on the GPU, and the kernel rounded the routed
# and shared sums once where the unfused path rounds each and then their sum, so a prefix hit's few-token suffix
# (pairs) and a cold prefill (fused_experts, shared apart) parted by a bf16 rounding. The kernel now rounds as the
# unfused path does (triton_moe_pairs' module doc), bit-equal to it but for float32 sums' order.
MOE_SHARED_ON_PAIRS = True
# The fused MoE's k-sum taken by the next add + RMSNorm kernel (moe_experts_pairs, pair_sum.PairSum): the same bits,
# one [T, d] write and read a layer fewer (a 16K prefill's 8 encoder layers: ~128 MB each) and one launch.
MOE_KSUM_IN_NORM = True
# Projections (ops.linear, grouped_linear) of up to this many rows run triton_gemv's GEMV kernel instead of cuBLAS.
# benchmarks/gemv_bench.py at the CED bench config's 9 projections on the H200, a step's total (13th session: at one
# row faster at all 9 shapes, 3.4 against cuBLAS's 13.2 us at 1024 x 2048); 14th session, shipped knobs, cuBLAS /
# kernel us a step: 1043 / 603 at 1 row, 1019 / 802 at 2, 906 / 1149 at 4, 815 / 2081 at 8. So 2.
GEMV_MAX_ROWS = 2
# Past GEMV_MAX_ROWS and up to this many rows, the kernel's tensor-core variant (triton_gemv dot=True: rows padded to
# 16, 32 or 64; up to triton_gemv.DOT_ROWS). The same bench, cuBLAS / variant us a step: 906 / 854 at 4 rows, 815 /
# 879 at 8, 822 / 839 at 16 (it wins at the narrow projections, 5.1 against 5.9-12.0 us at 1024 x 2048, and loses at
# 8192 x 1024). So 4. Those were isolated calls; in a step the variant keeps the PDL overlap cuBLAS's kernels break
# (25th session: 16 and 64 queued for a decode-step A/B, profile_decode --knob GEMV_DOT_MAX_ROWS=64).
GEMV_DOT_MAX_ROWS = 4
# Past the GEMV kernels' rows and up to this many, projections run triton_splitk (K split over programs, rows padded
# to an MMA's) instead of cuBLAS. benchmarks/gemv_bench.py's "splitk" rows on the H200 (19th session), us a step at
# the bench projections, cuBLAS / best split-K knobs: 891 / 873 at 4 rows (inside GEMV_DOT_MAX_ROWS anyway),
# 803 / 906 at 8, 809 / 990 at 16, 829 / 1138 at 32, 845 / 1420 at 64: cuBLAS's nvjet tiles stream the weights
# faster (its best split-K reaches ~2.3 TB/s). So 0: the kernel stays for the router's float32 gate below.
SPLITK_MAX_ROWS = 0
# triton_splitk's ``swap`` for those projections (the weight tile as wgmma's M side instead of the rows as
# mma.sync's). Off: on the H100 (25th session, profile_decode graph replay with SPLITK_MAX_ROWS=64) 2.972 / 4.360 ms
# at batch 16 / 64 swapped, 2.974 / 4.271 unswapped, 2.911 / ~3.6 on cuBLAS; gemv_bench's step totals at 16 / 64 rows,
# cuBLAS 910 / 951 us against the best split-K knobs' 1201 / 1912.
SPLITK_SWAP = False
# A prefill pass's FP4 entries decoded once to bf16 for its CED attention (Ops.ced_entry_table) where its queries
# read at least ENTRY_TABLE_READS times as many entries as the table holds and the table fits ENTRY_TABLE_MAX_BYTES:
# the attention kernel then loads bf16 rows instead of decoding FP4 per query (the same bits). On: the 16K bounded
# prefill's CED attention 33.4 -> 28.7 ms, wall 84.2 -> 77.1 ms (H100, 28th session, docs/benchmarks.md).
ENTRY_TABLE = True
ENTRY_TABLE_READS = 8
ENTRY_TABLE_MAX_BYTES = 64 << 20
INVARIANT_CED_SPLIT_TILES = 4  # batch-invariant mode: key tiles per split of the CED attention kernel


def invariant_ced_splits(q, entries, entry_slots, window: int) -> int:
    """The CED attention kernel's split count from a fixed split size (INVARIANT_CED_SPLIT_TILES key tiles):
    it depends on the layer's window and top-K only, never on the number of queries."""
    from . import triton_ced_attention as tca

    bn = tca.launch_config(q.shape[1], q.shape[2], q.dtype)["BLOCK_N"]
    K = entry_slots.shape[1] if entries is not None else 0
    tiles = max(-(-window // bn), -(-K // bn))
    return max(1, min(16, -(-tiles // INVARIANT_CED_SPLIT_TILES)))


class NvidiaOps(ReferenceOps):
    name = "nvidia"
    moe_capture_safe = True  # routed moe_experts runs the fused kernel: no host sync (CUDA graphs may hold it)

    def __init__(self, device="cuda"):
        device = torch.device(device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("the nvidia backend was asked for a CUDA device, but CUDA is not available")
        if device.type != "cuda" and not (INTERPRET and device.type == "cpu"):
            raise ValueError(f"the nvidia backend runs on CUDA devices (or on the CPU with TRITON_INTERPRET=1 set "
                             f"before deepinfer.backends.nvidia.ops is imported); got device {str(device)!r}")
        super().__init__(device)
        # Kernel launches by op (Python calls; CUDA-graph replays are not counted), so tests and benchmarks
        # can confirm that the fast path ran.
        self.kernel_calls = collections.Counter()

    # Projections.
    def linear(self, x, w):
        """The GEMV kernel (triton_gemv) up to GEMV_MAX_ROWS rows, its tensor-core variant up to GEMV_DOT_MAX_ROWS,
        the split-K kernel (triton_splitk) up to SPLITK_MAX_ROWS, cuBLAS's GEMM past them and in batch-invariant
        mode (whose matmul override keeps a row's reduction independent of the other rows)."""
        if x.dim() == 2 and w.dim() == 2:
            dot = self._gemv_route(x, w)
            if dot is not None and triton_gemv.supports(x[:, None, :], w[None], dot):
                self.kernel_calls["gemv"] += 1
                return triton_gemv.linear(x, w, dot=dot)
            if self._splitk_route(x, w) and triton_splitk.supports(x[:, None, :], w[None]):
                self.kernel_calls["splitk"] += 1
                return triton_splitk.linear(x, w, swap=SPLITK_SWAP and x.dtype == w.dtype)
        return super().linear(x, w)

    def grouped_linear(self, x, w):
        dot = self._gemv_route(x, w)
        if dot is not None and triton_gemv.supports(x, w, dot):
            self.kernel_calls["gemv"] += 1
            return triton_gemv.grouped_gemv(x, w, dot=dot)
        if self._splitk_route(x, w) and triton_splitk.supports(x, w):
            self.kernel_calls["splitk"] += 1
            return triton_splitk.grouped_splitk(x, w, swap=SPLITK_SWAP and x.dtype == w.dtype)
        if self._own_product(x, w) and x.dim() == 3 and w.dim() == 3 and x.shape[1] == w.shape[0] \
                and x.shape[2] == w.shape[2] and x.stride(2) == 1:
            # cuBLAS's batched GEMM reads x [T, G, K] and writes [T, G, N] in place through strides: einsum's
            # permuted result made the caller's flatten a copy kernel a layer (0.73 ms of a 4K prefill's 20)
            self.kernel_calls["grouped_bmm"] += 1
            out = torch.empty(x.shape[0], x.shape[1], w.shape[1], dtype=x.dtype, device=x.device)
            torch.bmm(x.transpose(0, 1), w.transpose(1, 2), out=out.transpose(0, 1))
            return out
        return super().grouped_linear(x, w)

    def _own_product(self, x, w) -> bool:
        """A product this backend may run its own way: one dtype (F.linear's contract), where the kernels run, no
        autograd, not in batch-invariant mode (whose matmul override owns every product)."""
        return not self.batch_invariant and x.dtype == w.dtype and kernel_device_ok(x, w) \
            and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))

    def _gemv_route(self, x, w):
        """None (cuBLAS), False (the GEMV kernel) or True (its tensor-core variant) for x's row count, where
        _own_product allows (the kernel itself takes mixed dtypes)."""
        rows = x.shape[0]
        if not (0 < rows <= max(GEMV_MAX_ROWS, GEMV_DOT_MAX_ROWS) and self._own_product(x, w)):
            return None
        return rows > GEMV_MAX_ROWS

    def _splitk_route(self, x, w) -> bool:
        """Whether x's rows are past the GEMV kernels' and within SPLITK_MAX_ROWS, where _own_product allows."""
        return max(GEMV_MAX_ROWS, GEMV_DOT_MAX_ROWS) < x.shape[0] <= SPLITK_MAX_ROWS and self._own_product(x, w)

    # Norms and activations.
    def rms_norm(self, x, weight, eps):
        if kernel_device_ok(x, weight) and triton_norm.supports(x, weight):
            self.kernel_calls["rms_norm"] += 1
            return triton_norm.rms_norm(x, weight, eps)
        return super().rms_norm(x, weight, eps)

    def add_rms_norm(self, x, residual, weight, eps):
        if kernel_device_ok(x, residual, weight) and triton_norm.supports(x, weight, residual):
            self.kernel_calls["add_rms_norm"] += 1
            return triton_norm.add_rms_norm(x, residual, weight, eps)
        return super().add_rms_norm(x, residual, weight, eps)

    def silu_and_mul(self, x):
        if kernel_device_ok(x) and triton_act.supports(x):
            self.kernel_calls["silu_and_mul"] += 1
            return triton_act.silu_and_mul(x)
        return super().silu_and_mul(x)

    # Mixture of experts.
    def moe_route(self, router_logits, top_k, **kw):
        """CED's router (sqrt-softplus scores, no expert groups) in one kernel (triton_ced_route); any other
        router is the reference's."""
        from . import triton_ced_route as tcr

        scoring, bias = kw.get("scoring", "softmax"), kw.get("bias")
        if kernel_device_ok(router_logits, bias) and tcr.supports(router_logits, top_k, scoring, kw.get("n_group"),
                                                                  bias) \
                and set(kw) <= {"scoring", "renormalize", "scaling", "bias", "n_group", "topk_group"}:
            self.kernel_calls["moe_route"] += 1
            return tcr.route(router_logits, top_k, renormalize=kw.get("renormalize", True),
                             scaling=kw.get("scaling", 1.0), bias=bias)
        return super().moe_route(router_logits, top_k, **kw)

    def moe_experts(self, x, w13, w2, weights, ids, *, clamp=None, impl="routed", w13_scale=None, w2_scale=None):
        """impl "routed" runs the fused Triton MoE (no host sync, CUDA-graph safe; up to MOE_PAIRS_MAX (token,
        expert) pairs, MOE_PAIRS_MAX_FP8 with FP8 weights, the two-launch pair kernel, same contract), FP8
        block-scaled weights included (w8a16: tiles widened to x's dtype in registers, block products scaled). It
        does not range-check ids (that would sync): an id outside [0, E) is the router's bug and its pair contributes
        zero; the reference path ("dense", or any input the kernel does not support) raises on it."""
        from . import triton_moe  # imported on first use, like the reference's moe module

        scales = dict(w13_scale=w13_scale, w2_scale=w2_scale)
        kernel = self._moe_kernel(x, w13, w2, weights, ids, impl, scales)
        if kernel == "pairs":
            from . import triton_moe_pairs

            self.kernel_calls["moe_pairs"] += 1
            return triton_moe_pairs.pair_experts(x, w13, w2, weights, ids, clamp=clamp, **scales)
        if kernel == "fused":
            self.kernel_calls["fused_moe"] += 1
            # Batch-invariant: one M-block size (and so one K step) whatever the number of tokens.
            block_m = INVARIANT_MOE_BLOCK_M if self.batch_invariant else None
            return triton_moe.fused_experts(x, w13, w2, weights, ids, clamp=clamp, block_m=block_m, **scales)
        return super().moe_experts(x, w13, w2, weights, ids, clamp=clamp, impl=impl, **scales)

    def _moe_kernel(self, x, w13, w2, weights, ids, impl, scales) -> Optional[str]:
        """Which kernel moe_experts takes: "pairs" (the two-launch pair kernels), "fused" or None (reference)."""
        from . import triton_moe

        if impl != "routed" or not kernel_device_ok(x, w13, w2, weights, ids, *scales.values()):
            return None
        most = MOE_PAIRS_MAX_FP8 if scales["w13_scale"] is not None else MOE_PAIRS_MAX
        if not self.batch_invariant and ids.numel() <= most:
            from . import triton_moe_pairs

            if triton_moe_pairs.supports(x, w13, w2, weights, ids, **scales):
                return "pairs"
        return "fused" if triton_moe.supports(x, w13, w2, weights, ids, **scales) else None

    def moe_experts_pairs(self, x, w13, w2, weights, ids, *, clamp=None, w13_scale=None, w2_scale=None):
        """Where moe_experts takes the fused MoE with its k-sum kernel (triton_moe.PDL_CHAIN) and MOE_KSUM_IN_NORM
        is on: its pair rows, left for ced_add_rms_norm's kernel to add (pair_sum.PairSum). None elsewhere."""
        from . import triton_moe

        scales = dict(w13_scale=w13_scale, w2_scale=w2_scale)
        if not MOE_KSUM_IN_NORM or self.batch_invariant or not triton_moe.PDL_CHAIN \
                or (torch.is_grad_enabled() and any(t.requires_grad for t in (x, w13, w2))) \
                or self._moe_kernel(x, w13, w2, weights, ids, "routed", scales) != "fused":
            return None
        self.kernel_calls["fused_moe"] += 1
        return triton_moe.fused_experts(x, w13, w2, weights, ids, clamp=clamp, pair_sum=True, **scales)

    def moe_experts_shared(self, x, w13, w2, weights, ids, shared_w13, shared_w2, *, clamp=None, w13_scale=None,
                           w2_scale=None):
        """With MOE_SHARED_ON_PAIRS (on: see there), where moe_experts takes the pair kernels (up to MOE_PAIRS_MAX
        pairs, bf16 / fp16 experts), the shared expert rides on them as Fs / F more pairs a token (triton_moe_pairs'
        module doc): two launches for what took five (its w13 GEMV, the activation, its w2 GEMV). None elsewhere
        (the caller runs both apart)."""
        from . import triton_moe_pairs

        shared = (shared_w13, shared_w2)
        if not MOE_SHARED_ON_PAIRS or self.batch_invariant or w13_scale is not None or ids.numel() > MOE_PAIRS_MAX \
                or not kernel_device_ok(x, w13, w2, weights, ids, shared_w13, shared_w2) \
                or (torch.is_grad_enabled() and any(t.requires_grad for t in (x, w13, w2, shared_w13, shared_w2))) \
                or not triton_moe_pairs.supports(x, w13, w2, weights, ids, shared=shared):
            return None
        self.kernel_calls["moe_pairs_shared"] += 1
        return triton_moe_pairs.pair_experts(x, w13, w2, weights, ids, clamp=clamp, shared=shared)

    # Attention.
    def paged_attention(self, q, k_cache, v_cache, meta: AttnMetadata, scale, window=None, sinks=None):
        if self.batch_invariant:
            return self._invariant_attention(q, k_cache, v_cache, meta, scale, window, sinks)
        nd = meta.num_decodes
        if 0 < nd < meta.q_index.shape[0] and meta.max_q > 1:
            # A mixed step: its decode rows (first in the stream) to the decode kernel, the chunks to the
            # prefill kernel, inside the one forward.
            dec, pre = meta.split(nd)
            return torch.cat([self.paged_attention(q[:nd], k_cache, v_cache, dec, scale, window, sinks),
                              self.paged_attention(q[nd:], k_cache, v_cache, pre, scale, window, sinks)])
        decode = meta.block_table is not None and meta.q_index.shape[1] == 1
        if decode:  # MLA's absorbed decode (V = a prefix of the one latent KV head): every head per KV tile
            from . import triton_mla

            r = triton_mla.mla_call_rank(q, k_cache, v_cache, meta.block_table, meta.block_size, window, sinks)
            if r and kernel_device_ok(q, k_cache, meta.block_table, meta.seq_lens):
                self.kernel_calls["mla_decode"] += 1
                if kernel_choice.use_tilelang("mla_decode", q.device):  # TileLang where it measured faster
                    from . import tilelang_mla

                    if tilelang_mla.supports(q, k_cache, meta.block_table, meta.block_size, r, meta.seq_lens):
                        self.kernel_calls["mla_decode:tilelang"] += 1
                        return tilelang_mla.mla_decode(q, k_cache, meta.block_table, meta.block_size, meta.seq_lens,
                                                       scale, r)
                return triton_mla.mla_decode(q, k_cache, meta.block_table, meta.block_size, meta.seq_lens, scale, r)
        if decode and kernel_device_ok(q, k_cache, v_cache, meta.block_table, meta.seq_lens, meta.q_pos, sinks) \
                and triton_attention.supports(q, k_cache, v_cache, meta.block_table, meta.block_size, sinks):
            self.kernel_calls["paged_attention"] += 1
            return triton_attention.paged_decode(q, k_cache, v_cache, meta.block_table, meta.block_size,
                                                 meta.seq_lens, meta.q_pos[:, 0], scale, window, sinks)
        from . import triton_prefill  # ragged rows (prefill chunks, mixed batches): flash attention, paged

        if meta.cu_q is not None and meta.block_table is not None and meta.max_q > 0 and 0 < scale < float("inf") \
                and kernel_device_ok(q, k_cache, v_cache, meta.block_table, meta.cu_q, meta.seq_lens, sinks) \
                and triton_prefill.supports(q, k_cache, v_cache, meta.block_table, meta.block_size, meta.cu_q,
                                            meta.seq_lens, sinks):
            self.kernel_calls["paged_prefill"] += 1
            return triton_prefill.paged_prefill(q, k_cache, v_cache, meta.block_table, meta.block_size, meta.cu_q,
                                                meta.seq_lens, meta.max_q, scale, window, sinks)
        return super().paged_attention(q, k_cache, v_cache, meta, scale, window, sinks)

    def _invariant_attention(self, q, k_cache, v_cache, meta: AttnMetadata, scale, window, sinks):
        """Batch-invariant mode: every row, decode or prefill chunk, through the one paged prefill kernel (no
        split-K: a program walks its row's keys in BLOCK_N tiles from the first), so a position's attention has
        the same bits whether it is decoded, prefilled in a chunk or after a prefix hit; else the reference's
        invariant attention (whose matmuls batch_invariant("cuda") routes to Triton)."""
        from . import triton_prefill

        if meta.cu_q is not None and meta.block_table is not None and meta.max_q > 0 and 0 < scale < float("inf") \
                and kernel_device_ok(q, k_cache, v_cache, meta.block_table, meta.cu_q, meta.seq_lens, sinks) \
                and triton_prefill.supports(q, k_cache, v_cache, meta.block_table, meta.block_size, meta.cu_q,
                                            meta.seq_lens, sinks):
            self.kernel_calls["paged_prefill"] += 1
            self.kernel_calls["paged_attention:invariant"] += 1
            return triton_prefill.paged_prefill(q, k_cache, v_cache, meta.block_table, meta.block_size, meta.cu_q,
                                                meta.seq_lens, meta.max_q, scale, window, sinks)
        return super().paged_attention(q, k_cache, v_cache, meta, scale, window, sinks)

    # CED (DeepSeek-V4.1-Flash): window + top-K sparse attention over the FP8 rings and the paged FP4 KV in one
    # pass, and the indexer's scores and top-K over the FP4 index keys (modules imported on first use).
    def ced_sparse_attention(self, q, kv, ring, entries, entry_slots, *, pos, cut, fresh_lo, fresh_start, ring_slot,
                             window, ring_fmt, entry_fmt, sinks, scale, unrope=None):
        """The Triton kernel folds ``unrope`` into the launch that stores the output (the DIRECT epilogue or the
        split merge); after the TileLang kernel the torch formula runs."""
        from . import triton_ced_attention as tca

        where = dict(pos=pos, cut=cut, fresh_lo=fresh_lo, fresh_start=fresh_start, ring_slot=ring_slot)
        splits = None
        if self.batch_invariant:  # Triton with a fixed split size over the keys (so a split count fixed per layer)
            splits = invariant_ced_splits(q, entries, entry_slots, window)
        elif kernel_choice.use_tilelang("ced_sparse_attention", q.device):  # TileLang where it measured faster
            from . import tilelang_ced_attention as lca

            if kernel_device_ok(q, kv, *ring, *(entries or ()), entry_slots, sinks, *where.values()) \
                    and lca.supports(q, kv, ring, entries, entry_slots, ring_fmt, entry_fmt, sinks):
                self.kernel_calls["ced_sparse_attention"] += 1
                self.kernel_calls["ced_sparse_attention:tilelang"] += 1
                from ...models.ced import functional as fn

                out = lca.sparse_attention(q, kv, ring, entries, entry_slots, window=window, ring_fmt=ring_fmt,
                                           entry_fmt=entry_fmt, sinks=sinks, scale=scale, **where)
                return out if unrope is None else fn.rope_rotate(out, *unrope, inverse=True)
        if kernel_device_ok(q, kv, *ring, *(entries or ()), entry_slots, sinks, *where.values()) \
                and tca.supports(q, kv, ring, entries, entry_slots, ring_fmt, entry_fmt, sinks) \
                and (unrope is None or tca.supports_unrope(q, unrope)):
            self.kernel_calls["ced_sparse_attention"] += 1
            return tca.sparse_attention(q, kv, ring, entries, entry_slots, window=window, ring_fmt=ring_fmt,
                                        entry_fmt=entry_fmt, sinks=sinks, scale=scale, num_splits=splits,
                                        unrope=unrope, **where)
        return super().ced_sparse_attention(q, kv, ring, entries, entry_slots, window=window, ring_fmt=ring_fmt,
                                            entry_fmt=entry_fmt, sinks=sinks, scale=scale, unrope=unrope, **where)

    def ced_rms_norm(self, x, weight, eps):
        from . import triton_ced_fused as tcf

        if kernel_device_ok(x, weight) and tcf.supports_rms(x, weight):
            self.kernel_calls["ced_rms_norm"] += 1
            return tcf.rms_norm(x, weight, eps)
        return super().ced_rms_norm(x, weight, eps)

    def ced_rope(self, x, pos, rope_dim, theta, inverse=False, reuse_input=False):
        from . import triton_ced_fused as tcf

        if kernel_device_ok(x, pos) and tcf.supports_rope(x, pos, rope_dim):
            self.kernel_calls["ced_rope"] += 1
            return tcf.rope(x, pos, tcf.inv_freq(rope_dim, theta, x.device), inverse, inplace=reuse_input)
        return super().ced_rope(x, pos, rope_dim, theta, inverse)

    def ced_indexer_topk(self, q, weights, keys, key_fmt, entry_slots, q_rows, num_visible, k, allowed=None,
                         return_scores=False, candidates=None):
        """The kernel returns the reference's set of ids in ascending order (see triton_ced_indexer). With
        candidates, each query's candidates become its own row of cache slots, all of them visible: the same
        kernels score P entries per query, and the positions they pick map back to entry ids."""
        from . import triton_ced_indexer as tci

        if candidates is not None and kernel_device_ok(q, weights, *keys, entry_slots, q_rows, candidates) \
                and allowed is None and tci.supports(q, weights, *keys, key_fmt, entry_slots):
            Tq, P = candidates.shape
            if P == 0:
                return torch.full((Tq, k), -1, dtype=torch.long, device=q.device), (
                    torch.empty(Tq, 0, device=q.device) if return_scores else None)
            # [Tq, P] cache rows and each query's count of candidates (a prefix: ascending ids, then -1)
            slots, count = self._rows(entry_slots, q_rows, candidates, count=True)
            rows = torch.arange(Tq, device=q.device)
            self.kernel_calls["ced_indexer_topk"] += 1
            pos, scores = tci.indexer_topk(q, weights, *keys, key_fmt, slots, rows, count, k, None, return_scores)
            return self._rows(candidates, rows, pos), scores
        if candidates is None and kernel_device_ok(q, weights, *keys, entry_slots, q_rows, num_visible, allowed) \
                and tci.supports(q, weights, *keys, key_fmt, entry_slots):
            self.kernel_calls["ced_indexer_topk"] += 1
            return tci.indexer_topk(q, weights, *keys, key_fmt, entry_slots, q_rows, num_visible, k, allowed,
                                    return_scores)
        return super().ced_indexer_topk(q, weights, keys, key_fmt, entry_slots, q_rows, num_visible, k, allowed,
                                        return_scores, candidates)

    def ced_swa_kv(self, y, weight, eps, pos, rope_dim, theta, fmt, fake, ring, ring_slot):
        from . import triton_ced_fused as tcf, triton_ced_swa as tcs

        if not self.batch_invariant and kernel_device_ok(y, weight, pos, *ring, ring_slot) \
                and tcs.supports(y, weight, pos, ring, ring_slot, rope_dim, fmt):
            self.kernel_calls["ced_swa_kv"] += 1
            return tcs.swa_kv_ring(y, weight, eps, pos, tcf.inv_freq(rope_dim, theta, y.device), ring, ring_slot,
                                   fake=fake)
        return super().ced_swa_kv(y, weight, eps, pos, rope_dim, theta, fmt, fake, ring, ring_slot)

    def ced_add_rms_norm(self, x, residual, weight, eps, extra=None):
        """residual may be a pair_sum.PairSum (moe_experts_pairs): the kernel adds its pair rows itself."""
        from . import triton_ced_fused as tcf

        rows, ksum, kernel_ok = self._add_inputs(x, residual, extra, weight)
        if kernel_ok and tcf.supports_add_rms(x, rows, weight, extra, ksum):
            self.kernel_calls["ced_add_rms_norm_pairs" if rows is not residual else "ced_add_rms_norm"] += 1
            return tcf.add_rms_norm(x, rows, weight, eps, extra, ksum=ksum)
        residual = dense(residual)
        if self.batch_invariant:  # the adds then ced_rms_norm, as a mixed step's path (finish, then the norm)
            h = super().ced_add(x, residual, extra)
            return h, self.ced_rms_norm(h, weight, eps)
        return super().ced_add_rms_norm(x, residual, weight, eps, extra)

    def ced_add(self, x, residual, extra=None):
        """residual may be a pair_sum.PairSum: the kernel adds its pair rows itself. Batch-invariant mode keeps the
        torch adds (its composition, as ced_add_rms_norm's)."""
        from . import triton_ced_fused as tcf

        rows, ksum, kernel_ok = self._add_inputs(x, residual, extra)
        if kernel_ok and tcf.supports_add(x, rows, extra, ksum):
            self.kernel_calls["ced_add_pairs" if rows is not residual else "ced_add"] += 1
            return tcf.add_moe(x, rows, extra, ksum=ksum)
        return super().ced_add(x, residual, extra)

    def _add_inputs(self, x, residual, extra, *more) -> tuple:
        """(rows, ksum, whether a fused add kernel may run) for ced_add / ced_add_rms_norm: a PairSum residual's
        pair rows and k (a dense one: itself, 1); the kernel may run outside batch-invariant mode, on a kernel
        device, without autograd."""
        rows, ksum = (residual.pairs, residual.k) if isinstance(residual, PairSum) else (residual, 1)
        ts = (x, rows, *more) + ((extra,) if extra is not None else ())
        ok = not self.batch_invariant and kernel_device_ok(*ts) \
            and not (torch.is_grad_enabled() and any(t.requires_grad for t in ts))
        return rows, ksum, ok

    def ced_swiglu(self, gu, limit):
        from . import triton_ced_fused as tcf

        if kernel_device_ok(gu) and tcf.supports_swiglu(gu) and not (torch.is_grad_enabled() and gu.requires_grad):
            self.kernel_calls["ced_swiglu"] += 1
            return tcf.swiglu(gu, limit)
        return super().ced_swiglu(gu, limit)

    def ced_moe_route(self, x, gate, top_k, *, bias, scaling):
        """cuBLAS's gate GEMV, then the router kernel (up to CED_ROUTE_GEMV_MAX_ROWS tokens: the GEMV in the kernel; up
        to CED_ROUTE_LOGITS_GEMV_MAX_ROWS: triton_gemv's kernel for the logits; then up to
        CED_ROUTE_LOGITS_SPLITK_MAX_ROWS: triton_splitk's; past them, with CED_ROUTE_LOGITS_TILED,
        triton_router_logits). Batch-invariant mode: always the gate matmul (routed to the invariant kernel) then
        the router kernel, so a row's logits do not depend on how many rows the step has."""
        from . import triton_ced_route as tcr

        M = x.shape[0]
        kernels = not self.batch_invariant and kernel_device_ok(x, gate) \
            and not (torch.is_grad_enabled() and (x.requires_grad or gate.requires_grad))
        route = partial(self.moe_route, top_k=top_k, scoring="sqrt_softplus", renormalize=True, scaling=scaling,
                        bias=bias)  # the router kernel on float32 logits
        if kernels and M <= CED_ROUTE_GEMV_MAX_ROWS and kernel_device_ok(bias) \
                and tcr.supports_hidden(x, gate, top_k, bias):
            self.kernel_calls["ced_moe_route"] += 1
            return tcr.route_from_hidden(x, gate, top_k, scaling=scaling, bias=bias)
        kernels = kernels and gate.dtype == torch.float32
        dot = M > triton_gemv.MAX_ROWS  # past the CUDA-core kernel's rows, its tensor-core variant
        if kernels and 0 < M <= CED_ROUTE_LOGITS_GEMV_MAX_ROWS and triton_gemv.supports(x[:, None, :], gate[None], dot):
            self.kernel_calls["gemv"] += 1
            if CED_ROUTE_TAIL and kernel_device_ok(bias) \
                    and triton_gemv.supports_route(x[:, None, :], gate[None], top_k, bias, dot):
                return self._route_on(lambda tail: triton_gemv.linear(x, gate, out_dtype=torch.float32, dot=dot,
                                                                      route=tail), x, gate, top_k, bias, scaling)
            return route(triton_gemv.linear(x, gate, out_dtype=torch.float32, dot=dot))
        if kernels and M <= CED_ROUTE_LOGITS_SPLITK_MAX_ROWS and triton_splitk.supports(x[:, None, :], gate[None]):
            self.kernel_calls["splitk"] += 1
            if CED_ROUTE_TAIL and kernel_device_ok(bias) \
                    and triton_splitk.supports_route(x[:, None, :], gate[None], top_k, bias):
                return self._route_on(lambda tail: triton_splitk.linear(x, gate, route=tail,
                                                                        **CED_ROUTE_LOGITS_SPLITK_KNOBS),
                                      x, gate, top_k, bias, scaling)
            return route(triton_splitk.linear(x, gate, **CED_ROUTE_LOGITS_SPLITK_KNOBS))
        if kernels and CED_ROUTE_LOGITS_TILED and triton_router_logits.supports(x, gate):
            self.kernel_calls["router_logits"] += 1
            return route(triton_router_logits.logits(x, gate))
        return super().ced_moe_route(x, gate, top_k, bias=bias, scaling=scaling)

    def ced_entry_table(self, entries, fmt, slots, reads, dtype):
        """With ENTRY_TABLE on, the entries of ``slots`` gathered and decoded (dequantize_kv) into a bf16 table
        where that pays (ENTRY_TABLE_READS, ENTRY_TABLE_MAX_BYTES) and the attention kernel reads it (bf16 or
        float32 queries); shapes only decide, so a CUDA-graph capture holds."""
        from . import triton_fp4

        if not ENTRY_TABLE or entries is None or fmt not in triton_fp4.GROUPS or dtype not in (torch.bfloat16,
                                                                                            torch.float32):
            return None
        codes, scales = entries
        R, J = slots.shape
        table_bytes = R * J * 2 * (2 * codes.shape[1])  # bf16 rows of D = 2 x the code bytes channels
        if R * J == 0 or R * J * ENTRY_TABLE_READS > reads or table_bytes > ENTRY_TABLE_MAX_BYTES:
            return None
        self.kernel_calls["ced_entry_table"] += 1
        rows = slots.reshape(-1)  # (a row with no entry decodes row 0: never read, its index is -1)
        if kernel_device_ok(codes, scales, rows) and triton_fp4.supports_dequantize(codes, scales, fmt,
                                                                                     torch.bfloat16, rows):
            self.kernel_calls["dequantize_kv"] += 1
            table = triton_fp4.dequantize(codes, scales, fmt, torch.bfloat16, rows=rows)  # gathered in the launch
        else:
            rows = rows.clamp(min=0)
            table = self.dequantize_kv(codes[rows], scales[rows], fmt, torch.bfloat16)
        index = torch.arange(R * J, device=slots.device).view(R, J)
        return table.view(torch.uint8), torch.where(slots >= 0, index, -1)

    def _rows(self, table, q_rows, ids, count=False):
        """entry_rows (and the count of ids >= 0), one kernel where it runs."""
        from . import triton_ced_pool as tcp

        if kernel_device_ok(table, q_rows, ids) and tcp.supports_entry_rows(table, q_rows, ids):
            self.kernel_calls["ced_entry_rows"] += 1
            return tcp.entry_rows(table, q_rows, ids, count)
        out = ReferenceOps.ced_entry_rows(self, table, q_rows, ids)
        return (out, (ids >= 0).sum(1)) if count else out

    def _route_on(self, product, x, gate, top_k, bias, scaling):
        """The router on the logits product's last program: product(tail) launches it; (weights, ids)."""
        from . import triton_ced_route as tcr

        self.kernel_calls["route_tail"] += 1
        tail = tcr.Tail(x.shape[0], gate.shape[0], top_k, device=x.device, bias=bias, scaling=scaling)
        product(tail)
        return tail.w, tail.ids

    def ced_entry_rows(self, table, q_rows, ids):
        return self._rows(table, q_rows, ids)

    def ced_query(self, qa, norm_w, eps, w, pos, rope_dim, theta, heads):
        """Where linear takes a GEMV kernel (and CED_QUERY_NORM_GEMV), the norm runs in its prologue (triton_gemv's
        norm_in; its sum in K chunks, so within an ulp of ced_rms_norm's) and the RoPE on its store where
        CED_QUERY_ROPE_GEMV allows, else in ced_rope; otherwise ced_rms_norm then ced_linear_rope."""
        from . import triton_ced_fused as tcf

        if CED_QUERY_NORM_GEMV and qa.dim() == 2 and w.dim() == 2 and qa.dtype == w.dtype \
                and kernel_device_ok(qa, norm_w, w, pos) and tcf.supports_rms(qa, norm_w) \
                and not (torch.is_grad_enabled() and norm_w.requires_grad):
            dot = self._gemv_route(qa, w)
            if dot is not None and triton_gemv.supports(qa[:, None, :], w[None], dot):
                self.kernel_calls["gemv_rms_in"] += 1
                rope = self._rope_epilogue(qa, w, pos, rope_dim, theta, heads)
                y = triton_gemv.linear(qa, w, dot=dot, norm_in=(norm_w.contiguous(), eps), rope=rope)
                q = y.view(qa.shape[0], heads, w.shape[0] // heads)
                return q if rope else self.ced_rope(q, pos, rope_dim, theta, reuse_input=True)
        return super().ced_query(qa, norm_w, eps, w, pos, rope_dim, theta, heads)

    def ced_linear_add_rms(self, x, w, residual, weight, eps):
        """Where linear takes the GEMV kernel, the residual add and the norm ride on its last program
        (triton_gemv.linear_add_rms: one launch, the bits of linear then ced_add_rms_norm); otherwise the two ops."""
        if CED_OUT_ADD_RMS_GEMV and x.dim() == 2 and w.dim() == 2 and kernel_device_ok(x, w, residual, weight) \
                and not (torch.is_grad_enabled() and residual.requires_grad):
            dot = self._gemv_route(x, w)
            if dot is not None and triton_gemv.supports_add_rms(x, w, residual, weight, dot):
                self.kernel_calls["gemv_add_rms"] += 1
                return triton_gemv.linear_add_rms(x, w, residual, weight, eps, dot=dot)
        return super().ced_linear_add_rms(x, w, residual, weight, eps)

    def ced_linear_rope(self, x, w, pos, rope_dim, theta, heads):
        """Where linear takes the GEMV kernel, the RoPE rides on its store (triton_gemv's rope epilogue: one
        launch, the bits of the GEMV then the rope kernel); otherwise the two ops."""
        rope = x.dim() == 2 and w.dim() == 2 and kernel_device_ok(x, w, pos) \
            and self._rope_epilogue(x, w, pos, rope_dim, theta, heads)
        if rope:
            dot = self._gemv_route(x, w)
            if dot is not None and triton_gemv.supports(x[:, None, :], w[None], dot):
                self.kernel_calls["gemv_rope"] += 1
                return triton_gemv.linear(x, w, dot=dot, rope=rope).view(x.shape[0], heads, w.shape[0] // heads)
        return super().ced_linear_rope(x, w, pos, rope_dim, theta, heads)

    @staticmethod
    def _rope_epilogue(x, w, pos, rope_dim, theta, heads):
        """triton_gemv's ``rope`` argument for x @ w.T where CED_QUERY_ROPE_GEMV is on and it supports the shapes,
        else None."""
        from . import triton_ced_fused as tcf

        if CED_QUERY_ROPE_GEMV and triton_gemv.supports_rope(x, w, pos, rope_dim, heads):
            return pos, tcf.inv_freq(rope_dim, theta, x.device), heads
        return None

    def ced_compress_plan(self, pos, block_table, m, size, per, *, rows=None, real=None, scratch_block=0):
        from . import triton_ced_plan as tpl

        if kernel_device_ok(pos, block_table) and tpl.supports(pos, block_table, rows, real):
            self.kernel_calls["ced_compress_plan"] += 1
            return tpl.compress_plan(pos, block_table, m, size, per, rows, real, scratch_block)
        return super().ced_compress_plan(pos, block_table, m, size, per, rows=rows, real=real,
                                         scratch_block=scratch_block)

    def ced_block_slots(self, block_table, per):
        from . import triton_ced_plan as tpl

        if kernel_device_ok(block_table) and tpl.supports_table(block_table):
            self.kernel_calls["ced_block_slots"] += 1
            return tpl.block_slots(block_table, per)
        return super().ced_block_slots(block_table, per)

    def ced_compress_write(self, v, z, m, weight, eps, entry_ids, rope_dim, theta, fmt, fake, store, rows):
        from . import triton_ced_compress as tcc, triton_ced_fused as tcf

        if not self.batch_invariant and kernel_device_ok(v, z, weight, entry_ids, *store, rows) \
                and tcc.supports(v, z, m, weight, fmt, store, rows, entry_ids) and 0 <= rope_dim <= v.shape[1] \
                and rope_dim % 2 == 0 and not (torch.is_grad_enabled() and v.requires_grad):
            self.kernel_calls["ced_compress_write"] += 1
            inv = tcf.inv_freq(rope_dim, theta, v.device) if rope_dim else None
            return tcc.compress_write(v, z, m, weight, eps, entry_ids, inv, fmt, fake, store, rows)
        return super().ced_compress_write(v, z, m, weight, eps, entry_ids, rope_dim, theta, fmt, fake, store, rows)

    def ced_pool_candidates(self, scores, num_visible, block, nblocks):
        from . import triton_ced_pool as tcp

        if kernel_device_ok(scores, num_visible) and tcp.supports(scores, num_visible):
            self.kernel_calls["ced_pool_candidates"] += 1
            return tcp.pool_candidates(scores, num_visible, block, nblocks)
        return super().ced_pool_candidates(scores, num_visible, block, nblocks)

    # KV quantisation: kernels for the lowbit FP8 ("fp8_e4m3_pow2"), FP4 and MXFP4 layouts, the reference otherwise.
    def quantize_kv(self, x: torch.Tensor, fmt: str):
        """x [..., C] -> (codes, scales) exactly as reference.lowbit.quantize(x, fmt). The fp8 kernel
        skips the reference's inf/NaN check (a host sync)."""
        if fmt == triton_kvquant.FMT and kernel_device_ok(x) and triton_kvquant.supports_quantize(x):
            self.kernel_calls["quantize_kv"] += 1
            return triton_kvquant.quantize_fp8_pow2(x)
        if fmt in ("fp4_e2m1_e4m3", "mxfp4") and kernel_device_ok(x):  # CED global KV and indexer keys
            from . import triton_fp4

            if triton_fp4.supports_quantize(x, fmt):
                self.kernel_calls["quantize_kv"] += 1
                return triton_fp4.quantize(x, fmt)
        return lowbit.quantize(x, fmt)

    def dequantize_kv(self, codes: torch.Tensor, scales: Optional[torch.Tensor], fmt: str,
                      dtype: torch.dtype = torch.float32):
        """Inverse of quantize_kv, as reference.lowbit.dequantize(codes, scales, fmt, dtype)."""
        if fmt == triton_kvquant.FMT and scales is not None and kernel_device_ok(codes, scales) \
                and codes.dtype == torch.uint8 and scales.dtype == torch.uint8 and codes.dim() >= 1 \
                and codes.shape[-1] % triton_kvquant.GROUP == 0 \
                and tuple(scales.shape) == (*codes.shape[:-1], codes.shape[-1] // triton_kvquant.GROUP) \
                and dtype in triton_kvquant.SUPPORTED_DTYPES:
            self.kernel_calls["dequantize_kv"] += 1
            return triton_kvquant.dequantize_fp8_pow2(codes, scales, dtype)
        if fmt in ("fp4_e2m1_e4m3", "mxfp4") and kernel_device_ok(codes, scales):
            from . import triton_fp4

            if triton_fp4.supports_dequantize(codes, scales, fmt, dtype):
                self.kernel_calls["dequantize_kv"] += 1
                return triton_fp4.dequantize(codes, scales, fmt, dtype)
        return lowbit.dequantize(codes, scales, fmt, dtype)

    # Sampling: the reference's penalties and exponential race around a Triton filter that does not sort the
    # vocabulary; it keeps the same tokens, so seeded rows draw the same tokens as the reference.
    def sample(self, logits, batch, generator=None):
        from . import triton_sampling

        if not batch.all_greedy and kernel_device_ok(logits, batch.temperature, batch.top_k, batch.top_p,
                                                     batch.min_p) and triton_sampling.supports(logits):
            self.kernel_calls["sampling_filter"] += 1
            return triton_sampling.sample(logits, batch, generator)
        return super().sample(logits, batch, generator)

    def guard_logits(self, logits, prev_bad=None):
        from . import triton_guard

        if logits.is_cuda and kernel_device_ok(logits, prev_bad) and triton_guard.supports(logits, prev_bad):
            self.kernel_calls["guard_logits"] += 1
            return triton_guard.guard_logits(logits, prev_bad)
        return super().guard_logits(logits, prev_bad)

    def apply_token_bitmask(self, logits, bitmask, rows):
        from . import triton_bitmask

        if kernel_device_ok(logits, bitmask, rows) and triton_bitmask.supports(logits, bitmask, rows):
            self.kernel_calls["apply_token_bitmask"] += 1
            return triton_bitmask.apply_token_bitmask(logits, bitmask, rows)
        return super().apply_token_bitmask(logits, bitmask, rows)

    # KV cache writes and rotary embeddings: one launch each.
    def write_kv(self, k_cache, v_cache, k, v, slots):
        from . import triton_kv_write

        if kernel_device_ok(k_cache, v_cache, k, v, slots) and triton_kv_write.supports(k_cache, v_cache, k, v, slots):
            self.kernel_calls["write_kv"] += 1
            return triton_kv_write.write_kv(k_cache, v_cache, k, v, slots)
        return super().write_kv(k_cache, v_cache, k, v, slots)

    def apply_rotary(self, q, k, positions, cos_sin_cache, interleaved):
        from . import triton_rope

        if kernel_device_ok(q, k, positions, cos_sin_cache) and triton_rope.supports(q, k, positions, cos_sin_cache):
            self.kernel_calls["apply_rotary"] += 1
            return triton_rope.apply_rotary(q, k, positions, cos_sin_cache, interleaved)
        return super().apply_rotary(q, k, positions, cos_sin_cache, interleaved)

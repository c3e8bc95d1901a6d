"""The CED model (DeepSeek-V4.1-Flash architecture at any size): modules and the full-sequence path.

The full-sequence path (``forward_full``) uses masks and no cache. It is the
oracle of the engine path and the training path of the demo model, so it is
batched ([B, N], equal lengths) and runs on any device in plain PyTorch.
Replay semantics are a parameter: the decoder runs over tokens [s, N) only,
and a decoder query i attends SWA keys in [max(s, i - n_win + 1), i]
(s = 0 is the exact mode).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..moe import EXPERT_PARAMS, MoEModel
from . import functional as fn
from .config import CEDConfig

if TYPE_CHECKING:
    from ...backends.base import Ops

INDEX_CHUNK = 1 << 24  # the full-sequence indexer's chunk: queries x scored entries x max(heads, head dim)
POOL_IMPLS = ("gather", "mask")


def _p(*shape):
    return nn.Parameter(torch.empty(*shape))


class CEDLayer(nn.Module):
    def __init__(self, c: CEDConfig, i: int):
        super().__init__()
        self.c, self.i = c, i
        self.mode, self.m = c.layer_modes[i], c.ratio(i)
        self.is_decoder = i >= c.num_encoder_layers
        H, D, d = c.num_heads, c.head_dim, c.hidden_size
        self.attn_norm = _p(d)
        self.wq_a = _p(c.q_lora_rank, d)
        self.q_norm = _p(c.q_lora_rank)
        self.wq_b = _p(H * D, c.q_lora_rank)
        self.wkv = _p(D, d)
        self.kv_norm = _p(D)
        self.wz = _p(D, d) if self.mode == "full" and self.m > 1 else None  # compressor gate, channel-wise
        self.wzi = _p(c.index_head_dim, d) if self.mode == "full" and self.m > 1 else None  # same for indexer K
        self.sink = _p(H) if c.use_sink else None
        self.wo_a = _p(c.out_groups, c.out_group_dim, H // c.out_groups * D)
        self.wo_b = _p(d, c.out_groups * c.out_group_dim)
        if self.mode in ("full", "reindex"):
            self.wiq = _p(c.index_heads * c.index_head_dim, c.q_lora_rank)
            self.wiw = _p(c.index_heads, d)
        else:
            self.wiq = self.wiw = None
        self.wik = _p(c.index_head_dim, d) if self.mode == "full" else None
        self.ffn_norm = _p(d)
        E, Fe = c.n_routed_experts, c.moe_intermediate_size
        self.gate = _p(E, d)
        self.gate_bias = _p(E)
        self.w13 = _p(E, 2 * Fe, d)
        self.w2 = _p(E, d, Fe)
        # What EPLB (parallel/placement.py) reads of a MoE layer, as of a MoEBlock; with a placement, w13 and w2
        # (and FP8 scales) hold its E + num_redundant_experts physical slots.
        self.num_experts, self.layer, self.n_group, self.placement = E, i, None, None
        Fs = Fe * c.n_shared_experts
        self.shared_w13 = _p(2 * Fs, d) if Fs else None
        self.shared_w2 = _p(d, Fs) if Fs else None

    # Pieces shared with the engine path.
    def _input_weights(self) -> list:
        """The products of a layer's normed input: W_q_a, W_kv and, in full / reindex layers, W_iw."""
        return [self.wq_a, self.wkv] + ([self.wiw] if self.wiw is not None else [])

    def fuse_input_projections(self) -> None:
        """Re-seat the input products' weights (``_input_weights``) as row blocks of one tensor, so the engine
        runs them as one GEMV / GEMM (a decode step: one launch a layer instead of two or three, and a wider
        product). Names, shapes and values stay; an in-place load (``load_weights``) writes through. Anything that
        re-seats one of them (``.to``, a new ``.data``) ends the fusion: ``project_input`` checks the storage."""
        ws = self._input_weights()
        if len({(w.dtype, w.device) for w in ws}) != 1 or ws[0].device.type == "meta":
            return
        with torch.no_grad():
            fused = torch.cat([w.data for w in ws])
        a = 0
        for w in ws:
            w.data = fused[a:a + w.shape[0]]
            a += w.shape[0]
        self._input_fused = fused

    def project_input(self, x):
        """x [T, d] (normed) -> (W_q_a x, W_kv x, W_iw x or None) from one product where
        ``fuse_input_projections`` joined the weights (column views of its [T, rows] output), else None (the
        callers then run their own products). Not under autograd (the joined tensor is no parameter)."""
        fused, ws = getattr(self, "_input_fused", None), self._input_weights()
        if fused is None or x.device != fused.device or x.dtype != fused.dtype \
                or (torch.is_grad_enabled() and any(w.requires_grad for w in ws)):
            return None
        a = 0
        for w in ws:  # still the joined tensor's rows?
            if w.data_ptr() != fused[a].data_ptr() or w.stride() != fused.stride():
                return None
            a += w.shape[0]
        y = self._linear(x, fused)
        r, D = self.wq_a.shape[0], self.wkv.shape[0]
        return y[:, :r], y[:, r:r + D], (y[:, r + D:] if self.wiw is not None else None)

    def query(self, x, pos, qa=None, need_cq: bool = True):
        """x [T, d] (normed) -> q [T, H, D] with RoPE, and the query latent cq [T, q_lora]. qa: W_q_a x when the
        caller has it (``project_input``). ``need_cq`` False (a layer without indexer): cq may come back None,
        the ops then computing q from qa in one op (Ops.ced_query: the norm may run in W_q_b's product)."""
        c, ops = self.c, self._kernels(x)
        qa = self._linear(x, self.wq_a) if qa is None else qa
        kernel = None if need_cq else fn._fused(ops, "ced_query", qa, self.q_norm, self.wq_b)
        if kernel is not None:
            return kernel(qa, self.q_norm, c.rms_norm_eps, self.wq_b, pos, c.rope_dim, c.rope_theta, c.num_heads), None
        cq = fn.rms(qa, self.q_norm, c.rms_norm_eps, ops=ops)
        kernel = fn._fused(ops, "ced_linear_rope", cq, self.wq_b)  # (at a few rows one GEMV with the RoPE in)
        if kernel is not None:
            return kernel(cq, self.wq_b, pos, c.rope_dim, c.rope_theta, c.num_heads), cq
        q = self._linear(cq, self.wq_b).view(x.shape[0], c.num_heads, c.head_dim)
        return fn.apply_rope(q, pos, c.rope_dim, c.rope_theta, ops=ops, reuse_input=True), cq  # (q: a temporary)

    def swa_kv(self, x, pos, y=None):
        """x [T, d] -> this layer's SWA latent [T, D]: RMSNorm(W_kv x), RoPE, FP8 fake-quant. y: W_kv x when the
        caller has it (``project_input``)."""
        c, ops = self.c, self._kernels(x)
        y = F.linear(x, self.wkv) if y is None else y
        kv = fn.apply_rope(fn.rms(y, self.kv_norm, c.rms_norm_eps, ops=ops), pos, c.rope_dim, c.rope_theta, ops=ops)
        return fn.fake(kv, c.swa_kv_format, c.fake_quant, ops=ops)

    def swa_proj(self, x):
        """x [T, d] (normed) -> the SWA projection W_kv x [T, D] (what ``swa_kv_rows`` takes)."""
        return self._linear(x, self.wkv)

    def swa_kv_rows(self, y, pos, ring, ring_slot, ops):
        """swa_kv from the projection y = swa_proj(x), also written to the ring ``ring`` (quantized) at
        [ring_slot, pos % ring size]: one op (``Ops.ced_swa_kv``, one kernel on the nvidia backend). A decode step
        runs it once; a prefill runs it twice on the same y (a row-wise op: the same bits each time), before
        attention with the ring writes sent to a scratch slot and after it with the real ones
        (engine_path.Pass.swa_kv)."""
        c = self.c
        return ops.ced_swa_kv(y, self.kv_norm, c.rms_norm_eps, pos, c.rope_dim, c.rope_theta, c.swa_kv_format,
                              c.fake_quant, ring, ring_slot)

    def entries(self, x, entry_ids=None):
        """Compressed KV and indexer K of complete groups of x [G*m, d] (normed); entry_ids [G] (default 0..G-1)
        give each entry's RoPE position j*m."""
        c, m = self.c, self.m
        v, ik = F.linear(x, self.wkv), F.linear(x, self.wik)
        w = fn.group_weights(F.linear(x, self.wz), m) if m > 1 else None
        wi = fn.group_weights(F.linear(x, self.wzi), m) if m > 1 else None
        ops = self._kernels(x)
        e = fn.rms(fn.compress(v, w, m), self.kv_norm, c.rms_norm_eps, ops=ops)
        if entry_ids is None:
            entry_ids = torch.arange(e.shape[0], device=x.device)
        pos = entry_ids * m
        e = fn.fake(fn.apply_rope(e, pos, c.rope_dim, c.rope_theta, ops=ops), c.global_kv_format, c.fake_quant,
                    ops=ops)
        k = fn.fake(fn.compress(ik, wi, m), c.index_k_format, c.fake_quant, ops=ops)
        return e, k

    def entries_to_cache(self, x, entry_ids, rows, cache, ops):
        """entries(x, entry_ids) quantized into this layer's cache rows ``rows`` (CEDCache.write_entries): one
        op per kind (``Ops.ced_compress_write``, one kernel each on the nvidia backend) after the projections."""
        c, m = self.c, self.m
        z, zi = (self._linear(x, self.wz), self._linear(x, self.wzi)) if m > 1 else (None, None)
        ops.ced_compress_write(self._linear(x, self.wkv), z, m, self.kv_norm, c.rms_norm_eps, entry_ids, c.rope_dim,
                               c.rope_theta, c.global_kv_format, c.fake_quant, cache.kv[self.i], rows)
        ops.ced_compress_write(self._linear(x, self.wik), zi, m, None, c.rms_norm_eps, entry_ids, 0, c.rope_theta,
                               c.index_k_format, c.fake_quant, cache.ik[self.i], rows)

    def _kernels(self, x):
        """The owning model's ops on CUDA, None elsewhere: functional's fake quantisation (sync-free kernels),
        rms and apply_rope (one fused kernel each) take them; the CPU keeps the torch formulas."""
        return ops_of(self, x.device) if x.is_cuda else None

    def _linear(self, x, w):
        """F.linear(x, w), through the backend's ``linear`` on CUDA (a GEMV kernel at a few rows, nvidia)."""
        ops = self._kernels(x)
        return F.linear(x, w) if ops is None else ops.linear(x, w)

    def index_query(self, x, cq, iw=None):
        """iw: W_iw x when the caller has it (``project_input``)."""
        c = self.c
        q = self._linear(cq, self.wiq).view(x.shape[0], c.index_heads, c.index_head_dim)
        w = (self._linear(x, self.wiw) if iw is None else iw) * c.index_heads ** -0.5
        return q, w

    def choose_entries(self, iq, iw, ik, qpos, pool=None, pool_impl: str = "gather"):
        """Top-K entry ids [Tq, K] of this full/reindex layer's queries at positions qpos [Tq] (a chunk of them),
        from indexer queries iq [Tq, nh, dh], weights iw [Tq, nh] and the source full layer's keys ik [J, dh].

        A decoder reindex layer picks only from the candidate pool of its full layer, ``pool`` (these queries'
        rows of it): with pool_impl "gather", entry ids [Tq, P] whose keys alone are scored; with "mask" (the
        slow twin) a [Tq, J] mask over scores of every entry. A decoder full layer builds that pool, in the
        same form. Returns (top-K ids, the pool it built or None, scores computed per query)."""
        c, m = self.c, self.m
        J = ik.shape[0]
        if self.is_decoder and self.mode == "reindex" and pool_impl == "gather":
            scores = fn.index_scores(iq, iw, ik[pool.clamp(min=0)])  # [Tq, P]: the pool's keys only
            return fn.select_candidates(scores, pool, c.index_topk), None, pool.shape[1]
        visible = torch.arange(J, device=iq.device)[None, :] < ((qpos + 1) // m)[:, None]
        scores = fn.index_scores(iq, iw, ik)  # [Tq, J]
        allowed = visible & pool if self.is_decoder and self.mode == "reindex" else visible
        topk = fn.select_topk(scores, allowed, c.index_topk)
        built = None
        if self.is_decoder and self.mode == "full":
            build = fn.pool_candidates if pool_impl == "gather" else fn.pool_mask
            built = build(scores, visible, c.pool_block, c.pool_blocks)
        return topk, built, J

    def out_proj(self, o, pos, reuse_input: bool = False, unrotated: bool = False):
        """o [T, H, D] attended latent -> inverse RoPE, grouped projection, final projection -> [T, d].
        ``reuse_input``: o is the caller's temporary, so the inverse RoPE may rotate it in place. ``unrotated``:
        the inverse RoPE is done (the attention op applied it: ``Ops.ced_sparse_attention(unrope=...)``)."""
        return self._linear(self._grouped_out(o, pos, reuse_input, unrotated), self.wo_b)

    def _grouped_out(self, o, pos, reuse_input: bool, unrotated: bool):
        """out_proj up to its last product: the inverse RoPE (unless ``unrotated``) and the grouped projection,
        flattened -> [T, groups x group dim]."""
        c, ops = self.c, self._kernels(o)
        if not unrotated:
            o = fn.apply_rope(o, pos, c.rope_dim, c.rope_theta, inverse=True, ops=ops, reuse_input=reuse_input)
        og = o.reshape(o.shape[0], c.out_groups, -1)
        grouped = torch.einsum("tgi,goi->tgo", og, self.wo_a) if ops is None else ops.grouped_linear(og, self.wo_a)
        return grouped.flatten(1)

    def out_proj_add_rms(self, o, pos, h, unrotated: bool = False):
        """The attention's output into the residual stream and the FFN norm: (h + out_proj(o), its RMSNorm), as
        functional.add_rms(h, out_proj(o)); the last product and the norm one kernel where the ops have it (a GEMV
        at a few rows: Ops.ced_linear_add_rms)."""
        c, ops = self.c, self._kernels(o)
        kernel = fn._fused(ops, "ced_linear_add_rms", o, self.wo_b, h)
        if kernel is None:
            return fn.add_rms(h, self.out_proj(o, pos, unrotated=unrotated), self.ffn_norm, c.rms_norm_eps, ops=ops)
        return kernel(self._grouped_out(o, pos, False, unrotated), self.wo_b, h, self.ffn_norm, c.rms_norm_eps)

    def _router_f32(self):
        """The router's weight and bias in float32, where the router computes: a bf16 model would otherwise cast
        them at every call (two kernels per layer and step). Kept while the parameters are unchanged (their
        version counters and storage); under autograd the weight is cast afresh, so the cast carries gradients."""
        g, b = self.gate, self.gate_bias
        if torch.is_grad_enabled() and (g.requires_grad or b.requires_grad):
            return g.float(), b
        key = (g._version, b._version, g.data_ptr(), b.data_ptr(), g.dtype, g.device)
        if getattr(self, "_f32_key", None) != key:
            self._f32, self._f32_key = (g.detach().float(), b.detach().float()), key
        return self._f32

    def moe(self, x):
        """x [T, d] (normed) -> (routed experts + shared expert [T, d], chosen expert ids [T, k]) (``moe_parts``)."""
        routed, shared, ids = self.moe_parts(x)
        return (routed if shared is None else routed + shared), ids

    def moe_parts(self, x, pairs: bool = False):
        """x [T, d] (normed) -> (routed experts [T, d], shared expert [T, d] or None, chosen ids [T, k]), through the
        owning model's backend ops (``ops_of``); where the backend runs both in one op (``moe_experts_shared``) the
        first is their sum and the second None. Sqrt-softplus scores, top-k on score + gate_bias, renormalised
        weights times the routed scaling factor; SwiGLU experts clamped at swiglu_limit, FP8 with their block
        scales when the loader kept them FP8 (models/quant.py). No host sync where the ops have none (nvidia).
        ``pairs``: the routed part may come as a pair_sum.PairSum (``moe_experts_pairs``), for a caller that adds
        it through functional.add_rms or takes pair_sum.dense of it."""
        c, ops = self.c, ops_of(self, x.device)
        gate, bias = self._router_f32()
        weights, ids = ops.ced_moe_route(x, gate, c.num_experts_per_tok, bias=bias, scaling=c.routed_scaling_factor)
        own = type(self).routed_experts is CEDLayer.routed_experts  # (not an expert-parallel layer's own)
        if self.shared_w13 is not None and own:
            both = self._experts_and_shared(x, weights, ids, ops)  # one op where the backend fuses them
            if both is not None:
                return both, None, ids
        y = self._routed_pairs(x, weights, ids, ops) if pairs and own else None
        if y is None:
            y = self.routed_experts(x, weights, ids)
        shared = None
        if self.shared_w13 is not None:  # (ced_swiglu: the clamped SwiGLU, one kernel on CUDA)
            shared = self._linear(ops.ced_swiglu(self._linear(x, self.shared_w13), c.swiglu_limit), self.shared_w2)
        return y, shared, ids

    def _experts_and_shared(self, x, weights, ids, ops):
        """routed_experts + the shared expert through ``ops.moe_experts_shared``, or None where it does not fuse
        them (an expert-parallel layer's own routed_experts never comes here)."""
        from ..quant import fp8_scales

        return ops.moe_experts_shared(x, self.w13, self.w2, weights, self._physical_ids(ids), self.shared_w13,
                                      self.shared_w2, clamp=self.c.swiglu_limit, **fp8_scales(self))

    def _physical_ids(self, ids):
        """Under EPLB each logical choice goes to one of its replicas' slots (``placement``); else ids as they are."""
        return ids if self.placement is None else self.placement.physical_ids(ids)

    def _routed_pairs(self, x, weights, ids, ops):
        """routed_experts as the backend's moe_experts_pairs (a PairSum), or None where it offers none."""
        from ..quant import fp8_scales

        return ops.moe_experts_pairs(x, self.w13, self.w2, weights, self._physical_ids(ids),
                                     clamp=self.c.swiglu_limit, **fp8_scales(self))

    def routed_experts(self, x, weights, ids):
        """The routed experts' weighted sum [T, d] of x [T, d] routed to ids [T, k] with weights [T, k] (expert
        parallelism, parallel/ced_parallel.py, runs them on the ranks that hold them). Under EPLB each logical
        choice goes to one of its replicas' slots; the load stays recorded per logical expert (``moe_parts``'s ids)."""
        from ..quant import fp8_scales

        return ops_of(self, x.device).moe_experts(x, self.w13, self.w2, weights, self._physical_ids(ids),
                                                  clamp=self.c.swiglu_limit, impl="routed", **fp8_scales(self))


def model_ops(model) -> "Ops":
    """The model's backend ops; a model built without any gets the reference ops on its device, kept."""
    if getattr(model, "ops", None) is None:
        from ...backends.reference.ops import ReferenceOps

        model.ops = ReferenceOps(next(model.parameters()).device)
    return model.ops


def ops_of(layer: CEDLayer, device) -> "Ops":
    """The backend ops of the model that owns ``layer`` (``model_ops``, read at call time), or the reference ops
    on ``device`` for a layer on its own."""
    owner = getattr(layer, "owner", None)
    model = owner() if owner is not None else None
    if model is None:
        from ...backends.reference.ops import ReferenceOps

        return ReferenceOps(device)
    return model_ops(model)


class ReplayStart(int):
    """A request's replay start s (it is that int wherever it is read) that also asks the decoder to score
    prompt positions [0, score_end) as exact replay (s = 0) would: a request with prompt_logprobs.

    Per step the engine path then runs the decoder twice over such a row's chunk: the generation pass over
    positions >= s with the SWA cut at s, which alone writes the decoder SWA rings the request generates from
    (so what it generates is what it would generate without prompt_logprobs), then the scoring pass over the
    chunk's positions < score_end with no cut, whose SWA keys live in separate scoring rings
    (``CEDCache.score_ring``); its hidden states replace the generation pass's at those positions, which only
    prompt logprobs read. Positions [s, score_end) are computed by both passes, each with its own semantics."""

    score_end: int

    def __new__(cls, start: int, score_end: int):
        obj = super().__new__(cls, start)
        obj.score_end = int(score_end)
        return obj

    def __getnewargs__(self):
        return int(self), self.score_end

    def __repr__(self) -> str:
        return f"ReplayStart({int(self)}, score_end={self.score_end})"


class CEDEngineMixin:
    """The engine-path contract of CEDForCausalLM (see engine_path.py)."""

    def allocate_kv_cache(self, num_slots, dtype, device, block_size: int = 16, max_seqs: int = 1):
        from .cache import CEDCache

        if not self.config.fake_quant:  # the caches hold quantized KV: fresh keys must be rounded as they are
            raise ValueError("CED config fake_quant=False is the full-sequence path's option (forward_full); the "
                             "engine's caches hold quantized KV, so fresh and cached keys would disagree and the "
                             "output would depend on how a prompt is chunked")
        return CEDCache(self.config, num_slots // block_size, block_size, max_seqs, dtype, device,
                        keep_encoder_outputs=getattr(self, "keep_encoder_outputs", False))

    def enable_pass_graphs(self, cache) -> None:
        """With CUDA graphs (the engine's start-up): a bounded prefill's decoder pass replays from graphs held by
        the cache (pass_graphs.py), captured as each shape first comes."""
        from .pass_graphs import DecoderPassGraphs

        cache.pass_graphs = DecoderPassGraphs()

    def kv_bytes_per_token(self, dtype) -> int:
        from .cache import CEDCache

        return CEDCache.bytes_per_token(self.config)

    def replay_start_for(self, num_prompt_tokens: int) -> int:
        if self.config.replay_mode == "exact":
            return 0
        return max(0, num_prompt_tokens - self.config.n_win)

    def paged_kv_views(self, cache, block_size: int) -> list:
        """The paged part of the cache, for the prefix cache's slower tiers (core/kv_offload.py): each full
        layer's global KV and indexer keys, block_size / m entry rows per block. The SWA rings and compressor
        tails are per-sequence state, not paged (a hit rebuilds them, stages/swa_replay.py, or restores the
        encoder's from the encoder-SWA pool, core/swa_pool.py)."""
        views = []
        for l in sorted(cache.kv):
            per = block_size // self.config.ratio(l)
            for kind, (codes, scales) in (("kv", cache.kv[l]), ("ik", cache.ik[l])):
                views.append((f"{kind}{l}.codes", codes, 0, per))
                if scales.shape[-1]:
                    views.append((f"{kind}{l}.scales", scales, 0, per))
        return views

    # A padded verify batch's padding writes only the scratch state slot and block (decode_path.py), so verify
    # steps are captured too; the kept hidden states a DSpark drafter reads come out of the graphs
    # (backends/cuda_graph.py appends them to the output).
    pads_verify_safely = True
    graphs_keep_hidden = True

    @property
    def supports_cuda_graphs(self) -> bool:
        """Decode (models/ced/decode_path.py) holds no host sync when the ops' routed MoE has none."""
        return bool(getattr(self.ops, "moe_capture_safe", False))

    def swa_state(self):
        """The SWA rings (every layer's) are not in the paged blocks: a prefix hit rebuilds them by replay
        (stages/swa_replay.py); in exact replay mode the decoder runs over every prompt position, so no hit
        can be used."""
        from ..base import SwaState

        c = self.config
        return SwaState(window=c.n_win, layers=c.num_layers, needs_all_positions=c.replay_mode == "exact")

    # The encoder-SWA pool's contract (core/swa_pool.py): the window state at a block boundary P, the encoder
    # rings' and the final encoder outputs' positions [P - n_win, P), out of and back into a state slot.
    @property
    def max_draft_tokens(self) -> int:
        """Most drafts a speculative step may verify: rejected ones must not overwrite the window state the
        accepted ones still need (the rings' and the compressor tails' allowance)."""
        return self.config.swa_allowance

    @property
    def swa_snapshot_slack(self) -> int:
        """How far past P a sequence may be and its rings still hold [P - n_win, P): the speculative allowance."""
        return self.config.ring_size - self.config.n_win

    def _window_rows(self, cache, P: int):
        c = self.config
        pos = torch.arange(P - c.n_win, P, device=cache.device)
        r = pos % c.ring_size
        for l in range(c.num_encoder_layers):
            codes, scales = cache.ring[l]
            yield f"ring{l}.codes", codes, r
            if scales.shape[-1]:
                yield f"ring{l}.scales", scales, r
        yield "encoder_out", cache.henc, r

    def swa_snapshot(self, cache, slot: int, P: int) -> dict:
        return {name: t[slot, r] for name, t, r in self._window_rows(cache, P)}

    def swa_restore(self, cache, slot: int, P: int, payload: dict) -> None:
        for name, t, r in self._window_rows(cache, P):
            t[slot, r] = payload[name].to(t.device, non_blocking=True)

    def replay_start_for_scoring(self, num_prompt_tokens: int) -> int:
        """The replay start of a request that also scores its prompt (prompt_logprobs): its own replay start,
        carrying the prompt positions to score with exact replay on the side (see ReplayStart)."""
        s = self.replay_start_for(num_prompt_tokens)
        return ReplayStart(s, num_prompt_tokens - 1) if s > 0 else s

    @property
    def pool_impl(self) -> str:
        return self._pool_impl

    @pool_impl.setter
    def pool_impl(self, value: str) -> None:
        if value not in POOL_IMPLS:
            raise ValueError(f"pool_impl={value!r} is invalid: expected one of {POOL_IMPLS}")
        self._pool_impl = value

    def forward(self, input_ids, meta, kv_cache):
        from .engine_path import forward_engine

        return forward_engine(self, input_ids, meta, kv_cache)

    def compute_logits(self, hidden):
        return self.logits(hidden)

    def reset_counters(self) -> None:
        L = self.config.num_layers
        # Per layer: tokens it ran on and the lowest position (both passes), indexer calls, (query, entry)
        # indexer scores computed (a decoder reindex layer scores its pool only), and the tokens of the
        # prompt-scoring pass (ReplayStart) among layer_tokens.
        self.counters = {"layer_tokens": [0] * L, "min_pos": [float("inf")] * L, "indexer_calls": [0] * L,
                         "index_scores": [0] * L, "score_tokens": [0] * L}

    def record_expert_load(self, layer: int, ids, real=None) -> None:
        """ids [T, k] the tokens' experts; real [T] bool (a padded verify batch): count only the real tokens."""
        if real is None:
            self.expert_load.record(layer, ids)
            return
        counts = torch.zeros(self.config.n_routed_experts, dtype=torch.long, device=ids.device)
        counts.scatter_add_(0, ids.reshape(-1), real[:, None].expand(ids.shape).reshape(-1).long())
        self.expert_load.record_counts(layer, counts)

    def moe_blocks(self) -> list:
        """Every layer has routed experts: EPLB places them as it places MoEBlocks'."""
        return list(self.layers)

    end_step = MoEModel.end_step  # closes the step's expert-load record; EPLB rebalances every step_interval


class CEDForCausalLM(CEDEngineMixin, nn.Module):
    def __init__(self, hf_config: dict, ops=None):
        super().__init__()
        self.config = c = CEDConfig.from_hf(hf_config) if isinstance(hf_config, dict) else hf_config
        self.ops = ops
        self.vocab_size, self.max_position = c.vocab_size, c.max_position_embeddings
        self.embed = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(CEDLayer(c, i) for i in range(c.num_layers))
        for layer in self.layers:  # so a layer's MoE reaches self.ops (ops_of); weak: no reference cycle
            layer.owner = weakref.ref(self)
        self.norm = _p(c.hidden_size)
        self.lm_head = None if c.tie_word_embeddings else _p(c.vocab_size, c.hidden_size)
        # How decoder reindex layers use the pool, in both paths: "gather" scores the pool's entries only,
        # "mask" (the slow twin) scores every entry and masks by the pool. See CEDLayer.choose_entries.
        self.pool_impl = "gather"
        self.reset_counters()
        from ..expert_load import ExpertLoad

        self.expert_load = ExpertLoad(list(range(c.num_layers)), c.n_routed_experts)

    def init_weights(self, seed: int = 0, std: float = 0.02) -> None:
        """Random init (for tests, benchmarks and the start of training): norms 1, biases 0, matrices N(0, std)."""
        g = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            with torch.no_grad():
                if name.endswith(("norm", "attn_norm", "ffn_norm", "q_norm", "kv_norm")):
                    p.fill_(1.0)
                elif name.endswith(("gate_bias", "sink")):
                    p.zero_()
                else:
                    fan_in = p.shape[-1]
                    p.copy_(torch.randn(p.shape, generator=g) * min(std, fan_in ** -0.5))

    def logits(self, h):
        c = self.c_norm(h)
        w = self.embed.weight if self.lm_head is None else self.lm_head
        return (model_ops(self).linear(c, w) if h.is_cuda else F.linear(c, w)).float()

    def c_norm(self, h):
        return fn.rms(h, self.norm, self.config.rms_norm_eps, ops=self.ops if h.is_cuda else None)

    # ---------------- full-sequence path ----------------
    def forward_full(self, input_ids: torch.Tensor, replay_start: int = 0, return_hidden: bool = False,
                     stats: Optional[dict] = None):
        """input_ids [N] or [B, N] -> float32 logits [(B,) N - s, V] for positions s..N-1 (s = replay_start)."""
        single = input_ids.dim() == 1
        ids = input_ids[None] if single else input_ids
        B, N = ids.shape
        s = max(0, min(replay_start, N - 1))
        pos = torch.arange(N, device=ids.device)
        h = self.embed(ids)  # [B, N, d]
        out = []
        for b in range(B):  # sequences are independent; the loop keeps every piece 2-D and shared with the engine
            out.append(self._full_one(h[b], pos, s, stats))
        hid = torch.stack(out)
        logits = self.logits(hid)
        if single:
            logits, hid = logits[0], hid[0]
        return (logits, hid) if return_hidden else logits

    def _full_one(self, h, pos, s, stats):
        c = self.config
        E = c.num_encoder_layers
        ctx: dict = {}
        for layer in self.layers[:E]:
            h = self._layer_full(layer, h, h, pos, 0, ctx, stats)
        return self._decoder_full(h, pos, s, ctx, stats)

    def _decoder_full(self, h_enc, pos, s, ctx, stats):
        c = self.config
        h = h_enc[s:]
        for layer in self.layers[c.num_encoder_layers:]:
            h = self._layer_full(layer, h, h_enc, pos, s, ctx, stats)
        return h

    def _layer_full(self, layer: CEDLayer, h, h_src, pos, s, ctx, stats):
        """h: [T, d] hidden of tokens s..N-1; h_src: [N, d] the hidden a full layer compresses (all tokens)."""
        c = self.config
        T = h.shape[0]
        qpos = pos[s:s + T]
        x = fn.rms(h, layer.attn_norm, c.rms_norm_eps)
        q, cq = layer.query(x, qpos)
        kv = layer.swa_kv(x, qpos)
        # SWA keys of query t: tokens t-W+1..t of this pass (the pass starts at s: the replay cut).
        offs = torch.arange(c.n_win, device=h.device) - (c.n_win - 1)
        idx = torch.arange(T, device=h.device)[:, None] + offs[None, :]  # [T, W]
        swa_kv, swa_mask = kv[idx.clamp(min=0)], idx >= 0
        if stats is not None:
            stats.setdefault("layer_tokens", {}).setdefault(layer.i, 0)
            stats["layer_tokens"][layer.i] += T
            stats.setdefault("first_pos", {})[layer.i] = int(qpos[0]) if T else None
        if layer.mode == "swa":
            glob, gmask = kv.new_zeros(T, 0, c.head_dim), torch.zeros(T, 0, dtype=torch.bool, device=h.device)
        else:
            m = layer.m
            src = c.source_full(layer.i)
            if layer.mode == "full":
                xs = x if h_src is h else fn.rms(h_src, layer.attn_norm, c.rms_norm_eps)
                J = xs.shape[0] // m
                ctx[("kv", layer.i)] = layer.entries(xs[: J * m])
            ents, ik = ctx[("kv", src)]
            if layer.mode in ("full", "reindex"):
                if stats is not None:
                    stats.setdefault("indexer_layers", []).append(layer.i)
                iq, iw = layer.index_query(x, cq)
                topk = self._index(layer, iq, iw, ik, qpos, ctx, stats)
            else:
                topk = ctx[("topk", c.source_topk(layer.i))]
            glob, gmask = fn.gather_rows(ents, topk)
        o = fn.attend(q, swa_kv, swa_mask, glob, gmask, layer.sink, c.head_dim ** -0.5)
        h = h + layer.out_proj(o, qpos)
        y, _ = layer.moe(fn.rms(h, layer.ffn_norm, c.rms_norm_eps))
        return h + y

    def _index(self, layer: CEDLayer, iq, iw, ik, qpos, ctx, stats):
        """The indexer of a full/reindex layer over queries at qpos [T], in chunks of queries: no [T, J] score
        matrix (nor the einsum's [T, heads, J]) is ever whole, so memory stays bounded at long prompts.
        Stores the top-K (and a decoder full layer's pool) in ctx; returns the top-K [T, K]."""
        c = self.config
        T = iq.shape[0]
        pool = ctx.get(("pool", c.source_full(layer.i))) if layer.is_decoder and layer.mode == "reindex" else None
        width = pool.shape[1] if pool is not None and self.pool_impl == "gather" else ik.shape[0]
        step = max(1, INDEX_CHUNK // max(1, width * max(c.index_heads, c.index_head_dim)))
        tops, pools, scored = [], [], 0
        for a in range(0, T, step):
            sl = slice(a, a + step)
            topk, built, w = layer.choose_entries(iq[sl], iw[sl], ik, qpos[sl], None if pool is None else pool[sl],
                                                  self.pool_impl)
            tops.append(topk)
            scored += w * topk.shape[0]
            if built is not None:
                pools.append(built)
        topk = torch.cat(tops) if tops else torch.full((0, c.index_topk), -1, dtype=torch.long, device=iq.device)
        if pools:
            ctx[("pool", layer.i)] = torch.cat(pools)
        ctx[("topk", layer.i)] = topk
        if stats is not None:
            per = stats.setdefault("index_scores", {})
            per[layer.i] = per.get(layer.i, 0) + scored
        return topk

    # ---------------- weights ----------------
    def load_weights(self, weights) -> None:
        from ..base import WeightError

        params = dict(self.named_parameters())
        seen = set()
        for name, t in weights:
            if name not in params:
                raise WeightError(f"checkpoint tensor {name!r} does not belong to CEDForCausalLM "
                                  f"(layer modes {list(self.config.layer_modes)})")
            p = params[name]
            if tuple(t.shape) != tuple(p.shape):
                raise WeightError(f"checkpoint tensor {name!r} has shape {tuple(t.shape)}, expected {tuple(p.shape)}")
            with torch.no_grad():
                p.copy_(t.to(p.dtype))
            seen.add(name)
        missing = [n for n in params if n not in seen]
        if missing:
            more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
            raise WeightError(f"checkpoint lacks tensor(s) {', '.join(missing[:3])}{more} needed by CEDForCausalLM")

    def after_load(self) -> None:
        """Once the weights are in (models/loader.py build_model): each layer's input products joined
        (CEDLayer.fuse_input_projections)."""
        for layer in self.layers:
            layer.fuse_input_projections()

    def hf_state_dict(self) -> dict:
        """The checkpoint's tensors (a joined weight's rows as their own tensors: safetensors refuses shared
        storage); under EPLB the experts' slots back to one copy per logical expert."""
        out = {n: p.data.clone() if p.data._base is not None else p.data.contiguous()
               for n, p in self.named_parameters()}
        for i, layer in enumerate(self.layers):
            if layer.placement is not None:
                for name in EXPERT_PARAMS:
                    if getattr(layer, name, None) is not None:
                        out[f"layers.{i}.{name}"] = layer.placement.logical(getattr(layer, name).data).contiguous()
        return out


"""The Ops interface: every kernel a model or stage may call.

``reference/`` implements each op in plain PyTorch and is the oracle;
``nvidia/`` and ``ascend/`` override the hot ones and are tested against it.
Shapes: T = tokens in the step (ragged, flattened), B = sequences, H = query
heads, Hk = KV heads, D = head dim.
"""

from __future__ import annotations

from typing import Optional

import attrs
import torch

from ..layout import AttnMetadata, resolve_future, to_device  # noqa: F401  (the shared layouts; re-exported)


class Ops:
    """Backend interface. Subclasses implement every method; reference.ops.ReferenceOps is the oracle."""

    name = "base"
    device: torch.device
    moe_capture_safe = False  # moe_experts(impl="routed") never syncs with the host (so decode may be captured)
    # Set by the engine with EngineConfig.batch_invariant (backends/batch_invariant.py): attention and MoE take
    # paths whose reduction order per row does not depend on the other rows of the call.
    batch_invariant = False

    def linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x [T, K] @ w.T for a weight w [N, K], no bias -> [T, N] in x's dtype (F.linear's contract): a model's
        projection, which a backend may run as a GEMV kernel at a few rows. Added after the first backends, so it
        has torch's default here (a backend written against the older interface keeps working)."""
        return torch.nn.functional.linear(x, w)

    def grouped_linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x [T, G, K], w [G, N, K] -> [T, G, N], group g's rows x[:, g] @ w[g].T: CED's grouped output projection
        (torch's einsum by default, as ``linear``)."""
        return torch.einsum("tgi,goi->tgo", x, w)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        raise NotImplementedError

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
        """Returns (rms_norm(x + residual), x + residual)."""
        raise NotImplementedError

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, 2F] -> silu(x[:, :F]) * x[:, F:]."""
        raise NotImplementedError

    def write_kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 slots: torch.Tensor) -> None:
        """Store k, v [T, Hk, D] at cache rows ``slots`` [T] of k_cache/v_cache [num_slots, Hk, D]."""
        raise NotImplementedError

    def apply_rotary(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                     interleaved: bool):
        """Rotary embedding of q [T, H, D] and k [T, Hk, D] at positions [T] -> new (q, k); inputs untouched.

        cos_sin_cache [P, R] = cat(cos, sin) of each position (R = rotary dim, even, <= D; its dtype is the
        precision of the rotation, outputs are cast back to q/k's dtype); channels R.. pass through.
        ``interleaved`` rotates adjacent channel pairs (GPT-J, DeepSeek), else the two halves of the first R
        channels (neox rotate_half: Llama, Qwen). Positions must be < P (not checked: a host sync)."""
        raise NotImplementedError

    def paged_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttnMetadata,
                        scale: float, window: Optional[int] = None,
                        sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Causal attention of ragged queries q [T, H, D] over each sequence's cached KV (already written).

        Serves prefill chunks and decode in one call. GQA when H is a multiple of Hk. ``window``: keys
        with position > q_pos - window only. ``sinks`` [H]: a learned logit per head that joins only the
        softmax denominator. Returns [T, H, Dv].
        """
        raise NotImplementedError

    def dense_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                        window: Optional[int] = None, sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Causal attention over one whole sequence, no cache: q [L, H, D], k/v [L, Hk, D] -> [L, H, Dv]."""
        raise NotImplementedError

    def moe_route(self, router_logits: torch.Tensor, top_k: int, *, scoring: str = "softmax",
                  renormalize: bool = True, scaling: float = 1.0, n_group: Optional[int] = None,
                  topk_group: Optional[int] = None, group_score: str = "max",
                  bias: Optional[torch.Tensor] = None):
        """router_logits [T, E] -> (weights [T, top_k] float32, ids [T, top_k] int64); the options of
        reference.moe.route, which documents which of them reproduce which model's router."""
        raise NotImplementedError

    def moe_experts(self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                    ids: torch.Tensor, *, clamp: Optional[float] = None, impl: str = "routed",
                    w13_scale: Optional[torch.Tensor] = None, w2_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
        """SwiGLU experts mixed by routing weights: x [T, d], w13 [E, 2F, d], w2 [E, d, F], weights/ids [T, k]
        -> [T, d] in x's dtype. impl "routed" (each expert on its own tokens) or "dense" (every expert on every
        token). clamp: DeepSeek-V4's SwiGLU clamp (gate <= clamp, |up| <= clamp), None for none.

        w13/w2 are in x's dtype, or float8_e4m3fn block-scaled as DeepSeek-V3 ships them, with both scales:
        w13_scale [E, cdiv(2F, 128), cdiv(d, 128)] and w2_scale [E, cdiv(d, 128), cdiv(F, 128)] float32, one
        per 128 x 128 block (weight = fp8 value x scale: the checkpoint's weight_scale_inv). The reference
        dequantizes the experts it uses and computes as with unquantized weights; a kernel may instead scale
        its float32 block products (w8a16). A ValueError names a missing, unpaired or misshapen scale."""
        raise NotImplementedError

    def moe_experts_shared(self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                           ids: torch.Tensor, shared_w13: torch.Tensor, shared_w2: torch.Tensor, *,
                           clamp: Optional[float] = None, w13_scale: Optional[torch.Tensor] = None,
                           w2_scale: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """moe_experts("routed") plus an ungated shared SwiGLU expert (shared_w13 [2 Fs, d], shared_w2 [d, Fs],
        the same clamp) in one op where a backend fuses them, or None: the caller then runs moe_experts and the
        shared expert apart (the default; their sum is the same function)."""
        return None

    def moe_experts_pairs(self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                          ids: torch.Tensor, *, clamp: Optional[float] = None, w13_scale: Optional[torch.Tensor] = None,
                          w2_scale: Optional[torch.Tensor] = None):
        """moe_experts("routed") as a pair_sum.PairSum, each token's k weighted expert rows not yet added, where the
        backend's ced_add_rms_norm adds them itself (saving the [T, d] sum's round trip); None elsewhere (the
        default): the caller runs moe_experts. ``PairSum.value()`` is moe_experts' result, bit for bit."""
        return None

    def sample(self, logits: torch.Tensor, batch, generator: Optional[torch.Generator] = None) -> torch.Tensor:
        raise NotImplementedError

    def guard_logits(self, logits: torch.Tensor, prev_bad: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The engine's guard after a stage writes logits [R, V]: zero, in place, the rows that hold a NaN or +inf
        or are all -inf, and return [R] bool of those rows or'ed with prev_bad's. On a device without the host
        looking (no sync); the CPU may look."""
        bad = ~torch.isfinite(logits.amax(-1))  # one pass: NaN with any NaN, +inf with any +inf, -inf if all are
        if logits.device.type == "cpu":
            if bad.any():
                logits[bad] = 0.0
        else:
            logits.masked_fill_(bad[:, None], 0.0)
        return bad if prev_bad is None else prev_bad | bad

    def compute_logprobs(self, logits: torch.Tensor, token_ids: torch.Tensor, num_top: int):
        raise NotImplementedError

    def apply_token_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
        """Structured outputs, in place: logits[rows[i], v] = -inf unless bit v % 32 of bitmask[i, v // 32] is set.
        logits [S, V] float, bitmask [R, W] int32 (W >= ceil(V / 32)), rows [R] int64 distinct row indices."""
        raise NotImplementedError

    # Low-bit KV caches and the CED (DeepSeek-V4.1-Flash) engine path's attention and indexer.
    def quantize_kv(self, x: torch.Tensor, fmt: str):
        """x [..., C] -> (codes uint8, scales uint8 or None) in reference.lowbit's byte layout for ``fmt``."""
        raise NotImplementedError

    def dequantize_kv(self, codes: torch.Tensor, scales: Optional[torch.Tensor], fmt: str,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Inverse of quantize_kv: -> x [..., C] in ``dtype``."""
        raise NotImplementedError

    def ced_indexer_topk(self, q: torch.Tensor, weights: torch.Tensor, keys: tuple, key_fmt: str,
                         entry_slots: torch.Tensor, q_rows: torch.Tensor, num_visible: torch.Tensor, k: int,
                         allowed: Optional[torch.Tensor] = None, return_scores: bool = False,
                         candidates: Optional[torch.Tensor] = None):
        """The CED indexer: score(t, j) = sum_h weights[t, h] * relu(q[t, h] . key(j)) over the entries of query
        t's sequence, then its top-k allowed entries (ties to the lower id).

        q [Tq, nh, dh]; weights [Tq, nh]; keys = (codes, scales) the paged index-key cache in ``key_fmt``;
        entry_slots [R, J] int64: cache row of sequence r's entry j; q_rows [Tq] int64: each query's sequence
        (a sequence's queries are contiguous); num_visible [Tq]: entries 0 .. n-1 are visible; allowed [Tq, J]
        bool or None narrows them further. Returns (ids [Tq, k] int64, -1 where fewer than k are allowed;
        scores [Tq, J] float32 when return_scores, else None). The reference orders ids by descending score;
        kernels may return the same set in another order (-1s still last). Scores of entries that are not
        visible are unspecified.

        candidates [Tq, P] int64 or None (then ``allowed`` must be None): entry ids of each query's candidates
        (visible ones, ascending, then -1); only they are scored, so the cost scales with P, not J (a decoder
        reindex layer's pool). The ids returned are entry ids, the set chosen from full scores masked to the
        candidates; scores are then [Tq, P], one per candidate.
        """
        raise NotImplementedError

    def ced_swa_kv(self, y: torch.Tensor, weight: torch.Tensor, eps: float, pos: torch.Tensor, rope_dim: int,
                   theta: float, fmt: str, fake: bool, ring: tuple, ring_slot: torch.Tensor) -> torch.Tensor:
        """A CED layer's SWA key/value from its projection y = W_kv x [T, D]: RMSNorm (weight [D]), RoPE on the
        last rope_dim channels at positions pos [T], and, when ``fake``, quantize-dequantize in ``fmt``
        (models/ced/model.py CEDLayer.swa_kv); also written, quantized in ``fmt``, to its ring
        ring = (codes [S, RING, D], scales) at [ring_slot[t], pos[t] % RING] (CEDCache.ring_write).
        Returns the key [T, D] in y's dtype."""
        raise NotImplementedError

    def ced_add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                         extra: Optional[torch.Tensor] = None):
        """h = x + residual (+ extra: x + (residual + extra)), each sum rounded to x's dtype, and CED's RMSNorm
        of h (models/ced/functional.py rms) -> (h, normed h)."""
        raise NotImplementedError

    def ced_add(self, x: torch.Tensor, residual, extra: Optional[torch.Tensor] = None) -> torch.Tensor:
        """h = x + residual (+ extra: x + (residual + extra)), each sum rounded to x's dtype: a deferred MoE output
        added to the residual stream where no norm follows. residual may be a pair_sum.PairSum."""
        raise NotImplementedError

    def ced_swiglu(self, gu: torch.Tensor, limit: float) -> torch.Tensor:
        """gu [T, 2F] (gate, up) -> silu(gate.clamp(max=limit)) * up.clamp(-limit, limit) [T, F]: the CED shared
        expert's activation."""
        raise NotImplementedError

    def ced_moe_route(self, x: torch.Tensor, gate: torch.Tensor, top_k: int, *, bias: Optional[torch.Tensor],
                      scaling: float):
        """CED's router from the hidden rows x [T, d]: logits x.float() @ gate.T (gate [E, d] float32), then
        moe_route's sqrt-softplus scores, bias, top-k, renormalisation and scaling."""
        raise NotImplementedError

    def ced_entry_rows(self, table: torch.Tensor, q_rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """table [R, J] int64, q_rows [Tq], ids [Tq, K] (-1 = none) -> table[q_rows[t], ids[t, k]] [Tq, K], -1
        where ids is -1: the cache rows of each query's chosen entries (its sequence's row of the table)."""
        raise NotImplementedError

    def ced_entry_table(self, entries: tuple, fmt: str, slots: torch.Tensor, reads: int, dtype: torch.dtype):
        """A pass's entries decoded once for its attention: entries (codes, scales) of the paged cache in ``fmt``,
        slots [R, J] each row's entries' cache rows (-1 = none), ``reads`` the entry reads the pass's attention will
        make (queries x top-K), dtype the queries'. -> (raw bf16 bytes [R * J, 2 D], index [R, J]: each entry's
        table row, -1 = none) to attend with entry_fmt "bf16" and ced_entry_rows over the index instead of slots,
        or None: the attention reads (and decodes) the cache in place. The values, hence the attention's bits, are
        the same either way; a backend builds the table where decoding each entry once beats decoding it per read.
        This default never does."""
        return None

    def ced_query(self, qa: torch.Tensor, norm_w: torch.Tensor, eps: float, w: torch.Tensor, pos: torch.Tensor,
                  rope_dim: int, theta: float, heads: int) -> torch.Tensor:
        """CED's query from W_q_a's output qa [T, K]: its RMSNorm (weight [K]), then ced_linear_rope with w
        [heads x D, K] -> q [T, heads, D]; the normed latent is not kept (which lets the norm run in the product's
        prologue)."""
        raise NotImplementedError

    def ced_linear_add_rms(self, x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float):
        """A product, the residual add and the next norm: h = residual + x @ w.T [T, N] and CED's RMSNorm of h
        (ced_add_rms_norm(residual, linear(x, w), ...), which may be one kernel) -> (h, normed h)."""
        raise NotImplementedError

    def ced_linear_rope(self, x: torch.Tensor, w: torch.Tensor, pos: torch.Tensor, rope_dim: int, theta: float,
                        heads: int) -> torch.Tensor:
        """CED's query projection with its RoPE: x [T, K] @ w.T viewed [T, heads, D], each head's last rope_dim
        channels rotated by pos [T] (ced_rope on the linear's output, which may be one kernel)."""
        raise NotImplementedError

    def ced_compress_plan(self, pos: torch.Tensor, block_table: torch.Tensor, m: int, size: int, per: int, *,
                          rows: Optional[torch.Tensor] = None, real: Optional[torch.Tensor] = None,
                          scratch_block: int = 0) -> tuple:
        """A decode step's compression plan for ratio m (models/ced/decode_path.py): pos [n] int64 token positions,
        block_table [R, NB] int64, tail size ``size``, ``per`` entries a block -> (tail slot pos % size [n],
        group members' tail slots (j m + i) % size [n, m] (both None where m == 1), group j = pos // m [n], cache
        row of entry j [n]: block_table[t, j // per] * per + j % per; with rows / real (a padded verify batch:
        each token's table row, whether it is real) the row's block only for a real token completing its group
        (pos % m == m - 1), its index clamped to the table, else ``scratch_block``). All int64."""
        raise NotImplementedError

    def ced_block_slots(self, block_table: torch.Tensor, per: int) -> torch.Tensor:
        """block_table [R, NB] int64 -> [R, NB per] int64: block_table[r, i // per] * per + i % per, the cache row
        of every entry id i a row's blocks hold (``per`` entries a block)."""
        raise NotImplementedError

    def ced_compress_write(self, v: torch.Tensor, z: Optional[torch.Tensor], m: int, weight: Optional[torch.Tensor],
                           eps: float, entry_ids: torch.Tensor, rope_dim: int, theta: float, fmt: str, fake: bool,
                           store: tuple, rows: torch.Tensor) -> None:
        """A CED full layer's entries of one kind into the paged cache: the groups of m rows of v [G*m, C]
        compressed with the gate z (softmax over each group, channel-wise; None when m == 1), RMSNorm with
        ``weight`` (or none), RoPE on the last rope_dim channels at entry_ids * m (0: none), quantize-dequantize
        in fmt when ``fake``, then quantized in fmt into store = (codes, scales) at rows [G] (CEDLayer.entries
        and CEDCache.write_entries)."""
        raise NotImplementedError

    def ced_pool_candidates(self, scores: torch.Tensor, num_visible: torch.Tensor, block: int, nblocks: int):
        """The CED decoder's candidate pool from a full layer's indexer scores [Tq, J] float32, entries
        0 .. num_visible[t] - 1 visible: blocks of ``block`` entries scored by their max visible score, the best
        ``nblocks`` kept (ties to the lower block, the newest visible block always kept). Returns their visible
        entry ids [Tq, min(nblocks, ceil(J / block)) * block] int64, ascending, then -1
        (models/ced/functional.py pool_candidates)."""
        raise NotImplementedError

    def ced_sparse_attention(self, q: torch.Tensor, kv: torch.Tensor, ring: tuple, entries: Optional[tuple],
                             entry_slots: torch.Tensor, *, pos: torch.Tensor, cut: torch.Tensor,
                             fresh_lo: torch.Tensor, fresh_start: torch.Tensor, ring_slot: torch.Tensor,
                             window: int, ring_fmt: str, entry_fmt: str, sinks: Optional[torch.Tensor],
                             scale: float, unrope: Optional[tuple] = None) -> torch.Tensor:
        """CED attention: one softmax per query over its sliding-window keys, its selected global entries and
        the sink (a per-head logit in the denominator only). MQA over one latent: K = V.

        q [Tq, H, D]; kv [Tq, D] the latents computed in this pass (row i belongs to query i). Query t's window
        is positions max(pos - window + 1, cut, 0) .. pos: those >= fresh_lo are kv rows fresh_start + p -
        fresh_lo, older ones are slot p % RING of ring row ``ring_slot`` in ring = (codes [S, RING, ...],
        scales) in ``ring_fmt``. entries = (codes [N, ...], scales) the paged global KV in ``entry_fmt`` (None:
        no global branch); entry_slots [Tq, K] int64 its rows per query, -1 = none. pos, cut, fresh_lo,
        fresh_start, ring_slot: [Tq] int64. sinks [H] or None. Returns [Tq, H, D] in q's dtype.
        unrope = (cos, sin) [Tq, R/2] float32, each query's rotary angles (functional.rope_cos_sin of pos): the
        output leaves rotated back by them (functional.rope_rotate inverse=True: CEDLayer.out_proj's first step),
        the same bits, where a backend may fold it into the kernel that stores the output.
        """
        raise NotImplementedError

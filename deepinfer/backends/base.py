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


def to_device(data, dtype: torch.dtype, device) -> torch.Tensor:
    """A host list (or CPU tensor) on ``device`` without blocking the host. ``torch.tensor(data, device="cuda")``
    copies synchronously: the host waits for every kernel queued before it, which would undo overlap
    scheduling; a pinned staging copy and a non-blocking transfer do not (the caching host allocator keeps
    the staging buffer until the copy has run)."""
    t = data.to(dtype) if isinstance(data, torch.Tensor) else torch.tensor(data, dtype=dtype)
    device = torch.device(device)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def resolve_future(ids: torch.Tensor, future) -> torch.Tensor:
    """Replace pending references (-1 - i) by future[i], on the device: the token a launched step sampled
    (overlap scheduling) is read where it lies, without waiting for it on the host."""
    if future is None:
        raise RuntimeError("input ids hold pending token references but the batch carries no future buffer")
    return torch.where(ids < 0, future.reshape(-1)[(-1 - ids).clamp_(min=0)], ids)


@attrs.define(eq=False)
class AttnMetadata:
    """How the step's ragged tokens map onto sequences and KV slots. Built once per forward."""

    positions: torch.Tensor  # [T] int64 absolute position of each token
    slot_mapping: torch.Tensor  # [T] int64 cache slot each token's K/V is written to
    seq_lens: torch.Tensor  # [B] int64 tokens in the cache after this step (context length)
    q_index: torch.Tensor  # [B, max_q] int64 row in T of each sequence's i-th query (0 where padded)
    q_valid: torch.Tensor  # [B, max_q] bool
    kv_slots: torch.Tensor  # [B, max_kv] int64 cache slot of each sequence's positions 0..max_kv-1 (0 where padded)
    q_pos: torch.Tensor  # [B, max_q] int64 position of each padded query
    block_table: Optional[torch.Tensor] = None  # [B, max_kv // block_size] int64 block ids (0 where padded)
    block_size: int = 0
    cu_q: Optional[torch.Tensor] = None  # [B + 1] int32: row b's queries are rows cu_q[b] .. cu_q[b+1]-1 of T
    max_q: int = 0  # host copy of q_index.shape[1] (most queries of any row this step)
    num_decodes: int = 0  # host: the leading rows with exactly one query (a backend may give them its decode kernel)
    # Per-row facts for models with per-sequence state (CED rings, compressors); host lists, read on the host.
    starts: list = attrs.field(factory=list)  # [B] first position computed this step
    nums: list = attrs.field(factory=list)  # [B] tokens computed this step
    block_tables: list = attrs.field(factory=list)  # [B] the sequences' block tables
    state_slots: list = attrs.field(factory=list)  # [B] per-sequence state slot (scheduler-assigned)
    replay_starts: list = attrs.field(factory=list)  # [B] bounded-replay start of each sequence
    cache: dict = attrs.field(factory=dict)  # per-window masks, built lazily and shared by layers

    def split(self, nd: int) -> tuple:
        """(rows [0, nd), rows [nd, B)) as two metadata objects over the first nd and the remaining tokens,
        for nd leading rows of one query each (a mixed step's decode rows: see ``num_decodes``)."""
        def host(lst, sl):
            return lst[sl] if lst else lst

        head, tail = slice(0, nd), slice(nd, None)
        dec = AttnMetadata(positions=self.positions[:nd], slot_mapping=self.slot_mapping[:nd],
                           seq_lens=self.seq_lens[head], q_index=self.q_index[head, :1], q_valid=self.q_valid[head, :1],
                           kv_slots=self.kv_slots[head], q_pos=self.q_pos[head, :1],
                           block_table=None if self.block_table is None else self.block_table[head],
                           block_size=self.block_size, cu_q=None if self.cu_q is None else self.cu_q[:nd + 1],
                           max_q=1, num_decodes=nd, **{k: host(getattr(self, k), head) for k in _HOST_ROWS})
        pre = AttnMetadata(positions=self.positions[nd:], slot_mapping=self.slot_mapping[nd:],
                           seq_lens=self.seq_lens[tail], q_index=(self.q_index[tail] - nd).clamp_(min=0),
                           q_valid=self.q_valid[tail], kv_slots=self.kv_slots[tail], q_pos=self.q_pos[tail],
                           block_table=None if self.block_table is None else self.block_table[tail],
                           block_size=self.block_size, cu_q=None if self.cu_q is None else self.cu_q[nd:] - nd,
                           max_q=self.max_q, num_decodes=0, **{k: host(getattr(self, k), tail) for k in _HOST_ROWS})
        return dec, pre

    def mask(self, window: Optional[int] = None) -> torch.Tensor:
        """[B, max_q, max_kv] bool: key visible to query (causal, inside the context, inside the window)."""
        key = ("mask", window)
        if key not in self.cache:
            kv_pos = torch.arange(self.kv_slots.shape[1], device=self.kv_slots.device)
            qp = self.q_pos[:, :, None]
            m = (kv_pos[None, None, :] <= qp) & (kv_pos[None, None, :] < self.seq_lens[:, None, None])
            if window is not None:
                m &= kv_pos[None, None, :] > qp - window
            self.cache[key] = m
        return self.cache[key]


_HOST_ROWS = ("starts", "nums", "block_tables", "state_slots", "replay_starts")


class Ops:
    """Backend interface. Subclasses implement every method; reference.ops.ReferenceOps is the oracle."""

    name = "base"
    device: torch.device
    moe_capture_safe = False  # moe_experts(impl="routed") never syncs with the host (so decode may be captured)

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
                    ids: torch.Tensor, *, clamp: Optional[float] = None, impl: str = "routed") -> torch.Tensor:
        """SwiGLU experts mixed by routing weights: x [T, d], w13 [E, 2F, d], w2 [E, d, F], weights/ids [T, k]
        -> [T, d]. impl "routed" (each expert on its own tokens) or "dense" (every expert on every token)."""
        raise NotImplementedError

    def sample(self, logits: torch.Tensor, batch, generator: Optional[torch.Generator] = None) -> torch.Tensor:
        raise NotImplementedError

    def compute_logprobs(self, logits: torch.Tensor, token_ids: torch.Tensor, num_top: int):
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
                         allowed: Optional[torch.Tensor] = None, return_scores: bool = False):
        """The CED indexer: score(t, j) = sum_h weights[t, h] * relu(q[t, h] . key(j)) over the entries of query
        t's sequence, then its top-k allowed entries (ties to the lower id).

        q [Tq, nh, dh]; weights [Tq, nh]; keys = (codes, scales) the paged index-key cache in ``key_fmt``;
        entry_slots [R, J] int64: cache row of sequence r's entry j; q_rows [Tq] int64: each query's sequence
        (a sequence's queries are contiguous); num_visible [Tq]: entries 0 .. n-1 are visible; allowed [Tq, J]
        bool or None narrows them further. Returns (ids [Tq, k] int64, -1 where fewer than k are allowed;
        scores [Tq, J] float32 when return_scores, else None). The reference orders ids by descending score;
        kernels may return the same set in another order (-1s still last). Scores of entries that are not
        visible are unspecified.
        """
        raise NotImplementedError

    def ced_sparse_attention(self, q: torch.Tensor, kv: torch.Tensor, ring: tuple, entries: Optional[tuple],
                             entry_slots: torch.Tensor, *, pos: torch.Tensor, cut: torch.Tensor,
                             fresh_lo: torch.Tensor, fresh_start: torch.Tensor, ring_slot: torch.Tensor,
                             window: int, ring_fmt: str, entry_fmt: str, sinks: Optional[torch.Tensor],
                             scale: float) -> torch.Tensor:
        """CED attention: one softmax per query over its sliding-window keys, its selected global entries and
        the sink (a per-head logit in the denominator only). MQA over one latent: K = V.

        q [Tq, H, D]; kv [Tq, D] the latents computed in this pass (row i belongs to query i). Query t's window
        is positions max(pos - window + 1, cut, 0) .. pos: those >= fresh_lo are kv rows fresh_start + p -
        fresh_lo, older ones are slot p % RING of ring row ``ring_slot`` in ring = (codes [S, RING, ...],
        scales) in ``ring_fmt``. entries = (codes [N, ...], scales) the paged global KV in ``entry_fmt`` (None:
        no global branch); entry_slots [Tq, K] int64 its rows per query, -1 = none. pos, cut, fresh_lo,
        fresh_start, ring_slot: [Tq] int64. sinks [H] or None. Returns [Tq, H, D] in q's dtype.
        """
        raise NotImplementedError

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
    # Per-row facts for models with per-sequence state (CED rings, compressors); host lists, read on the host.
    starts: list = attrs.field(factory=list)  # [B] first position computed this step
    nums: list = attrs.field(factory=list)  # [B] tokens computed this step
    block_tables: list = attrs.field(factory=list)  # [B] the sequences' block tables
    state_slots: list = attrs.field(factory=list)  # [B] per-sequence state slot (scheduler-assigned)
    replay_starts: list = attrs.field(factory=list)  # [B] bounded-replay start of each sequence
    cache: dict = attrs.field(factory=dict)  # per-window masks, built lazily and shared by layers

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


class Ops:
    """Backend interface. Subclasses implement every method; reference.ops.ReferenceOps is the oracle."""

    name = "base"
    device: torch.device

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

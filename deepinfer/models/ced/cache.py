"""The CED engine caches, in their real byte layouts.

- Global compressed KV (FP4 E2M1 + E4M3 scale per 16 channels) and indexer K (MXFP4) of every full
  layer, in paged blocks: a block of ``block_size`` tokens holds ``block_size // m`` entries of a
  layer with compression ratio m, so the scheduler's block tables serve every layer.
- SWA KV (FP8 E4M3, power-of-two scale per 32 channels) in a compact ring per sequence and layer of
  ``n_win + swa_allowance`` slots; position p lives in slot p % ring.
- Scoring rings: SWA KV of the decoder layers as exact replay computes it, for a request that scores its
  prompt under bounded replay (models.ced.model.ReplayStart); ``n_win`` slots per sequence and decoder layer
  (no speculative allowance: the scoring pass only runs over prompt tokens).
- The compressor's incomplete trailing group: the normed inputs of its last tokens, per sequence; m +
  swa_allowance slots (token at position p in slot p % slots), so a decode step writes its token and reads
  the whole group unbranched, and a speculative step whose drafts are rejected (at most the allowance) still
  finds the inputs of the group it rolled back into.
- With an encoder-SWA pool (core/swa_pool.py, ``keep_encoder_outputs``): the final encoder hidden states of
  each sequence's last ring-many positions (position p in slot p % ring), which a snapshot keeps beside the
  encoder rings because the decoder replays the last n_win prompt tokens' encoder outputs.
Per-sequence parts are indexed by the sequence's state slot, plus one scratch row (slot ``max_seqs``) that
a CUDA graph's padded rows use (backends/cuda_graph.py). With CUDA graphs the engine also allocates one
scratch block last (core/engine.py); a padded verify batch writes its padding's entries there.
"""

from __future__ import annotations

import torch

from ...backends.base import to_device
from ...backends.reference import lowbit
from .config import CEDConfig


def _alloc(n: int, channels: int, fmt: str, device, lead=()):
    codes, scales = lowbit.quantize(torch.zeros(1, channels), fmt)
    c = torch.zeros(*lead, n, codes.shape[-1], dtype=torch.uint8, device=device)
    s = torch.zeros(*lead, n, scales.shape[-1] if scales is not None else 0, dtype=torch.uint8, device=device)
    return c, s


class CEDCache:
    def __init__(self, c: CEDConfig, num_blocks: int, block_size: int, max_seqs: int, dtype, device,
                 keep_encoder_outputs: bool = False):
        self.c, self.block_size, self.dtype, self.device = c, block_size, dtype, device
        self.kv, self.ik, self.pending = {}, {}, {}
        for l, mode in enumerate(c.layer_modes):
            if mode != "full":
                continue
            m = c.ratio(l)
            if block_size % m:
                raise ValueError(f"block_size={block_size} must be a multiple of the compression ratio m={m} "
                                 f"of layer {l}")
            n = num_blocks * (block_size // m)
            self.kv[l] = _alloc(n, c.head_dim, c.global_kv_format, device)
            self.ik[l] = _alloc(n, c.index_head_dim, c.index_k_format, device)
            if m > 1:
                self.pending[l] = torch.zeros(max_seqs + 1, m + c.swa_allowance, c.hidden_size, dtype=dtype,
                                              device=device)
        self.ring = {l: _alloc(c.ring_size, c.head_dim, c.swa_kv_format, device, lead=(max_seqs + 1,))
                     for l in range(c.num_layers)}
        self.score_ring = {l: _alloc(c.n_win, c.head_dim, c.swa_kv_format, device, lead=(max_seqs,))
                           for l in range(c.num_encoder_layers, c.num_layers)}
        self.pass_graphs = None  # bounded replay's decoder-pass graphs (pass_graphs.py), set by the engine
        self.henc = torch.zeros(max_seqs + 1, c.ring_size, c.hidden_size, dtype=dtype, device=device) \
            if keep_encoder_outputs else None

    @property
    def scratch_slot(self) -> int:
        """The per-sequence buffers' scratch row: a CUDA graph's padded rows and padded tokens use it."""
        return next(iter(self.ring.values()))[0].shape[0] - 1

    @property
    def scratch_block(self) -> int:
        """The last block: the engine's scratch block when it captures CUDA graphs (it allocates one more)."""
        l = next(iter(self.kv), None)
        if l is None:
            return 0  # no full layer: no entry is ever written
        return self.kv[l][0].shape[0] // (self.block_size // self.c.ratio(l)) - 1

    @staticmethod
    def bytes_per_token(c: CEDConfig) -> int:
        """Paged bytes per token over all layers: only full layers store KV and indexer K, 1/m per token.
        Rounded up to whole bytes; the exact figure is exact_bytes_per_token."""
        return int(-(-CEDCache.exact_bytes_per_token(c) // 1))

    @staticmethod
    def exact_bytes_per_token(c: CEDConfig) -> float:
        total = 0.0
        for l, mode in enumerate(c.layer_modes):
            if mode == "full":
                total += (lowbit.bytes_per_token(c.global_kv_format, c.head_dim)
                          + lowbit.bytes_per_token(c.index_k_format, c.index_head_dim)) / c.ratio(l)
        return total

    @staticmethod
    def ring_bytes_per_seq(c: CEDConfig) -> int:
        """SWA ring bytes per sequence slot (not counting the scoring rings, score_ring_bytes_per_seq)."""
        return c.num_layers * c.ring_size * lowbit.bytes_per_token(c.swa_kv_format, c.head_dim)

    @staticmethod
    def score_ring_bytes_per_seq(c: CEDConfig) -> int:
        return (c.num_layers - c.num_encoder_layers) * c.n_win * lowbit.bytes_per_token(c.swa_kv_format, c.head_dim)

    # Paged global entries.
    def entry_slots(self, layer: int, block_table: list, entry_ids: torch.Tensor) -> torch.Tensor:
        per = self.block_size // self.c.ratio(layer)
        bt = to_device(block_table, torch.long, entry_ids.device)
        return bt[entry_ids // per] * per + entry_ids % per

    def write_entries(self, layer: int, slots: torch.Tensor, e: torch.Tensor, k: torch.Tensor,
                      quantize=lowbit.quantize) -> None:
        """Quantize entries e [n, D] and indexer keys k [n, dh] (with ``quantize``, e.g. an Ops' quantize_kv)
        into cache rows ``slots`` [n]."""
        c = self.c
        for store, x, fmt in ((self.kv[layer], e, c.global_kv_format), (self.ik[layer], k, c.index_k_format)):
            codes, scales = quantize(x, fmt)
            store[0][slots] = codes
            if scales is not None:
                store[1][slots] = scales

    def read_entries(self, layer: int, slots: torch.Tensor):
        c = self.c
        out = []
        for store, fmt in ((self.kv[layer], c.global_kv_format), (self.ik[layer], c.index_k_format)):
            sc = store[1][slots] if store[1].shape[-1] else None
            out.append(lowbit.dequantize(store[0][slots], sc, fmt, dtype=self.dtype))
        return out

    # SWA rings (score=True: the scoring rings). Position p lives in slot p % (the ring's slots).
    def rings(self, score: bool = False) -> dict:
        return self.score_ring if score else self.ring

    def ring_write(self, layer: int, slots: torch.Tensor, pos: torch.Tensor, kv: torch.Tensor,
                   quantize=lowbit.quantize, score: bool = False) -> None:
        store = self.rings(score)[layer]
        codes, scales = quantize(kv, self.c.swa_kv_format)
        r = pos % store[0].shape[1]
        store[0][slots, r] = codes
        if scales is not None:
            store[1][slots, r] = scales

    def ring_read(self, layer: int, slots: torch.Tensor, pos: torch.Tensor, score: bool = False) -> torch.Tensor:
        store = self.rings(score)[layer]
        r = pos.clamp(min=0) % store[0].shape[1]
        sc = store[1][slots, r] if store[1].shape[-1] else None
        return lowbit.dequantize(store[0][slots, r], sc, self.c.swa_kv_format, dtype=self.dtype)

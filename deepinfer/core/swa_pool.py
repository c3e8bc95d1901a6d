"""The encoder-SWA state pool: CED's encoder sliding-window KV at block boundaries, in host memory with a TTL.

CED.md's tiers: global KV persists (device, host, disk: core/prefix_cache.py, core/kv_tiers); encoder SWA
KV lives in a host-memory pool with a TTL of minutes; decoder SWA KV is always recomputed. A prefix-cache hit
of P tokens whose encoder state at P is in this pool needs no bounded replay: the engine copies the state
into the sequence's rings and computes from P exactly as a cold prefill would. Without it the swa_replay
stage replays [P - n_win, P) with the window cut there (an approximation, trained for).

What a snapshot holds (the model's ``swa_snapshot``): every encoder layer's SWA ring over [P - n_win, P) and
the final encoder hidden states of those positions, since CED's decoder runs over the last n_win prompt
tokens' encoder outputs (some of which lie before P). It is keyed by the hash of the block that ends at P,
so it is found exactly when the paged prefix is, and it carries the TTL (``swa_cache_ttl_s``): an expired
snapshot is a miss and the hit falls back to bounded replay.

When snapshots are taken: after a step, for each sequence, at its last block boundary P (once per P), if the
rings still hold [P - n_win, P) (the step ended at most the rings' speculative allowance past P) and the
block's hash is known.
Decode crosses every boundary one token at a time; a prefill chunk that would end far past its prompt's
last boundary is cut there by the scheduler (``align``), so the prompt's own state is kept too. A sequence
whose window state came from bounded replay is snapshotted only (layers + 1) windows past its cut, where
its state no longer depends on the approximation.

The copies leave the device without blocking, into pinned memory, in stream order after the step that
computed them; a restore copies back in stream order before the step that reads them, so neither waits.
Enabled with prefix caching on and a host tier (``host_cache_gb`` > 0): ``swa_cache_gb`` (None: a quarter
of host_cache_gb; 0: off) caps it.
"""

from __future__ import annotations

import time

import torch

from .kv_tiers.host import HostTier


def wanted(config, model) -> bool:
    """Whether this engine keeps the pool: prefix caching and a host tier on, and a model whose window state
    a snapshot can bring back (CED in bounded replay mode)."""
    if not (config.enable_prefix_caching and config.host_cache_gb > 0 and pool_bytes(config) > 0):
        return False
    if not hasattr(model, "swa_snapshot"):
        return False
    state = model.swa_state()
    return state is not None and not state.needs_all_positions


def pool_bytes(config) -> int:
    gb = config.host_cache_gb / 4 if config.swa_cache_gb is None else config.swa_cache_gb
    return int(gb * 2**30)


class SwaStatePool:
    def __init__(self, model, cache, config, clock=time.monotonic):
        self.model, self.cache = model, cache
        self.block_size = config.block_size
        state = model.swa_state()
        self.window, self.layers = state.window, state.layers
        self.slack = model.swa_snapshot_slack  # how far past P a step may end and the rings still hold P's state
        self.store = HostTier(pool_bytes(config), ttl_s=config.swa_cache_ttl_s, clock=clock)
        self.snapshots = self.restores = 0

    def _key(self, seq, P: int):
        return seq.block_hashes[P // self.block_size - 1]

    def take(self, seq, P: int):
        """The snapshot that lets a hit of P tokens restore the window state instead of replaying, or None (the
        scheduler asks at admission and keeps it on the sequence until its first step restores it)."""
        if P < self.window or len(seq.block_hashes) < P // self.block_size:
            return None
        return self.store.get(self._key(seq, P))

    def align(self, seq, n: int) -> int:
        """Tokens to compute this step instead of n: a prefill chunk that ends its prompt more than ``slack``
        tokens past the prompt's last block boundary stops at that boundary (its state is then snapshotted)."""
        a = seq.num_computed_tokens
        b = a + n
        P = b // self.block_size * self.block_size
        if seq.cache_root is None or b != seq.num_prompt_tokens or not a < P or b - P <= self.slack \
                or not self._worth_keeping(seq, P):
            return n
        return P - a

    def _worth_keeping(self, seq, P: int) -> bool:
        """A boundary whose state a snapshot may hold: a full window behind it, and past where a bounded
        replay's cut still shapes the state ((layers + 1) windows from the cut)."""
        cut = seq.prefix_replay_start
        return P >= self.window and P >= (cut + (self.layers + 1) * self.window if cut else 0)

    def after_step(self, seq, n: int) -> None:
        """Snapshot seq's state at its last block boundary, if the rings still hold it and the block's hash is
        known (under overlap scheduling the block's last token is known a step or two after its position is
        computed: the snapshot is then taken that much later, within the rings' allowance)."""
        b = seq.num_computed_tokens
        P = b // self.block_size * self.block_size
        if P == 0 or b - P > self.slack or not self._worth_keeping(seq, P) \
                or len(seq.block_hashes) < P // self.block_size:
            return
        key = self._key(seq, P)
        if self.store.contains(key):
            return
        parts = self.model.swa_snapshot(self.cache, seq.state_slot, P)
        pin = self.cache.device.type == "cuda" if hasattr(self.cache, "device") else False
        payload = {}
        for name, t in parts.items():
            dst = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
            dst.copy_(t, non_blocking=pin)
            payload[name] = dst
        if self.store.put(key, payload):
            self.snapshots += 1

    def restore(self, seq) -> None:
        """Before seq's first step after its hit: the window state ``take`` found, into seq's state slot."""
        P, payload = seq.swa_restore
        self.model.swa_restore(self.cache, seq.state_slot, P, payload)
        self.restores += 1

    def summary(self) -> dict:
        st = self.store.stats()
        return {"swa_snapshots": self.snapshots, "swa_restores": self.restores, "swa_entries": st.entries,
                "swa_bytes": st.bytes, "swa_expirations": st.expirations, "swa_evictions": st.evictions}

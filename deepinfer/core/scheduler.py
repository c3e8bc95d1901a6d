"""Continuous batching with chunked prefill, priorities and preemption by recompute.

Each step: running sequences first (decodes, then prefill chunks), then new ones from the waiting queue,
all under one token budget. The scheduler never calls a model and never reads a tensor.

- Order. A sequence's key is ``(priority, arrival)``: a lower priority value is served first, ties by
  arrival (vLLM's priority scheduling; with every priority 0 it is FCFS). The waiting queue is a heap on
  that key; running rows are scheduled decodes first, then prefill chunks, each in key order.
- Preemption by recompute. When the pool runs out of blocks for a running row, the running sequence
  with the largest key (lowest priority, then latest arrival) that is not already in this step nor
  draining gives its blocks back (the row itself when every other candidate is taken). It goes back to
  the waiting queue with its original key, so it resumes first among equals, and is later recomputed
  from its known tokens (its sampled tokens and generator are kept, so it finishes with the output it
  would have had). A step that preempts admits nothing.
- Watermark. Admitting a sequence needs the blocks of its first chunk plus ``watermark_blocks`` free
  (``watermark`` of the pool, at least one block; vLLM's 0.01), so an admission does not force the
  preemption of a running sequence in the next steps: after a step that admits, at least
  ``watermark_blocks`` are free. Running sequences' growth may dip into the watermark. With nothing
  running there is nothing to protect, so the first admission needs only its blocks (a request as large
  as the pool still runs).
- Skip-ahead with aging. When a waiting sequence does not fit, later ones that fit may be admitted past
  it; each step in which that happens counts as one pass-over. Once a sequence has been passed over
  ``aging_steps`` times it reserves: nothing with a larger key is admitted until it fits (the running
  ones finish or are preempted and give their blocks back). Bound: a waiting sequence is passed over by
  later-keyed ones at most ``aging_steps`` times per stay in the queue; sequences with a smaller key
  (higher priority, or earlier arrival at the same priority) are served first by definition and are not
  counted. ``aging_steps=0`` is strict head-of-line order.
- Prefix caching. With a prefix cache (core/prefix_cache.py), admitting a sequence first takes the longest
  cached run of its full blocks (leaving at least one token to compute); ``replay`` (the swa_replay stage)
  says from which position the model must recompute on such a hit (a model whose sliding-window state is
  not cached replays the tokens before the hit point), and a hit it cannot use is given back. The n
  sequences of one request share the prompt's blocks: a sibling waits (without counting as passed over)
  until the first one has computed the prompt's full blocks, then hits them. With data-parallel attention
  (core/rank_pools.py) each rank has its own cache: the state slot (the rank) is taken before the lookup,
  preferring the rank that holds the longest run of the prompt.
- Bounded work. A step inspects at most ``MAX_SKIPPED`` waiting sequences that do not fit (plus the
  ones it admits, at most ``max_num_seqs``) and pushes the skipped ones back: O((max_num_seqs +
  MAX_SKIPPED) log W) for W waiting. Removing a running or waiting sequence (finish, abort, preemption)
  is a dict deletion; a removed waiting entry is dropped lazily when it surfaces.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Optional

from .kv_cache import BlockPool, blocks_needed
from .state import ScheduledBatch, Sequence, SeqStatus

MAX_SKIPPED = 8  # waiting sequences that do not fit, inspected per step before admission gives up


def _key(seq: Sequence) -> tuple:
    return (seq.priority, seq.arrival)


class WaitingQueue:
    """Waiting sequences in key order: a heap with lazy removal. ``len`` and ``remove`` are O(1),
    ``push`` and ``pop`` O(log n); iterating sorts (for inspection, not the hot path)."""

    def __init__(self):
        self._heap: list = []  # (priority, arrival, tie, seq); entries of removed sequences are stale
        self._live: dict = {}  # seq -> its current heap entry
        self._tie = itertools.count()

    def push(self, seq: Sequence) -> None:
        entry = (*_key(seq), next(self._tie), seq)
        self._live[seq] = entry
        heapq.heappush(self._heap, entry)

    def pop(self) -> Sequence:
        while True:
            entry = heapq.heappop(self._heap)
            seq = entry[-1]
            if self._live.get(seq) is entry:
                del self._live[seq]
                return seq

    def remove(self, seq: Sequence) -> bool:
        if self._live.pop(seq, None) is None:
            return False
        if len(self._heap) > 2 * len(self._live) + 64:  # mostly stale: rebuild, amortised O(1) per removal
            self._heap = list(self._live.values())
            heapq.heapify(self._heap)
        return True

    def __contains__(self, seq) -> bool:
        return seq in self._live

    def __len__(self) -> int:
        return len(self._live)

    def __iter__(self):
        return (entry[-1] for entry in sorted(self._live.values()))


class Scheduler:
    """``running`` is a dict used as an ordered set (admission order); ``waiting`` a WaitingQueue."""

    def __init__(self, pool: BlockPool, block_size: int, max_num_seqs: int, max_num_batched_tokens: int,
                 watermark: float = 0.01, aging_steps: int = 32, prefix=None, replay=None,
                 swa_pool=None):
        """prefix: core.prefix_cache.PrefixCache or None; replay: (seq, hit tokens) -> first position to
        recompute (the swa_replay stage's ``plan``), None: recompute from the hit point; swa_pool:
        core.swa_pool.SwaStatePool or None (a hit whose window state it holds restores instead of replaying)."""
        self.pool = pool
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.watermark_blocks = max(1, int(watermark * pool.num_blocks)) if watermark > 0 else 0
        self.aging_steps = aging_steps
        self.waiting = WaitingQueue()
        self.running: dict = {}  # seq -> None
        self.num_preemptions = 0
        self._passed_over: dict = {}  # waiting seq -> steps in which a later-keyed sequence was admitted
        self._free_slots = list(range(max_num_seqs - 1, -1, -1))  # per-sequence state slots (rings, tails)
        self.prefix, self.replay, self.swa_pool = prefix, replay, swa_pool

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.push(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _grow(self, seq: Sequence, n: int, reserve: int = 0) -> bool:
        """Give seq the blocks for n more tokens if that leaves ``reserve`` blocks free."""
        need = blocks_needed(seq.num_computed_tokens + n, self.block_size) - len(seq.block_table)
        if need <= 0:
            return True
        pool = self.pool.part_of(seq.state_slot)  # data-parallel attention: its rank's blocks (core/rank_pools.py)
        if not pool.can_allocate(need + reserve):
            return False
        seq.block_table.extend(pool.allocate(need))
        return True

    def _take_slot(self, seq: Sequence) -> int:
        """A free state slot: the next one, or (blocks partitioned by rank) the next one of the rank holding the
        longest cached run of seq's prefix (core/rank_pools.py), else of the rank with the most free blocks."""
        free = self._free_slots
        ranks = getattr(self.pool, "num_ranks", 1)
        if ranks == 1:
            return free.pop()
        last: dict = {}  # rank -> index in free of its next slot
        for i in range(len(free) - 1, -1, -1):
            last.setdefault(free[i] % ranks, i)
            if len(last) == ranks:
                break
        if self.prefix is not None and seq.cache_root is not None:
            running = [0] * ranks
            for s in self.running:
                running[s.state_slot % ranks] += 1
            best = self.prefix.preferred_rank(seq, self._lookup_limit(seq), list(last), running)
            if best is not None:
                return free.pop(last[best])
        return free.pop(max(last.values(), key=lambda i: (self.pool.free_for(free[i]), i)))

    @staticmethod
    def _lookup_limit(seq: Sequence) -> int:
        """Most tokens a prefix hit may cover: all but the last known one, which must be computed."""
        return min(len(seq.token_ids), seq.num_tokens) - 1

    def _victim(self, victims: list, taken: set, seq: Sequence) -> Sequence:
        """The next preemption candidate whose blocks seq can use: running, not chosen this step, not draining
        (its blocks go back within a step), on seq's partition; seq itself is one, so there is one."""
        while victims[-1].status is not SeqStatus.RUNNING or victims[-1] in taken or victims[-1].draining:
            victims.pop()
        part = self.pool.part_of(seq.state_slot)
        for i in range(len(victims) - 1, -1, -1):
            v = victims[i]
            if (v.status is SeqStatus.RUNNING and v not in taken and not v.draining
                    and self.pool.part_of(v.state_slot) is part):
                return victims.pop(i)
        raise AssertionError("no preemption candidate: seq itself should be one")

    def _drop_blocks(self, seq: Sequence) -> None:
        self.pool.free(seq.block_table)
        seq.block_table = []
        seq.num_computed_tokens = seq.num_committed_blocks = seq.num_cached_tokens = seq.prefix_replay_start = 0
        seq.swa_restore = None

    def _use_prefix(self, seq: Sequence) -> None:
        """Give a waiting sequence the cached blocks of its longest cached prefix and the position to
        compute from (see the module docstring)."""
        if self.prefix is None or seq.cache_root is None or seq.block_table:
            return
        hit = self.prefix.lookup(seq, self._lookup_limit(seq))
        P = len(hit) * self.block_size
        snapshot = self.swa_pool.take(seq, P) if self.swa_pool is not None and P else None
        start = P if self.replay is None or not P or snapshot is not None else self.replay(seq, P)
        if not 0 < start <= P:  # nothing cached, or a hit the model cannot use
            self.pool.free(hit)
            return
        seq.block_table = hit
        seq.num_committed_blocks = len(hit)
        seq.num_computed_tokens, seq.num_cached_tokens = start, P
        seq.prefix_replay_start = start if start < P else 0
        seq.swa_restore = (P, snapshot) if snapshot is not None else None

    def _chunk(self, seq: Sequence, budget: int) -> int:
        """Tokens seq computes this step: what it has left, within the budget (and, with an encoder-SWA pool,
        its prompt's last chunk stopping at its last block boundary: core/swa_pool.py)."""
        left = seq.num_tokens - seq.num_computed_tokens
        if seq.draft:
            if left == 1 and budget > 1:  # a decode row verifies its draft: its last token and up to k drafts
                del seq.draft[budget - 1:]
                return 1 + len(seq.draft)
            seq.draft.clear()
        n = min(left, budget)
        return n if self.swa_pool is None else self.swa_pool.align(seq, n)

    def _held(self, seq: Sequence) -> bool:
        """A sibling waits while the first sequence of its request has not computed the prompt's full blocks."""
        first = seq.wait_for
        if first is None:
            return False
        full = (first.num_prompt_tokens - 1) // self.block_size * self.block_size
        if first.status is SeqStatus.WAITING or (first.status is SeqStatus.RUNNING
                                                 and first.num_computed_tokens < full):
            return True
        seq.wait_for = None
        return False

    def _preempt(self, seq: Sequence) -> None:
        del self.running[seq]
        self._drop_blocks(seq)
        self._release_slot(seq)
        seq.num_preemptions += 1
        self.add(seq)  # with its original key: first among equals
        self.num_preemptions += 1

    def schedule(self) -> Optional[ScheduledBatch]:
        budget = self.max_num_batched_tokens
        chosen: list = []  # (seq, n)
        taken: set = set()
        preempted = False
        # Decodes first (one token each), then running prefill chunks, so a long prompt never stalls decoding.
        order = sorted(self.running, key=lambda s: (s.num_tokens - s.num_computed_tokens > 1, *_key(s)))
        victims = sorted(self.running, key=_key)  # preemption candidates, the last one goes first
        for seq in order:
            if budget == 0:
                break
            if seq.status is not SeqStatus.RUNNING or seq.draining:
                continue  # preempted earlier in this loop, or its last token is already being sampled
            n = self._chunk(seq, budget)
            while not self._grow(seq, n):
                victim = self._victim(victims, taken, seq)
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status is not SeqStatus.RUNNING:
                continue
            chosen.append((seq, n))
            taken.add(seq)
            budget -= n
        if not preempted:
            budget = self._admit(chosen, budget)
        if not chosen:
            return None
        seqs = [s for s, _ in chosen]
        nums = [n for _, n in chosen]
        starts = [s.num_computed_tokens for s in seqs]
        samples = [s.num_computed_tokens + n - len(s.draft) == s.num_tokens for s, n in chosen]
        drafts = [list(s.draft) for s in seqs] if any(s.draft for s in seqs) else None
        return ScheduledBatch(seqs=seqs, num_tokens=nums, start=starts, samples=samples, drafts=drafts)

    def _admit(self, chosen: list, budget: int) -> int:
        """Admit waiting sequences in key order, skipping ahead of ones that do not fit (see the module
        docstring); appends to chosen and returns the budget left."""
        skipped: list = []  # (seq, admissions before it was skipped)
        held: list = []  # siblings waiting for their request's first sequence (not passed over)
        admitted = 0
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting.pop()
            if self._held(seq):
                held.append(seq)
                continue
            seq.state_slot = self._take_slot(seq)  # first: with data-parallel attention the slot picks the rank
            self._use_prefix(seq)  # (whose cache the lookup reads)
            n = self._chunk(seq, budget)
            if not self._grow(seq, n, reserve=self.watermark_blocks if self.running else 0):
                self._release_slot(seq)  # back where it was: the next admission takes it again
                self._drop_blocks(seq)  # a prefix hit's blocks go back (they stay cached)
                skipped.append((seq, admitted))
                if self._passed_over.get(seq, 0) >= self.aging_steps or len(skipped) >= MAX_SKIPPED:
                    break  # it reserves: nothing behind it is admitted until it fits
                continue
            self._passed_over.pop(seq, None)
            if self.prefix is not None and seq.cache_root is not None:
                self.prefix.count(seq)
            seq.status = SeqStatus.RUNNING
            self.running[seq] = None
            chosen.append((seq, n))
            budget -= n
            admitted += 1
        for seq, before in skipped:
            if admitted > before:
                self._passed_over[seq] = self._passed_over.get(seq, 0) + 1
            self.waiting.push(seq)
        for seq in held:
            self.waiting.push(seq)
        return budget

    def update(self, batch: ScheduledBatch) -> None:
        """Record that the step computed the scheduled tokens."""
        for seq, n in zip(batch.seqs, batch.num_tokens):
            seq.num_computed_tokens += n

    def finish(self, seq: Sequence) -> None:
        """Release a finished (or aborted) sequence's blocks."""
        if seq in self.running:
            del self.running[seq]
        elif self.waiting.remove(seq):
            self._passed_over.pop(seq, None)
        if seq.block_table:
            self.pool.free(seq.block_table)  # num_cached_tokens stays: the request's output reports it
            seq.block_table = []
        self._release_slot(seq)
        seq.status = SeqStatus.FINISHED

    def _release_slot(self, seq: Sequence) -> None:
        if seq.state_slot >= 0:
            self._free_slots.append(seq.state_slot)
            seq.state_slot = -1

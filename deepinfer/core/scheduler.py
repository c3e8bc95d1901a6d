"""Continuous batching with chunked prefill and preemption by recompute.

Each step: running sequences first (decodes, then prefill chunks), then new
ones from the waiting queue, all under one token budget. When the pool runs
out of blocks, the most recently admitted running sequence is preempted: its
blocks are freed and it goes back to the front of the queue, to be recomputed
from its known tokens later (its sampled tokens and generator are kept, so it
finishes with the output it would have had). The scheduler never calls a
model and never reads a tensor.
"""

from __future__ import annotations

from collections import deque
from typing import Optional

from .kv_cache import BlockPool, blocks_needed
from .state import ScheduledBatch, Sequence, SeqStatus


class Scheduler:
    def __init__(self, pool: BlockPool, block_size: int, max_num_seqs: int, max_num_batched_tokens: int):
        self.pool = pool
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque = deque()
        self.running: list = []
        self.num_preemptions = 0
        self._free_slots = list(range(max_num_seqs - 1, -1, -1))  # per-sequence state slots (rings, tails)

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _grow(self, seq: Sequence, n: int) -> bool:
        need = blocks_needed(seq.num_computed_tokens + n, self.block_size) - len(seq.block_table)
        if need <= 0:
            return True
        if not self.pool.can_allocate(need):
            return False
        seq.block_table.extend(self.pool.allocate(need))
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.pool.free(seq.block_table)
        seq.block_table = []
        seq.num_computed_tokens = 0
        self._release_slot(seq)
        seq.num_preemptions += 1
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def schedule(self) -> Optional[ScheduledBatch]:
        budget = self.max_num_batched_tokens
        chosen: list = []  # (seq, n)
        preempted = False
        # Decodes first (one token each), then running prefill chunks, so a long prompt never stalls decoding.
        order = sorted(self.running, key=lambda s: s.num_tokens - s.num_computed_tokens > 1)
        for seq in order:
            if budget == 0:
                break
            if seq.status is not SeqStatus.RUNNING or seq.draining:
                continue  # preempted earlier in this loop, or its last token is already being sampled
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self._grow(seq, n):
                # The most recently admitted running sequence not already in this step (never take blocks back
                # from a chosen row) nor draining (its blocks go back within a step); seq itself when every
                # later-admitted one is chosen.
                taken = {id(s) for s, _ in chosen}
                victim = next(v for v in reversed(self.running) if id(v) not in taken and not v.draining)
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status is not SeqStatus.RUNNING:
                continue
            chosen.append((seq, n))
            budget -= n
        # Admit waiting sequences in FCFS order; not in a step that had to preempt.
        while self.waiting and budget > 0 and not preempted and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self._grow(seq, n):
                break
            self.waiting.popleft()
            seq.state_slot = self._free_slots.pop()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            chosen.append((seq, n))
            budget -= n
        if not chosen:
            return None
        seqs = [s for s, _ in chosen]
        nums = [n for _, n in chosen]
        starts = [s.num_computed_tokens for s in seqs]
        samples = [s.num_computed_tokens + n == s.num_tokens for s, n in chosen]
        return ScheduledBatch(seqs=seqs, num_tokens=nums, start=starts, samples=samples)

    def update(self, batch: ScheduledBatch) -> None:
        """Record that the step computed the scheduled tokens."""
        for seq, n in zip(batch.seqs, batch.num_tokens):
            seq.num_computed_tokens += n

    def finish(self, seq: Sequence) -> None:
        """Release a finished (or aborted) sequence's blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if seq.block_table:
            self.pool.free(seq.block_table)
            seq.block_table = []
        self._release_slot(seq)
        seq.status = SeqStatus.FINISHED

    def _release_slot(self, seq: Sequence) -> None:
        if seq.state_slot >= 0:
            self._free_slots.append(seq.state_slot)
            seq.state_slot = -1

"""Every running sequence's block table (and bounded-replay start) in one device tensor, updated incrementally.

Row ``state_slot`` of ``table`` [max_seqs, max_blocks] (int64) holds the block ids of the sequence that owns
that slot. ``sync`` writes only what changed since the last step (blocks appended, or a slot that changed
hands after a finish or a preemption) in one scatter, so the host does O(changed blocks) work per step and
the step's metadata is gathered on the device (core/inputs.py ``device_inputs``). ``cuts`` [2, max_seqs
(+ scratch)] holds each slot's SWA cuts the same way, for models whose decode reads them on the device
(CED, inside a CUDA graph): row 0 the decoder's (the later of the replay start and a prefix hit's replay
start), row 1 the other layers' (the prefix hit's replay start, or 0).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..backends.base import to_device
from .state import window_cuts


class BlockTables:
    def __init__(self, max_seqs: int, max_blocks: int, device, scratch_block: Optional[int] = None):
        """scratch_block: adds row ``scratch_row`` = max_seqs, every entry that block (padded rows of a CUDA
        graph write their KV there and read only it)."""
        self.device = torch.device(device)
        self.max_blocks = max_blocks
        self.table = torch.zeros(max_seqs + (scratch_block is not None), max_blocks, dtype=torch.long,
                                 device=self.device)
        self.scratch_row = max_seqs if scratch_block is not None else None
        if scratch_block is not None:
            self.table[max_seqs] = scratch_block
        self.cuts = torch.zeros(2, self.table.shape[0], dtype=torch.long, device=self.device)
        self._cuts: list = [(0, 0)] * max_seqs  # host mirror of cuts
        # The block-table list a row mirrors (the scheduler only extends a table in place; releasing blocks
        # gives the sequence a new list) and how many of its entries the row holds.
        self._owner: list = [None] * max_seqs
        self._count = [0] * max_seqs

    def sync(self, seqs) -> None:
        """Bring the rows of ``seqs`` (each with a state slot) up to date with their block tables."""
        rows, cols, vals, reset, replay = [], [], [], [], []
        for s in seqs:
            r, bt = s.state_slot, s.block_table
            cuts = window_cuts(s)
            if self._cuts[r] != cuts:
                self._cuts[r] = cuts
                replay.append((r, *cuts))
            start = self._count[r] if self._owner[r] is bt else 0
            if start == 0 and self._count[r]:
                reset.append(r)  # entries past the new owner's table read 0, as padding does
            if start < len(bt):
                n = len(bt) - start
                rows.extend([r] * n)
                cols.extend(range(start, len(bt)))
                vals.extend(bt[start:])
            self._owner[r], self._count[r] = bt, len(bt)
        if reset:
            self.table[to_device(reset, torch.long, self.device)] = 0
        if rows:
            idx = to_device([rows, cols, vals], torch.long, self.device)
            self.table[idx[0], idx[1]] = idx[2]
        if replay:
            idx = to_device(list(zip(*replay)), torch.long, self.device)
            self.cuts[:, idx[0]] = idx[1:]

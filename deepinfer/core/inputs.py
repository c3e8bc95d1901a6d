"""The step's model inputs (laid out by the prefill stage, read by the forward and verify stages): every scheduled row (prefill chunks and decode tokens) as one ragged token stream.

Rows are laid out single-token rows first (decode rows, and one-token chunks), then the longer chunks, so
a backend can hand the leading ``num_decodes`` rows to its decode kernel and the rest to its prefill
kernel inside the one model call. ``sample_index`` maps each sampling row (in batch order) to the stream
position whose logits it samples from, so the layout never leaks into what later stages see.
"""

from __future__ import annotations

from typing import Optional

import attrs
import torch

from ..backends.base import AttnMetadata, resolve_future, to_device
from ..layout import host_tensor
from .state import window_cuts


def stream_ids(ids: list, batch, device) -> torch.Tensor:
    """The step's token ids [T] on ``device``; pending references (< 0) resolved from the batch's future there.
    (Through numpy, and the sign check on the tensor: a 16K prompt's list took 1.5 + 0.33 ms by torch.tensor and
    min().)"""
    host = host_tensor(ids, torch.long)
    out = to_device(host, torch.long, device)
    return resolve_future(out, batch.future) if ids and int(host.min()) < 0 else out


def build_inputs(batch, rows: list, block_size: int, device, num_decodes: int = 0) -> tuple:
    """rows: indices into batch.seqs, in stream order. Returns (input_ids [T], AttnMetadata, query_start
    list [R+1]). ``num_decodes``: how many leading rows hold exactly one query (a dispatch hint)."""
    seqs = [batch.seqs[i] for i in rows]
    starts = [batch.start[i] for i in rows]
    nums = [batch.num_tokens[i] for i in rows]
    ids: list = []
    for s, st, n in zip(seqs, starts, nums):
        ids.extend(s.input_ids(st, n))
    qstart = [0]
    for n in nums:
        qstart.append(qstart[-1] + n)
    max_q, lens = max(nums), [st + n for st, n in zip(starts, nums)]
    max_blocks = -(-max(lens) // block_size)
    max_kv = max_blocks * block_size  # whole blocks, so attention can gather blocks rather than tokens
    bt = torch.tensor([(s.block_table + [0] * max_blocks)[:max_blocks] for s in seqs], dtype=torch.long)
    n_t = torch.tensor(nums)
    st_t = torch.tensor(starts)
    seq_of_tok = torch.repeat_interleave(torch.arange(len(rows)), n_t)  # [T]
    tok_off = torch.arange(len(ids)) - torch.tensor(qstart[:-1]).repeat_interleave(n_t)
    positions = st_t[seq_of_tok] + tok_off
    slot = bt[seq_of_tok, positions // block_size] * block_size + positions % block_size
    kv_pos = torch.arange(max_kv)
    kv_slots = bt[:, kv_pos // block_size] * block_size + kv_pos % block_size  # [R, max_kv]
    qi = torch.arange(max_q)
    q_valid = qi[None, :] < n_t[:, None]
    q_index = torch.where(q_valid, torch.tensor(qstart[:-1])[:, None] + qi[None, :], 0)
    q_pos = st_t[:, None] + qi[None, :]

    def dev(t, dtype=torch.long):
        return to_device(t, dtype, device)

    meta = AttnMetadata(positions=dev(positions), slot_mapping=dev(slot), seq_lens=dev(lens),
                        q_index=dev(q_index), q_valid=dev(q_valid, torch.bool), kv_slots=dev(kv_slots),
                        q_pos=dev(q_pos), block_table=dev(bt), block_size=block_size,
                        cu_q=dev(qstart, torch.int32), max_q=max_q, starts=starts, nums=nums,
                        block_tables=[s.block_table for s in seqs], state_slots=[s.state_slot for s in seqs],
                        replay_starts=[s.replay_start for s in seqs], num_decodes=num_decodes,
                        swa_cuts=[s.prefix_replay_start for s in seqs],
                        enc_restored=[getattr(s, "swa_restore", None) is not None for s in seqs],
                        write_floors=[s.num_cached_tokens for s in seqs], state_rows=dev([s.state_slot for s in seqs]),
                        replay_rows=dev([window_cuts(s)[0] for s in seqs]),
                        swa_cut_rows=dev([window_cuts(s)[1] for s in seqs]))
    return stream_ids(ids, batch, device), meta, qstart


def device_inputs(batch, rows: list, block_size: int, tables, num_decodes: int = 0) -> tuple:
    """What build_inputs returns, computed on the device from the persistent block tables
    (core.block_tables.BlockTables, already synced): the host sends O(rows) numbers and the token ids, and
    gathers, positions, slots and masks happen on the device with no sync. build_inputs is its oracle."""
    device = tables.device
    seqs = [batch.seqs[i] for i in rows]
    starts = [batch.start[i] for i in rows]
    nums = [batch.num_tokens[i] for i in rows]
    ids: list = []
    for s, st, n in zip(seqs, starts, nums):
        ids.extend(s.input_ids(st, n))
    qstart = [0]
    for n in nums:
        qstart.append(qstart[-1] + n)
    T, R, max_q = qstart[-1], len(rows), max(nums)
    lens_host = [st + n for st, n in zip(starts, nums)]
    max_blocks = -(-max(lens_host) // block_size)
    host = to_device([starts, nums, [s.state_slot for s in seqs], qstart[:-1]], torch.long, device)
    starts_t, nums_t, slots_t, q0 = host[0], host[1], host[2], host[3]
    cu_q = to_device(qstart, torch.int32, device)
    bt = tables.table[slots_t, :max_blocks]  # [R, NB]
    seq_of_tok = torch.repeat_interleave(torch.arange(R, device=device), nums_t, output_size=T)  # [T]
    positions = starts_t[seq_of_tok] + torch.arange(T, device=device) - q0[seq_of_tok]
    slot = bt[seq_of_tok, positions // block_size] * block_size + positions % block_size
    kv_pos = torch.arange(max_blocks * block_size, device=device)
    kv_slots = bt[:, kv_pos // block_size] * block_size + kv_pos % block_size  # [R, max_kv]
    qi = torch.arange(max_q, device=device)
    q_valid = qi[None, :] < nums_t[:, None]
    q_index = torch.where(q_valid, q0[:, None] + qi[None, :], 0)
    meta = AttnMetadata(positions=positions, slot_mapping=slot, seq_lens=starts_t + nums_t, q_index=q_index,
                        q_valid=q_valid, kv_slots=kv_slots, q_pos=starts_t[:, None] + qi[None, :], block_table=bt,
                        block_size=block_size, cu_q=cu_q, max_q=max_q, starts=starts, nums=nums,
                        block_tables=[s.block_table for s in seqs], state_slots=[s.state_slot for s in seqs],
                        replay_starts=[s.replay_start for s in seqs], num_decodes=num_decodes,
                        swa_cuts=[s.prefix_replay_start for s in seqs],
                        enc_restored=[getattr(s, "swa_restore", None) is not None for s in seqs],
                        write_floors=[s.num_cached_tokens for s in seqs], state_rows=slots_t,
                        replay_rows=tables.cuts[0, slots_t], swa_cut_rows=tables.cuts[1, slots_t])
    return stream_ids(ids, batch, device), meta, qstart


@attrs.define(eq=False)
class ForwardInputs:
    """What the one model call of a step reads (prefill stage), built lazily: a CUDA-graph replay of a
    decode-only step needs only the host lists, not the metadata tensors."""

    batch: object  # ScheduledBatch
    rows: list  # [R] indices into batch.seqs, in stream order (decode rows first)
    where: list  # [R] stream row of each batch row (the inverse of rows)
    qstart: list  # [R + 1] stream offset of each row's first token
    sample_index: list  # [S] stream position of each sampling row's last token, sampling rows in batch order
    num_decodes: int  # leading rows that are one token and sample (decode rows)
    block_size: int
    device: torch.device
    tables: object = None  # core.block_tables.BlockTables (synced) to build on the device; None: on the host
    # [D] stream positions whose logits verify drafts: each drafting sampling row's last token and all but its
    # last draft (a row with k drafts: k positions, in batch order); empty when no row drafts.
    draft_index: list = attrs.field(factory=list)
    _built: Optional[tuple] = None

    @property
    def decode_only(self) -> bool:
        return self.num_decodes == len(self.rows)

    @property
    def num_tokens(self) -> int:
        return self.qstart[-1]

    def tensors(self) -> tuple:
        """(input_ids [T], AttnMetadata), built once."""
        if self._built is None:
            if self.tables is not None:
                ids, meta, _ = device_inputs(self.batch, self.rows, self.block_size, self.tables, self.num_decodes)
            else:
                ids, meta, _ = build_inputs(self.batch, self.rows, self.block_size, self.device, self.num_decodes)
            self._built = (ids, meta)
        return self._built

    def row_span(self, i: int) -> tuple:
        """Stream span [a, b) of batch row i."""
        r = self.where[i]
        return self.qstart[r], self.qstart[r + 1]


def plan(batch, block_size: int, device, tables=None) -> Optional[ForwardInputs]:
    """Lay out a scheduled batch as one stream (decode rows first, then the rest in batch order); None when
    nothing is scheduled."""
    n = len(batch.seqs)
    if n == 0:
        return None
    is_dec = [batch.num_tokens[i] == 1 and batch.samples[i] for i in range(n)]
    rows = [i for i in range(n) if is_dec[i]] + [i for i in range(n) if not is_dec[i]]
    qstart, where = [0], [0] * n
    for r, i in enumerate(rows):
        where[i] = r
        qstart.append(qstart[-1] + batch.num_tokens[i])
    sample_index = [qstart[where[i] + 1] - 1 for i in range(n) if batch.samples[i]]
    draft_index = []
    for i, d in enumerate(batch.drafts or ()):
        if d:
            end = qstart[where[i] + 1] - 1  # the last draft's position: its logits give the bonus token
            draft_index.extend(range(end - len(d), end))
    return ForwardInputs(batch, rows, where, qstart, sample_index, sum(is_dec), block_size, torch.device(device),
                         tables, draft_index)

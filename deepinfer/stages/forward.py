"""Shared by the forward stages (prefill, verify): turn scheduled rows into model inputs."""

from __future__ import annotations

import torch

from ..backends.base import AttnMetadata, to_device


def build_inputs(batch, rows: list, block_size: int, device) -> tuple:
    """rows: indices into batch.seqs. Returns (input_ids [T], AttnMetadata, query_start list [R+1])."""
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
                        cu_q=dev(qstart, torch.int32), max_q=max_q, starts=starts, nums=nums, block_tables=[s.block_table for s in seqs],
                        state_slots=[s.state_slot for s in seqs], replay_starts=[s.replay_start for s in seqs])
    ids_t = dev(ids)
    if ids and min(ids) < 0:
        ids_t = resolve_future(ids_t, batch.future)
    return ids_t, meta, qstart


def resolve_future(ids: torch.Tensor, future) -> torch.Tensor:
    """Replace pending references (-1 - i) by future[i], on the device: the token a launched step sampled
    (overlap scheduling) is read where it lies, without waiting for it on the host."""
    if future is None:
        raise RuntimeError("input ids hold pending token references but the batch carries no future buffer")
    return torch.where(ids < 0, future.reshape(-1)[(-1 - ids).clamp_(min=0)], ids)


def decode_rows(batch) -> list:
    """Rows the verify stage owns: one new token that samples (plain decode; drafts come later)."""
    return [i for i, (n, smp) in enumerate(zip(batch.num_tokens, batch.samples)) if smp and n == 1]


def prefill_rows(batch) -> list:
    owned = set(decode_rows(batch))
    return [i for i in range(len(batch.seqs)) if i not in owned]

"""A CED decode step's index plans in one launch each: where compression reads and writes, and where entries live.

models/ced/decode_path.py lays out, once per step and compression ratio m, from device tensors alone:
- the compression plan: each token's group j = pos // m, its tail slot pos % size, its group members' tail slots
  (j m + i) % size, and the cache row of entry j: block_table[row, j // per] * per + j % per, where per =
  block_size // m entries share a block; in a padded verify batch only a real token completing its group (pos % m
  == m - 1) writes its row's block, every other token the scratch block;
- the entry slots: the cache row of every entry id a block table can hold, [R, NB per].

In torch each is ~6-17 small kernels (divisions, remainders, aranges, gathers); here one integer kernel each,
bit for bit the same int64 values (backends/reference/ops.py holds the torch formulas). Positions are never
negative, so C's truncating division and remainder equal torch's floor ones. Capture-safe: shapes decide the
grids, nothing is read back.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .triton_pdl import launch_kw, pdl_start
from deepinfer.backends.nvidia.host_math import cdiv, next_pow2

BLOCK_T = 128  # tokens a program
BLOCK_J = 1024  # entry ids a program


@triton.jit
def _plan_kernel(pos_ptr, bt_ptr, rows_ptr, real_ptr, at_ptr, mem_ptr, j_ptr, out_ptr, n, stride_bt, NB, m, size,
                 per, scratch, BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, HAS_TAIL: tl.constexpr,
                 PADDED: tl.constexpr, PDL: tl.constexpr = 0):
    pdl_start(PDL)
    t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = t < n
    p = tl.load(pos_ptr + t, mask=ok, other=0)
    j = p // m
    tl.store(j_ptr + t, j, mask=ok)
    if HAS_TAIL:
        tl.store(at_ptr + t, p % size, mask=ok)
        i = tl.arange(0, BLOCK_M)
        tl.store(mem_ptr + t[:, None] * m + i[None, :], (j[:, None] * m + i[None, :]) % size,
                 mask=ok[:, None] & (i < m)[None, :])
    b = j // per
    if PADDED:  # the row's block (its last for an id past the table), or the scratch block
        row = tl.load(rows_ptr + t, mask=ok, other=0)
        b = tl.minimum(b, NB - 1)
        blk = tl.load(bt_ptr + row * stride_bt + b, mask=ok & (b >= 0), other=0)
        own = (tl.load(real_ptr + t, mask=ok, other=0) != 0) & (p % m == m - 1)
        blk = tl.where(own, blk, scratch)
    else:  # (b < NB by construction: a sequence's table covers its positions; masked so nothing reads past it)
        blk = tl.load(bt_ptr + t.to(tl.int64) * stride_bt + b, mask=ok & (b < NB), other=0)
    tl.store(out_ptr + t, blk * per + j % per, mask=ok)


@triton.jit
def _slots_kernel(bt_ptr, out_ptr, stride_bt, stride_o, J, per, BLOCK: tl.constexpr, PDL: tl.constexpr = 0):
    pdl_start(PDL)
    r = tl.program_id(0).to(tl.int64)
    ids = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = ids < J
    blk = tl.load(bt_ptr + r * stride_bt + ids // per, mask=ok, other=0)
    tl.store(out_ptr + r * stride_o + ids, blk * per + ids % per, mask=ok)


def supports_table(block_table: torch.Tensor) -> bool:
    """Whether the kernels read this block table: int64 [R, NB], unit stride along NB (block_slots' inputs)."""
    return block_table.dtype == torch.int64 and block_table.dim() == 2 \
        and (block_table.shape[1] == 0 or block_table.stride(1) == 1)


def supports(pos: torch.Tensor, block_table: torch.Tensor, rows: Optional[torch.Tensor] = None,
             real: Optional[torch.Tensor] = None) -> bool:
    """Whether compress_plan runs these: int64 pos [n] and a block table supports_table takes on one device;
    rows int64 [n] and real bool [n] together or neither."""
    if pos.dtype != torch.int64 or pos.dim() != 1 or not supports_table(block_table):
        return False
    if pos.device != block_table.device:
        return False
    if (rows is None) != (real is None):
        return False
    if rows is not None:
        if rows.dtype != torch.int64 or rows.shape != pos.shape or real.dtype != torch.bool or real.shape != pos.shape:
            return False
        if rows.device != pos.device or real.device != pos.device:
            return False
    return True


def compress_plan(pos: torch.Tensor, block_table: torch.Tensor, m: int, size: int, per: int,
                  rows: Optional[torch.Tensor] = None, real: Optional[torch.Tensor] = None,
                  scratch_block: int = 0) -> tuple:
    """(tail slot [n] or None, member slots [n, m] or None, group j [n], entry cache row [n]) int64, as
    ReferenceOps.ced_compress_plan computes them (tail slots only where m > 1). rows / real: a padded verify
    batch's token rows and real mask (see the module doc)."""
    if not supports(pos, block_table, rows, real) or m < 1 or per < 1 or (m > 1 and size < 1):
        raise ValueError(f"compress_plan: unsupported inputs: pos {pos.dtype} {tuple(pos.shape)}, block_table "
                         f"{block_table.dtype} {tuple(block_table.shape)}, m {m}, size {size}, per {per}")
    n, dev = pos.shape[0], pos.device
    tail = m > 1
    j = torch.empty(n, dtype=torch.int64, device=dev)
    out = torch.empty(n, dtype=torch.int64, device=dev)
    at = torch.empty(n, dtype=torch.int64, device=dev) if tail else None
    members = torch.empty(n, m, dtype=torch.int64, device=dev) if tail else None
    if n == 0:
        return at, members, j, out
    padded = rows is not None
    _plan_kernel[(cdiv(n, BLOCK_T),)](
        pos, block_table, rows if padded else pos, real.view(torch.uint8) if padded else pos,
        at if tail else j, members if tail else j, j, out, n, block_table.stride(0), block_table.shape[1], m,
        max(size, 1), per, int(scratch_block), BLOCK=BLOCK_T, BLOCK_M=next_pow2(m), HAS_TAIL=tail, PADDED=padded,
        num_warps=4, **launch_kw(dev))
    return at, members, j, out


def block_slots(block_table: torch.Tensor, per: int) -> torch.Tensor:
    """[R, NB per] int64: block_table[r, i // per] * per + i % per, the cache row of every entry id i."""
    if not supports_table(block_table) or per < 1:
        raise ValueError(f"block_slots: unsupported inputs: block_table {block_table.dtype} "
                         f"{tuple(block_table.shape)}, per {per}")
    R, NB = block_table.shape
    J = NB * per
    out = torch.empty(R, J, dtype=torch.int64, device=block_table.device)
    if R and J:
        _slots_kernel[(R, cdiv(J, BLOCK_J))](block_table, out, block_table.stride(0), out.stride(0), J, per,
                                              BLOCK=BLOCK_J, num_warps=4, **launch_kw(block_table.device))
    return out

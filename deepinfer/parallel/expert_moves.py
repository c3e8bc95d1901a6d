"""EPLB across the expert-parallel ranks: each rank's physical slots, and moving expert weights between ranks.

With ``enable_eplb`` and W > 1 ranks, a MoE layer has ``P = E + num_redundant_experts`` physical slots, ``S = P /
W`` on each rank (rank ``r`` holds slots ``[r S, (r + 1) S)``, as parallel/eplb.py numbers them). Every rank keeps
the whole tables (``RankPlacement``: phy2log, log2phy, logcnt of all P slots, identical on every rank) and the
weights of its own S slots only.

Start (``rank_initial_placement``): rank r's slots hold its contiguous experts ``[r E/W, (r+1) E/W)`` (what it
loaded from the checkpoint, as without EPLB) and then copies of them again, so no rank reads another rank's
experts at start-up; ``num_redundant_experts`` must divide over the ranks.

A rebalance (decided on rank 0, sent to every rank as the new phy2log at a step boundary) is applied by every
rank from the same old and new tables, so every rank derives the same ``move_plan``: each slot whose expert
changes takes it from a slot that holds it now, on its own rank where there is one, else from the lowest such
slot. Each rank then reads every source row it holds (its local copies and what it sends) before it writes any
slot, exchanges the rows with one ``all_to_all_single`` per expert tensor (w13, w2, FP8 scales; sent as bytes, so
the move is bitwise whatever the dtype), writes them, and adopts the new tables. No files, no host copy of the
weights on GPUs.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..models.moe import EXPERT_PARAMS
from .placement import ExpertPlacement, apply_placement


def rank_initial_placement(num_experts: int, num_slots: int, num_ranks: int) -> list:
    """phy2log [P] before any rebalance: rank r's S slots hold its E/W experts in order, then again from its
    first (module docstring)."""
    E, P, R = num_experts, num_slots, num_ranks
    if E % R or P % R:
        raise ValueError(f"EPLB over {R} ranks: {E} experts and {P} physical slots (experts + num_redundant_experts) "
                         f"must both divide over the ranks; choose num_redundant_experts a multiple of {R}")
    n, S = E // R, P // R
    return [(p // S) * n + (p % S) % n for p in range(P)]


def move_plan(old: list, new: list, num_ranks: int) -> list:
    """(dst slot, src slot) for every slot whose expert changes from ``old`` to ``new`` (phy2log lists): the source
    holds ``new[dst]`` under ``old``, on dst's rank where one does, else the lowest such slot. Sorted by dst."""
    S = len(old) // num_ranks
    holders: dict = {}
    for p, e in enumerate(old):
        holders.setdefault(e, []).append(p)
    plan = []
    for d, e in enumerate(new):
        if e == old[d]:
            continue
        if e not in holders:
            raise ValueError(f"EPLB: expert {e} has no slot in the placement in use (slot {d} cannot get it)")
        here = [s for s in holders[e] if s // S == d // S]
        plan.append((d, here[0] if here else holders[e][0]))
    return plan


class RankPlacement(ExpertPlacement):
    """One expert-parallel MoE block's placement: the tables of all P slots, the weights of this rank's S."""

    def __init__(self, phy2log: list, num_experts: int, device, comm):
        super().__init__(phy2log, num_experts, device)
        self.comm = comm
        self.per_rank = self.num_slots // comm.world_size

    def attach(self, block) -> None:
        """The block's loaded experts [E/W, ...] -> its S slots (copies of its own experts, from the tables)."""
        n, S, r = block.num_local, self.per_rank, self.comm.rank
        mine = self.phy2log_host[r * S:(r + 1) * S]
        if any(not block.first <= e < block.first + n for e in mine):
            raise ValueError(f"EPLB: rank {r}'s initial slots hold experts {mine}, not only its loaded experts "
                             f"[{block.first}, {block.first + n})")
        idx = torch.tensor([e - block.first for e in mine], device=block.w13.device)
        for name in EXPERT_PARAMS:
            p = getattr(block, name, None)
            if p is not None:
                p.data = p.data.index_select(0, idx)
        block.first, block.num_local, block.placement = r * S, S, self

    def move(self, block, phy2log: list) -> int:
        """Adopt ``phy2log`` on this rank (every rank calls it with the same tables, at the same step): the
        module docstring's exchange. Returns how many slots changed (on all ranks)."""
        plan = move_plan(self.phy2log_host, phy2log, self.comm.world_size)
        if not plan:
            return 0
        R, S, r = self.comm.world_size, self.per_rank, self.comm.rank
        local = [(d - r * S, s - r * S) for d, s in plan if d // S == r and s // S == r]
        sends = [(d, s - r * S) for d, s in plan if s // S == r and d // S != r]  # dst order = dst-rank order
        recvs = sorted(((s // S, d - r * S) for d, s in plan if d // S == r and s // S != r))  # by src rank, dst
        send_counts = [sum(1 for d, _ in sends if d // S == q) for q in range(R)]
        recv_counts = [sum(1 for q, _ in recvs if q == src) for src in range(R)]
        cross = any(d // S != s // S for d, s in plan)
        dev = block.w13.device

        def index(xs):
            return torch.tensor(xs, dtype=torch.long, device=dev)

        for name in EXPERT_PARAMS:
            p = getattr(block, name, None)
            if p is None:
                continue
            w = p.data.view(torch.uint8)  # [S, ..., bytes]: the exchange moves bytes, whatever the dtype
            local_rows = w.index_select(0, index([s for _, s in local])) if local else None  # read before writing
            got = None
            if cross:
                out = w.index_select(0, index([s for _, s in sends])) if sends else w.new_empty((0, *w.shape[1:]))
                got = self.comm.all_to_all(out, send_counts, recv_counts)  # [sum(recv), ...] by src rank, dst
            if local:
                w[index([d for d, _ in local])] = local_rows
            if recvs:
                w[index([d for _, d in recvs])] = got
        self._set_tables(phy2log)
        return len(plan)

    def logical(self, tensor: torch.Tensor) -> torch.Tensor:
        raise ValueError("an expert-parallel rank holds only its own slots: its experts' logical view (checkpoint "
                         "writing) is not available; gather them with DriverModel.expert_slots()")


def attach_rank_slots(model, num_slots: int, comm) -> Optional[list]:
    """Put every expert-parallel MoE block of a loaded shard on its rank's ``num_slots / W`` slots (the initial
    placement). Returns the initial phy2log."""
    blocks = model.moe_blocks()
    if not blocks:
        return None
    E = blocks[0].num_experts
    start = rank_initial_placement(E, num_slots, comm.world_size)
    for b in blocks:
        RankPlacement(start, E, b.w13.device, comm).attach(b)
    return start


def apply_on_rank(model, phy2log: torch.Tensor) -> int:
    """This rank's part of a rebalance: phy2log [L, P] (expert-load row order) adopted by every block in module
    order (the same on every rank, so the blocks' exchanges pair up)."""
    blocks = model.moe_blocks()
    return apply_placement(blocks, [model.expert_load.row[b.layer] for b in blocks], phy2log)


def gather_slots(block, comm) -> Optional[dict]:
    """{name: [P, ...]} the block's expert tensors of every rank's slots, on rank 0 (None elsewhere); bytes on the
    wire, so FP8 gathers over gloo too."""
    out = {}
    for name in EXPERT_PARAMS:
        p = getattr(block, name, None)
        if p is not None:
            got = comm.gather_cat(p.data.view(torch.uint8), dim=0)
            out[name] = None if got is None else got.view(p.dtype)
    return out if comm.rank == 0 else None

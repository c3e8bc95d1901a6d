"""Expert parallelism: a MoE block's experts sharded over R ranks, tokens dispatched to them and combined back.

Rank ``r`` holds experts ``[r E/R, (r+1) E/R)`` (w13, w2; its checkpoint tensors are the only expert tensors it
reads). The block's input is the same on every rank (attention is tensor-parallel or replicated), and so is the
router (replicated, float32). Two ways to run the experts, the same function:

* ``alltoall`` (the default): rank r takes its contiguous share of the tokens, sends each (token, choice) pair
  to the rank that holds the chosen expert (``all_to_all_single`` of the pairs' hidden rows, local expert ids and
  routing weights), runs its experts over what it received (``Ops.moe_experts`` with one choice per row), sends
  the weighted outputs back, sums each token's choices, and the tokens' outputs are all-gathered so every rank
  holds the whole batch again.
* ``allreduce`` (the fallback where all-to-all is missing or slow): every rank runs its own experts over the
  pairs that chose them, over all tokens, and one all-reduce sums the partial outputs.

Shared experts and the router stay replicated. The expert load is recorded on every rank for all tokens (the
driver's record is the one reported); with data-parallel attention each rank routes only its own tokens, so the
per-slot counts every rank sends (all-gathered before the exchange, which needs them anyway) give rank 0 the
whole batch's load.

EPLB (parallel/expert_moves.py): rank r then holds physical slots ``[r S, (r+1) S)`` (``first``, ``num_local``
count slots, not experts) and each choice goes to one replica's slot (``ExpertPlacement.physical_ids``) before
the same exchange.
"""

from __future__ import annotations

import re
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..backends.reference import moe as ref_moe
from ..backends.reference.moe import expert_counts
from ..models.moe import _FUSED_DOWN, _FUSED_GATE_UP, MoEBlock
from .tp_layers import Slice

EP_COMMS = ("alltoall", "allreduce")


class ExpertExchange:
    """The dispatch and combine of a block holding ``num_local`` experts (EPLB: physical slots) from ``first``,
    shared by ExpertParallelMoE and CED's expert-parallel layers (parallel/ced_parallel.py). The block provides
    ``ops``, ``w13``, ``w2``, ``clamp``, ``impl``, ``num_experts``, ``layer``, ``expert_load``, ``placement``."""

    comm: object
    first: int
    num_local: int
    ep_comm: str
    tokens_local: bool  # data-parallel attention: x is this rank's own tokens, not the whole batch

    def exchange(self, x, weights, ids):
        """x [T, d] with its routing (weights [T, k] float32, logical expert ids [T, k]) -> the routed experts'
        weighted sum [T, d], computed where the experts live."""
        # EPLB: each logical choice to one replica's physical slot (over all of x's tokens, as in one process).
        slots = ids if self.placement is None else self.placement.physical_ids(ids)
        return self._alltoall(x, weights, slots) if self.ep_comm == "alltoall" else self._allreduce(x, weights, slots)

    def _experts(self, xs, local_ids, w):
        """Rows xs [N, d], each with one local expert id [N] and weight [N] -> weighted outputs [N, d]."""
        if xs.shape[0] == 0:
            return xs.new_zeros(xs.shape)
        moe_experts = getattr(self.ops, "moe_experts", None)
        args = (xs, self.w13, self.w2, w[:, None], local_ids[:, None])
        if moe_experts is not None:
            return moe_experts(*args, clamp=self.clamp, impl=self.impl)
        fn = ref_moe.experts_dense if self.impl == "dense" else ref_moe.experts_routed
        return fn(*args, clamp=self.clamp)

    def _allreduce(self, x, weights, ids):
        T, k = ids.shape
        flat = ids.reshape(-1)
        mine = ((flat >= self.first) & (flat < self.first + self.num_local)).nonzero().flatten()  # [N] pair indices
        ys = self._experts(x[mine // k], flat[mine] - self.first, weights.reshape(-1)[mine])  # [N, d]
        out = torch.zeros(T, x.shape[1], dtype=torch.float32, device=x.device)
        out.index_add_(0, mine // k, ys.float())
        return self.comm.all_reduce(out).to(x.dtype)

    def _alltoall(self, x, weights, ids):
        """ids [T, k]: the slot of each choice (the expert without EPLB); rank r holds slots [r S, (r+1) S)."""
        comm, R, S = self.comm, self.comm.world_size, self.num_local
        T, k = ids.shape
        if self.tokens_local:  # data-parallel attention: this rank's own tokens
            lo, hi = 0, T
        else:  # the same tokens on every rank: each takes its share, [bounds[r], bounds[r + 1])
            bounds = [T * r // R for r in range(R + 1)]
            lo, hi = bounds[comm.rank], bounds[comm.rank + 1]
        flat = ids[lo:hi].reshape(-1)  # [n k] my tokens' choices
        dest = flat // S  # [n k] the rank holding each chosen slot
        order = torch.argsort(dest, stable=True)
        every = comm.all_gather(expert_counts(flat, R * S))  # [R, R S] each rank's pairs per slot
        send = every[comm.rank].view(R, S).sum(1).tolist()  # pairs I send each rank
        counts = every[:, comm.rank * S:(comm.rank + 1) * S].sum(1).tolist()  # pairs each rank sends me
        if self.tokens_local and self.expert_load is not None:  # the whole batch's load, from every rank's counts
            per_slot = every.sum(0)  # [P]
            load = per_slot if self.placement is None else torch.zeros(
                self.num_experts, dtype=per_slot.dtype, device=per_slot.device).index_add_(
                0, self.placement.phy2log, per_slot)
            self.expert_load.record_counts(self.layer, load)
        tok = lo + order // k  # [n k] token of each sorted pair
        xs = comm.all_to_all(x[tok], send, counts)  # [M, d]
        meta = torch.stack([flat[order] - dest[order] * S,
                            weights[lo:hi].reshape(-1)[order].view(torch.int32).long()], dim=1)  # [n k, 2]
        meta = comm.all_to_all(meta, send, counts)  # [M, 2] local expert id, weight's float32 bits
        w = meta[:, 1].to(torch.int32).view(torch.float32)
        ys = self._experts(xs, meta[:, 0], w)  # [M, d] weighted
        back = comm.all_to_all(ys, counts, send)  # [n k, d] in my sorted pair order
        mine = torch.zeros(hi - lo, x.shape[1], dtype=torch.float32, device=x.device)
        mine.index_add_(0, tok - lo, back.float())
        if self.tokens_local:
            return mine.to(x.dtype)
        return comm.all_gather_rows(mine, [bounds[r + 1] - bounds[r] for r in range(R)]).to(x.dtype)


class ExpertParallelMoE(ExpertExchange, MoEBlock):
    """A MoEBlock holding ``num_local`` experts (EPLB: physical slots) from ``first``; set up by
    ``shard_experts``."""

    def _slots(self) -> dict:
        """The checkpoint names of this rank's experts (their global numbers) and of the replicated tensors."""
        out = {}
        for name, (pname, idx) in MoEBlock._slots(self).items():
            m = re.match(r"experts\.(\d+)\.", name)
            if m is None:
                out[name] = (pname, idx)
            elif self.first <= int(m.group(1)) < self.first + self.num_local:
                out[name] = (pname, (int(m.group(1)) - self.first, *idx[1:]))
        return out

    def _route(self, x):
        logits = F.linear(x.float(), self.gate_weight.float())  # [T, E]
        kw = dict(scoring=self.scoring, renormalize=self.renormalize, scaling=self.scaling, n_group=self.n_group,
                  topk_group=self.topk_group, group_score=self.group_score, bias=self.e_score_correction_bias)
        moe_route = getattr(self.ops, "moe_route", None)
        weights, ids = (moe_route(logits, self.top_k, **kw) if moe_route is not None
                        else ref_moe.route(logits, self.top_k, **kw))  # [T, k] float32, [T, k] int64
        if self.expert_load is not None and not self.tokens_local:  # every rank routes every token
            self.expert_load.record(self.layer, ids)
        return weights, ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self._route(x)
        out = self.exchange(x, weights, ids)
        if self.shared_w13 is not None:
            gate, up = F.linear(x, self.shared_w13).chunk(2, dim=-1)  # [T, Fs] each
            shared = F.linear(F.silu(gate) * up, self.shared_w2)  # [T, d]
            if self.shared_gate_weight is not None:
                shared = torch.sigmoid(F.linear(x, self.shared_gate_weight)) * shared
            out = out + shared
        return out


def hold_share(b, cls, comm, ep_comm: str, tokens_local: bool) -> None:
    """Make block ``b`` (on the meta device, ``b.num_experts`` experts in ``w13`` [E, ...] and ``w2``) a ``cls``
    (an ExpertExchange) holding this rank's E / R experts."""
    R, E = comm.world_size, b.num_experts
    if E % R:
        raise ValueError(f"enable_expert_parallel: {E} experts do not divide over {R} ranks "
                         f"(tensor_parallel_size x data_parallel_size); choose a world size that divides {E}")
    n = E // R
    b.__class__ = cls
    b.comm, b.first, b.num_local, b.ep_comm, b.tokens_local = comm, comm.rank * n, n, ep_comm, tokens_local
    b.w13 = nn.Parameter(torch.empty(n, *b.w13.shape[1:], device="meta", dtype=b.w13.dtype), requires_grad=False)
    b.w2 = nn.Parameter(torch.empty(n, *b.w2.shape[1:], device="meta", dtype=b.w2.dtype), requires_grad=False)


def shard_experts(model, comm, ep_comm: str = "alltoall", tokens_local: bool = False) -> tuple:
    """Turn every MoEBlock of a model on the meta device into an ExpertParallelMoE holding this rank's experts.
    Returns (block checkpoint prefixes, the expert ranges) for the checkpoint plan (``expert_plan``)."""
    if ep_comm not in EP_COMMS:
        raise ValueError(f"expert-parallel communication {ep_comm!r} is invalid: expected one of {EP_COMMS}")
    blocks = [m for m in model.modules() if isinstance(m, MoEBlock)]
    prefixes = []
    for b in blocks:
        hold_share(b, ExpertParallelMoE, comm, ep_comm, tokens_local)
        prefixes.append(b.checkpoint_prefix)
    return blocks, prefixes


def _alias(prefix: str) -> tuple:
    """A block's checkpoint prefix and Mixtral's other spelling of it (transformers 5 writes either)."""
    if prefix.endswith(".block_sparse_moe"):
        return prefix, prefix[:-len("block_sparse_moe")] + "mlp"
    return (prefix,)


def expert_plan(blocks: list) -> tuple:
    """(keep(name), plan(name)) for the MoE blocks' checkpoint tensors: another rank's per-expert tensors are
    not read; fused expert tensors ([E, ...]) are read as this rank's rows."""
    where = {}
    for b in blocks:
        for p in _alias(b.checkpoint_prefix):
            where[p + "."] = b

    def block_of(name: str) -> Optional[tuple]:
        for p, b in where.items():
            if name.startswith(p):
                return b, name[len(p):]
        return None

    def keep(name: str) -> bool:
        found = block_of(name)
        if found is None:
            return True
        b, local = found
        m = re.match(r"experts\.(\d+)\.", local)
        return m is None or b.first <= int(m.group(1)) < b.first + b.num_local

    def plan(name: str) -> Optional[Slice]:
        found = block_of(name)
        if found is None:
            return None
        b, local = found
        if local in (_FUSED_GATE_UP, _FUSED_DOWN):
            return Slice(0, b.first, b.first + b.num_local)
        return None

    return keep, plan, tuple(where)

"""EPLB while serving: physical expert slots, replica routing, rebalancing from the window.

``enable_eplb(model, eplb_config)`` (LLM(enable_eplb=True, eplb_config={...}) calls it) gives every MoEBlock
(and every CEDLayer, which has the same attributes) an ``ExpertPlacement``: its expert weights become ``P = E +
num_redundant_experts`` physical slots (w13 [P, 2F, d], w2 [P, d, F], FP8 scales alike), slot ``p`` a copy of
logical expert ``phy2log[p]``, and the block routes each logical choice to one replica. ``Eplb`` counts engine
steps (the model's ``end_step``) and every ``step_interval`` steps reads the expert load of the last
``window_size`` steps (models/expert_load.py), asks the policy (parallel/eplb.py) for a placement and copies
expert weights between slots where it changed.

Replica choice (deterministic): a token's choice of expert ``e`` goes to replica ``j mod c_e`` of ``e``, where
``j`` counts the earlier (token, choice) pairs of the step's layer that chose ``e`` (token order, then choice
order) and ``c_e`` is ``e``'s replica count. Each replica so gets its share of ``e``'s tokens to within one,
which is what the policy assumes. Replicas are copies, so the output does not depend on the choice beyond the
rounding of differently sized matmuls.

In one process the "ranks" and "nodes" are simulated (``num_ranks`` / ``num_nodes`` slot groups of one
device), so the balancedness figures say what expert parallelism would see, and the weight moves are copies
within one tensor. Over the torch.distributed workers (``tensor_parallel_size`` x ``data_parallel_size`` > 1,
``enable_expert_parallel``) each rank holds only its ``P / W`` slots (parallel/expert_moves.py), rank 0's
``Eplb`` decides, and the move is an exchange of weights between ranks; the tables, the routing and the policy
are these.

Rebalancing reads the window's counts back to the host (one sync every ``step_interval`` steps) and runs the
policy on the CPU (0.8 to 4.7 s for a whole Qwen3-30B-A3B- or DeepSeek-V3-shaped model: docs/benchmarks.md).
"""

from __future__ import annotations

import logging
from typing import Optional

import attrs
import torch

from ..backends.reference.moe import expert_counts
from ..models.moe import EXPERT_PARAMS
from . import eplb

log = logging.getLogger(__name__)


def _count(name: str, minimum: int):
    def check(inst, attribute, value):
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise ValueError(f"eplb_config[{name!r}]={value!r} is invalid: must be an int >= {minimum}")
    return check


def _bool(inst, attribute, value):
    if not isinstance(value, bool):
        raise ValueError(f"eplb_config[{attribute.name!r}]={value!r} is invalid: must be a bool")


@attrs.frozen
class EplbConfig:
    """vLLM's EPLB keys (same defaults), plus the layout of the expert-parallel ranks."""

    window_size: int = attrs.field(default=1000, validator=_count("window_size", 1))  # engine steps of load kept
    step_interval: int = attrs.field(default=3000, validator=_count("step_interval", 1))  # steps between rebalances
    num_redundant_experts: int = attrs.field(default=0, validator=_count("num_redundant_experts", 0))
    log_balancedness: bool = attrs.field(default=False, validator=_bool)  # log before/after at each rebalance
    # DeepInfer's: the expert-parallel ranks and nodes the slots are laid out over (simulated in one process;
    # with parallel workers num_ranks is the world size: None, or that number).
    num_ranks: Optional[int] = attrs.field(default=None, validator=attrs.validators.optional(_count("num_ranks", 1)))
    num_nodes: int = attrs.field(default=1, validator=_count("num_nodes", 1))

    def __attrs_post_init__(self) -> None:
        if self.num_ranks is not None and self.num_ranks % self.num_nodes:
            raise ValueError(f"eplb_config['num_ranks']={self.num_ranks} is not a multiple of "
                             f"eplb_config['num_nodes']={self.num_nodes}")

    @classmethod
    def from_dict(cls, d: Optional[dict]) -> "EplbConfig":
        if d is None:
            return cls()
        if isinstance(d, cls):
            return d
        if not isinstance(d, dict):
            raise ValueError(f"eplb_config={d!r} is invalid: must be a dict of {sorted(cls.keys())}")
        unknown = set(d) - cls.keys()
        if unknown:
            raise ValueError(f"eplb_config has unknown key(s) {sorted(unknown)}; known: {sorted(cls.keys())}")
        return cls(**d)

    @staticmethod
    def keys() -> set:
        return {f.name for f in attrs.fields(EplbConfig)}


class ExpertPlacement:
    """One MoEBlock's physical slots: tables on the block's device (fixed shapes, updated in place, so a
    captured CUDA graph stays valid) and a host copy of phy2log."""

    def __init__(self, phy2log: list, num_experts: int, device):
        P, E = len(phy2log), num_experts
        self.num_experts, self.num_slots = E, P
        self.phy2log_host = list(phy2log)
        self.phy2log = torch.zeros(P, dtype=torch.long, device=device)  # [P]
        self.log2phy = torch.zeros(E, P - E + 1, dtype=torch.long, device=device)  # [E, most replicas], -1 pad
        self.logcnt = torch.zeros(E, dtype=torch.long, device=device)  # [E]
        self._set_tables(phy2log)

    def _set_tables(self, phy2log: list) -> None:
        log2phy, logcnt = eplb.tables(torch.tensor([phy2log]), self.num_experts)
        pad = torch.full((self.num_experts, self.log2phy.shape[1]), -1, dtype=torch.long)
        pad[:, :log2phy.shape[2]] = log2phy[0]
        self.phy2log.copy_(torch.tensor(phy2log))
        self.log2phy.copy_(pad)
        self.logcnt.copy_(logcnt[0])
        self.phy2log_host = list(phy2log)

    def physical_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T, k] logical experts -> [T, k] physical slots (the module docstring's replica choice)."""
        flat = ids.reshape(-1).long()  # [N] pairs in token order
        order = torch.argsort(flat, stable=True)  # [N] pairs grouped by expert, token order within
        counts = expert_counts(flat, self.num_experts)  # [E]
        start = counts.cumsum(0) - counts  # [E] first sorted position of each expert
        nth = torch.empty_like(flat)
        nth[order] = torch.arange(flat.numel(), device=flat.device) - start[flat[order]]  # [N] earlier same-expert pairs
        replica = nth % self.logcnt[flat]  # [N]
        return self.log2phy[flat, replica].view_as(ids)

    def attach(self, block) -> None:
        """Expand the block's [E, ...] expert tensors into the [P, ...] slots."""
        idx = torch.tensor(self.phy2log_host, device=block.w13.device)
        for name in EXPERT_PARAMS:
            p = getattr(block, name, None)
            if p is not None:
                p.data = p.data.index_select(0, idx)
        block.placement = self

    def move(self, block, phy2log: list) -> int:
        """Adopt ``phy2log``: copy into each changed slot the weights of a slot that holds its expert now. Returns
        how many slots changed."""
        old = self.phy2log_host
        dst = [p for p in range(self.num_slots) if phy2log[p] != old[p]]
        if not dst:
            return 0
        src = [old.index(phy2log[p]) for p in dst]  # every expert has a slot before and after
        device = block.w13.device
        dst_t, src_t = torch.tensor(dst, device=device), torch.tensor(src, device=device)
        for name in EXPERT_PARAMS:
            p = getattr(block, name, None)
            if p is not None:
                p.data[dst_t] = p.data[src_t]  # the right side is gathered first: no slot is read after written
        self._set_tables(phy2log)
        return len(dst)

    def logical(self, tensor: torch.Tensor) -> torch.Tensor:
        """A [P, ...] slot tensor -> [E, ...] one copy per logical expert (its first replica)."""
        return tensor[self.log2phy[:, 0]]


class Eplb:
    """The rebalancing loop of one model: counts steps, rebalances, keeps the before/after record.

    In one process it attaches the default placement and moves weights within each block (simulated ranks).
    Over expert-parallel workers (``mover`` given: parallel/workers.py's DriverModel.move_experts) the blocks
    are already on their ranks' slots, ``num_ranks`` is the world size, and ``mover(phy2log [L, P])`` applies a
    placement on every rank and returns how many slots changed."""

    def __init__(self, model, config: EplbConfig, num_ranks: Optional[int] = None, mover=None):
        blocks = model.moe_blocks() if hasattr(model, "moe_blocks") else []
        load = getattr(model, "expert_load", None)
        if not blocks or load is None:
            raise ValueError(f"enable_eplb needs a mixture-of-experts model with MoE blocks (Mixtral, Qwen-MoE, "
                             f"DeepSeek-V2/V3, CED); {type(model).__name__} has none")
        E = blocks[0].num_experts
        self.config, self.blocks, self.load = config, blocks, load
        self.num_experts, self.num_slots = E, E + config.num_redundant_experts
        if num_ranks is not None and config.num_ranks not in (None, num_ranks):
            raise ValueError(f"eplb_config['num_ranks']={config.num_ranks} does not match the {num_ranks} "
                             "expert-parallel ranks (tensor_parallel_size x data_parallel_size); leave it out")
        self.num_ranks = num_ranks or config.num_ranks or 1
        self.num_groups = blocks[0].n_group or 1
        eplb.check_layout(E, self.num_slots, self.num_groups, config.num_nodes, self.num_ranks)
        self.rows = [load.row[b.layer] for b in blocks]  # each block's row of the expert-load totals
        placed = [b.placement is not None for b in blocks]
        self.distributed = mover is not None
        if mover is None:
            if any(placed):
                raise ValueError("EPLB is already enabled on this model")
            default = eplb.default_placement(1, E, self.num_slots)[0].tolist()
            for b in blocks:
                ExpertPlacement(default, E, b.w13.device).attach(b)
            mover = self._move_here
        elif not all(placed) or any(b.placement.num_slots != self.num_slots for b in blocks):
            raise ValueError(f"EPLB over workers: every MoE block must be on {self.num_slots} physical slots first")
        self._mover = mover
        load.set_window(config.window_size)
        self.initial = self.current()  # [L, P] the placement serving started with
        self.steps = 0
        self.history: list = []

    def _move_here(self, phy2log: torch.Tensor) -> int:
        return apply_placement(self.blocks, self.rows, phy2log)

    def current(self) -> torch.Tensor:
        """[L, P] phy2log of every block, in expert-load row order."""
        out = torch.empty(len(self.load.layers), self.num_slots, dtype=torch.long)
        for b, row in zip(self.blocks, self.rows):
            out[row] = torch.tensor(b.placement.phy2log_host)
        return out

    def end_step(self) -> None:
        self.steps += 1
        if self.steps % self.config.step_interval == 0:
            self.rebalance()

    def balancedness(self, phy2log, load=None) -> float:
        load = self.load.totals() if load is None else load
        return eplb.balancedness(eplb.rank_loads(load, phy2log, self.num_ranks))

    def rebalance(self) -> dict:
        """Place the experts for the window's load now; returns the record added to ``history``."""
        c = self.config
        load = self.load.totals()  # [L, E] the one host sync
        current = self.current()
        phy2log, _, _ = eplb.rebalance_experts(load, self.num_slots, self.num_groups, c.num_nodes, self.num_ranks,
                                               current)
        moved = self._mover(phy2log)
        rec = {"step": self.steps, "window_steps": min(self.load.num_steps, self.load.window),
               "tokens": int(load.sum()), "before": self.balancedness(current, load),
               "after": self.balancedness(phy2log, load), "moved_slots": moved}
        self.history.append(rec)
        if c.log_balancedness:
            log.info("EPLB at step %d: balancedness %.3f -> %.3f, %d slots moved", rec["step"], rec["before"],
                     rec["after"], moved)
        return rec

    def stats(self) -> dict:
        c = self.config
        load = self.load.totals()
        return {"num_logical_experts": self.num_experts, "num_physical_experts": self.num_slots,
                "num_redundant_experts": c.num_redundant_experts, "num_ranks": self.num_ranks,
                "num_nodes": c.num_nodes, "distributed": self.distributed,
                "window_size": c.window_size, "step_interval": c.step_interval, "steps": self.steps,
                "window_steps": min(self.load.num_steps, self.load.window), "tokens": int(load.sum()),
                "balancedness_default": self.balancedness(self.initial, load),
                "balancedness": self.balancedness(self.current(), load),
                "rebalances": len(self.history), "history": list(self.history)}


def apply_placement(blocks: list, rows: list, phy2log: torch.Tensor) -> int:
    """Adopt phy2log [L, P] (expert-load row order) in every block (``rows[i]``: block i's row); returns how many
    slots changed. Over workers every rank calls it with the same tables, blocks in the same order."""
    return sum(b.placement.move(b, phy2log[row].tolist()) for b, row in zip(blocks, rows))


def enable_eplb(model, eplb_config=None) -> Eplb:
    """Put every MoE block of ``model`` on physical slots (default placement) and return its rebalancing loop,
    also set as ``model.eplb`` (the model's end_step drives it)."""
    state = Eplb(model, EplbConfig.from_dict(eplb_config))
    model.eplb = state
    return state

"""CED (models/ced/) under parallel serving: every layer's routed experts expert-parallel, the rest replicated.

Each rank holds experts ``[r E/R, (r+1) E/R)`` of every layer (``w13``, ``w2``: the only expert tensors it reads)
and runs them for the tokens routed there (parallel/expert_parallel.py's exchange, as DeepSeek-V3's); the router,
the shared expert, attention, the indexer and the compressor are replicated. Without data-parallel attention
every rank computes every row (its caches hold every sequence); with it each rank computes its own rows, and its
``CEDCache`` holds only its sequences: paged global KV and indexer keys in its partition of the block ids
(core/rank_pools.py), SWA rings, compressor tails and scoring rings in its own state slots (``slot // D``).

Two rules keep the ranks' collectives paired when their rows differ (data-parallel attention): a pass with no
query on this rank still joins each layer's exchange (``moe_is_collective``, read by models/ced/engine_path.py),
and when any row of the step scores its prompt (``ReplayStart``) every rank runs the scoring pass
(``meta.cache["score_pass"]``), on the host path. The expert load is then counted from the exchange's
per-expert counts of every rank (the model's own per-rank record is off).

EPLB places CED's experts as it places MoEBlocks' (a CEDLayer carries the same ``num_experts``, ``layer``,
``placement``): each rank's slots (parallel/expert_moves.py), the exchange routing to replicas' slots.
"""

from __future__ import annotations

import re
from typing import Optional

from ..models.ced.model import CEDForCausalLM, CEDLayer
from .expert_parallel import ExpertExchange, hold_share
from .tp_layers import Slice

_EXPERTS = re.compile(r"^layers\.(\d+)\.(w13|w2)$")


class ExpertParallelCEDLayer(ExpertExchange, CEDLayer):
    """A CEDLayer whose routed experts run where they live (set up by ``shard_ced``)."""

    moe_is_collective = True

    def routed_experts(self, x, weights, ids):
        return self.exchange(x, weights, ids)


class ExpertParallelCED(CEDForCausalLM):
    """A CED model with data-parallel attention: the exchange records every rank's expert load."""

    def record_expert_load(self, layer: int, ids) -> None:
        pass


def shard_ced(model: CEDForCausalLM, comm, ops, ep_comm: str, tokens_local: bool) -> tuple:
    """Turn a CED model on the meta device into this rank's shard; returns (keep, plan) for its checkpoint."""
    if tokens_local and ep_comm != "alltoall":
        raise ValueError(f"expert_parallel_comm={ep_comm!r} with data-parallel attention: it needs 'alltoall'")
    c = model.config
    for layer in model.layers:
        layer.expert_load = None
        layer.ops, layer.clamp, layer.impl = ops, c.swiglu_limit, "routed"
        hold_share(layer, ExpertParallelCEDLayer, comm, ep_comm, tokens_local)
        if tokens_local:
            layer.expert_load = model.expert_load
    if tokens_local:
        model.__class__ = ExpertParallelCED
    first, n = model.layers[0].first, model.layers[0].num_local

    def plan(name: str) -> Optional[Slice]:
        return Slice(0, first, first + n) if _EXPERTS.match(name) else None

    return (lambda name: True), plan

"""Expert-parallel load balancing (EPLB): where to put each expert's replicas, from its measured load.

Our own implementation of the hierarchical policy DeepSeek describes for V3 (github.com/deepseek-ai/EPLB):

* The model has ``E`` logical experts per MoE layer and ``num_replicas`` physical slots (``E`` plus the
  redundant ones), ``num_replicas / num_ranks`` slots on each rank (GPU), ``num_ranks / num_nodes`` ranks on
  each node. A logical expert with ``c`` replicas is assumed to split its load evenly over them (the serving
  side makes this true to within one token: models/moe.py via parallel/placement.py).
* Hierarchical policy, when ``num_groups`` (the router's expert groups, ``n_group``) is a multiple of
  ``num_nodes``: pack the groups onto the nodes, ``num_groups / num_nodes`` on each, heaviest group first onto
  the lightest node with room (so group-limited routing keeps a token's experts on few nodes); then on each
  node, replicate its experts into the node's slots and pack the replicas onto the node's ranks.
* Global policy, otherwise: replicate over all experts and pack onto all ranks, ignoring groups and nodes.
* Replicate: every expert gets one slot, and each further slot goes to the expert whose per-replica load
  (load / replicas) is the highest. Pack: replicas heaviest first, each onto the lightest rank that still
  has a free slot (every rank ends with exactly its slots).
* Refinement (ours): the greedy placement, and the placement in use (``current``, by default
  ``default_placement``; under the hierarchical policy only where it keeps each group on one node and its
  busiest node is within the margin below), are improved by swapping slots between the heaviest rank and another;
  the one in use is kept unless the other's heaviest rank is lighter by more than ``KEEP_MARGIN`` (1%), so
  rebalancing never makes the heaviest rank heavier and does not move most weights for a sliver.
* Then, where the search is small (at most ``EXACT_MAX_SLOTS`` slots per node, within ``EXACT_BUDGET``
  search nodes), a branch-and-bound search over replica counts and packings replaces the result by a placement
  whose heaviest rank is as light as possible (the greedy can miss it: loads 4, 4, 1 on 2 ranks of 2 slots
  give 5 for the greedy replication, 4.5 when the light expert takes the redundant slot). On real sizes (128
  experts) the refined greedy result stands.

Balancedness is DeepSeek's and vLLM's figure of merit: the mean rank load over the heaviest rank's load,
summed over layers first (a layer waits for its heaviest rank, so the sum of the maxima is the time).

Tables (torch int64, on the CPU): ``phy2log`` [L, P] the logical expert in each physical slot; ``log2phy``
[L, E, max replicas] the slots of each logical expert in increasing order, padded with -1; ``logcnt`` [L, E]
the replica counts. Slots are numbered rank by rank: rank ``r`` holds slots ``[r * P / R, (r + 1) * P / R)``.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from typing import Optional, Sequence

import torch

EXACT_MAX_SLOTS = 16  # the exact phase runs on (layer, node) sub-problems of at most this many slots
EXACT_BUDGET = 50_000  # and gives up after this many search nodes (the placement found so far stands)
# The placement in use (refined by swaps) stays unless a new one's heaviest rank is lighter by more than this
# fraction: a fresh greedy placement differs in most slots, and from one window to the next of the same
# router it is often only 0.1% lighter (benchmarks/eplb_bench.py).
KEEP_MARGIN = 0.01


def check_layout(num_experts: int, num_replicas: int, num_groups: int, num_nodes: int, num_ranks: int) -> None:
    """Raise ValueError naming the value when these numbers cannot describe an expert placement."""
    for name, v in (("num_experts", num_experts), ("num_replicas", num_replicas), ("num_groups", num_groups),
                    ("num_nodes", num_nodes), ("num_ranks", num_ranks)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"EPLB: {name}={v!r} is invalid: must be an int >= 1")
    if num_replicas < num_experts:
        raise ValueError(f"EPLB: num_replicas={num_replicas} is fewer than the {num_experts} logical experts "
                         "(every expert needs a slot)")
    if num_replicas % num_ranks:
        raise ValueError(f"EPLB: num_replicas={num_replicas} physical slots do not divide over num_ranks={num_ranks} "
                         "ranks (choose num_redundant_experts so that experts + redundant is a multiple of the ranks)")
    if num_ranks % num_nodes:
        raise ValueError(f"EPLB: num_ranks={num_ranks} is not a multiple of num_nodes={num_nodes}")
    if num_experts % num_groups:
        raise ValueError(f"EPLB: num_groups={num_groups} does not divide the {num_experts} experts")


def _as_load(load) -> torch.Tensor:
    load = torch.as_tensor(load)
    if load.dim() == 1:
        load = load[None]
    if load.dim() != 2:
        raise ValueError(f"EPLB: load must be [layers, experts], got shape {tuple(load.shape)}")
    load = load.detach().to("cpu", torch.float64)
    if not torch.isfinite(load).all() or (load < 0).any():
        raise ValueError("EPLB: load must be finite and >= 0")
    return load


# The greedy steps.
def replicate(load: Sequence[float], num_slots: int) -> list:
    """Replica count per expert: one each, then every further slot to the highest load per replica
    (ties to the lower expert id)."""
    counts = [1] * len(load)
    heap = [(-w, e) for e, w in enumerate(load)]
    heapq.heapify(heap)
    for _ in range(num_slots - len(load)):
        _, e = heapq.heappop(heap)
        counts[e] += 1
        heapq.heappush(heap, (-load[e] / counts[e], e))
    return counts


def pack(weights: Sequence[float], num_bins: int) -> list:
    """Balanced packing of ``len(weights)`` items into ``num_bins`` bins of exactly ``len / num_bins`` items:
    heaviest item first (ties: lower index) onto the lightest bin with room (ties: lower bin). Returns the
    bin of each item."""
    per_bin = len(weights) // num_bins
    sums, sizes = [0.0] * num_bins, [0] * num_bins
    out = [0] * len(weights)
    for i in sorted(range(len(weights)), key=lambda i: (-weights[i], i)):
        b = min((b for b in range(num_bins) if sizes[b] < per_bin), key=lambda b: (sums[b], b))
        out[i] = b
        sums[b] += weights[i]
        sizes[b] += 1
    return out


def _greedy(load: Sequence[float], num_slots: int, num_ranks: int) -> list:
    """Rank-ordered list of experts per rank: replicate, then pack."""
    counts = replicate(load, num_slots)
    items = [e for e, c in enumerate(counts) for _ in range(c)]
    bins = pack([load[e] / counts[e] for e in items], num_ranks)
    ranks = [[] for _ in range(num_ranks)]
    for e, b in zip(items, bins):
        ranks[b].append(e)
    return ranks


def _max_rank(load: Sequence[float], ranks: list) -> float:
    counts = [0] * len(load)
    for r in ranks:
        for e in r:
            counts[e] += 1
    return max(sum(load[e] / counts[e] for e in r) for r in ranks)


# The exact phase (small sub-problems).
def _compositions(total: int, parts: int):
    """Every tuple of ``parts`` ints >= 1 summing to ``total``."""
    if parts == 1:
        yield (total,)
        return
    for first in range(1, total - parts + 2):
        for rest in _compositions(total - first, parts - 1):
            yield (first,) + rest


def _search(load: Sequence[float], num_slots: int, num_ranks: int, best: float, budget: int):
    """Branch and bound for a placement whose heaviest rank is lighter than ``best``. Returns the experts of
    each rank of the lightest one found (None: none beats ``best``) and whether the search finished within
    ``budget`` nodes (then nothing beats what it returns)."""
    E, per_rank = len(load), num_slots // num_ranks
    if num_slots > EXACT_MAX_SLOTS or math.comb(num_slots - 1, E - 1) > budget:
        return None, False
    total = sum(load)
    lower, tol = total / num_ranks, 1e-12 * max(total, 1.0)
    nodes, found = 0, None

    def dfs(items, i, sums, bins, low) -> Optional[list]:
        """Place items[i:]; low[e]: the lowest rank expert e's next replica may take (replicas are alike)."""
        nonlocal nodes
        nodes += 1
        if nodes > budget:
            raise TimeoutError
        if i == len(items):
            return [list(b) for b in bins]
        w, e = items[i]
        tried = set()
        for b in range(low[e], num_ranks):
            if len(bins[b]) == per_rank or (sums[b], len(bins[b])) in tried or sums[b] + w >= best - tol:
                continue
            tried.add((sums[b], len(bins[b])))  # a rank alike to one tried would repeat its subtree
            sums[b] += w
            bins[b].append(e)
            saved, low[e] = low[e], b
            done = dfs(items, i + 1, sums, bins, low)
            low[e] = saved
            bins[b].pop()
            sums[b] -= w
            if done is not None:
                return done
        return None

    try:
        for counts in _compositions(num_slots, E):
            items = sorted(((load[e] / c, e) for e, c in enumerate(counts) for _ in range(c)),
                           key=lambda t: (-t[0], t[1]))
            while max(lower, items[0][0]) < best - tol:  # each placement found lowers best: look again
                ranks = dfs(items, 0, [0.0] * num_ranks, [[] for _ in range(num_ranks)], [0] * E)
                if ranks is None:
                    break
                found, best = ranks, _max_rank(load, ranks)
            if best <= lower + tol:
                break
    except TimeoutError:
        return found, False
    return found, True


def _improve(load: Sequence[float], ranks: list, max_rounds: int = 10_000) -> list:
    """Swap slots between the heaviest rank and another while that lowers the heavier of the two below the
    heaviest's load (replica counts fixed). Each swap lowers the sorted vector of rank loads, so it ends.
    Slots keep their positions: a rank's other slots do not move."""
    counts = [0] * len(load)
    for r in ranks:
        for e in r:
            counts[e] += 1
    w = [[load[e] / counts[e] for e in r] for r in ranks]
    sums = [sum(x) for x in w]
    for _ in range(max_rounds):
        h = max(range(len(ranks)), key=lambda r: (sums[r], -r))
        move = None
        for o in range(len(ranks)):
            if o == h:
                continue
            for i, wi in enumerate(w[h]):
                for j, wj in enumerate(w[o]):
                    peak = max(sums[h] - wi + wj, sums[o] - wj + wi)
                    if wi > wj and peak < sums[h] * (1 - 1e-12) and (move is None or peak < move[0]):
                        move = (peak, o, i, j)
        if move is None:
            break
        _, o, i, j = move
        ranks[h][i], ranks[o][j] = ranks[o][j], ranks[h][i]
        w[h][i], w[o][j] = w[o][j], w[h][i]
        sums[h], sums[o] = sum(w[h]), sum(w[o])
    return ranks


def place(load: Sequence[float], num_slots: int, num_ranks: int, seed: Optional[list] = None,
          keep_margin: float = KEEP_MARGIN, budget: int = EXACT_BUDGET):
    """Experts of one (layer, node) onto ``num_ranks`` ranks of ``num_slots / num_ranks`` slots. Candidates: the
    greedy placement, improved by swaps, and ``seed`` (the placement in use, experts per rank) as it is or
    improved by swaps (a few slots move), the greedy winning only when its heaviest rank is lighter by more
    than ``keep_margin`` (a fraction); then the exact search when it is small. Returns (experts in each rank's
    slots, whether it is proven optimal)."""
    ranks = _improve(load, _greedy(load, num_slots, num_ranks))
    if seed is not None:
        kept = min([[list(r) for r in seed], _improve(load, [list(r) for r in seed])],
                   key=lambda r: _max_rank(load, r))  # min keeps the first of equals: the seed as it is
        if _max_rank(load, ranks) >= _max_rank(load, kept) * (1 - keep_margin):
            ranks = kept
    better, exact = _search(load, num_slots, num_ranks, _max_rank(load, ranks), budget)
    return (better or ranks), exact


def _groups_on_nodes(current: list, group_size: int, num_groups: int, num_nodes: int) -> Optional[list]:
    """The node of each group in ``current`` when it keeps every group on one node, num_groups / num_nodes
    groups on each (a placement of the hierarchical policy); else None."""
    per_node, node_of = len(current) // num_nodes, [None] * num_groups
    for p, e in enumerate(current):
        if node_of[e // group_size] not in (None, p // per_node):
            return None
        node_of[e // group_size] = p // per_node
    if None in node_of or any(node_of.count(n) != num_groups // num_nodes for n in range(num_nodes)):
        return None
    return node_of


def _layer(load: list, num_replicas: int, num_groups: int, num_nodes: int, num_ranks: int,
           current: Optional[list] = None, keep_margin: float = KEEP_MARGIN):
    """One layer's phy2log (list) and whether it is proven optimal. Global policy (``num_nodes`` 1): all
    experts onto all ranks. Hierarchical: groups onto nodes, then each node's experts onto its ranks. Either
    way ``current`` is a candidate where it fits the policy (hierarchical: it keeps every group on one node,
    and its busiest node is within ``keep_margin`` of the new packing's)."""
    per_rank = num_replicas // num_ranks
    current_ranks = None if current is None else [current[r:r + per_rank] for r in range(0, num_replicas, per_rank)]
    if num_nodes == 1:
        ranks, exact = place(load, num_replicas, num_ranks, current_ranks, keep_margin)
        return [e for r in ranks for e in r], exact
    E = len(load)
    group_size = E // num_groups
    group_load = [sum(load[g * group_size:(g + 1) * group_size]) for g in range(num_groups)]
    node_of = pack(group_load, num_nodes)
    kept = None if current is None else _groups_on_nodes(current, group_size, num_groups, num_nodes)

    def busiest(nodes: list) -> float:
        return max(sum(w for w, n in zip(group_load, nodes) if n == node) for node in range(num_nodes))

    seeded = kept is not None and busiest(kept) * (1 - keep_margin) <= busiest(node_of)
    node_of = kept if seeded else node_of
    slots_per_node, ranks_per_node = num_replicas // num_nodes, num_ranks // num_nodes
    phy2log, exact = [], True
    for n in range(num_nodes):
        experts = [e for g in range(num_groups) if node_of[g] == n for e in range(g * group_size, (g + 1) * group_size)]
        local = {e: i for i, e in enumerate(experts)}
        seed = [[local[e] for e in r] for r in current_ranks[n * ranks_per_node:(n + 1) * ranks_per_node]] \
            if seeded else None
        ranks, ok = place([load[e] for e in experts], slots_per_node, ranks_per_node, seed, keep_margin)
        exact &= ok
        for r in ranks:
            phy2log.extend(experts[i] for i in r)
    return phy2log, exact


def _policy(num_groups: int, num_nodes: int) -> tuple:
    """(groups, nodes) the layer placement uses: the hierarchy when the groups divide over several nodes, else
    the global policy (one group, one node)."""
    return (num_groups, num_nodes) if num_nodes > 1 and num_groups % num_nodes == 0 else (1, 1)


def tables(phy2log: torch.Tensor, num_experts: int):
    """(log2phy [L, E, max replicas] padded with -1, logcnt [L, E]) from phy2log [L, P]."""
    phy2log = torch.as_tensor(phy2log, dtype=torch.long)
    if phy2log.dim() == 1:
        phy2log = phy2log[None]
    L, P = phy2log.shape
    logcnt = torch.zeros(L, num_experts, dtype=torch.long).scatter_add_(1, phy2log, torch.ones_like(phy2log))
    if (logcnt == 0).any():
        layer, e = (logcnt == 0).nonzero()[0].tolist()
        raise ValueError(f"EPLB: logical expert {e} has no physical slot in layer {layer}")
    log2phy = torch.full((L, num_experts, int(logcnt.max())), -1, dtype=torch.long)
    for layer in range(L):
        seen = [0] * num_experts
        for p, e in enumerate(phy2log[layer].tolist()):
            log2phy[layer, e, seen[e]] = p
            seen[e] += 1
    return log2phy, logcnt


def rebalance_experts(load, num_replicas: int, num_groups: int, num_nodes: int, num_ranks: int,
                      current=None, keep_margin: float = KEEP_MARGIN):
    """The placement for ``load`` [L, E] (tokens per logical expert, per MoE layer; [E] is one layer).
    ``current``: the phy2log [L, P] in use (default: ``default_placement``); under the global policy the new
    placement's heaviest rank is never heavier than its (under the hierarchical one, when ``current`` keeps
    every group on one node and its busiest node is no busier than the new packing's), and the new placement
    replaces it only where its heaviest rank is lighter by more than ``keep_margin`` (swaps aside). Either way nodes, ranks and slots are matched to
    ``current`` (without changing any rank's load) so that fewer weights move.

    Returns (phy2log [L, P], log2phy [L, E, max replicas] (-1 padded), logcnt [L, E]), int64 on the CPU.
    """
    phy2log, _ = _rebalance(load, num_replicas, num_groups, num_nodes, num_ranks, current, keep_margin)
    return (phy2log, *tables(phy2log, _as_load(load).shape[1]))


def _align(new: list, old: list) -> list:
    """``new`` (one rank's experts) reordered so that an expert already in one of ``old``'s slots stays there."""
    rest, out = sorted(new), [None] * len(new)
    for i, e in enumerate(old):
        if e in rest:
            rest.remove(e)
            out[i] = e
    fill = iter(rest)
    return [next(fill) if e is None else e for e in out]


def _match(new: list, old: list, size: int) -> list:
    """``new`` with its blocks of ``size`` slots (ranks, or nodes) permuted so that each lands where ``old`` has
    the most of its experts: pairs of blocks by decreasing overlap, greedily (ties: lower indices)."""
    n = len(new) // size
    blocks = [Counter(new[i * size:(i + 1) * size]) for i in range(n)]
    olds = [Counter(old[j * size:(j + 1) * size]) for j in range(n)]
    pairs = sorted(((-sum((blocks[i] & olds[j]).values()), i, j) for i in range(n) for j in range(n)))
    to, taken = {}, set()
    for _, i, j in pairs:
        if i not in to and j not in taken:
            to[i] = j
            taken.add(j)
    out = [None] * len(new)
    for i, j in to.items():
        out[j * size:(j + 1) * size] = new[i * size:(i + 1) * size]
    return out


def _in_place(new: list, old: list, per_node: int, per_rank: int) -> list:
    """``new`` rearranged without changing any rank's load or any group's node: nodes, then the ranks within
    each node, then the slots within each rank, matched to ``old`` so that fewer weights move."""
    new = _match(new, old, per_node)
    out = []
    for n in range(0, len(new), per_node):
        node = _match(new[n:n + per_node], old[n:n + per_node], per_rank)
        out += [e for r in range(0, per_node, per_rank)
                for e in _align(node[r:r + per_rank], old[n + r:n + r + per_rank])]
    return out


def _rebalance(load, num_replicas, num_groups, num_nodes, num_ranks, current, keep_margin=KEEP_MARGIN):
    """(phy2log [L, P], whether every layer is proven optimal)."""
    load = _as_load(load)
    L, E = load.shape
    check_layout(E, num_replicas, num_groups, num_nodes, num_ranks)
    current = default_placement(L, E, num_replicas) if current is None else torch.as_tensor(current).long()
    if tuple(current.shape) != (L, num_replicas):
        raise ValueError(f"EPLB: current placement has shape {tuple(current.shape)}, expected "
                         f"[layers={L}, num_replicas={num_replicas}]")
    if ((current < 0) | (current >= E)).any():
        raise ValueError(f"EPLB: current placement holds expert ids outside [0, {E})")
    tables(current, E)  # every expert has a slot
    groups, nodes = _policy(num_groups, num_nodes)
    per_rank, rows, exact = num_replicas // num_ranks, [], True
    for layer in range(L):
        old = current[layer].tolist()
        new, ok = _layer(load[layer].tolist(), num_replicas, groups, nodes, num_ranks, old, keep_margin)
        rows.append(_in_place(new, old, num_replicas // nodes, per_rank))
        exact &= ok
    return torch.tensor(rows, dtype=torch.long), exact


def default_placement(num_layers: int, num_experts: int, num_replicas: int) -> torch.Tensor:
    """phy2log [L, P] before any rebalancing: slot p holds expert p mod E (experts in order, then the redundant
    slots holding the first experts again), as vLLM starts."""
    if num_replicas < num_experts:
        raise ValueError(f"EPLB: num_replicas={num_replicas} is fewer than the {num_experts} logical experts")
    return (torch.arange(num_replicas) % num_experts).repeat(num_layers, 1)


def rank_loads(load, phy2log, num_ranks: int) -> torch.Tensor:
    """[L, R] float64 load on each rank under ``phy2log`` [L, P], each expert's load split evenly over its
    replicas."""
    load = _as_load(load)
    phy2log = torch.as_tensor(phy2log, dtype=torch.long)
    if phy2log.dim() == 1:
        phy2log = phy2log[None]
    L, E = load.shape
    if phy2log.shape[0] != L or phy2log.shape[1] % num_ranks:
        raise ValueError(f"EPLB: phy2log of shape {tuple(phy2log.shape)} does not fit {L} layers on "
                         f"num_ranks={num_ranks} ranks")
    _, logcnt = tables(phy2log, E)
    per_slot = load.gather(1, phy2log) / logcnt.gather(1, phy2log)  # [L, P]
    return per_slot.reshape(L, num_ranks, -1).sum(-1)


def balancedness(loads: torch.Tensor) -> float:
    """Mean rank load over the heaviest rank's, each summed over layers: loads [L, R] (or [R]). 1.0 is perfect;
    1.0 also when nothing was routed."""
    loads = torch.as_tensor(loads, dtype=torch.float64)
    if loads.dim() == 1:
        loads = loads[None]
    top = float(loads.max(-1).values.sum())
    return 1.0 if top == 0 else float(loads.mean(-1).sum()) / top


def max_rank_load(load, phy2log, num_ranks: int) -> torch.Tensor:
    """[L] the heaviest rank's load per layer."""
    return rank_loads(load, phy2log, num_ranks).max(-1).values


def is_exact(load, num_replicas: int, num_groups: int, num_nodes: int, num_ranks: int, current=None) -> bool:
    """Whether rebalance_experts' placement of every layer of ``load`` is proven optimal (its heaviest rank as
    light as any placement's, within the hierarchy when the hierarchical policy applies)."""
    return _rebalance(load, num_replicas, num_groups, num_nodes, num_ranks, current)[1]

"""Greedy DSpark drafting in CUDA graphs: the drafter's forward and its Markov chain, one graph per batch bucket.

On a small target a speculative step is host time: the drafter's eager forward (~60 kernel launches) cost as
much as the verify step itself on the H200 (benchmarks/profile_spec_step.py). Captured, a step's drafting is
two input copies, one replay and the one host copy of the drafts and survivals the eager path already made.

Only all-greedy batches of at most the largest bucket replay (a sampled row draws from its own generator on the
host's schedule and needs its q rows kept: the eager ``DSpark.draft_batch``); the graph computes what
``draft_batch`` computes for greedy rows, with the same kernels, so the drafts are the same. Captured at engine
start-up (``capture``), after the target's decode graphs, never during serving.
"""

from __future__ import annotations

import torch

from ...backends.cuda_graph import capture_graph
from ...layout import stack_rows, to_device


# A captured bucket holds its base logits [B, P, V] float32 in the graphs' pool for good (eager drafting frees
# them after each step, and neither is in the KV-sizing profile): larger buckets draft eagerly.
MAX_LOGITS_BYTES = 256 * 2**20


class DraftGraphs:
    def __init__(self, net, target, buckets, k: int, context_dtype: torch.dtype):
        self.net, self.target = net, target
        self.K = min(k, net.config.positions)
        per_row = net.config.positions * net.config.vocab_size * 4
        self.buckets = sorted(b for b in set(buckets) if b * per_row <= MAX_LOGITS_BYTES)
        self.context_dtype = context_dtype  # the target's kept hidden states' dtype (copied in unconverted)
        self.graphs: dict = {}  # bucket -> (graph, context buffer, anchor buffer, output buffer)
        self.pool = None
        self.replays = 0

    def capture(self) -> None:
        for B in self.buckets:  # (the collector is off inside each capture: capture_graph)
            self._capture(B)

    def _capture(self, B: int) -> None:
        net, dev = self.net, self.net.anchor.weight.device
        width = net.config.target_layers * net.config.target_hidden
        ctx = torch.zeros(B, width, dtype=self.context_dtype, device=dev)
        anchors = torch.zeros(B, dtype=torch.long, device=dev)

        def run():
            base, conf = net(ctx, anchors, self.target)
            tokens, survival, _ = net.chain(base, conf, anchors, self.K, keep_q=False)
            return torch.cat([tokens.double(), survival.double()], 1)  # [B, 2K]: one copy to the host

        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        with torch.no_grad():
            graph, out = capture_graph(run, dev, self.pool)
        self.graphs[B] = (graph, ctx, anchors, out)

    def covers(self, contexts: list, greedy: list, ks: list) -> bool:
        return bool(contexts) and bool(self.buckets) and all(greedy) and len(contexts) <= self.buckets[-1] \
            and max(ks) <= self.K and all(c.dtype == self.context_dtype for c in contexts)

    def draft(self, contexts: list, anchors: list, ks: list) -> tuple:
        """(tokens [B] host lists, survival [B] host lists), row b's first ks[b] of each: what
        ``DSpark.draft_batch`` returns for greedy rows (its q is None then)."""
        n = len(contexts)
        B = next(b for b in self.buckets if b >= n)
        graph, ctx, anc, out = self.graphs[B]
        stack_rows(contexts, out=ctx[:n])
        anc[:n].copy_(to_device(anchors, torch.long, anc.device))  # (pinned: a pageable copy syncs)
        graph.replay()
        self.replays += 1
        K = self.K
        host = out[:n].tolist()  # the one synchronising copy
        return [[int(t) for t in row[:k]] for row, k in zip(host, ks)], [row[K:K + k] for row, k in zip(host, ks)]

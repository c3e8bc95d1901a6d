"""Bounded replay's decoder pass in CUDA graphs.

Under bounded replay a prompt's decoder runs over its last n_win positions only, whatever the prompt's length,
so on the GPU that pass is a fixed sequence of ~35 kernel launches a decoder layer over a fixed number of
tokens: launch-bound host work (on the H200 a bounded 4K prefill kept its GPU busy 20 ms of a 37-65 ms wall).
What of it depends on the prompt's length is (a) the decoder's full layers' compression of every chunk token,
which reads the final encoder state alone and so runs eagerly before the pass (``engine_path.compress_full``),
and (b) the number of entries the indexer scores, which a graph fixes by padding each full layer's entry rows
to a power-of-two width (repeating the last entry's row, as ``engine_path._RowSlots`` pads rows; a query sees
only its visible entries, so the padding is never read as an entry). The rest is captured once per (tokens,
padded widths, ...) key and replayed: the pass's device index lists, its input and its full layers' entry rows
are copied into the graph's static tensors, one replay runs the layers.

Which steps replay (``covers``): one row, exactly n_win decoder queries (a bounded prefill's last chunk), no
restored encoder state, no kept hidden states (DSpark), no expert-parallel exchange, not batch-invariant, on
CUDA with the generation rings' fused SWA write. Everything else runs the eager layers. The first step of a
key runs the layers eagerly on the static tensors (the warm-up: kernels compiled, allocator primed) and then
captures them; later steps of that key replay. The counters the eager layers keep on the host (``model.counters``,
the ops' ``kernel_calls``) are what one eager pass adds, measured around the capture and added at every
replay, with the scored-entry counts of the padded layers taken at the step's real width.

The graphs hold their activations in one memory pool for the engine's life (not measured; by the shapes a few MB
a key at the bench config: 128 queries' activations and the indexer's [128, width] float32 scores), which the KV
sizing at start-up does not see; at most MAX_GRAPHS keys are captured, past that (or after a capture that raised)
a covered pass runs the plain layers. tests/test_pass_graphs.py
holds the static eager run to the plain one on the CPU and the replays to the eager pass on the GPU.
"""

from __future__ import annotations

import copy
import logging

import torch

from . import engine_path
from .model import model_ops

log = logging.getLogger(__name__)

MAX_GRAPHS = 16
MIN_WIDTH = 64  # the narrowest padded entry width


def width_bucket(j: int) -> int:
    """The padded entry width of j entries: the next power of two, at least MIN_WIDTH."""
    w = MIN_WIDTH
    while w < j:
        w *= 2
    return w


def pad_slots(slots: torch.Tensor, width: int, out: torch.Tensor = None) -> torch.Tensor:
    """slots [R, J] cache rows -> [R, width] (width >= J), its last column repeated (J = 0: row 0 of the cache)."""
    R, J = slots.shape
    if out is None:
        out = torch.empty(R, width, dtype=slots.dtype, device=slots.device)
    out[:, :J].copy_(slots)
    if width > J:
        out[:, J:].copy_(slots[:, J - 1:J].expand(R, width - J) if J else torch.zeros((), dtype=slots.dtype))
    return out


def scored_width(model, i: int, J: int) -> int:
    """Entries decoder layer i scores per query when its full layer has J entry rows (what layer_engine counts in
    ``index_scores``): J for a full layer and a mask-pool reindex layer; a gather reindex layer scores its pool,
    min(pool_blocks, ceil(J / pool_block)) * pool_block (functional.pool_candidates); 0 for other layers."""
    c, mode = model.config, model.config.layer_modes[i]
    if mode == "full" or (mode == "reindex" and model.pool_impl != "gather"):
        return J
    if mode == "reindex":
        return min(c.pool_blocks, -(-J // c.pool_block)) * c.pool_block
    return 0


def _snapshot(model) -> tuple:
    calls = getattr(model_ops(model), "kernel_calls", None)
    return {k: list(v) for k, v in model.counters.items()}, (dict(calls) if calls is not None else None)


def _restore(model, snap) -> None:
    counters, calls = snap
    for k, v in counters.items():
        model.counters[k][:] = v
    kc = getattr(model_ops(model), "kernel_calls", None)
    if kc is not None and calls is not None:
        kc.clear()
        kc.update(calls)


def _delta(model, before) -> tuple:
    """What the host counters gained since ``before`` (additive ones; min_pos is applied from the pass)."""
    counters, calls = before
    out = {k: [a - b for a, b in zip(model.counters[k], v)] for k, v in counters.items() if k != "min_pos"}
    kc = getattr(model_ops(model), "kernel_calls", None)
    dcalls = {k: n - (calls or {}).get(k, 0) for k, n in kc.items()} if kc is not None else {}
    return out, {k: n for k, n in dcalls.items() if n}


class DecoderPassGraphs:
    """The engine's decoder-pass graphs (on its CED cache: they hold its tensors' addresses). ``capture=False``
    runs the same static-tensor pass eagerly instead of capturing it (the CPU tests' path)."""

    def __init__(self, capture: bool = True):
        self.capture = capture
        self.graphs: dict = {}  # key -> (graph, static inputs, static output, counter delta)
        self.failed: set = set()  # keys whose capture raised: eager from then on
        self.pool = None
        self.replays = self.captures = 0

    def covers(self, model, meta, dec, hd, scoring: bool) -> bool:
        c = model.config
        if self.capture and not (hd.is_cuda and torch.cuda.is_available()):
            return False
        ops = model_ops(model)
        return (len(meta.starts) == 1 and dec.n == c.n_win and dec.early is None and not scoring
                and not getattr(model, "capture_last", 0) and not getattr(ops, "batch_invariant", False)
                and not torch.is_grad_enabled() and "ring_dst" in dec._dev
                and not any(getattr(layer, "moe_is_collective", False) for layer in model.layers)
                and not (hd.is_cuda and torch.cuda.is_current_stream_capturing()))

    def run(self, model, hd, dec, h_enc, cache, ctx, stats) -> torch.Tensor:
        """The decoder's outputs [n, d] for pass ``dec`` (inputs hd [n, d]): its full layers compressed eagerly
        into ``ctx`` first, then one replay (or, for a new key, the eager static pass and a capture)."""
        c = model.config
        full = [layer for layer in model.layers[c.num_encoder_layers:] if layer.mode == "full"]
        for layer in full:
            engine_path.compress_full(model, layer, dec, h_enc, None, cache, ctx)
        live = {layer.i: ctx[("kv", layer.i)] for layer in full}
        widths = {i: width_bucket(s.shape[1]) for i, s in live.items()}
        names = tuple(sorted(dec._dev))
        load = getattr(getattr(model, "expert_load", None), "current", None)
        key = (hd.dtype, dec.n, names, tuple(tuple(getattr(dec, k).shape) for k in names),
               tuple(sorted(widths.items())), None if load is None else load.data_ptr())
        entry = self.graphs.get(key)
        if entry is not None:
            graph, st, out, delta = entry
            self._fill(st, hd, dec, live)
            graph.replay()
            self.replays += 1
            self._count(model, dec, delta, live, widths)
            return out
        if self.capture and (key in self.failed or len(self.graphs) >= MAX_GRAPHS):
            return engine_path.decoder_layers(model, hd, dec, h_enc, cache, ctx, stats)[0]  # (ctx has the kv)
        st = self._statics(hd, dec, live, widths)
        self._fill(st, hd, dec, live)
        sp = self._static_pass(dec, st)
        before = _snapshot(model)
        out, _ = engine_path.decoder_layers(model, st["hd"], sp, h_enc, cache, self._ctx(st), stats)
        delta = _delta(model, before)
        _restore(model, before)
        self._count(model, dec, delta, live, widths)
        if self.capture:
            self._capture(model, key, st, dec, h_enc, cache, stats)
        return out

    @staticmethod
    def _statics(hd, dec, live, widths) -> dict:
        st = {"hd": torch.empty_like(hd)}
        for k in dec._dev:
            st[k] = torch.empty_like(getattr(dec, k))
        for i, s in live.items():
            st[("kv", i)] = torch.empty(s.shape[0], widths[i], dtype=s.dtype, device=s.device)
        return st

    @staticmethod
    def _fill(st, hd, dec, live) -> None:
        st["hd"].copy_(hd)
        for k in dec._dev:
            st[k].copy_(getattr(dec, k))
        for i, s in live.items():
            pad_slots(s, st[("kv", i)].shape[1], out=st[("kv", i)])

    @staticmethod
    def _ctx(st) -> dict:
        return {k: v for k, v in st.items() if isinstance(k, tuple)}

    @staticmethod
    def _static_pass(dec, st):
        """A copy of pass ``dec`` whose device lists are the static tensors (its per-step cache emptied)."""
        sp = copy.copy(dec)
        sp._kept = {}
        for k in dec._dev:
            sp.__dict__[k] = st[k]
        return sp

    def _capture(self, model, key, st, dec, h_enc, cache, stats) -> None:
        from ...backends.cuda_graph import capture_graph

        sp = self._static_pass(dec, st)  # (a fresh one: the eager run's kept tensors were made outside the graph)
        before = _snapshot(model)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        try:
            graph, (out, _) = capture_graph(
                lambda: engine_path.decoder_layers(model, st["hd"], sp, h_enc, cache, self._ctx(st), stats),
                st["hd"].device, self.pool, warmup=False, error_mode="thread_local")
        except Exception as e:  # (a host sync in some op: that key stays eager)
            self.failed.add(key)
            log.warning("decoder pass not captured (eager from now on for this shape): %s", e)
            return
        finally:
            delta = _delta(model, before)
            _restore(model, before)
        self.graphs[key] = (graph, st, out, delta)
        self.captures += 1

    @staticmethod
    def _count(model, dec, delta, live, widths) -> None:
        """Add one pass's host counters; the scored entries at the step's real entry widths."""
        c = model.config
        counters, calls = delta
        for k, v in counters.items():
            row = model.counters[k]
            for i, d in enumerate(v):
                if k == "index_scores" and d:
                    src = c.source_full(i)
                    padded, real = scored_width(model, i, widths[src]), scored_width(model, i, live[src].shape[1])
                    d = d // padded * real
                row[i] += d
        if dec.min_pos is not None:
            for i in range(c.num_encoder_layers, c.num_layers):
                model.counters["min_pos"][i] = min(model.counters["min_pos"][i], dec.min_pos)
        kc = getattr(model_ops(model), "kernel_calls", None)
        if kc is not None:
            kc.update(calls)

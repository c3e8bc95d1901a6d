"""The CED model in the engine: engine path versus the full-sequence oracle, replay, caches, checkpoints.

The oracle is ``forward_full(tokens, replay_start=s)`` run on the engine's own token trajectory, with the
same replay semantics as the engine (bounded: s = N - n_win for a prompt of N tokens; exact: s = 0). Every
position the engine's decoder computes (prefill chunks, decode steps, recomputes after preemption) is
compared with the oracle's logits at that position, to TOL.

Discrete steps can go either way on a near-tie when the engine's batch shapes change the last bits of a
value: the indexer top-K, the decoder's candidate pool, MoE routing, and rounding to a low-bit KV format
(greedy loops make exact top-K ties common: a repeated token can give the same indexer key). A ``Shadow``
records every such choice the engine made (per layer and position), and while the oracle runs it adopts the
engine's choice wherever the two differ but the engine's is also optimal up to TIE (selection) or its input
matches the oracle's to EPS (rounding). Anything else that differs stays and shows up in the logits. How
often the oracle had to follow the engine is counted in STATS (printed at the end; run pytest with -s).
"""

from __future__ import annotations

import contextlib
import json
import math
from collections import Counter, defaultdict
from fractions import Fraction

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from deepinfer import LLM, SamplingParams
from deepinfer.backends.reference import lowbit
from deepinfer.backends.reference import moe as moe_ops
from deepinfer.core.kv_cache import blocks_needed
from deepinfer.models.base import WeightError
from deepinfer.models.ced import engine_path
from deepinfer.models.ced import functional as fn
from deepinfer.models.ced.cache import CEDCache
from deepinfer.models.ced.config import CEDConfig, CEDConfigError
from deepinfer.models.ced.decode_path import DecodePass
from deepinfer.models.ced.model import CEDForCausalLM, CEDLayer
from deepinfer.testing.ced import block_sizes_for, build_ced_checkpoint, ced_configs
from deepinfer.testing.compare import MODEL_FACTOR, assert_logits_close
from deepinfer.testing.engine import step_greedy

TOL = 1e-4  # engine vs oracle logits, relative to the oracle's largest |logit| at that position
TIE = 1e-4  # the engine's selection is acceptable if its scores are within TIE x scale of the oracle's optimum
EPS = 1e-4  # the engine's rounding is acceptable if its input matches the oracle's to EPS x max|input|
STATS = Counter()

# A small config with every layer mode in both parts (encoder: swa, full m=2, reindex, reuse; decoder: full,
# reuse, reindex), used by the fixed-case tests.
BASE = dict(hidden_size=48, num_layers=7, num_encoder_layers=4, num_heads=2, head_dim=32, rope_dim=8, q_lora_rank=32,
            out_groups=2, out_group_dim=32, n_win=5, swa_allowance=2,
            layer_modes=("swa", "full", "reindex", "reuse", "full", "reuse", "reindex"), encoder_ratio=2,
            index_heads=2, index_head_dim=32, index_topk=3, pool_block=2, pool_blocks=2, n_routed_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=32, max_position_embeddings=512)


@pytest.fixture(scope="module", autouse=True)
def report_stats():
    """Print how far engine and oracle were apart and how many near-ties the oracle followed."""
    yield
    stats = dict(STATS)
    stats["max_err"] = stats.pop("max_err_1e-9", 0) * 1e-9
    print(f"\nCED engine vs oracle (max_err relative to max|logit|; sync_*: near-ties the oracle followed): {stats}")


# ----------------------------------------------------------------------------------------------------------
# The shadow: the engine's discrete choices, followed by the oracle on near-ties.

def _close_sorted(a: torch.Tensor, b: torch.Tensor, tol: float) -> bool:
    """Same number of values and, sorted, equal to tol (inf == inf)."""
    if a.numel() != b.numel():
        return False
    a, b = a.sort().values, b.sort().values
    same = (a == b) | ((a - b).abs() <= tol)
    return bool(same.all())


class Shadow:
    """Records, per sequence, layer and position, every discrete choice the engine makes; while the oracle runs
    on one of those sequences, it adopts the engine's choice where the two differ only by a near-tie."""

    def __init__(self):
        self.rec: dict = defaultdict(list)  # (seq, layer, kind, position) -> the engine's choices, in order
        self.side = None  # "engine" or "oracle" while hooked
        self.seq = None  # oracle: the request id the oracle is running; engine: request id per metadata row
        self.layer = None  # (layer index, query positions, their sequences) of the layer being computed
        self.quant = None  # [layer index, pending kinds, row positions, their sequences] in swa_kv / entries
        self.entry_rows = None  # engine: (entry ids, sequences) a full layer compresses this step

    def _choices(self, key):
        return self.rec.get(key, [])

    @contextlib.contextmanager
    def hooked(self, side: str, seq=None):
        saved = dict(layer_engine=engine_path.layer_engine, compress=engine_path._compress_chunk,
                     decode_compress=DecodePass.compress,
                     layer_full=CEDForCausalLM._layer_full, choose=CEDLayer.choose_entries, swa_kv=CEDLayer.swa_kv,
                     swa_kv_rows=CEDLayer.swa_kv_rows, entries_to_cache=CEDLayer.entries_to_cache,
                     entries=CEDLayer.entries, fake=lowbit.fake_quantize, select=fn.select_topk,
                     select_cands=fn.select_candidates, pool=fn.pool_mask, pool_cands=fn.pool_candidates,
                     route=moe_ops.route)
        me = self
        inner = []  # set while select_candidates runs: the select_topk inside it ranks candidates, not entries

        def layer_engine(model, layer, h, P, *args, **kw):
            me.layer = (layer.i, P.pos.tolist(), [me.seq[r] for r in P.rows_t.tolist()])
            return saved["layer_engine"](model, layer, h, P, *args, **kw)

        def compress_chunk(model, layer, xs, meta, cache, device):
            ids, seqs = [], []  # entry j completes when its group's last token, (j + 1) m - 1, is computed
            floors = meta.write_floors or [0] * len(meta.starts)  # a prefix hit's entries are not rewritten
            for r, (a, k) in enumerate(zip(meta.starts, meta.nums)):
                js = range(max(a, floors[r]) // layer.m, (a + k) // layer.m)
                ids += js
                seqs += [me.seq[r]] * len(js)
            me.entry_rows = (ids, seqs)
            try:
                return saved["compress"](model, layer, xs, meta, cache, device)
            finally:
                me.entry_rows = None

        def decode_compress(P, model, layer, xs, cache):  # every row compresses its group pos // m
            me.entry_rows = ((P.pos // layer.m).tolist(), [me.seq[r] for r in P.rows_t.tolist()])
            try:
                return saved["decode_compress"](P, model, layer, xs, cache)
            finally:
                me.entry_rows = None

        def layer_full(self, layer, h, h_src, pos, s, *args):
            me.layer = (layer.i, pos[s:s + h.shape[0]].tolist(), [me.seq] * h.shape[0])
            return saved["layer_full"](self, layer, h, h_src, pos, s, *args)

        def choose_entries(self, iq, iw, ik, qpos, *args):  # the full path's indexer, a chunk of queries at a time
            whole = me.layer
            me.layer = (self.i, qpos.tolist(), [me.seq] * qpos.numel())
            try:
                return saved["choose"](self, iq, iw, ik, qpos, *args)
            finally:
                me.layer = whole

        def swa_kv(self, x, pos, y=None):
            me.quant = [self.i, ["swa"], pos.tolist(), me.layer[2]]
            try:
                return saved["swa_kv"](self, x, pos, y=y)
            finally:
                me.quant = None

        def swa_kv_rows(self, y, pos, *args):  # (the decode path's swa_kv, with its ring write)
            me.quant = [self.i, ["swa"], pos.tolist(), me.layer[2]]
            try:
                return saved["swa_kv_rows"](self, y, pos, *args)
            finally:
                me.quant = None

        def entries_to_cache(self, x, entry_ids, *args):  # (the decode path's entries, with the cache write)
            assert me.side == "engine" and me.entry_rows is not None and me.entry_rows[0] == entry_ids.tolist()
            me.quant = [self.i, ["kv", "ik"], entry_ids.tolist(), me.entry_rows[1]]
            try:
                return saved["entries_to_cache"](self, x, entry_ids, *args)
            finally:
                me.quant = None

        def entries(self, x, entry_ids=None):
            ids = (torch.arange(x.shape[0] // self.m) if entry_ids is None else entry_ids).tolist()
            if me.side == "engine":
                assert me.entry_rows is not None and me.entry_rows[0] == ids, "entries outside a step's groups"
                seqs = me.entry_rows[1]
            else:
                seqs = [me.seq] * len(ids)
            me.quant = [self.i, ["kv", "ik"], ids, seqs]
            try:
                return saved["entries"](self, x, entry_ids)
            finally:
                me.quant = None

        def fake_quantize(x, fmt):
            y = saved["fake"](x, fmt)
            if me.quant is None:
                return y
            layer, kinds, rows, seqs = me.quant
            assert x.dim() == 2 and x.shape[0] == len(rows) == len(seqs), (x.shape, len(rows), len(seqs))
            kind = kinds.pop(0)
            if fmt == "fp32":  # lossless: nothing rounds
                return y
            y = y.clone()
            for i, (p, q) in enumerate(zip(rows, seqs)):
                key = (q, layer, kind, p)
                if me.side == "engine":
                    me.rec[key].append((x[i].detach().clone(), y[i].detach().clone()))
                    continue
                for xe, ye in me._choices(key):
                    if torch.equal(ye, y[i]):
                        break
                    if float((xe - x[i]).abs().max()) <= EPS * float(x[i].abs().max()):
                        y[i] = ye  # the engine's input was the same up to float noise: follow its rounding
                        STATS[f"sync_{kind}_rounding"] += 1
                        break
            return y

        def follow_topk(out, scores, allowed):
            """out [Tq, k] entry ids chosen from scores [Tq, J] among allowed [Tq, J]: recorded (engine) or
            replaced by the engine's choice where that is also a top-K set up to a near-tie (oracle)."""
            layer, pos, seqs = me.layer
            for i, (p, q) in enumerate(zip(pos, seqs)):
                key = (q, layer, "topk", p)
                if me.side == "engine":
                    me.rec[key].append(out[i].clone())
                    continue
                mine = out[i][out[i] >= 0]
                cands = me._choices(key)
                if not cands or any(set(c[c >= 0].tolist()) == set(mine.tolist()) for c in cands):
                    continue
                row, ok = scores[i].float(), allowed[i]
                tol = TIE * float(row[ok].abs().max()) if bool(ok.any()) else 0.0
                for c in cands:
                    theirs = c[c >= 0]
                    if bool((theirs < row.numel()).all()) and bool(ok[theirs].all()) and _close_sorted(
                            row[theirs], row[mine], tol):
                        out[i] = c  # the engine's set is also a top-K set up to a near-tie
                        STATS["sync_topk"] += 1
                        break
            return out

        def select_topk(scores, allowed, k):
            out = saved["select"](scores, allowed, k)
            return out if inner else follow_topk(out, scores, allowed)

        def select_candidates(scores, cand, k):
            inner.append(True)
            try:
                out = saved["select_cands"](scores, cand, k)
            finally:
                inner.pop()
            # In entry space: each query's candidate scores at their ids, nothing else allowed.
            J = int(cand.max()) + 1 if cand.numel() else 0
            full = scores.new_full((scores.shape[0], J + 1), -math.inf)
            full.scatter_(1, torch.where(cand >= 0, cand, J), scores.float())
            return follow_topk(out, full[:, :J], fn.candidates_mask(cand, J))

        def follow_pool(out, scores, visible, block):
            """out [Tq, J] pool masks built from scores [Tq, J]: recorded, or replaced by the engine's."""
            layer, pos, seqs = me.layer
            J = scores.shape[1]
            nb = -(-J // block)
            for i, (p, q) in enumerate(zip(pos, seqs)):
                key = (q, layer, "pool", p)
                if me.side == "engine":
                    me.rec[key].append(out[i].clone())
                    continue
                cands = [torch.nn.functional.pad(c[:J], (0, max(0, J - c.numel()))) & visible[i]
                         for c in me._choices(key)]
                if not cands or any(torch.equal(c, out[i]) for c in cands):
                    continue
                s = scores[i].float().masked_fill(~visible[i], -math.inf)
                best = torch.nn.functional.pad(s, (0, nb * block - J), value=-math.inf).reshape(nb, block).amax(-1)
                tol = TIE * float(scores[i].float()[visible[i]].abs().max())
                newest = int(visible[i].long().cumsum(0).argmax()) // block
                kept = torch.nn.functional.pad(out[i], (0, nb * block - J)).reshape(nb, block).any(-1)
                for c in cands:
                    theirs = torch.nn.functional.pad(c, (0, nb * block - J)).reshape(nb, block).any(-1)
                    if bool(theirs[newest]) and _close_sorted(best[theirs], best[kept], tol):
                        out[i] = c  # the engine kept other blocks whose scores tie with the oracle's
                        STATS["sync_pool"] += 1
                        break
            return out

        def pool_mask(scores, visible, block, nblocks):
            return follow_pool(saved["pool"](scores, visible, block, nblocks), scores, visible, block)

        def pool_candidates(scores, visible, block, nblocks):
            out = saved["pool_cands"](scores, visible, block, nblocks)
            J, P = scores.shape[1], out.shape[1]
            masks = follow_pool(fn.candidates_mask(out, J), scores, visible, block)
            ids = torch.arange(J).expand(masks.shape[0], J)
            back = torch.sort(torch.where(masks, ids, J), dim=1).values[:, :P]  # the masks as candidate lists
            return back.masked_fill(back >= J, -1)

        def route(logits, k, **kw):
            weights, ids = saved["route"](logits, k, **kw)
            layer, pos, seqs = me.layer
            bias = kw.get("bias")
            for i, (p, q) in enumerate(zip(pos, seqs)):
                key = (q, layer, "route", p)
                if me.side == "engine":
                    me.rec[key].append(ids[i].clone())
                    continue
                cands = me._choices(key)
                if not cands or any(set(c.tolist()) == set(ids[i].tolist()) for c in cands):
                    continue
                sel = torch.sqrt(torch.nn.functional.softplus(logits[i].float()))
                sel = sel + (0 if bias is None else bias.float())
                for c in cands:
                    if _close_sorted(sel[c], sel[ids[i]], TIE * float(sel.abs().max())):
                        # Route this token to the engine's experts, with route's own weights for them.
                        force = torch.zeros_like(sel).index_fill_(0, c, 1e4) + (0 if bias is None else bias.float())
                        w1, i1 = saved["route"](logits[i:i + 1], k, **{**kw, "bias": force})
                        weights[i], ids[i] = w1[0], i1[0]
                        STATS["sync_route"] += 1
                        break
            return weights, ids

        self.side = side
        if side == "oracle":
            self.seq = seq
        engine_path.layer_engine, engine_path._compress_chunk = layer_engine, compress_chunk
        DecodePass.compress = decode_compress
        CEDForCausalLM._layer_full, CEDLayer.swa_kv, CEDLayer.entries = layer_full, swa_kv, entries
        CEDLayer.swa_kv_rows, CEDLayer.entries_to_cache = swa_kv_rows, entries_to_cache
        CEDLayer.choose_entries = choose_entries
        lowbit.fake_quantize, fn.select_topk, fn.pool_mask, moe_ops.route = fake_quantize, select_topk, pool_mask, route
        fn.select_candidates, fn.pool_candidates = select_candidates, pool_candidates
        try:
            yield self
        finally:
            engine_path.layer_engine, engine_path._compress_chunk = saved["layer_engine"], saved["compress"]
            DecodePass.compress = saved["decode_compress"]
            CEDForCausalLM._layer_full, CEDLayer.swa_kv = saved["layer_full"], saved["swa_kv"]
            CEDLayer.swa_kv_rows, CEDLayer.entries_to_cache = saved["swa_kv_rows"], saved["entries_to_cache"]
            CEDLayer.entries, lowbit.fake_quantize = saved["entries"], saved["fake"]
            CEDLayer.choose_entries = saved["choose"]
            fn.select_topk, fn.pool_mask, moe_ops.route = saved["select"], saved["pool"], saved["route"]
            fn.select_candidates, fn.pool_candidates = saved["select_cands"], saved["pool_cands"]
            self.side = self.seq = self.layer = self.quant = self.entry_rows = None



# ----------------------------------------------------------------------------------------------------------
# Running the engine and capturing what it computed.

def run_engine(llm: LLM, prompts: list, max_tokens: int, on_step=None, shadow: Shadow | None = None):
    """Step the engine to completion. Returns (outputs per prompt, captures per prompt, the Sequence objects).

    A capture is (position, final hidden state) for every position the decoder computed, in order (positions
    recomputed after a preemption appear again). on_step(engine) runs after every step; a shadow records the
    engine's discrete choices.
    """
    engine, model = llm.engine, llm.engine.model
    caps: dict = {}
    orig = model.forward

    def forward(input_ids, meta, cache):
        by_slot = {s.state_slot: s for s in engine.scheduler.running}
        if shadow is not None:
            shadow.seq = [by_slot[slot].request_id for slot in meta.state_slots]
        h = orig(input_ids, meta, cache)
        q = 0
        for r, (a, n) in enumerate(zip(meta.starts, meta.nums)):
            seq = by_slot[meta.state_slots[r]]
            assert meta.replay_starts[r] == seq.replay_start
            for p in range(max(a, seq.replay_start), a + n):
                caps.setdefault(seq.request_id, []).append((p, h[q + p - a].detach().clone()))
            q += n
        return h

    model.forward = forward  # an instance attribute: nn.Module.__call__ finds it first
    try:
        with shadow.hooked("engine") if shadow is not None else contextlib.nullcontext():
            outs, seqs = step_greedy(engine, prompts, max_tokens, on_step=on_step)
    finally:
        del model.forward
    return outs, [caps.get(f"r{i}", []) for i in range(len(prompts))], seqs


# ----------------------------------------------------------------------------------------------------------
# The comparison.

def check_against_oracle(llm: LLM, prompts: list, outs: list, caps: list, exact: bool, max_tokens: int,
                         shadow: Shadow) -> None:
    model = llm.engine.model
    c = model.config
    for i, (prompt, out, cap) in enumerate(zip(prompts, outs, caps)):
        assert len(out) == max_tokens
        N = len(prompt)
        s = 0 if exact else max(0, N - c.n_win)
        toks = prompt + out
        with torch.no_grad(), shadow.hooked("oracle", seq=f"r{i}"):  # run_engine's request ids
            ref = model.forward_full(torch.tensor(toks), replay_start=s)  # [len - s, V]
        # The decoder computed exactly the positions s .. len-2 (the last sampled token is never fed back).
        assert sorted({p for p, _ in cap}) == list(range(s, len(toks) - 1)), f"prompt {i}: positions computed"
        STATS["sequences"] += 1
        with torch.no_grad():
            for p, h in cap:
                got = model.compute_logits(h[None])[0]
                r = ref[p - s]
                scale = float(r.abs().max())
                err = float((got - r).abs().max()) / scale
                STATS["positions"] += 1
                STATS["max_err_1e-9"] = max(STATS["max_err_1e-9"], round(err * 1e9))
                assert err <= TOL, (f"prompt {i} (N={N}, s={s}): engine logits at position {p} differ from the "
                                    f"oracle by {err:.3g} x max|logit|")
                if p >= N - 1:  # a sampled position: greedy took the engine's argmax, and the oracle's
                    tok = out[p - N + 1]
                    assert tok == int(got.argmax()), (i, p)
                    best = int(r.argmax())
                    STATS["tokens"] += 1
                    if tok != best:  # only on a tie within the tolerance
                        assert float(r[best] - r[tok]) <= 2 * TOL * scale, (
                            f"prompt {i}: greedy token at position {p + 1} is {tok}, oracle argmax {best}")
                        STATS["greedy_ties"] += 1


# ----------------------------------------------------------------------------------------------------------
# Engine path == full path, over generated configs.

@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_ced_configs_strategy_draws_valid_small_configs(data):
    ov = data.draw(ced_configs())
    c = CEDConfig(**ov)
    E, L, modes = c.num_encoder_layers, c.num_layers, c.layer_modes
    assert 3 <= L <= 6 and 1 <= E < L and 3 <= c.n_win <= 10 and 0 <= c.swa_allowance <= 3
    assert modes[E] == "full" and "full" not in modes[E + 1:]
    first_full = modes.index("full") if "full" in modes[:E] else E
    assert set(modes[:first_full]) <= {"swa"}  # the encoder: only swa layers before its first full layer
    assert c.head_dim in (32, 64) and c.index_head_dim % 32 == 0 and c.num_heads % c.out_groups == 0
    bs = data.draw(block_sizes_for(ov))
    assert bs % c.encoder_ratio == 0 and bs % c.decoder_ratio == 0


@st.composite
def oracle_cases(draw) -> dict:
    ov = draw(ced_configs())
    W = ov["n_win"]
    lens = [draw(st.integers(1, W - 1)), draw(st.integers(W + 1, 3 * W + 4)), draw(st.integers(1, 3 * W))]
    if len(set(lens)) < 3:
        lens[2] = lens[1] + 2  # three different lengths
    return dict(ov=ov, seed=draw(st.integers(0, 2**16)), block_size=draw(block_sizes_for(ov)), lens=lens,
                budget=draw(st.sampled_from([1, 3, 7, 512])),  # 512: no chunking
                single_exact=draw(st.booleans()), lossless=draw(st.booleans()))


def run_case(case: dict, tmp_path, max_tokens: int = 64) -> None:
    d = tmp_path / f"ced{case['seed']}"
    ov = dict(case["ov"])
    if case["lossless"]:  # fp32 caches: the engine and the oracle agree to float rounding, no rounding flips
        ov.update(global_kv_format="fp32", index_k_format="fp32", swa_kv_format="fp32")
    cfg = build_ced_checkpoint(d, seed=case["seed"], **ov)
    g = torch.Generator().manual_seed(case["seed"])
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in case["lens"]]
    blocks = sum(blocks_needed(n + max_tokens, case["block_size"]) for n in case["lens"]) + 1
    runs = [(not case["single_exact"], prompts),  # the batch of 3 in one mode,
            (case["single_exact"], prompts[1:2])]  # the long prompt alone in the other
    for exact, ps in runs:
        llm = LLM(str(d), block_size=case["block_size"], num_kv_blocks=blocks,
                  max_num_batched_tokens=case["budget"], max_num_seqs=4,
                  hf_overrides={"replay_mode": "exact"} if exact else None)
        assert llm.engine.model.config.replay_mode == ("exact" if exact else "bounded")
        shadow = Shadow()
        outs, caps, seqs = run_engine(llm, ps, max_tokens, shadow=shadow)
        for p, seq in zip(ps, seqs):
            assert seq.replay_start == (0 if exact else max(0, len(p) - cfg.n_win))
        check_against_oracle(llm, ps, outs, caps, exact, max_tokens, shadow)
        assert llm.engine.pool.num_free == llm.engine.pool.num_blocks


SMALL = dict(index_head_dim=32, index_heads=2, q_lora_rank=32, out_group_dim=32, moe_intermediate_size=32,
             n_routed_experts=4, n_shared_experts=1, decoder_ratio=1, max_position_embeddings=512, hidden_size=32,
             num_heads=2, out_groups=2, head_dim=32, rope_dim=8, num_experts_per_tok=2, use_sink=True,
             rope_theta=10000.0, swa_allowance=1)


@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=oracle_cases())
@example(case=dict(  # m=3 encoder, short prompts with no complete entry yet, one-token chunks, block size 3
    ov=dict(SMALL, num_layers=5, num_encoder_layers=2, layer_modes=("full", "reuse", "full", "reindex", "reuse"),
            n_win=3, encoder_ratio=3, index_topk=2, pool_block=1, pool_blocks=2),
    seed=1, block_size=3, lens=[2, 9, 1], budget=1, single_exact=False, lossless=False))
@example(case=dict(  # leading swa layers, a decoder swa layer, topk and pool larger than what is visible
    ov=dict(SMALL, num_layers=6, num_encoder_layers=3, layer_modes=("swa", "swa", "full", "full", "swa", "reuse"),
            n_win=10, encoder_ratio=2, index_topk=8, pool_block=4, pool_blocks=4, head_dim=64, rope_dim=16),
    seed=2, block_size=4, lens=[9, 25, 4], budget=7, single_exact=True, lossless=True))
def test_engine_matches_full_path(case, tmp_path_factory):
    run_case(case, tmp_path_factory.mktemp("oracle"))


# ----------------------------------------------------------------------------------------------------------
# Fixed cases: preemption, counters, expert load.

def base_checkpoint(tmp_path, name="base", **over) -> tuple:
    d = tmp_path / name
    cfg = build_ced_checkpoint(d, seed=3, **dict(BASE, **over))
    return str(d), cfg


def distinct_prompts(vocab: int, lens: list, seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(vocab, generator=g).tolist()
    out, at = [], 0
    for n in lens:
        out.append(perm[at:at + n])
        at += n
    return out


def test_preemption_keeps_outputs_and_replay_start(tmp_path):
    path, cfg = base_checkpoint(tmp_path)
    prompts = distinct_prompts(cfg.vocab_size, [13, 7, 11], seed=4)
    T = 12
    expected = [max(0, len(p) - cfg.n_win) for p in prompts]

    roomy = LLM(path, block_size=2, num_kv_blocks=64, max_num_batched_tokens=6, max_num_seqs=4)
    ref_outs, ref_caps, _ = run_engine(roomy, prompts, T)
    assert roomy.engine.scheduler.num_preemptions == 0

    # 15 blocks of 2 hold the longest sequence (13 + 12 tokens) but not all three: the engine must preempt.
    tight = LLM(path, block_size=2, num_kv_blocks=15, max_num_batched_tokens=6, max_num_seqs=4)
    live: list = []  # every Sequence the engine admits
    resumed: list = []

    def watch(engine):  # the replay start belongs to the request: still the admission value after preemption
        for s in live:
            assert s.replay_start == expected[int(s.request_id[1:])], (s.request_id, s.replay_start)
            if s.num_preemptions and s.request_id not in resumed:
                resumed.append(s.request_id)

    orig_add = tight.engine.add_request

    def add_request(rid, prompt, params):
        req = orig_add(rid, prompt, params)
        live.extend(req.seqs)
        return req

    tight.engine.add_request = add_request
    shadow = Shadow()
    outs, caps, seqs = run_engine(tight, prompts, T, on_step=watch, shadow=shadow)
    assert tight.engine.scheduler.num_preemptions > 0
    assert resumed, "no sequence was preempted"
    assert [s.replay_start for s in seqs] == expected
    assert outs == ref_outs
    # Every position the recomputes produced (some more than once) matches the oracle with the same replay start.
    assert sum(len(c) for c in caps) > sum(len(c) for c in ref_caps)
    check_against_oracle(tight, prompts, outs, caps, exact=False, max_tokens=T, shadow=shadow)
    assert tight.engine.pool.num_free == tight.engine.pool.num_blocks


@pytest.mark.parametrize("mode", ["bounded", "exact"])
def test_counters_follow_replay(tmp_path, mode):
    path, cfg = base_checkpoint(tmp_path)
    llm = LLM(path, block_size=2, num_kv_blocks=40, max_num_batched_tokens=4,
              hf_overrides={"replay_mode": mode} if mode == "exact" else None)
    model = llm.engine.model
    (prompt,) = distinct_prompts(cfg.vocab_size, [17], seed=5)
    N, T, W, E = len(prompt), 6, cfg.n_win, cfg.num_encoder_layers
    assert N > W
    model.reset_counters()
    forwards = []
    orig = model.forward
    model.forward = lambda ids, meta, cache: forwards.append(len(ids)) or orig(ids, meta, cache)
    try:
        (out,) = llm.generate([prompt], SamplingParams(max_tokens=T, temperature=0.0, ignore_eos=True), use_tqdm=False)
    finally:
        del model.forward
    assert len(out.outputs[0].token_ids) == T
    cnt = model.counters
    assert forwards == [4, 4, 4, 4, 1] + [1] * (T - 1)  # chunked prefill, then T - 1 decode steps
    for l, m in enumerate(cfg.layer_modes):
        if l < E:  # the encoder runs over every token
            assert (cnt["layer_tokens"][l], cnt["min_pos"][l]) == (N + T - 1, 0), l
        elif mode == "bounded":  # the decoder never runs before the replay start N - n_win
            assert cnt["min_pos"][l] == N - W, l
            assert cnt["layer_tokens"][l] == W + T - 1, l
        else:
            assert (cnt["layer_tokens"][l], cnt["min_pos"][l]) == (N + T - 1, 0), l
        # full and reindex layers run their indexer once per forward; reuse and swa layers never
        assert cnt["indexer_calls"][l] == (len(forwards) if m in ("full", "reindex") else 0), (l, m)
    # The oracle's own statistics agree on the decoder's span.
    stats: dict = {}
    s = 0 if mode == "exact" else N - W
    with torch.no_grad():
        model.forward_full(torch.tensor(prompt + out.outputs[0].token_ids[:-1]), replay_start=s, stats=stats)
    for l in range(E, cfg.num_layers):
        assert stats["layer_tokens"][l] == cnt["layer_tokens"][l] and stats["first_pos"][l] == s
    indexed = [l for l, m in enumerate(cfg.layer_modes) if m in ("full", "reindex")]
    assert sorted(set(stats["indexer_layers"])) == indexed


def test_expert_load_counts_every_routed_token(tmp_path):
    path, cfg = base_checkpoint(tmp_path)
    llm = LLM(path, block_size=2, num_kv_blocks=80, max_num_batched_tokens=5, max_num_seqs=4)
    engine, model = llm.engine, llm.engine.model
    k, L, E = cfg.num_experts_per_tok, cfg.num_layers, cfg.num_encoder_layers
    window = llm.expert_load()["window"]
    per_step: list = []  # per engine step: tokens each layer ran on (from the counters) and tokens forwarded
    last = {"counters": [0] * L, "fwd": 0}

    def on_step(engine):
        now = list(model.counters["layer_tokens"])
        per_step.append(([a - b for a, b in zip(now, last["counters"])], engine.stats["forward_tokens"] - last["fwd"]))
        last["counters"], last["fwd"] = now, engine.stats["forward_tokens"]

    model.reset_counters()
    prompts = distinct_prompts(cfg.vocab_size, [9, 3], seed=6)
    run_engine(llm, prompts, 20, on_step=on_step)
    assert len(per_step) < window

    def check():
        load = llm.expert_load()
        recent = per_step[-window:]
        assert load["steps_recorded"] == len(recent)
        for l in range(L):
            counts = load["layers"][l]
            assert len(counts) == cfg.n_routed_experts and min(counts) >= 0
            assert sum(counts) == k * sum(layer[l] for layer, _ in recent), l
            if l < E:  # the encoder routes every token the step forwarded
                assert sum(counts) == k * sum(fwd for _, fwd in recent), l

    check()
    assert sum(llm.expert_load()["layers"][E]) == k * ((cfg.n_win + 19) + (3 + 19))  # decoder: replayed + decoded
    # Past the window, only the last `window` steps count.
    run_engine(llm, distinct_prompts(cfg.vocab_size, [4], seed=7), window, on_step=on_step)
    assert len(per_step) > window
    check()


# ----------------------------------------------------------------------------------------------------------
# Cache byte layouts.

def fmt_bytes(fmt: str, C: int) -> Fraction:
    """Bytes of one C-channel vector, from the format definitions: FP4 codes are half a byte per channel with an
    E4M3 byte per 16 channels (NVFP4-like) or an E8M0 byte per 32 (MXFP4); FP8 codes a byte per channel with an
    E8M0 byte per 32."""
    return {"fp4_e2m1_e4m3": Fraction(C, 2) + Fraction(C, 16), "mxfp4": Fraction(C, 2) + Fraction(C, 32),
            "fp8_e4m3_pow2": Fraction(C) + Fraction(C, 32), "fp32": Fraction(4 * C)}[fmt]


def expected_bytes_per_token(c: CEDConfig) -> Fraction:
    total = Fraction(0)
    for l, mode in enumerate(c.layer_modes):
        if mode == "full":
            m = c.encoder_ratio if l < c.num_encoder_layers else c.decoder_ratio
            total += (fmt_bytes(c.global_kv_format, c.head_dim) + fmt_bytes(c.index_k_format, c.index_head_dim)) / m
    return total


def test_bytes_per_token_of_the_real_model():
    """The report's 890 bytes/token: 40 layers, full layers at 2, 8, 14 (m = 2) and 20 (m = 1), head dim 512,
    indexer K 128 channels."""
    enc = ["swa", "swa"] + (["full"] + ["reuse"] * 5) * 3
    dec = ["full", "reuse", "reuse", "reuse"] + ["reindex", "reuse", "reuse", "reuse"] * 4
    c = CEDConfig(num_layers=40, num_encoder_layers=20, layer_modes=tuple(enc + dec), head_dim=512, rope_dim=64,
                  index_head_dim=128)
    assert expected_bytes_per_token(c) == 890
    assert CEDCache.bytes_per_token(c) == 890 and CEDCache.exact_bytes_per_token(c) == 890


@pytest.mark.parametrize("gfmt,ifmt,m,D,dh", [
    ("fp4_e2m1_e4m3", "mxfp4", 2, 32, 32),  # the report's formats
    ("mxfp4", "mxfp4", 3, 64, 32),  # 1/3 of an entry per token: a fractional figure, rounded up
    ("fp4_e2m1_e4m3", "fp4_e2m1_e4m3", 1, 64, 64),
])
def test_kv_bytes_per_token_and_cache_layout(tmp_path, gfmt, ifmt, m, D, dh):
    path, cfg = base_checkpoint(tmp_path, global_kv_format=gfmt, index_k_format=ifmt, encoder_ratio=m, head_dim=D,
                                index_head_dim=dh)
    block_size, num_blocks, max_seqs = 6, 10, 3
    llm = LLM(path, block_size=block_size, num_kv_blocks=num_blocks, max_num_seqs=max_seqs)
    exact = expected_bytes_per_token(cfg)
    assert llm.engine.kv_bytes_per_token == math.ceil(exact)
    assert CEDCache.exact_bytes_per_token(cfg) == pytest.approx(float(exact), rel=1e-12)

    cache = llm.engine.kv_cache
    full = [l for l, mode in enumerate(cfg.layer_modes) if mode == "full"]
    assert sorted(cache.kv) == sorted(cache.ik) == full  # only full layers store global KV and indexer K
    paged = 0
    for l in full:
        ml = cfg.ratio(l)
        for (codes, scales), fmt, C in ((cache.kv[l], gfmt, D), (cache.ik[l], ifmt, dh)):
            assert codes.dtype == scales.dtype == torch.uint8
            assert codes.shape[0] == scales.shape[0] == num_blocks * block_size // ml  # entry slots
            assert codes.shape[-1] + scales.shape[-1] == fmt_bytes(fmt, C)
            assert codes.shape[-1] == C // 2
            paged += codes.numel() + scales.numel()
        if ml > 1:  # the compressor's group: m hidden states per sequence (plus the graphs' scratch row)
            assert tuple(cache.pending[l].shape) == (max_seqs + 1, ml + cfg.swa_allowance, cfg.hidden_size)
    assert paged == num_blocks * block_size * exact
    # SWA rings: every layer, n_win + allowance FP8 slots per sequence (plus the graphs' scratch row).
    assert sorted(cache.ring) == list(range(cfg.num_layers))
    for l, (codes, scales) in cache.ring.items():
        assert codes.dtype == scales.dtype == torch.uint8
        assert tuple(codes.shape) == (max_seqs + 1, cfg.n_win + cfg.swa_allowance, D)
        assert tuple(scales.shape) == (max_seqs + 1, cfg.n_win + cfg.swa_allowance, D // 32)
        assert codes.shape[-1] + scales.shape[-1] == fmt_bytes("fp8_e4m3_pow2", D)
    assert CEDCache.ring_bytes_per_seq(cfg) == cfg.num_layers * (cfg.n_win + cfg.swa_allowance) * fmt_bytes(
        "fp8_e4m3_pow2", D)
    # The cache really serves a generation of this shape.
    out = llm.generate([list(range(10, 30))], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),
                       use_tqdm=False)
    assert out[0].outputs[0].finish_reason == "length" and len(out[0].outputs[0].token_ids) == 3


# ----------------------------------------------------------------------------------------------------------
# Bad checkpoints fail at load, naming what is wrong.

@pytest.fixture(scope="module")
def good_checkpoint(tmp_path_factory):
    d = tmp_path_factory.mktemp("good")
    cfg = build_ced_checkpoint(d, seed=0, **BASE)
    return d, cfg


def write_variant(src, dst, config=None, tensors=None):
    """Copy a checkpoint directory, replacing config.json and/or the weights."""
    import shutil

    shutil.copytree(src, dst)
    if config is not None:
        (dst / "config.json").write_text(json.dumps(config))
    if tensors is not None:
        save_file(tensors, str(dst / "model.safetensors"))
    return str(dst)


@pytest.mark.parametrize("modes,where,why", [
    (("swa", "reuse", "full", "reuse", "full", "reuse", "reindex"), r"layer_modes\[1\]", "earlier full layer"),
    (("swa", "full", "reuse", "reuse", "full", "reindex", "full"), r"layer_modes\[6\]", "only the first decoder"),
    (("swa", "full", "reuse", "reuse", "swa", "swa", "swa"), r"layer_modes\[4\]", "first decoder layer must be full"),
    (("swa", "full", "reuse", "reuse", "reindex", "full", "reuse"), r"layer_modes\[4\]", "earlier full layer"),
    (("swa", "full", "dense", "reuse", "full", "reuse", "reuse"), r"layer_modes\[2\]", "expected one of"),
    (("swa", "full", "reuse", "full", "reuse", "reuse"), r"layer_modes", "needs 7 entries"),
])
def test_inconsistent_layer_modes_fail_at_load(good_checkpoint, tmp_path, modes, where, why):
    src, cfg = good_checkpoint
    hf = dict(cfg.to_hf(), layer_modes=list(modes))
    path = write_variant(src, tmp_path / "bad", config=hf)
    with pytest.raises(CEDConfigError, match=where) as info:
        LLM(path)
    assert why in str(info.value)


@pytest.mark.parametrize("field,value,why", [
    ("out_groups", 0, "must be an int >= 1"), ("num_heads", 0, "must be an int >= 1"),
    ("n_shared_experts", -1, "must be an int >= 0"), ("head_dim", 48, "scale group of swa_kv_format"),
    ("index_head_dim", 16, "scale group of index_k_format"),
])
def test_config_widths_are_checked_naming_the_field(field, value, why):
    """Widths a layer divides by, or a cache quantizes in groups of, fail in the config, not deep in the model."""
    with pytest.raises(CEDConfigError, match=rf"{field}={value} is invalid: .*{why}"):
        CEDConfig(**{field: value})
    CEDConfig(head_dim=48, rope_dim=16, global_kv_format="bf16", swa_kv_format="fp32")  # raw formats: any width


def test_fake_quant_off_is_refused_by_the_engine(good_checkpoint, tmp_path):
    """fake_quant=False is forward_full's option: the engine's caches hold quantized KV, so its fresh keys would
    disagree with its cached ones (a prompt's output would depend on its chunking)."""
    src, cfg = good_checkpoint
    path = write_variant(src, tmp_path / "nofq", config=dict(cfg.to_hf(), fake_quant=False))
    with pytest.raises(ValueError, match="fake_quant=False is the full-sequence path's option"):
        LLM(path)


def test_missing_wrong_shape_and_foreign_tensors_fail_at_load(good_checkpoint, tmp_path):
    src, cfg = good_checkpoint
    weights = load_file(str(src / "model.safetensors"))
    # A missing tensor: the reindex layer's indexer query.
    w = dict(weights)
    del w["layers.6.wiq"]
    with pytest.raises(WeightError, match=r"layers\.6\.wiq"):
        LLM(write_variant(src, tmp_path / "missing", tensors=w))
    # A tensor of the wrong shape: the encoder full layer's compressor gate.
    w = dict(weights)
    w["layers.1.wz"] = torch.zeros(cfg.head_dim + 1, cfg.hidden_size)
    with pytest.raises(WeightError, match=r"layers\.1\.wz.*shape") as info:
        LLM(write_variant(src, tmp_path / "shape", tensors=w))
    assert str((cfg.head_dim, cfg.hidden_size)) in str(info.value)
    # A config whose layer 5 is reindex where the weights have a reuse layer: its indexer weights are missing.
    hf = dict(cfg.to_hf(), layer_modes=["swa", "full", "reindex", "reuse", "full", "reindex", "reindex"])
    with pytest.raises(WeightError, match=r"layers\.5\.wi"):
        LLM(write_variant(src, tmp_path / "modes", config=hf))
    # And the reverse: indexer weights for a layer the config says is reuse.
    hf = dict(cfg.to_hf(), layer_modes=["swa", "full", "reuse", "reuse", "full", "reuse", "reuse"])
    with pytest.raises(WeightError, match=r"layers\.2\.wi"):
        LLM(write_variant(src, tmp_path / "foreign", config=hf))
    # The untouched checkpoint loads.
    assert LLM(str(src)).engine.model.config.layer_modes == cfg.layer_modes


# ----------------------------------------------------------------------------------------------------------
# Reindex layers score only the candidate pool (issue 12.3): the gathered pool against its masked twin.

@st.composite
def pool_cases(draw) -> dict:
    """Indexer scores with few distinct values (so many exact ties), visibility, a pool shape and K."""
    Tq, J = draw(st.integers(1, 6)), draw(st.integers(0, 40))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    levels = draw(st.integers(1, 6))
    scores = torch.randint(0, levels, (Tq, J), generator=g).float() * draw(st.sampled_from([1.0, -0.5, 0.25]))
    nvis = torch.randint(0, J + 1, (Tq,), generator=g)
    return dict(scores=scores, visible=torch.arange(J)[None, :] < nvis[:, None], block=draw(st.integers(1, 5)),
                nblocks=draw(st.integers(1, 5)), k=draw(st.integers(1, 12)))


@settings(max_examples=80, deadline=None)
@given(case=pool_cases())
def test_pool_candidates_and_their_top_k_match_the_masked_twin(case):
    """pool_candidates lists the entries pool_mask marks (ascending, then -1), and the top-K chosen from the
    candidates' scores alone is the top-K of the masked full scores, ties to the lower entry id included."""
    scores, visible, block, nblocks, k = (case[n] for n in ("scores", "visible", "block", "nblocks", "k"))
    Tq, J = scores.shape
    mask = fn.pool_mask(scores, visible, block, nblocks)
    cand = fn.pool_candidates(scores, visible, block, nblocks)
    assert cand.shape == (Tq, min(nblocks, -(-J // block)) * block if J else 0)
    assert torch.equal(fn.candidates_mask(cand, J), mask)
    for t in range(Tq):
        n = int(mask[t].sum())
        assert bool((cand[t, :n] >= 0).all()) and bool((cand[t, n:] == -1).all())
        assert bool((cand[t, 1:n] > cand[t, :max(n - 1, 0)]).all())  # strictly ascending
    gathered = torch.gather(scores, 1, cand.clamp(min=0)) if J else scores
    assert torch.equal(fn.select_candidates(gathered, cand, k), fn.select_topk(scores, visible & mask, k))


def _kernel_ops():
    """NvidiaOps when its kernels run here (a GPU, or Triton's interpreter on the CPU), else None."""
    try:
        from deepinfer.backends.nvidia.ops import INTERPRET, NvidiaOps
    except ImportError:
        return None
    if not (torch.cuda.is_available() or INTERPRET):
        return None
    return NvidiaOps(torch.device("cuda" if torch.cuda.is_available() else "cpu"))


GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # E2M1 magnitudes


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(row_js=st.lists(st.integers(0, 30), min_size=1, max_size=3), queries=st.integers(1, 3),
       nh=st.integers(1, 3), dh=st.sampled_from([32, 64]), fmt=st.sampled_from(["mxfp4", "fp4_e2m1_e4m3"]),
       k=st.integers(1, 8), block=st.integers(1, 4), nblocks=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_indexer_op_with_candidates_picks_the_masked_set(row_js, queries, nh, dh, fmt, k, block, nblocks, seed):
    """ced_indexer_topk(candidates=pool) scores only the pool and picks the set that allowed=mask(pool) picks
    from every entry's scores, in the reference op and in the kernel (Triton's interpreter on the CPU).
    Keys on the FP4 grid (every group holds a 6, so the scale is 1), small integer queries and weights: every
    score is exact in float32 whatever the summation order, so the sets must agree exactly, ties included."""
    from deepinfer.backends.reference.ops import ReferenceOps

    g = torch.Generator().manual_seed(seed)
    N = sum(row_js) + 1
    keys = GRID[torch.randint(0, len(GRID), (N, dh), generator=g)] * torch.where(
        torch.rand(N, dh, generator=g) < 0.5, -1.0, 1.0)
    keys[:, ::16] = 6.0
    codes, scales = lowbit.quantize(keys, fmt)
    assert torch.equal(lowbit.dequantize(codes, scales, fmt), keys)
    perm, at = torch.randperm(N, generator=g), 0
    Jmax = max(row_js)
    slots = torch.zeros(len(row_js), Jmax, dtype=torch.long)
    for r, J in enumerate(row_js):
        if J:
            slots[r, :J] = perm[at:at + J]
            slots[r, J:] = perm[at + J - 1]  # as the engine pads a row: its last entry's cache row
        at += J
    q_rows = torch.arange(len(row_js)).repeat_interleave(queries)
    Tq = q_rows.numel()
    nvis = torch.stack([torch.randint(0, row_js[r] + 1, (), generator=g) for r in q_rows.tolist()])
    q = torch.randint(-2, 3, (Tq, nh, dh), generator=g).float()
    w = torch.randint(1, 4, (Tq, nh), generator=g).float() / 2
    ref = ReferenceOps(torch.device("cpu"))
    args = (q, w, (codes, scales), fmt, slots, q_rows, nvis)
    _, full = ref.ced_indexer_topk(*args, k, return_scores=True)
    visible = torch.arange(Jmax)[None, :] < nvis[:, None]
    pool = fn.pool_candidates(full, visible, block, nblocks)
    want, _ = ref.ced_indexer_topk(*args, k, allowed=fn.candidates_mask(pool, Jmax))
    for ops in (ref, _kernel_ops()):
        if ops is None:
            continue
        dev = ops.device
        ids, sc = ops.ced_indexer_topk(*(a.to(dev) if torch.is_tensor(a) else a for a in args[:2]), (codes.to(dev),
                                       scales.to(dev)), fmt, slots.to(dev), q_rows.to(dev), nvis.to(dev), k,
                                       return_scores=True, candidates=pool.to(dev))
        ids, sc = ids.cpu(), sc.cpu()
        assert ids.shape == want.shape
        if ops is ref:
            assert torch.equal(ids, want)  # the same ids in the same order (by score, ties to the lower id)
        else:
            assert ops.kernel_calls["ced_indexer_topk"] >= 1 or pool.shape[1] == 0  # no candidate: no launch
            assert [sorted(r[r >= 0].tolist()) for r in ids] == [sorted(r[r >= 0].tolist()) for r in want]
        ok = pool >= 0
        assert torch.equal(sc[ok], torch.gather(full, 1, pool.clamp(min=0))[ok])  # one score per candidate


class RecordChoices:
    """Records every (layer, query positions, top-K, indexer inputs) the full path's indexer chooses."""

    def __init__(self):
        self.rows: list = []

    @contextlib.contextmanager
    def hooked(self):
        saved = CEDLayer.choose_entries
        me = self

        def choose_entries(layer, iq, iw, ik, qpos, *args):
            out = saved(layer, iq, iw, ik, qpos, *args)
            me.rows.append((layer.i, qpos.clone(), out[0].clone(), iq, iw, ik, out[1]))
            return out

        CEDLayer.choose_entries = choose_entries
        try:
            yield self
        finally:
            CEDLayer.choose_entries = saved

    def by_layer(self) -> dict:
        """layer -> (positions, top-K, scores of every entry) over all chunks."""
        out: dict = {}
        for i, pos, topk, iq, iw, ik, _ in self.rows:
            out.setdefault(i, []).append((pos, topk, fn.index_scores(iq, iw, ik)))
        return {i: tuple(torch.cat(x) for x in zip(*v)) for i, v in out.items()}


def assert_same_choices(got: dict, want: dict, what: str) -> None:
    """Two runs' top-K per layer and position: the same sets, except an entry swapped at the K-th place with one
    whose score ties within TIE x the row's largest score (two float orders of one sum)."""
    assert sorted(got) == sorted(want), what
    for i in want:
        (pa, ta, _), (pb, tb, sb) = got[i], want[i]
        assert torch.equal(pa, pb), (what, i)
        for t in range(tb.shape[0]):
            a, b = set(ta[t][ta[t] >= 0].tolist()), set(tb[t][tb[t] >= 0].tolist())
            if a != b:
                assert len(a) == len(b), (what, i, t)
                kth = float(sb[t][sorted(b)].min())
                tol = TIE * float(sb[t].abs().max())
                assert all(abs(float(sb[t][j]) - kth) <= tol for j in a ^ b), (what, i, t, sorted(a), sorted(b))


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(ov=ced_configs(), n=st.integers(2, 48), cut=st.floats(0, 1), seed=st.integers(0, 2**16))
def test_full_path_reindex_over_the_pool_equals_the_masked_twin(ov, n, cut, seed):
    """forward_full with pool_impl "gather" (decoder reindex layers score their pool only) against "mask" (every
    entry scored, then masked by the pool): the same top-K sets and the same logits; the gathered path scores
    (queries x pool width) entries per reindex layer, the masked one (queries x entries)."""
    torch.manual_seed(seed)
    c = CEDConfig(**ov, vocab_size=97)
    model = CEDForCausalLM(c.to_hf())
    model.init_weights(seed, std=0.3)
    ids = torch.randint(0, c.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))
    s = int(cut * (n - 1))
    res = {}
    for impl in ("mask", "gather"):
        model.pool_impl = impl
        stats: dict = {}
        with torch.no_grad(), RecordChoices().hooked() as rec:
            res[impl] = (model.forward_full(ids, replay_start=s, stats=stats), rec.by_layer(), stats["index_scores"])
    assert_same_choices(res["gather"][1], res["mask"][1], "gather vs mask")
    assert_logits_close(res["gather"][0], res["mask"][0], factor=MODEL_FACTOR, what="gather vs mask")
    T = n - s
    for i, mode in enumerate(c.layer_modes):
        if mode == "reindex" and i >= c.num_encoder_layers:
            STATS["pool_twin_reindex_layers"] += 1
            J = n // c.decoder_ratio
            P = min(c.pool_blocks, -(-J // c.pool_block)) * c.pool_block if J else 0
            assert (res["gather"][2][i], res["mask"][2][i]) == (T * P, T * J), i
        elif mode in ("full", "reindex"):
            assert res["gather"][2][i] == res["mask"][2][i], i


def test_full_path_indexer_is_chunked_and_memory_bounded(monkeypatch):
    """The full path's indexer never holds a whole [queries, entries] score matrix: with a small INDEX_CHUNK every
    indexer einsum stays within it, and the result is the unchunked one."""
    from deepinfer.models.ced import model as model_mod

    c = CEDConfig(**BASE, vocab_size=97)
    model = CEDForCausalLM(c.to_hf())
    model.init_weights(5, std=0.3)
    ids = torch.randint(0, c.vocab_size, (120,), generator=torch.Generator().manual_seed(5))
    with torch.no_grad(), RecordChoices().hooked() as whole:
        want = model.forward_full(ids)
    sizes = []
    orig = fn.index_scores

    def index_scores(q, w, k):
        out = orig(q, w, k)
        sizes.append(out.numel() * max(c.index_heads, c.index_head_dim))  # the einsum's [Tq, heads, J] and keys
        return out

    budget = 4 * 120 * max(c.index_heads, c.index_head_dim)  # 4 queries' scores of the decoder's 120 entries
    monkeypatch.setattr(model_mod, "INDEX_CHUNK", budget)
    monkeypatch.setattr(fn, "index_scores", index_scores)
    with torch.no_grad(), RecordChoices().hooked() as chunked:
        got = model.forward_full(ids)
    assert sizes and max(sizes) <= budget
    assert len(chunked.rows) > len(whole.rows)  # it did run in chunks
    monkeypatch.setattr(fn, "index_scores", orig)
    assert_same_choices(chunked.by_layer(), whole.by_layer(), "chunked vs whole")
    assert_logits_close(got, want, factor=MODEL_FACTOR, what="chunked vs whole")


def test_engine_reindex_scores_only_the_pool(tmp_path, monkeypatch):
    """The engine path: pool_impl "gather" gives "mask"'s greedy tokens and logprobs (also with the indexer op
    called in chunks of 2 queries), while its reindex layer scores (queries x pool width) entries, not
    (queries x entries): the work counted in model.counters["index_scores"]."""
    path, cfg = base_checkpoint(tmp_path, pool_blocks=2, pool_block=2)  # a pool of 4 entries
    prompts = distinct_prompts(cfg.vocab_size, [40, 23], seed=8)
    sp = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=3)
    reindex = [l for l, m in enumerate(cfg.layer_modes) if m == "reindex" and l >= cfg.num_encoder_layers]
    runs, whole = {}, engine_path.INDEX_CHUNK
    for impl, chunk in (("mask", whole), ("gather", whole), ("gather", 2)):
        monkeypatch.setattr(engine_path, "INDEX_CHUNK", chunk)
        llm = LLM(path, block_size=2, num_kv_blocks=80, max_num_batched_tokens=16, max_num_seqs=4, max_model_len=64,
                  hf_overrides={"replay_mode": "exact"})  # every position through the decoder: the most indexing
        llm.engine.model.pool_impl = impl
        llm.engine.model.reset_counters()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        runs[impl, chunk] = ([o.outputs[0].token_ids for o in outs], [o.outputs[0].logprobs for o in outs],
                             dict(llm.engine.model.counters))
    tokens, lps, cnt = runs["mask", whole]
    for key in (("gather", whole), ("gather", 2)):
        assert runs[key][0] == tokens, key
        for a, b in zip(runs[key][1], lps):
            for da, db in zip(a, b):
                assert sorted(da) == sorted(db)
                assert max(abs(da[t].logprob - db[t].logprob) for t in da) <= 1e-5, key
    queries = sum(len(p) + 10 - 1 for p in prompts)  # exact replay: every position through the decoder
    for l in reindex:
        gather, mask = runs["gather", whole][2]["index_scores"][l], cnt["index_scores"][l]
        assert gather <= queries * 4 < mask, (l, gather, mask)
    STATS["reindex_scores_gather_vs_mask"] = (gather, mask)


# ----------------------------------------------------------------------------------------------------------
# prompt_logprobs never changes what a request generates (issue 12.7).

def watch_scoring(llm: LLM) -> list:
    """Wrap the model's forward to record, per row of every step, (start, tokens, replay start, score_end)."""
    model, rows = llm.engine.model, []
    orig = model.forward

    def forward(input_ids, meta, cache):
        for a, n, s in zip(meta.starts, meta.nums, meta.replay_starts):
            rows.append((a, n, int(s), getattr(s, "score_end", 0)))
        return orig(input_ids, meta, cache)

    model.forward = forward
    return rows


def prompt_lps(out, prompt) -> list:
    return [out.prompt_logprobs[p][prompt[p]].logprob for p in range(1, len(prompt))]


def check_scoring(plain: list, scored: list, prompts: list, want_lps: list, what: str) -> None:
    """With prompt_logprobs, each prompt generated the tokens it generates without, and its prompt logprobs are
    exact replay's (want_lps)."""
    for i, (a, b, p, want) in enumerate(zip(plain, scored, prompts, want_lps)):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids, (what, i)
        assert_logits_close(torch.tensor(prompt_lps(b, p)), torch.tensor(want), factor=MODEL_FACTOR,
                            dtype=torch.float32, what=f"{what}: prompt {i} logprobs vs exact replay")


def began_inside_overlap(rows: list) -> bool:
    """A chunk began inside [s, score_end), where both decoder passes run, each with its own rings."""
    return any(s < a < e for a, _, s, e in rows)


def test_prompt_logprobs_keep_generation_and_score_like_exact_replay(tmp_path):
    """A random-weight checkpoint (every layer mode, pool, chunked prefill of 3 tokens, preemption): with
    prompt_logprobs the greedy tokens are those without, the replay start is still N - n_win, the prompt
    logprobs are the full path's exact-replay ones (forward_full with s = 0), and the decoder ran its
    scoring pass over the N - 1 scored positions of each prompt (score_tokens)."""
    path, cfg = base_checkpoint(tmp_path)
    prompts = distinct_prompts(cfg.vocab_size, [13, 7, 11], seed=4)
    T, W, E = 8, cfg.n_win, cfg.num_encoder_layers
    plain_sp = SamplingParams(max_tokens=T, temperature=0.0, ignore_eos=True)
    score_sp = SamplingParams(max_tokens=T, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
    # float32 on any device, so the engine and forward_full agree to float noise.
    roomy = LLM(path, block_size=2, num_kv_blocks=64, max_num_batched_tokens=3, max_num_seqs=4, dtype="float32")
    runs = {"plain": roomy.generate(prompts, plain_sp, use_tqdm=False)}
    rows = watch_scoring(roomy)
    roomy.engine.model.reset_counters()
    runs["scored"] = roomy.generate(prompts, score_sp, use_tqdm=False)
    cnt = roomy.engine.model.counters
    for l in range(E, cfg.num_layers):  # each prompt's positions 0 .. N - 2, once (no preemption here)
        assert cnt["score_tokens"][l] == sum(len(p) - 1 for p in prompts), l
        assert cnt["min_pos"][l] == 0
    assert cnt["score_tokens"][:E] == [0] * E
    for seq, p in zip([r.seqs[0] for r in roomy.engine.requests.values()][-3:], prompts):
        assert seq.replay_start == len(p) - W and seq.replay_start.score_end == len(p) - 1
    model = roomy.engine.model
    dev = next(model.parameters()).device
    with torch.no_grad():
        want = [torch.log_softmax(model.forward_full(torch.tensor(p, device=dev), replay_start=0)[:-1], -1)
                .gather(1, torch.tensor(p[1:], device=dev)[:, None])[:, 0].tolist() for p in prompts]
    check_scoring(runs["plain"], runs["scored"], prompts, want, "chunks of 3")
    tight = LLM(path, block_size=2, num_kv_blocks=15, max_num_batched_tokens=3, max_num_seqs=4, dtype="float32")
    rows += watch_scoring(tight)
    check_scoring(runs["plain"], tight.generate(prompts, score_sp, use_tqdm=False), prompts, want, "preempted")
    assert tight.engine.scheduler.num_preemptions > 0 and began_inside_overlap(rows)


DEMO_PROMPTS = 8


@pytest.fixture(scope="module")
def demo_prompts():
    from deepinfer.models.loader import DEMO_DIR

    llm = LLM(max_model_len=256)
    tok = llm.tokenizer
    ids = tok.encode((DEMO_DIR / "heldout_sample.txt").read_text(), add_special_tokens=False)
    return llm, [[tok.bos_token_id] + ids[i * 211: i * 211 + 200] for i in range(DEMO_PROMPTS)]


def test_demo_prompt_logprobs_keep_greedy_tokens(demo_prompts):
    """The bundled demo model, 8 prompts of 201 tokens (the issue found 1 of 8 generating other greedy tokens
    when prompt_logprobs switched it to exact replay): with prompt_logprobs every prompt generates the tokens
    it generates without, whole prompts in one step and in chunks of 64 tokens with preemption; the prompt
    logprobs are exact replay's (the replay mode of the recorded held-out figure in test_demo_model) under the
    same schedule (chunking alone moves a demo logprob by up to 9e-4 nats: bf16 and low-bit KV)."""
    llm, prompts = demo_prompts
    plain_sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    score_sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, prompt_logprobs=1)
    # 30 blocks of 16 hold 2 of the 8 sequences (13 blocks each): chunked prefill of 64 tokens with preemption.
    for what, kw in (("one step", {}), ("chunks of 64, preempted", dict(num_kv_blocks=30, max_num_batched_tokens=64))):
        bounded = llm if not kw else LLM(max_model_len=256, **kw)
        exact = LLM(max_model_len=256, hf_overrides={"replay_mode": "exact"}, **kw)
        want = [prompt_lps(o, p) for o, p in zip(exact.generate(prompts, score_sp, use_tqdm=False), prompts)]
        plain = bounded.generate(prompts, plain_sp, use_tqdm=False)
        rows = watch_scoring(bounded)
        check_scoring(plain, bounded.generate(prompts, score_sp, use_tqdm=False), prompts, want, what)
        if kw:
            assert bounded.engine.scheduler.num_preemptions > 0 and began_inside_overlap(rows)

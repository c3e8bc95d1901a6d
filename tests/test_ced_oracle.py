"""The CED engine (reference backend, float32, paged caches, chunked prefill, batched decode) against the
independent float64 oracle of deepinfer/testing/ced_oracle.py, written from CED.md alone.

tests/test_ced.py holds the engine to ``forward_full``, which is built from the same layer methods and helpers
as the engine: it checks paging, chunking, rings and replay, but a mistake in the CED arithmetic itself would
sit on both sides. Here the other side shares no code with the engine.

Discrete choices (the indexer's top-K, the decoder's candidate pool, the experts, and the rounding of each
stored KV vector) are never copied from one side into the other. Each side makes its own; the test records the
engine's (per request, layer and position) and compares them with the oracle's. The first place (in position
order, then layer order) where the two differ must be a near-tie: the oracle's float64 scores of the engine's
choice lie within TIE_FACTOR x float32 eps x the row's score magnitude of its own choice's scores (for a
rounding: the engine's float32 input of that vector lies within ROUND_TOL of the oracle's, so the value sat on
a rounding boundary). Past that position the two computations legitimately part, so logits are compared at
every decoder position before it, within FACTOR x float32 eps x the row's max|logit|; what was compared and
the near-ties met are counted in STATS (printed at the end; pytest -s).

The engine's choices are observed, never changed: ``engine_path.layer_engine`` is wrapped to read each layer's
top-K and pool from the pass context after it ran, ``model.record_expert_load`` gives the experts, and
``lowbit.quantize`` every vector stored (its input and what reads back).
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import math
from collections import Counter, defaultdict
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import deepinfer.testing.ced_oracle as oracle_mod
from deepinfer import LLM
from deepinfer.backends.reference import lowbit
from deepinfer.core.kv_cache import blocks_needed
from deepinfer.models.ced import engine_path
from deepinfer.testing.ced import block_sizes_for, build_ced_checkpoint, ced_configs
from deepinfer.testing.ced_oracle import CEDOracle, load_ced_checkpoint, quantize
from deepinfer.testing.compare import assert_logits_close, eps, logits_bound
from deepinfer.testing.engine import step_greedy

EPS32 = eps(torch.float32)
# Engine (float32) vs oracle (float64) logits, in float32 eps of the row's max|logit|. The worst seen over about
# 60 drawn cases (DEEPINFER_HYPOTHESIS_RANDOM=1) is 23 eps (float32 rounding over 3-8 layers, RoPE angles
# computed in float32, softmax and SwiGLU); 256 leaves 10x for other CPUs. Rounding to the cache formats alone
# moves the logits by ~1e7 eps (test_fake_quant_changes_the_function_by_a_measured_amount), and an arithmetic
# mistake (a dropped sink, the other RoPE pair layout, softmax routing, no routed scaling, entry RoPE at j
# instead of j*m) already moves a stored KV vector by 0.08-0.8 x its max|x|, so it stops at the first vector.
FACTOR = 256
# Near-tie of a selection: the oracle's scores of the two choices, sorted, agree within this many float32 eps of
# the row's largest |score| (the engine computes those scores in float32 from the same stored keys).
TIE_FACTOR = 1024
# Near-tie of a rounding: the engine's float32 input of a stored vector within this fraction of the vector's
# max|x| of the oracle's input (float32 rounding over the layers below: the worst seen is 1.2e-6; 1e-4 is ~840
# eps). A wrong computation moves the first vector it touches by 0.08-0.8 x max|x|.
ROUND_TOL = 1e-4
STATS = Counter()


@pytest.fixture(scope="module", autouse=True)
def report_stats():
    yield
    print(f"\nCED engine vs independent oracle: {dict(STATS)}")


# ----------------------------------------------------------------------------------------------------------
# The oracle stands alone.

def test_oracle_imports_nothing_from_the_engine():
    """The oracle imports only the standard library, torch and safetensors: no deepinfer module at all."""
    tree = ast.parse(Path(oracle_mod.__file__).read_text())
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"relative import from {'.' * node.level}{node.module or ''}"
            names.append(node.module)
    roots = {n.split(".")[0] for n in names}
    assert roots <= {"__future__", "json", "math", "dataclasses", "pathlib", "torch", "safetensors"}, roots


def _format_cases(fmt: str, seed: int, log2_scale: int) -> torch.Tensor:
    """float32 vectors [8, 64] for ``fmt``: random values across a range of magnitudes, all-zero groups, and
    groups built on the format's grid so that values fall exactly on rounding midpoints (ties) and the group's
    maximum exactly on a scale boundary."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(8, 64, generator=g, dtype=torch.float64) * 2.0 ** log2_scale
    x[0, :32] = 0.0
    e2m1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
    mid4 = torch.cat([e2m1, (e2m1[1:] + e2m1[:-1]) / 2])
    sign = torch.where(torch.rand(64, generator=g) < 0.5, -1.0, 1.0).double()
    if fmt == "fp8_e4m3_pow2":
        # E4M3 values and midpoints (mantissa steps of 1/16) times 2^k, with a group maximum of 448 * 2^k.
        k = 2.0 ** log2_scale
        mant = 1 + torch.randint(0, 16, (64,), generator=g).double() / 16
        ex = torch.randint(-6, 8, (64,), generator=g).double()
        x[1] = sign * mant * 2.0 ** ex * k
        x[1, ::32] = 448 * k
    else:
        group = 16 if fmt == "fp4_e2m1_e4m3" else 32
        s = (1.0 + torch.randint(0, 8, (1,), generator=g).item() / 8) * 2.0 ** log2_scale
        if fmt == "mxfp4":
            s = 2.0 ** log2_scale
        x[1] = sign * mid4[torch.randint(0, mid4.numel(), (64,), generator=g)] * s
        x[1, ::group] = (6.0 if fmt == "fp4_e2m1_e4m3" else 4.0) * s
    return x.float()


@settings(max_examples=30, deadline=None)
@given(fmt=st.sampled_from(["fp8_e4m3_pow2", "fp4_e2m1_e4m3", "mxfp4", "fp32", "bf16"]),
       seed=st.integers(0, 2**16), log2_scale=st.integers(-20, 12))
def test_oracle_formats_agree_with_the_cache_byte_layouts(fmt, seed, log2_scale):
    """The oracle's quantizers, written from the format definitions, read back exactly what the engine's byte
    layouts (backends/reference/lowbit.py) store, ties and scale boundaries included."""
    x = _format_cases(fmt, seed, log2_scale)
    want = lowbit.fake_quantize(x, fmt).double()
    got = quantize(x.double(), fmt)
    bad = (got != want).nonzero()
    assert bad.numel() == 0, (f"{fmt}: {bad.shape[0]} values differ, first at {bad[0].tolist()}: x "
                              f"{float(x[tuple(bad[0])])!r} -> oracle {float(got[tuple(bad[0])])!r}, "
                              f"cache {float(want[tuple(bad[0])])!r}")
    if fmt not in ("fp32", "bf16"):
        assert not torch.equal(got, x.double()), "nothing was rounded"


# ----------------------------------------------------------------------------------------------------------
# The engine's side: outputs, final hidden states and every discrete choice, per request, layer and position.

class EngineRecord:
    def __init__(self):
        self.choices = defaultdict(dict)  # (request, layer, position) -> {"topk"|"pool"|"experts": ...}
        self.hidden = {}  # (request, position) -> final hidden state
        self.stored = defaultdict(set)  # fmt -> bytes of every vector the engine stored (as read back)
        self.stored_x = defaultdict(list)  # (fmt, channels) -> the float32 inputs of those vectors
        self.rows = None  # request id per row of the step in flight
        self.cur = None  # (layer, positions, requests) of the layer in flight
        self.chunked = self.batched_decode = False

    @contextlib.contextmanager
    def hooked(self, llm: LLM, prompts: dict):
        engine, model = llm.engine, llm.engine.model
        orig_forward, orig_layer, orig_quant = model.forward, engine_path.layer_engine, lowbit.quantize
        sig = inspect.signature(orig_layer)
        me = self

        def forward(input_ids, meta, cache):
            by_slot = {s.state_slot: s for s in engine.scheduler.running}
            seqs = [by_slot[slot] for slot in meta.state_slots]
            me.rows = [s.request_id for s in seqs]
            decoding = 0
            for s, a, n in zip(seqs, meta.starts, meta.nums):
                N = len(prompts[s.request_id])
                me.chunked |= a < N and n < N
                decoding += a >= N
            me.batched_decode |= decoding >= 2
            h = orig_forward(input_ids, meta, cache)
            q = 0
            for r, (a, n) in enumerate(zip(meta.starts, meta.nums)):
                for p in range(max(a, meta.replay_starts[r]), a + n):
                    key = (me.rows[r], p)
                    assert key not in me.hidden, f"position {key} computed twice"
                    me.hidden[key] = h[q + p - a].detach().clone()
                q += n
            return h

        def layer_engine(*args, **kw):
            a = sig.bind(*args, **kw).arguments
            layer, P, ctx = a["layer"], a["P"], a["ctx"]
            if getattr(P, "score", False):  # a prompt-scoring pass (prompt_logprobs): not requested here
                raise AssertionError("unexpected prompt-scoring pass")
            me.cur = (layer.i, P.pos.tolist(), [me.rows[r] for r in P.rows_t.tolist()])
            out = orig_layer(*args, **kw)
            i, pos, reqs = me.cur
            topk = ctx.get(("topk", i)) if layer.mode in ("full", "reindex") else None
            pool = ctx.get(("pool", i)) if layer.is_decoder and layer.mode == "full" else None
            for t, (p, rid) in enumerate(zip(pos, reqs)):
                rec = me.choices[(rid, i, p)]
                if topk is not None:
                    rec["topk"] = sorted(j for j in topk[t].tolist() if j >= 0)
                if pool is not None:  # a [J] mask of the pool, or its entry ids (-1 padded): kept as sorted ids
                    row = pool[t]
                    ids = row.nonzero()[:, 0] if row.dtype == torch.bool else row[row >= 0]
                    rec["pool"] = ids.sort().values.tolist()
            me.cur = None
            return out

        def record_expert_load(layer, ids):
            i, pos, reqs = me.cur
            assert layer == i and ids.shape[0] == len(pos)
            for t, (p, rid) in enumerate(zip(pos, reqs)):
                me.choices[(rid, i, p)]["experts"] = sorted(ids[t].tolist())
            return type(model).record_expert_load(model, layer, ids)

        def quantize_hook(x, fmt):
            codes, scales = orig_quant(x, fmt)
            back = lowbit.dequantize(codes, scales, fmt, dtype=torch.float32).reshape(-1, x.shape[-1]) + 0.0
            me.stored[fmt].update(r.tobytes() for r in back.numpy())
            me.stored_x[(fmt, x.shape[-1])].append(x.detach().float().reshape(-1, x.shape[-1]).clone())
            return codes, scales

        model.forward, model.record_expert_load = forward, record_expert_load  # instance attributes
        engine_path.layer_engine, lowbit.quantize = layer_engine, quantize_hook
        try:
            yield self
        finally:
            engine_path.layer_engine, lowbit.quantize = orig_layer, orig_quant
            del model.forward, model.record_expert_load


def run_engine(llm: LLM, prompts: list, max_tokens: int) -> tuple:
    """Greedy generation of every prompt at once through engine.step(); returns (outputs, EngineRecord)."""
    rec = EngineRecord()
    with rec.hooked(llm, {f"r{i}": p for i, p in enumerate(prompts)}):  # step_greedy's request ids
        outs, _ = step_greedy(llm.engine, prompts, max_tokens, max_steps=2000)
    return outs, rec


# ----------------------------------------------------------------------------------------------------------
# The comparison.

def _near(a: list, b: list, tol: float) -> float:
    """max |a_i - b_i| of the two score lists, each sorted (inf when their lengths differ)."""
    if len(a) != len(b):
        return math.inf
    return max((abs(x - y) for x, y in zip(sorted(a), sorted(b))), default=0.0)


def _events(run, rid: str, rec: EngineRecord, stats: Counter = STATS) -> list:
    """Every place the engine's choices differ from the oracle's, as (position, layer order, what, detail)."""
    ev = []
    for q in run.quant:  # a stored vector the engine never stored: a rounding that went the other way (or a bug)
        y = (q["y"].float() + 0.0).numpy()
        seen = rec.stored[q["fmt"]]
        stats["stored_vectors"] += y.shape[0]
        for r, p in enumerate(q["pos"].tolist()):
            if y[r].tobytes() not in seen:
                ev.append((p, q["layer"], 0, ("round", q["kind"], q["fmt"], q["x"][r], q["y"][r])))
    for l, lay in run.layers.items():
        for t, p in enumerate(lay["pos"].tolist()):
            mine = rec.choices.get((rid, l, p), {})
            stats["choices_experts"] += 1
            if lay.get("chooses_topk"):
                stats["choices_topk"] += 1
                ours = sorted(j for j in lay["topk"][t].tolist() if j >= 0)
                if mine.get("topk") != ours:
                    ev.append((p, l, 1, ("topk", t, mine.get("topk"), ours)))
            if "pool" in lay:
                stats["choices_pool"] += 1
                ours = lay["pool"][t].nonzero()[:, 0].tolist()
                if mine.get("pool") != ours:
                    ev.append((p, l, 2, ("pool", t, mine.get("pool"), ours)))
            ours = sorted(lay["experts"][t].tolist())
            if mine.get("experts") != ours:
                ev.append((p, l, 3, ("experts", t, mine.get("experts"), ours)))
    return sorted(ev, key=lambda e: e[:3])


def _assert_near_tie(event, run, rec: EngineRecord, what: str, stats: Counter = STATS) -> str:
    """The first difference must be a near-tie; returns its kind (for STATS)."""
    p, l, _, detail = event
    kind = detail[0]
    lay = run.layers.get(l)
    where = f"{what}, position {p}, layer {l}"
    if kind == "round":
        _, k, fmt, x, y = detail
        xs = torch.cat(rec.stored_x[(fmt, x.numel())]).double()
        dist = float((xs - x.double()).abs().amax(-1).min()) / float(x.abs().max())
        assert dist <= ROUND_TOL, (f"{where}: the oracle's {k} vector ({fmt}) is stored by no engine row, and the "
                                   f"engine's nearest input lies {dist:.3g} x max|x| away (not a rounding tie)")
        stats["tie_round"] += 1
        stats["tie_round_max_dist_1e-9"] = max(stats["tie_round_max_dist_1e-9"], math.ceil(dist * 1e9))
        return f"round_{k}"
    t, theirs, ours = detail[1:]
    if kind == "experts":
        sc = lay["expert_scores"][t]
        tol = TIE_FACTOR * EPS32 * float(sc.abs().max())
        gap = _near([float(sc[j]) for j in theirs], [float(sc[j]) for j in ours], tol) if theirs else math.inf
        assert gap <= tol, (f"{where}: the engine routed to experts {theirs}, the oracle to {ours}; selection "
                            f"scores {sc.tolist()}: apart by {gap:.3g} > {tol:.3g}, no near-tie")
    elif kind == "topk":
        sc, ok = lay["index_scores"][t], lay["allowed"][t]
        tol = TIE_FACTOR * EPS32 * float(sc[ok].abs().max()) if bool(ok.any()) else 0.0
        assert theirs is not None and all(j < ok.numel() and bool(ok[j]) for j in theirs), (
            f"{where}: the engine's top-K {theirs} picks entries the oracle does not allow (not visible, or "
            f"outside the decoder's pool)")
        gap = _near([float(sc[j]) for j in theirs], [float(sc[j]) for j in ours], tol)
        assert gap <= tol, (f"{where}: the engine's top-K {theirs} vs the oracle's {ours}: scores apart by "
                            f"{gap:.3g} > {tol:.3g}, no near-tie")
    else:  # pool: the kept blocks' scores, the newest block (always kept) aside
        bs, block = lay["block_scores"][t], lay["pool_block"]
        v = int((p + 1) // lay["ratio"])  # visible entries
        assert theirs is not None and all(0 <= j < v for j in theirs), (
            f"{where}: the engine's pool {theirs} is missing or holds entries not visible (< {v})")
        kt, ko = ({j // block for j in ids} for ids in (theirs, ours))
        newest = (v - 1) // block
        assert newest in kt, f"{where}: the engine's pool {kt} drops the newest block {newest}"
        fin = bs[torch.isfinite(bs)]
        tol = TIE_FACTOR * EPS32 * float(fin.abs().max())
        gap = _near([float(bs[b]) for b in kt if b != newest], [float(bs[b]) for b in ko if b != newest], tol)
        assert gap <= tol, (f"{where}: the engine's pool blocks {kt} vs the oracle's {ko}: block scores apart by "
                            f"{gap:.3g} > {tol:.3g}, no near-tie")
    stats[f"tie_{kind}"] += 1
    return kind


def compare(oracle: CEDOracle, llm: LLM, prompts: list, outs: list, rec: EngineRecord, exact: bool,
            what: str) -> tuple:
    """Every sequence of one engine run against the oracle; returns (positions compared, positions computed)."""
    model = llm.engine.model
    c = oracle.c
    compared = total = 0
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        rid, N = f"r{i}", len(prompt)
        s = 0 if exact else max(0, N - c["n_win"])
        toks = prompt + out[:-1]  # the last sampled token is never fed back
        run = oracle(toks, replay_start=s, fake_quant=True)
        # The engine computed the decoder at exactly the oracle's positions, every layer at the oracle's.
        got = sorted(p for r, p in rec.hidden if r == rid)
        assert got == list(range(s, len(toks))), f"{what} {rid}: decoder positions {got[:3]}... s={s}"
        for l, lay in run.layers.items():
            pos = sorted(p for (r, ll, p) in rec.choices if r == rid and ll == l)
            assert pos == lay["pos"].tolist(), f"{what} {rid}: layer {l} ran at positions {pos}"
        ev = _events(run, rid, rec)
        stop = len(toks)
        if ev:
            STATS["sequences_parted"] += 1
            _assert_near_tie(ev[0], run, rec, f"{what} {rid} (N={N}, s={s})")
            stop = ev[0][0]
        STATS["sequences"] += 1
        ps = [p for p in range(s, stop)]
        total += len(toks) - s
        compared += len(ps)
        if not ps:
            continue
        with torch.no_grad():
            eng = model.compute_logits(torch.stack([rec.hidden[(rid, p)] for p in ps]))
        ref = run.logits[[p - s for p in ps]]
        err = ((eng.double() - ref).abs().amax(-1) / logits_bound(ref, 1.0, torch.float32)).max()
        STATS["max_err_eps"] = max(STATS["max_err_eps"], math.ceil(float(err)))
        assert_logits_close(eng, ref, factor=FACTOR, dtype=torch.float32,
                            what=f"{what} {rid} (N={N}, s={s}, positions {ps[0]}..{ps[-1]})")
        STATS["positions"] += len(ps)
        for p in ps:  # the engine's greedy token is the oracle's argmax, or a near-tie of it
            if p >= N - 1 and p - N + 1 < len(out):
                tok, row = out[p - N + 1], ref[p - s]
                best = int(row.argmax())
                if tok != best:
                    assert float(row[best] - row[tok]) <= 2 * FACTOR * EPS32 * float(row.abs().max()), (
                        f"{what} {rid}: greedy token at {p + 1} is {tok}, the oracle's argmax {best}")
                    STATS["tie_greedy"] += 1
    return compared, total


# ----------------------------------------------------------------------------------------------------------
# Engine == oracle over drawn configurations.

SMALL = dict(index_head_dim=32, index_heads=2, q_lora_rank=32, out_group_dim=32, moe_intermediate_size=32,
             n_routed_experts=4, n_shared_experts=1, decoder_ratio=1, max_position_embeddings=512, hidden_size=32,
             num_heads=2, out_groups=2, head_dim=32, rope_dim=8, num_experts_per_tok=2, use_sink=True,
             rope_theta=10000.0, swa_allowance=1)


@st.composite
def oracle_cases(draw) -> dict:
    ov = draw(ced_configs())
    W = ov["n_win"]
    lens = [draw(st.integers(1, W - 1)), draw(st.integers(W + 1, 3 * W + 4)), draw(st.integers(1, 3 * W))]
    return dict(ov=ov, seed=draw(st.integers(0, 2**16)), block_size=draw(block_sizes_for(ov)), lens=lens,
                budget=draw(st.sampled_from([1, 3, 7, 512])), batch_exact=draw(st.booleans()),
                max_tokens=draw(st.integers(3, 8)))


def random_extras(weights: dict, seed: int) -> dict:
    """Non-trivial sinks, router biases and norm weights (the checkpoint builder leaves them 0 and 1, which would
    hide a dropped sink, bias or norm weight)."""
    g = torch.Generator().manual_seed(seed)
    out = dict(weights)
    for k, v in weights.items():
        if k.endswith((".sink", ".gate_bias")):
            out[k] = torch.randn(v.shape, generator=g) * 0.5
        elif k.endswith("norm"):
            out[k] = 1 + torch.randn(v.shape, generator=g) * 0.2
    return out


def run_case(case: dict, tmp_path) -> Counter:
    """Build the case's checkpoint, run the engine twice (the three prompts batched in one replay mode, the long
    one alone in the other), compare every sequence with the oracle; returns what the runs exercised."""
    d = tmp_path / f"ced{case['seed']}"
    cfg = build_ced_checkpoint(d, seed=case["seed"], std=0.2, **case["ov"])
    weights, config = load_ced_checkpoint(d)
    weights = random_extras(weights, case["seed"])
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in weights.items()}, str(d / "model.safetensors"))
    oracle = CEDOracle(weights, config)
    g = torch.Generator().manual_seed(case["seed"])
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in case["lens"]]
    T = case["max_tokens"]
    blocks = sum(blocks_needed(n + T, case["block_size"]) for n in case["lens"]) + 1
    seen, compared, total = Counter(), 0, 0
    for exact, ps in ((case["batch_exact"], prompts), (not case["batch_exact"], prompts[1:2])):
        llm = LLM(str(d), block_size=case["block_size"], num_kv_blocks=blocks, max_num_batched_tokens=case["budget"],
                  max_num_seqs=4, hf_overrides={"replay_mode": "exact"} if exact else None)
        outs, rec = run_engine(llm, ps, T)
        if case["budget"] < max(len(p) for p in ps):
            assert rec.chunked, "the budget is below a prompt's length, yet no prompt was prefilled in chunks"
        seen["exact" if exact else "bounded"] += 1
        seen["chunked"] += rec.chunked
        seen["batched_decode"] += rec.batched_decode
        a, b = compare(oracle, llm, ps, outs, rec, exact, f"{'exact' if exact else 'bounded'} run")
        compared, total = compared + a, total + b
    E = cfg.num_encoder_layers
    seen.update(f"{'decoder' if l >= E else 'encoder'}_{m}" for l, m in enumerate(cfg.layer_modes))
    STATS.update(seen)
    STATS["positions_total"] += total
    # A near-tie ends a sequence's comparison where it falls; most positions must still be compared.
    assert compared >= total / 2, f"only {compared} of {total} positions compared"
    return seen


@settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=oracle_cases())
def test_engine_matches_independent_oracle(case, tmp_path_factory):
    run_case(case, tmp_path_factory.mktemp("ced_oracle"))


FIXED = {
    # Every mode in both parts, m = 2, chunks of 3 with three prompts decoding together; bounded batch, the long
    # prompt alone in exact mode.
    "all_modes_bounded_batch": dict(
        ov=dict(SMALL, num_layers=8, num_encoder_layers=4, layer_modes=("swa", "full", "reindex", "reuse",
                                                                      "full", "reuse", "reindex", "swa"),
                n_win=5, encoder_ratio=2, index_topk=3, pool_block=2, pool_blocks=2, head_dim=64, rope_dim=16),
        seed=11, block_size=4, lens=[3, 14, 9], budget=4, batch_exact=False, max_tokens=8),
    # m = 3, two-token chunks, prompts with no complete entry yet, exact batch, no sink, tied LM head, theta 100.
    "ratio3_exact_batch": dict(
        ov=dict(SMALL, num_layers=5, num_encoder_layers=2, layer_modes=("full", "reuse", "full", "reindex", "reuse"),
                n_win=3, encoder_ratio=3, index_topk=2, pool_block=1, pool_blocks=2, use_sink=False,
                tie_word_embeddings=True, rope_theta=100.0),
        seed=12, block_size=3, lens=[2, 10, 1], budget=2, batch_exact=True, max_tokens=8),
}


@pytest.mark.parametrize("name", sorted(FIXED))
def test_engine_matches_independent_oracle_fixed(name, tmp_path):
    """Fixed cases that certainly exercise every mechanism: each layer mode in the encoder and the decoder,
    bounded and exact replay, chunked prefill and several sequences decoding in one step."""
    case = FIXED[name]
    seen = run_case(case, tmp_path)
    assert seen["chunked"] == 2 and seen["batched_decode"] >= 1 and seen["bounded"] == seen["exact"] == 1, seen
    modes = case["ov"]["layer_modes"]
    E = case["ov"]["num_encoder_layers"]
    assert {k for k in seen if k.startswith(("encoder_", "decoder_"))} == (
        {f"encoder_{m}" for m in modes[:E]} | {f"decoder_{m}" for m in modes[E:]})


def test_fixed_cases_cover_every_layer_mode_in_both_parts():
    kinds = set()
    for case in FIXED.values():
        E = case["ov"]["num_encoder_layers"]
        kinds |= {(l >= E, m) for l, m in enumerate(case["ov"]["layer_modes"])}
    assert kinds == {(dec, m) for dec in (False, True) for m in ("swa", "full", "reindex", "reuse")}


# ----------------------------------------------------------------------------------------------------------
# The quantization is real, and the engine follows it.

def test_fake_quant_changes_the_function_by_a_measured_amount(tmp_path):
    """The oracle without rounding and with the caches' formats part by far more than the float32 bound, and the
    engine sits within the bound of the quantized oracle: the formats are applied, and applied where they belong."""
    d = tmp_path / "q"
    ov = dict(SMALL, num_layers=6, num_encoder_layers=3, layer_modes=("swa", "full", "reuse", "full", "reindex",
                                                                     "reuse"),
              n_win=6, encoder_ratio=2, index_topk=3, pool_block=2, pool_blocks=2)
    cfg = build_ced_checkpoint(d, seed=5, std=0.2, **ov)
    weights, config = load_ced_checkpoint(d)
    oracle = CEDOracle(weights, config)
    g = torch.Generator().manual_seed(5)
    llm = LLM(str(d), block_size=4, num_kv_blocks=16, max_num_batched_tokens=512,
              hf_overrides={"replay_mode": "exact"})
    # A prompt where the engine and the oracle round every stored vector alike, so that the logits compare at
    # every position: a rounding near-tie can go either way by the machine's float32 arithmetic (on an AMD EPYC
    # host the first prompt met one at position 0, where earlier hosts met none), so up to 4 prompts, each
    # difference a near-tie.
    for attempt in range(4):
        prompt = torch.randint(0, cfg.vocab_size, (20,), generator=g).tolist()
        outs, rec = run_engine(llm, [prompt], 1)
        quant = oracle(prompt, replay_start=0, fake_quant=True)
        ev = _events(quant, "r0", rec)
        if not ev:
            break
        _assert_near_tie(ev[0], quant, rec, f"prompt {attempt}")
    assert not ev, "every prompt met a rounding near-tie"
    with torch.no_grad():
        eng = llm.engine.model.compute_logits(torch.stack([rec.hidden[("r0", p)] for p in range(20)]))
    plain = oracle(prompt, replay_start=0, fake_quant=False)
    in_eps = lambda a, b: float(((a.double() - b).abs().amax(-1) / logits_bound(b, 1.0, torch.float32)).max())
    e_q, e_plain, q_plain = in_eps(eng, quant.logits), in_eps(eng, plain.logits), in_eps(quant.logits, plain.logits)
    STATS["quant_vs_plain_eps"] = round(q_plain)
    STATS["engine_vs_quant_eps"] = round(e_q)
    assert e_q <= FACTOR, e_q
    assert q_plain >= 100 * FACTOR and e_plain >= 100 * FACTOR, (q_plain, e_plain)
    # Every stored vector was rounded (none left at full precision) and rounding moved it by at most the format's
    # resolution: FP8 3 mantissa bits (2^-4 relative), FP4 at most half of a step of 2 x scale (amax / 6).
    for q in quant.quant:
        rel = float(((q["y"] - q["x"]).abs().amax(-1) / q["x"].abs().amax(-1)).max())
        bound = 2 ** -4 if q["fmt"] == "fp8_e4m3_pow2" else 1 / 3
        assert 0 < rel <= bound, (q["layer"], q["kind"], rel)


# ----------------------------------------------------------------------------------------------------------
# The comparison itself: it accepts a differing choice only at a near-tie.

def record_of(run, rid: str) -> EngineRecord:
    """An EngineRecord holding exactly the oracle's own choices and stored vectors."""
    rec = EngineRecord()
    for l, lay in run.layers.items():
        for t, p in enumerate(lay["pos"].tolist()):
            ch = rec.choices[(rid, l, p)]
            ch["experts"] = sorted(lay["experts"][t].tolist())
            if lay.get("chooses_topk"):
                ch["topk"] = sorted(j for j in lay["topk"][t].tolist() if j >= 0)
            if "pool" in lay:
                ch["pool"] = lay["pool"][t].nonzero()[:, 0].tolist()
    for q in run.quant:
        rec.stored[q["fmt"]].update(r.tobytes() for r in (q["y"].float() + 0.0).numpy())
        rec.stored_x[(q["fmt"], q["x"].shape[-1])].append(q["x"].float())
    return rec


def test_comparison_accepts_only_near_ties(tmp_path):
    """Exact ties made on purpose (a repeated token gives equal indexer keys in an m = 1 first layer, and two
    experts with the same gate row and bias score alike) pass as near-ties; a choice of a clearly lower score, a
    pool without its newest block, and a stored vector nobody computed fail."""
    d = tmp_path / "ties"
    ov = dict(SMALL, num_layers=4, num_encoder_layers=2, layer_modes=("full", "reindex", "full", "reuse"),
              n_win=4, encoder_ratio=1, index_topk=2, pool_block=2, pool_blocks=1, num_experts_per_tok=1)
    cfg = build_ced_checkpoint(d, seed=7, std=0.2, **ov)
    weights, config = load_ced_checkpoint(d)
    toks = [5] * 6 + [9] + [5] * 5
    # The expert that layer 0 routes the first token to gets a twin (same gate row, same bias 0), and their
    # scores tie everywhere (the gate rows act after layer 0's attention, so the routing stays).
    chosen = int(CEDOracle(weights, config)(toks).layers[0]["experts"][0, 0])
    twin = (chosen + 1) % cfg.n_routed_experts
    weights["layers.0.gate"][twin] = weights["layers.0.gate"][chosen]
    oracle = CEDOracle(weights, config)
    run = oracle(toks, fake_quant=True)
    E = cfg.num_encoder_layers
    assert _events(run, "r0", record_of(run, "r0"), Counter()) == []

    def first_event(edit):
        rec = record_of(run, "r0")
        edit(rec)
        ev = _events(run, "r0", rec, Counter())
        assert ev, "the edit made no difference"
        return ev[0], rec

    def accepted(edit):
        ev, rec = first_event(edit)
        _assert_near_tie(ev, run, rec, "edited", Counter())
        return ev

    def rejected(edit, match):
        ev, rec = first_event(edit)
        with pytest.raises(AssertionError, match=match):
            _assert_near_tie(ev, run, rec, "edited", Counter())

    # Top-K of layer 0 at position 11: the oracle keeps the two lowest of the tied 5s (or 9 and one 5).
    lay, t = run.layers[0], 11
    sc, ours = lay["index_scores"][t], sorted(j for j in lay["topk"][t].tolist() if j >= 0)
    fives = [j for j in range(12) if toks[j] == 5]
    other5 = next(j for j in reversed(fives) if j not in ours)
    tied = sorted([j for j in ours if j != min(j for j in ours if toks[j] == 5)] + [other5])
    assert float(sc[tied].sort().values.sub(sc[ours].sort().values).abs().max()) == 0.0
    assert accepted(lambda r: r.choices[("r0", 0, t)].update(topk=tied))[3][0] == "topk"
    far = sorted([j for j in ours if toks[j] == 5][:1] + [6]) if 6 not in ours else sorted(fives[:2])
    assert float(sc[far].sum() - sc[ours].sum()) != 0.0
    rejected(lambda r: r.choices[("r0", 0, t)].update(topk=far), "no near-tie")
    # Experts of layer 0 at the first token: the twin of the chosen expert is a tie, the worst expert is not.
    xs, t = run.layers[0]["expert_scores"], 0
    assert int(run.layers[0]["experts"][t, 0]) == min(chosen, twin) and xs[t, chosen] == xs[t, twin]
    accepted(lambda r: r.choices[("r0", 0, t)].update(experts=[max(chosen, twin)]))
    rejected(lambda r: r.choices[("r0", 0, t)].update(experts=[int(xs[t].argmin())]), "no near-tie")
    # The decoder's pool (layer 2, one block kept: the newest) must keep the newest block.
    t = 11
    lay = run.layers[2]
    assert lay["pool"][t].nonzero()[:, 0].tolist() == [10, 11]
    rejected(lambda r: r.choices[("r0", 2, t)].update(pool=[0, 1]), "drops the newest block")
    # A stored vector: a rounding tie when the engine stored an input within ROUND_TOL, a failure otherwise.
    q = next(q for q in run.quant if q["kind"] == "swa" and q["layer"] == 1)
    row = (q["y"][3].float() + 0.0).numpy().tobytes()
    ev = accepted(lambda r: r.stored[q["fmt"]].discard(row))
    assert ev[3][:2] == ("round", "swa") and ev[0] == 3

    def moved(r):
        r.stored[q["fmt"]].discard(row)
        key = (q["fmt"], q["x"].shape[-1])
        r.stored_x[key] = [x + 0.01 * x.abs().amax(-1, keepdim=True) for x in r.stored_x[key]]

    rejected(moved, "not a rounding tie")


def test_oracle_runs_a_sequence_shorter_than_a_compression_group(tmp_path):
    """Fewer tokens than a full layer's ratio m: no complete group, no entry (it once failed reshaping none)."""
    build_ced_checkpoint(tmp_path, seed=0, num_layers=2, num_encoder_layers=1, layer_modes=("full", "full"),
                         encoder_ratio=4, hidden_size=32, head_dim=32, rope_dim=8, q_lora_rank=32, out_group_dim=32,
                         moe_intermediate_size=32)
    run = CEDOracle(*load_ced_checkpoint(tmp_path))([5, 6, 7], replay_start=0, fake_quant=True)
    assert torch.isfinite(run.logits).all() and run.logits.shape[0] == 3

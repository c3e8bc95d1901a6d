"""EPLB on the CPU: balancedness over simulated expert-parallel ranks before and after rebalancing, with a
skewed router; and the policy alone at real model shapes.

    python benchmarks/eplb_bench.py                                  # tiny Qwen3-MoE and DeepSeek-V3, 32 experts
    python benchmarks/eplb_bench.py --arch qwen3-moe --experts 64 --top-k 8 --layouts 8:1:0 8:1:8 \
        --hot 4 --bias 0.5 --repeats 3 --threads 1 --out eplb.jsonl

Engine part (one tiny random-weight checkpoint per ``--arch``, built with transformers, float32, reference
backend): every MoE block's router gets a fixed selection bias of ``--bias`` on ``--hot`` experts (drawn per
layer, seeded), added to the scores before top-k as DeepSeek-V3's correction bias is, so those experts are
chosen far more often. For each layout ``ranks:nodes:redundant`` an LLM with ``enable_eplb=True`` generates
phase 1 (``--prompts`` random prompts, greedy), rebalances once from phase 1's load, then generates phase 2
(other prompts) ``--repeats`` times. A row gives the balancedness (mean over max rank load, summed over layers)
of phase 1's load under the default placement and under the new one (in sample), and of phase 2's load under
both (held out: the placement never saw it), the slots moved and the policy's time. The same phase-2 batch runs
without EPLB in the same process, alternating with the EPLB runs; the greedy tokens must agree, and the row
gives the ratio of output tokens/s (EPLB's cost in one process: the replica routing; there is no
communication to win back yet).

Policy part (``--real-shapes``, on by default): the policy alone on synthetic skewed loads (tokens routed by
a router whose logits are N(0, 1) plus ``--bias`` x 10 on the hot experts) at the Qwen3-30B-A3B shape
(48 layers, 128 experts, top-8) and the DeepSeek-V3 shape (58 layers, 256 experts in 8 groups, top-8); then
the steady state: a second sample of the same router, its balancedness under the first placement (held out)
and after rebalancing from it, with the slots that move, at the default keep_margin and at 0.

Block part (``--block``, on by default): what the replica routing costs where the experts do real work: one
MoEBlock of the moe_bench shape (d=1024, 64 experts, top-8, F=256, float32, routed, reference backend) with
and without a placement of 8 redundant slots, at 8, 64 and 256 tokens; outputs checked to agree first, then
``--block-repeats`` rounds alternating the two; the ratio is the median of the per-round ratios.

Writes JSONL rows with every setting and prints a table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

import torch

from deepinfer import LLM, SamplingParams
from deepinfer.bench import append_jsonl, engine_settings, machine_info
from deepinfer.backends.reference.ops import ReferenceOps
from deepinfer.models.moe import MoEBlock
from deepinfer.parallel import eplb
from deepinfer.parallel.placement import ExpertPlacement
from deepinfer.testing.models import build_tiny_hf_model

EXPERT_KEYS = {"qwen3-moe": ("num_experts", "num_experts_per_tok"),
               "mixtral": ("num_local_experts", "num_experts_per_tok"),
               "deepseek_v3": ("n_routed_experts", "num_experts_per_tok")}


def layout(text: str) -> tuple:
    try:
        ranks, nodes, redundant = (int(v) for v in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"layout {text!r} is not ranks:nodes:redundant (three ints)") from None
    return ranks, nodes, redundant


def hot_experts(num_experts: int, hot: int, layer: int, seed: int) -> list:
    g = torch.Generator().manual_seed(seed * 1000 + layer)
    return sorted(torch.randperm(num_experts, generator=g)[:hot].tolist())


def skew_router(llm, hot: int, bias: float, seed: int) -> None:
    """A fixed selection bias on ``hot`` experts of every MoE block (the block's correction bias, created when
    the architecture has none: it only changes which experts are chosen, not their weights). A parallel engine
    gets it on every rank (DriverModel.set_parameters), so the ranks' routers agree."""
    from deepinfer.models.moe import MoEBlock

    model = llm.engine.model
    net = getattr(model, "inner", model)
    values = {}
    for name, b in net.named_modules():
        if isinstance(b, MoEBlock):
            extra = torch.zeros(b.num_experts)
            extra[hot_experts(b.num_experts, hot, b.layer, seed)] = bias
            if b.e_score_correction_bias is not None:
                extra += b.e_score_correction_bias.detach().float().cpu()
            values[f"{name}.e_score_correction_bias"] = extra
    if hasattr(model, "set_parameters"):
        model.set_parameters(values)
        return
    for name, value in values.items():
        block = net.get_submodule(name.rpartition(".")[0])
        block.e_score_correction_bias = torch.nn.Parameter(value.to(block.gate_weight.device), requires_grad=False)


def prompts(vocab: int, n: int, length: int, seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, vocab, (length,), generator=g).tolist() for _ in range(n)]


def generate(llm, batch: list, output_len: int):
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(batch, params, use_tqdm=False)
    return time.perf_counter() - t0, [o.outputs[0].token_ids for o in outs]


def engine_rows(args, arch: str, path: str, hf_layers: int) -> list:
    common = dict(model=path, num_kv_blocks=args.prompts * 8, max_model_len=256, max_num_seqs=args.prompts)
    base = LLM(**common)
    skew_router(base, args.hot, args.bias, args.seed)
    vocab = base.engine.model.vocab_size
    phase1 = prompts(vocab, args.prompts, args.input_len, args.seed + 1)
    phase2 = prompts(vocab, args.prompts, args.input_len, args.seed + 2)
    rows = []
    for ranks, nodes, redundant in args.layouts:
        llm = LLM(**common, enable_eplb=True, eplb_config={
            "window_size": 1 << 20, "step_interval": 1 << 40, "num_redundant_experts": redundant,
            "num_ranks": ranks, "num_nodes": nodes})
        skew_router(llm, args.hot, args.bias, args.seed)
        state = llm.engine.model.eplb
        generate(llm, phase1, args.output_len)
        t0 = time.perf_counter()
        rec = state.rebalance()  # from phase 1's load
        policy_s = time.perf_counter() - t0
        state.load.set_window(1 << 20)  # phase 2 alone from here
        times, base_times, same = [], [], True
        for _ in range(args.repeats):  # alternate, so neither pays for a noisy moment alone
            t, toks = generate(llm, phase2, args.output_len)
            tb, base_toks = generate(base, phase2, args.output_len)
            times.append(t)
            base_times.append(tb)
            same &= toks == base_toks
        held = state.stats()
        out_tokens = args.prompts * args.output_len
        b = llm.engine.model.moe_blocks()[0]
        rows.append({
            "bench": "eplb_engine", **engine_settings(llm), "arch_name": arch, "moe_layers": len(state.rows),
            "num_layers": hf_layers, "num_experts": state.num_experts, "top_k": b.top_k,
            "num_groups": state.num_groups, "hot": args.hot, "bias": args.bias, "seed": args.seed,
            "num_ranks": ranks, "num_nodes": nodes, "num_redundant_experts": redundant,
            "policy": "hierarchical" if nodes > 1 and state.num_groups % nodes == 0 else "global",
            "prompts": args.prompts, "input_len": args.input_len, "output_len": args.output_len,
            "repeats": args.repeats, "phase1_default": rec["before"], "phase1_eplb": rec["after"],
            "phase2_default": held["balancedness_default"], "phase2_eplb": held["balancedness"],
            "phase2_tokens": held["tokens"], "moved_slots": rec["moved_slots"], "policy_s": policy_s,
            "tok_s_eplb": out_tokens / statistics.median(times), "tok_s_off": out_tokens / statistics.median(base_times),
            "tokens_match": same, **machine_info()})
        if not same:
            print(f"greedy tokens differ with EPLB ({arch}, {ranks}:{nodes}:{redundant})", file=sys.stderr)
    return rows


def synthetic_load(layers: int, experts: int, top_k: int, tokens: int, hot: int, bias: float, seed: int,
                   sample: int = 0):
    """[layers, experts] tokens per expert: a router's top-k over N(0, 1) logits, + bias x 10 on the hot
    experts (drawn from ``seed``); ``sample`` draws other tokens of the same router."""
    g = torch.Generator().manual_seed(seed * 7919 + sample)
    out = torch.zeros(layers, experts)
    for layer in range(layers):
        logits = torch.randn(tokens, experts, generator=g)
        logits[:, hot_experts(experts, hot, layer, seed)] += bias * 10
        ids = logits.topk(top_k, dim=-1).indices
        out[layer] = torch.bincount(ids.reshape(-1), minlength=experts).float()
    return out


SHAPES = {  # name: (layers, experts, top_k, groups, [(ranks, nodes, redundant)])
    "Qwen3-30B-A3B": (48, 128, 8, 1, [(8, 1, 0), (8, 1, 8), (8, 1, 16), (16, 2, 16)]),
    "DeepSeek-V3": (58, 256, 8, 8, [(32, 1, 32), (32, 4, 32), (64, 8, 64)]),
}


def policy_rows(args) -> list:
    rows = []
    for name, (L, E, k, G, layouts) in SHAPES.items():
        load = synthetic_load(L, E, k, args.synthetic_tokens, args.hot, args.bias, args.seed)
        for ranks, nodes, redundant in layouts:
            P = E + redundant
            t0 = time.perf_counter()
            phy2log, _, _ = eplb.rebalance_experts(load, P, G, nodes, ranks)
            dt = time.perf_counter() - t0
            default = eplb.default_placement(L, E, P)
            # Steady state: rebalance again from another sample of the same router, from the placement in use.
            load2 = synthetic_load(L, E, k, args.synthetic_tokens, args.hot, args.bias, args.seed, sample=1)
            again, _, _ = eplb.rebalance_experts(load2, P, G, nodes, ranks, current=phy2log)
            fresh, _, _ = eplb.rebalance_experts(load2, P, G, nodes, ranks, current=phy2log, keep_margin=0.0)
            rows.append({"bench": "eplb_policy", "shape": name, "moe_layers": L, "num_experts": E, "top_k": k,
                         "num_groups": G, "num_ranks": ranks, "num_nodes": nodes, "num_redundant_experts": redundant,
                         "policy": "hierarchical" if nodes > 1 and G % nodes == 0 else "global",
                         "tokens_per_layer": args.synthetic_tokens, "hot": args.hot, "bias": args.bias,
                         "seed": args.seed,
                         "default": eplb.balancedness(eplb.rank_loads(load, default, ranks)),
                         "eplb": eplb.balancedness(eplb.rank_loads(load, phy2log, ranks)),
                         "policy_s": dt, "moved_first": float((phy2log != default).float().mean()),
                         "moved_again": float((again != phy2log).float().mean()),
                         "again_held_out": eplb.balancedness(eplb.rank_loads(load2, phy2log, ranks)),
                         "again": eplb.balancedness(eplb.rank_loads(load2, again, ranks)),
                         "keep_margin": eplb.KEEP_MARGIN, "moved_again_margin0": float((fresh != phy2log).float().mean()),
                         "again_margin0": eplb.balancedness(eplb.rank_loads(load2, fresh, ranks)), **machine_info()})
    return rows


def block_rows(args) -> list:
    d, E, k, F, redundant = 1024, 64, 8, 256, 8
    g = torch.Generator().manual_seed(args.seed)
    plain = MoEBlock(d, F, E, k, ReferenceOps("cpu"), layer=0)
    for p in plain.parameters():
        p.data = torch.randn(p.shape, generator=g) * d ** -0.5
    plain.requires_grad_(False)
    placed = MoEBlock(d, F, E, k, ReferenceOps("cpu"), layer=0).requires_grad_(False)
    placed.load_state_dict(plain.state_dict())
    ExpertPlacement(eplb.default_placement(1, E, E + redundant)[0].tolist(), E, "cpu").attach(placed)
    rows = []
    for T in (8, 64, 256):
        x = torch.randn(T, d, generator=g)
        with torch.no_grad():
            a, b = plain(x), placed(x)
        err = float((a - b).abs().max() / a.abs().max())
        if err > 1e-4:
            raise SystemExit(f"the block on slots disagrees at T={T}: max relative difference {err:.2e}")
        ratios, t_plain, t_placed = [], [], []
        for r in range(args.block_repeats):
            pair = {}
            for name, blk in (("plain", plain), ("placed", placed))[::(-1 if r % 2 else 1)]:
                t0 = time.perf_counter()
                with torch.no_grad():
                    blk(x)
                pair[name] = time.perf_counter() - t0
            ratios.append(pair["placed"] / pair["plain"])
            t_plain.append(pair["plain"])
            t_placed.append(pair["placed"])
        rows.append({"bench": "eplb_block", "hidden": d, "experts": E, "top_k": k, "expert_size": F,
                     "num_redundant_experts": redundant, "tokens": T, "dtype": "float32", "backend": "reference",
                     "repeats": args.block_repeats, "ms_plain": 1e3 * statistics.median(t_plain),
                     "ms_placed": 1e3 * statistics.median(t_placed), "placed_over_plain": statistics.median(ratios),
                     "max_rel_diff": err, **machine_info()})
    return rows


def table(rows: list) -> str:
    out = []
    eng = [r for r in rows if r["bench"] == "eplb_engine"]
    if eng:
        out += ["| model | E / top-k | ranks:nodes:redundant | policy | phase 1 default -> EPLB | phase 2 (held out) "
                "default -> EPLB | slots moved | tok/s EPLB / off | tokens match |",
                "|---|---|---|---|---|---|---:|---:|---|"]
        for r in eng:
            out.append(f"| {r['arch_name']} | {r['num_experts']} / {r['top_k']} | {r['num_ranks']}:{r['num_nodes']}:"
                       f"{r['num_redundant_experts']} | {r['policy']} | {r['phase1_default']:.3f} -> "
                       f"**{r['phase1_eplb']:.3f}** | {r['phase2_default']:.3f} -> **{r['phase2_eplb']:.3f}** | "
                       f"{r['moved_slots']} | {r['tok_s_eplb'] / r['tok_s_off']:.2f}x | {r['tokens_match']} |")
    pol = [r for r in rows if r["bench"] == "eplb_policy"]
    if pol:
        out += ["", "| shape | layers x E | ranks:nodes:redundant | policy | default | EPLB | policy s | slots moved "
                "| 2nd sample: held out -> rebalanced | slots moved | margin 0: rebalanced | slots moved |",
                "|---|---|---|---|---:|---:|---:|---:|---|---:|---:|---:|"]
        for r in pol:
            out.append(f"| {r['shape']} | {r['moe_layers']} x {r['num_experts']} | {r['num_ranks']}:{r['num_nodes']}:"
                       f"{r['num_redundant_experts']} | {r['policy']} | {r['default']:.3f} | **{r['eplb']:.3f}** | "
                       f"{r['policy_s']:.2f} | {r['moved_first']:.0%} | {r['again_held_out']:.3f} -> "
                       f"**{r['again']:.3f}** | {r['moved_again']:.0%} | {r['again_margin0']:.3f} | "
                       f"{r['moved_again_margin0']:.0%} |")
    blk = [r for r in rows if r["bench"] == "eplb_block"]
    if blk:
        out += ["", "| MoEBlock | tokens | plain ms | on slots ms | on slots / plain |", "|---|---:|---:|---:|---:|"]
        for r in blk:
            out.append(f"| d={r['hidden']}, E={r['experts']}+{r['num_redundant_experts']}, top-{r['top_k']}, "
                       f"F={r['expert_size']} | {r['tokens']} | {r['ms_plain']:.2f} | {r['ms_placed']:.2f} | "
                       f"**{r['placed_over_plain']:.3f}x** |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", nargs="*", default=["qwen3-moe", "deepseek_v3"], choices=sorted(EXPERT_KEYS),
                    help="tiny models of the engine part (none: skip it)")
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--layouts", type=layout, nargs="+", default=[(4, 1, 0), (4, 1, 4), (8, 1, 8), (8, 2, 8)],
                    help="ranks:nodes:redundant (simulated expert-parallel layout)")
    ap.add_argument("--hot", type=int, default=4, help="experts the router is biased towards, per layer")
    ap.add_argument("--bias", type=float, default=0.3, help="selection bias added to the hot experts' scores")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--real-shapes", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--synthetic-tokens", type=int, default=4096, help="tokens per layer of the synthetic load")
    ap.add_argument("--block", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--block-repeats", type=int, default=9)
    ap.add_argument("--out", default="eplb_bench.jsonl")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    for arch in args.arch:
        with tempfile.TemporaryDirectory() as d:
            n_key, k_key = EXPERT_KEYS[arch]
            overrides = {n_key: args.experts, k_key: args.top_k, "num_hidden_layers": 4}
            if arch == "deepseek_v3":
                overrides.update(n_group=4, topk_group=2)
            build_tiny_hf_model(d, arch, init_range=0.3, **overrides)
            rows += engine_rows(args, arch, d, overrides["num_hidden_layers"])
    if args.real_shapes:
        rows += policy_rows(args)
    if args.block:
        rows += block_rows(args)
    append_jsonl(args.out, rows)
    print(table(rows))
    print(f"\n{len(rows)} rows appended to {args.out}")
    return 0 if all(r.get("tokens_match", True) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

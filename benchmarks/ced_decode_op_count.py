"""How many kernels one CED decode step launches, counted on the CPU, by the phase of the step they run in.

    TRITON_INTERPRET=1 python benchmarks/ced_decode_op_count.py [--batch 1] [--dtype bfloat16] [--cuda-path]
        [--out docs/results/cpu_ced_decode_ops.jsonl --label COMMIT]

The bench config's layer modes (deepinfer/models/ced/config.py SIZES["bench"]: 16 layers, 2 swa, 3 full,
1 reindex) at toy widths (launch counts do not depend on widths), loaded through LLM on the CPU; one steady
decode step (decode_path.forward_decode) runs under a TorchDispatchMode that counts every aten op that is not
a view, an allocation or a metadata query (on CUDA each is about one kernel launch), and every Triton launch.
Counts are attributed to the innermost phase they run in (PHASES: the layers' own norms with their residual
adds, q/kv projections, compression, entry rows, indexer, pool building, attention, output projection, MoE with
its router, experts and expert-load record, ring writes; "other" for the rest).

Default: the reference backend, the CPU path as it runs (torch formulas everywhere). ``--cuda-path``: the
nvidia backend under Triton's interpreter, with the dispatch CUDA tensors get (CEDLayer._kernels returns the
ops, functional takes the fused rms / rope and the fake-quantisation kernels): the launches of a CUDA decode
step (cuBLAS and torch kernels as aten ops, Triton kernels one each).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import tempfile

from torch.utils._python_dispatch import TorchDispatchMode

from deepinfer import LLM, SamplingParams
from deepinfer.models.ced import decode_path, functional as fn, model as ced_model
from deepinfer.testing.ced import as_on_cuda
from deepinfer.models.ced.config import SIZES
from deepinfer.testing.ced import build_ced_checkpoint

# The bench config's structure at toy widths.
TOY = dict(hidden_size=64, num_heads=2, head_dim=64, rope_dim=16, q_lora_rank=32, out_groups=2, out_group_dim=32,
           n_win=8, swa_allowance=2, index_heads=2, index_head_dim=32, index_topk=8, pool_block=2, pool_blocks=4,
           n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, max_position_embeddings=512)
FREE = {"view", "_unsafe_view", "reshape", "expand", "slice", "select", "unsqueeze", "squeeze", "permute", "t",
        "transpose", "as_strided", "alias", "detach", "split", "chunk", "unbind", "size", "stride", "numel", "dim",
        "is_same_size", "unflatten", "flatten", "lift_fresh", "empty", "empty_like", "empty_strided", "new_empty",
        "new_empty_strided"}


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.where = ["other"]
        self.ops = collections.Counter()  # (piece, op) -> calls
        self.calls = collections.Counter()  # piece -> calls of the piece itself
        self.inside_triton = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in FREE and not self.inside_triton:
            self.ops[(self.where[-1], name)] += 1
        return func(*args, **(kwargs or {}))

    @contextlib.contextmanager
    def triton_launches(self):
        """Count each interpreted Triton launch once (as "triton:<kernel>"), not the torch ops it runs inside."""
        from triton.runtime import interpreter

        call = interpreter.GridExecutor.__call__

        def counted(ex, *a, **k):
            self.ops[(self.where[-1], "triton:" + ex.fn.__name__)] += 1
            self.inside_triton += 1
            try:
                return call(ex, *a, **k)
            finally:
                self.inside_triton -= 1

        interpreter.GridExecutor.__call__ = counted
        try:
            yield
        finally:
            interpreter.GridExecutor.__call__ = call

    @contextlib.contextmanager
    def attributed(self):
        """Wrap the step's phases (PHASES) so their ops count under the innermost phase running."""
        saved = []

        def wrap(name, f):
            def inner(*a, **k):
                if name in TOP_LEVEL and self.where[-1] != "other":  # (a norm inside another phase is that phase's)
                    return f(*a, **k)
                self.calls[name] += 1
                self.where.append(name)
                try:
                    return f(*a, **k)
                finally:
                    self.where.pop()
            return inner

        for name, owners, attr in _phase_targets():
            for owner in owners:
                if attr in vars(owner):
                    saved.append((owner, attr, vars(owner)[attr]))
                    setattr(owner, attr, wrap(name, vars(owner)[attr]))
        try:
            yield
        finally:
            for owner, attr, f in reversed(saved):
                setattr(owner, attr, f)


def _phase_targets():
    """(phase, classes or modules defining it, attribute): what each phase of a CED decode step runs. Nested
    phases count under the innermost (the pool under the indexer, the router under the MoE)."""
    from deepinfer.backends.nvidia import ops as nv
    from deepinfer.backends.reference.ops import ReferenceOps
    from deepinfer.models import expert_load
    from deepinfer.models.ced import cache as ced_cache, engine_path

    ops = (ReferenceOps, nv.NvidiaOps)
    L = ced_model.CEDLayer
    return [("qkv", (L,), "query"), ("qkv", (L,), "swa_kv"), ("qkv", (L,), "project_input"),
            ("qkv", (L,), "swa_proj"), ("qkv", (L,), "swa_kv_rows"),
            ("norm", (fn,), "rms"), ("norm", (fn,), "add_rms"), ("entry_rows", ops, "ced_entry_rows"),
            ("compression", (decode_path.DecodePass,), "compress"),
            ("compression", (decode_path.DecodePass,), "_plan"), ("entry_rows", (decode_path.DecodePass,),
                                                                     "entry_slots"),
            ("indexer", (L,), "index_query"), ("indexer", (engine_path,), "_choose_entries"),
            ("pool", (fn,), "pool_candidates"), ("pool", (fn,), "pool_mask"), ("pool", ops, "ced_pool_candidates"),
            ("attention", ops, "ced_sparse_attention"), ("out_proj", (L,), "out_proj"),
            ("out_proj", (L,), "out_proj_add_rms"),
            ("moe", (L,), "moe"), ("moe", (L,), "moe_parts"), ("router", ops, "moe_route"),
            ("router", ops, "ced_moe_route"),
            ("experts", ops, "moe_experts"), ("expert_load", (expert_load.ExpertLoad,), "record"),
            ("ring_write", (ced_cache.CEDCache,), "ring_write")]


TOP_LEVEL = {"norm"}
PHASES = ("norm", "qkv", "compression", "entry_rows", "indexer", "pool", "attention", "out_proj", "moe", "router",
          "experts", "expert_load", "ring_write", "other")


def count_step(batch: int, dtype: str, cuda_path: bool = False) -> dict:
    b = SIZES["bench"]
    ov = dict(TOY, num_layers=b["num_layers"], num_encoder_layers=b["num_encoder_layers"],
              layer_modes=b["layer_modes"])
    with tempfile.TemporaryDirectory() as d:
        build_ced_checkpoint(d, seed=0, **ov)
        llm = LLM(d, dtype=dtype, device="cpu", block_size=16, num_kv_blocks=64, max_num_seqs=batch,
                  enable_prefix_caching=False, backend="nvidia" if cuda_path else None)
        counter = OpCounter()
        steps = []
        seen = decode_path.forward_decode

        def counted(*a):
            if len(steps) == 2:  # a steady step (not the first decode)
                with counter, counter.attributed(), counter.triton_launches() if cuda_path \
                        else contextlib.nullcontext():
                    out = seen(*a)
                steps.append(1)
                return out
            steps.append(1)
            return seen(*a)

        decode_path.forward_decode = counted
        try:
            sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
            with as_on_cuda() if cuda_path else contextlib.nullcontext():
                llm.generate([list(range(3, 3 + 20 + i)) for i in range(batch)], sp, use_tqdm=False)
        finally:
            decode_path.forward_decode = seen
    by_phase = collections.Counter()
    for (phase, _), n in counter.ops.items():
        by_phase[phase] += n
    return {"batch": batch, "dtype": dtype, "path": "cuda (interpreted)" if cuda_path else "cpu",
            "layers": b["num_layers"], "launches": sum(by_phase.values()), "by_phase": dict(by_phase),
            "phase_calls": dict(counter.calls),
            "by_phase_op": {ph: dict(collections.Counter({op: n for (p, op), n in counter.ops.items() if p == ph})
                                     .most_common()) for ph in by_phase}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--cuda-path", action="store_true", help="the nvidia backend's CUDA dispatch, interpreted")
    ap.add_argument("--label", default="", help="a name for the row (e.g. the commit), kept in the JSONL")
    ap.add_argument("--out", default=None, help="append the row as JSONL")
    a = ap.parse_args()
    row = count_step(a.batch, a.dtype, a.cuda_path)
    row["label"] = a.label
    print(f"{row['path']}, batch {a.batch}, {a.dtype}: {row['launches']} launches per decode step")
    print(f"{'phase':>12} {'calls':>6} {'launches':>8}  ops")
    for ph in PHASES:
        ops = row["by_phase_op"].get(ph, {})
        print(f"{ph:>12} {row['phase_calls'].get(ph, '-'):>6} {row['by_phase'].get(ph, 0):>8}  "
              + ", ".join(f"{k} {v}" for k, v in ops.items()))
    if a.out:
        with open(a.out, "a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()

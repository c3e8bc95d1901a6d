"""How many kernels one CED decode step launches, counted on the CPU, by the functional piece they run in.

    TRITON_INTERPRET=1 python benchmarks/ced_decode_op_count.py [--batch 4] [--dtype bfloat16] [--cuda-path]

The bench config's layer modes (deepinfer/models/ced/config.py SIZES["bench"]: 16 layers, 2 swa, 3 full,
1 reindex) at toy widths (launch counts do not depend on widths), loaded through LLM on the CPU; one steady
decode step (decode_path.forward_decode) runs under a TorchDispatchMode that counts every aten op that is not
a view, an allocation or a metadata query (on CUDA each is about one kernel launch), and every Triton launch.
Counts are attributed to the innermost of functional.rms / apply_rope / fake and CEDLayer.moe they run in
("other" for the rest).

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
from deepinfer.models.ced.config import SIZES
from deepinfer.testing.ced import build_ced_checkpoint

# The bench config's structure at toy widths.
TOY = dict(hidden_size=64, num_heads=2, head_dim=64, rope_dim=16, q_lora_rank=32, out_groups=2, out_group_dim=32,
           n_win=8, swa_allowance=2, index_heads=2, index_head_dim=32, index_topk=8, pool_block=2, pool_blocks=4,
           n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, max_position_embeddings=512)
PIECES = ("rms", "apply_rope", "fake")
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
        """Wrap functional's pieces (and CEDLayer.moe) so their ops count under their own name."""
        saved = {n: getattr(fn, n) for n in PIECES}
        moe = ced_model.CEDLayer.moe

        def wrap(name, f):
            def inner(*a, **k):
                self.calls[name] += 1
                self.where.append(name)
                try:
                    return f(*a, **k)
                finally:
                    self.where.pop()
            return inner

        for n, f in saved.items():
            setattr(fn, n, wrap(n, f))
        ced_model.CEDLayer.moe = wrap("moe", moe)
        try:
            yield
        finally:
            for n, f in saved.items():
                setattr(fn, n, f)
            ced_model.CEDLayer.moe = moe


@contextlib.contextmanager
def as_on_cuda():
    """CPU tensors dispatched as CUDA ones are (for the interpreted nvidia backend): CEDLayer._kernels returns
    the model's ops, and functional's fused rms / rope and fake quantisation take them."""
    kernels, fused, fake = ced_model.CEDLayer._kernels, getattr(fn, "_fused", None), fn.fake  # (before the
    # fused kernels there was no _fused: then only fake quantisation changes, so before/after runs compare)

    def fake_on_cuda(x, fmt, on, ops=None):
        if on and ops is not None:
            return ops.dequantize_kv(*ops.quantize_kv(x, fmt), fmt, dtype=x.dtype)
        return fake(x, fmt, on, ops)

    ced_model.CEDLayer._kernels = lambda self, x: ced_model.ops_of(self, x.device)
    fn._fused = lambda ops, name, *ts: getattr(ops, name, None) if ops is not None else None
    fn.fake = fake_on_cuda
    try:
        yield
    finally:
        ced_model.CEDLayer._kernels, fn._fused, fn.fake = kernels, fused, fake


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
            sp = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
            with as_on_cuda() if cuda_path else contextlib.nullcontext():
                llm.generate([list(range(3, 3 + 20 + i)) for i in range(batch)], sp, use_tqdm=False)
        finally:
            decode_path.forward_decode = seen
    by_piece = collections.Counter()
    for (piece, _), n in counter.ops.items():
        by_piece[piece] += n
    return {"batch": batch, "dtype": dtype, "path": "cuda (interpreted)" if cuda_path else "cpu",
            "layers": b["num_layers"], "launches": sum(by_piece.values()), "by_piece": dict(by_piece),
            "piece_calls": dict(counter.calls),
            "top_other": collections.Counter({k[1]: v for k, v in counter.ops.items() if k[0] == "other"})
            .most_common(40)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--cuda-path", action="store_true", help="the nvidia backend's CUDA dispatch, interpreted")
    ap.add_argument("--out", default=None, help="append the row as JSONL")
    a = ap.parse_args()
    row = count_step(a.batch, a.dtype, a.cuda_path)
    print(f"{row['path']}, batch {a.batch}, {a.dtype}")
    print(f"{'piece':>12} {'calls':>6} {'launches':>8}")
    for piece in ("rms", "apply_rope", "fake", "moe", "other"):
        print(f"{piece:>12} {row['piece_calls'].get(piece, '-'):>6} {row['by_piece'].get(piece, 0):>8}")
    print(f"{'step':>12} {'':>6} {row['launches']:>8}")
    print("other:", ", ".join(f"{k} {v}" for k, v in row["top_other"]))
    if a.out:
        with open(a.out, "a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()

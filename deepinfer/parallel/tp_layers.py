"""Tensor parallelism for the Llama family: sharding a model built on the meta device, and the slices of the
checkpoint each rank reads.

Megatron's split, over ``T`` ranks (rank ``r``):
  * column-parallel (outputs split, no communication): ``qkv_proj`` (rank r's query heads ``[r H/T, (r+1) H/T)``
    and KV heads ``[r Hk/T, (r+1) Hk/T)``, fused from the q/k/v slices) and ``gate_up_proj`` (rows of the
    intermediate dimension ``[r I/T, (r+1) I/T)`` of gate and of up);
  * row-parallel (inputs split, outputs all-reduced, bias added once after the sum): ``o_proj``, ``down_proj``;
  * vocabulary-parallel: the embedding holds vocabulary rows ``[r V', (r+1) V')`` (``V' = ceil(V / T)``, the last
    shard zero-padded); a token outside them looks up zeros and the all-reduce sums the one rank that holds it;
    the LM head (or the tied embedding) gives each rank its ``V'`` logits, gathered on rank 0 (workers.py);
  * replicated: norms, q/k norms, rotary tables.
Each rank's KV cache holds its own KV heads (``Hk / T``), so ``num_key_value_heads`` must divide by T.

Modules are changed in place on the meta device (their weights are the local shards' shapes), so loading
copies each rank's slices with the usual shape checks (``iter_shard``: safetensors slices, only this rank's
rows or columns are read from disk).
"""

from __future__ import annotations

import re
from typing import Callable, Iterator, Optional

import attrs
import torch
import torch.nn.functional as F
from torch import nn


class RowParallelLinear(nn.Linear):
    """y = all_reduce(x_shard @ W_shard^T) + b; W_shard [out, in / T], b replicated."""

    comm: object

    def forward(self, x):
        y = self.comm.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Embedding):
    """Rows [start, start + num_embeddings) of the vocabulary; the all-reduce assembles every token's row."""

    comm: object
    start: int

    def forward(self, ids):
        local = ids - self.start
        outside = (local < 0) | (local >= self.num_embeddings)  # [T]
        x = F.embedding(local.clamp(0, self.num_embeddings - 1), self.weight)  # [T, d]
        return self.comm.all_reduce(x.masked_fill(outside[:, None], 0.0))


def _meta_linear(cls, in_f: int, out_f: int, bias: bool, like: nn.Linear) -> nn.Linear:
    return cls(in_f, out_f, bias=bias, device="meta", dtype=like.weight.dtype)


def check_divisible(c, T: int, arch: str) -> None:
    """Refuse a Llama-family config that does not split over T ranks, naming both numbers."""
    for name, v in (("num_key_value_heads", c.num_kv_heads), ("num_attention_heads", c.num_heads)):
        if v % T:
            raise ValueError(f"tensor_parallel_size={T} does not divide {arch}'s {name}={v}: each rank holds "
                             f"{name} / tensor_parallel_size heads; choose a tensor_parallel_size that divides {v}")


def shard_llama(model, comm, T: int, r: int) -> dict:
    """Shard a LlamaForCausalLM (or a MoE member of the family; its MoE blocks are left to expert parallelism)
    on the meta device for rank ``r`` of ``T``. Returns the checkpoint plan's parameters (``llama_plan``)."""
    from ..models.llama import MLP, Attention

    c = model.config
    check_divisible(c, T, model.arch)
    dense_mlps = [m for m in model.modules() if isinstance(m, MLP)]
    if dense_mlps and c.intermediate_size % T:
        raise ValueError(f"tensor_parallel_size={T} does not divide {model.arch}'s intermediate_size="
                         f"{c.intermediate_size}")
    H, Hk, D, I = c.num_heads // T, c.num_kv_heads // T, c.head_dim, c.intermediate_size // T
    for attn in [m for m in model.modules() if isinstance(m, Attention)]:
        attn.h, attn.hk = H, Hk
        old = attn.qkv_proj
        attn.qkv_proj = _meta_linear(nn.Linear, c.hidden_size, (H + 2 * Hk) * D, old.bias is not None, old)
        o = attn.o_proj
        attn.o_proj = _meta_linear(RowParallelLinear, H * D, c.hidden_size, o.bias is not None, o)
        attn.o_proj.comm = comm
    for mlp in dense_mlps:
        gu, dn = mlp.gate_up_proj, mlp.down_proj
        mlp.gate_up_proj = _meta_linear(nn.Linear, c.hidden_size, 2 * I, gu.bias is not None, gu)
        mlp.down_proj = _meta_linear(RowParallelLinear, I, c.hidden_size, dn.bias is not None, dn)
        mlp.down_proj.comm = comm
    V = c.vocab_size
    Vl = -(-V // T)
    emb = model.model.embed_tokens
    new = VocabParallelEmbedding(Vl, c.hidden_size, device="meta", dtype=emb.weight.dtype)
    new.comm, new.start = comm, r * Vl
    model.model.embed_tokens = new
    if model.lm_head is not None:
        model.lm_head = nn.Linear(c.hidden_size, Vl, bias=False, device="meta", dtype=model.lm_head.weight.dtype)
    # The local shapes the fused loaders and the KV cache read (vocab_size stays the full vocabulary).
    model.config = attrs.evolve(c, num_heads=H, num_kv_heads=Hk, intermediate_size=I)
    return {"T": T, "r": r, "heads": c.num_heads, "kv_heads": c.num_kv_heads, "head_dim": D,
            "inter": c.intermediate_size, "vocab": V, "vocab_local": Vl}


@attrs.frozen
class Slice:
    """A checkpoint tensor's rows (dim 0) or columns (dim 1) ``[start, stop)`` for this rank, zero-padded to
    ``size`` along that dim (the vocabulary's last shard)."""

    dim: int
    start: int
    stop: int
    size: Optional[int] = None


_TP_COLUMN = re.compile(r"\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.(weight|bias)$")
_TP_ROW = re.compile(r"\.(o_proj|down_proj)\.weight$")
_VOCAB = re.compile(r"(^|\.)(embed_tokens|lm_head)\.weight$")


def llama_plan(p: dict, skip_prefixes: tuple = ()) -> Callable:
    """name -> Slice (or None: the whole tensor) for the dense parts of a tensor-parallel Llama-family model.
    ``skip_prefixes``: checkpoint prefixes (MoE blocks) that this plan leaves whole."""
    T, r, D = p["T"], p["r"], p["head_dim"]
    h, hk, i = p["heads"] // T * D, p["kv_heads"] // T * D, p["inter"] // T

    def plan(name: str) -> Optional[Slice]:
        if name.startswith(skip_prefixes):
            return None
        m = _TP_COLUMN.search(name)
        if m:
            n = {"q_proj": h, "k_proj": hk, "v_proj": hk}.get(m.group(1), i)
            return Slice(0, r * n, (r + 1) * n)
        m = _TP_ROW.search(name)
        if m:
            n = h if m.group(1) == "o_proj" else i
            return Slice(1, r * n, (r + 1) * n)
        if _VOCAB.search(name):
            Vl = p["vocab_local"]
            return Slice(0, min(r * Vl, p["vocab"]), min((r + 1) * Vl, p["vocab"]), Vl)
        return None

    return plan


def iter_shard(path, keep: Callable, plan: Callable) -> Iterator:
    """(name, tensor) of this rank's share of a safetensors checkpoint: tensors ``keep(name)`` refuses are not
    read; ``plan(name)`` -> Slice reads only its rows/columns (safetensors slices), None the whole tensor."""
    from contextlib import ExitStack

    from safetensors import safe_open

    from ..models.loader import FP8_CODES, CheckpointError, _reading, safetensors_files

    with ExitStack() as stack:
        for f in safetensors_files(path):
            with _reading(f):
                fh = stack.enter_context(safe_open(str(f), framework="pt"))
            for name in fh.keys():
                if not keep(name):
                    continue
                with _reading(f):
                    sl = fh.get_slice(name)
                    if sl.get_dtype() in FP8_CODES:
                        raise CheckpointError(f"checkpoint tensor {name!r} is FP8: parallel serving does not load "
                                              "FP8 checkpoints yet; serve it with tensor_parallel_size=1")
                    s = plan(name)
                    if s is None:
                        yield name, fh.get_tensor(name)
                        continue
                    t = sl[s.start:s.stop] if s.dim == 0 else sl[:, s.start:s.stop]
                if s.size is not None and t.shape[s.dim] < s.size:
                    pad = list(t.shape)
                    pad[s.dim] = s.size - t.shape[s.dim]
                    t = torch.cat([t, t.new_zeros(pad)], dim=s.dim)
                yield name, t

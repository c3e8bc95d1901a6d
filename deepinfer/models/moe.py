"""A sparse mixture-of-experts feed-forward block, shared by every MoE architecture.

One module for Mixtral, Qwen2-MoE / Qwen3-MoE and DeepSeek-V2/V3: flags for the router (scoring,
renormalisation, scaling, group-limited selection, correction bias), an optional shared expert (with
Qwen2-MoE's sigmoid gate) and the checkpoint's spelling of the tensor names (``naming``).

Weights are stored fused: ``w13`` [E, 2F, d] (gate rows, then up rows) and ``w2`` [E, d, F], the layout of
transformers 5 and of the reference kernels. Checkpoints are read in both layouts: per expert
(``experts.{e}.w1.weight`` / ``experts.{e}.gate_proj.weight`` ...) and fused (``experts.gate_up_proj``,
``experts.down_proj``). Experts of an FP8 block-scaled checkpoint may stay FP8 (models/quant.py,
``store_experts_fp8``): w13/w2 are then float8_e4m3fn with ``w13_scale_inv``/``w2_scale_inv`` beside them,
read from each tensor's ``weight_scale_inv`` (per expert) or ``_scale_inv`` (fused), and passed to
``Ops.moe_experts``.

Expert-parallel load balancing (parallel/placement.py) gives a block a ``placement``: its expert tensors then
hold physical slots (replicas of the logical experts, [P, ...]), the router's logical choices are recorded as
load and then mapped to slots, and checkpoint I/O goes through the logical view.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..backends.reference import moe as ref_moe
from .base import WeightError
from .quant import FP8, SCALE_BLOCK, SCALE_SUFFIX, fp8_scales

NAMINGS = ("mixtral", "qwen", "deepseek")
IMPLS = ("routed", "dense")
EXPERT_PARAMS = ("w13", "w2", "w13_scale_inv", "w2_scale_inv")  # the per-expert tensors, [E, ...] (EPLB: [P, ...])
# naming -> (gate, up, down) per-expert projection names
_EXPERT_PARTS = {"mixtral": ("w1", "w3", "w2"), "qwen": ("gate_proj", "up_proj", "down_proj"),
                 "deepseek": ("gate_proj", "up_proj", "down_proj")}
# naming -> shared expert module name
_SHARED = {"mixtral": "shared_expert", "qwen": "shared_expert", "deepseek": "shared_experts"}
_FUSED_GATE_UP, _FUSED_DOWN = "experts.gate_up_proj", "experts.down_proj"


class MoEBlock(nn.Module):
    """x [T, d] -> [T, d]: route each token to ``top_k`` of ``num_experts`` SwiGLU experts, plus a shared expert.

    ``impl``: "routed" (each expert runs on its own tokens; the serving path) or "dense" (every expert on
    every token; the oracle). Both compute the same function. ``expert_load``: an ExpertLoad that gets the
    chosen expert ids of every forward, under ``layer``.
    """

    def __init__(self, hidden_size: int, expert_size: int, num_experts: int, top_k: int, ops, *, layer: int,
                 scoring: str = "softmax", renormalize: bool = True, scaling: float = 1.0,
                 n_group: Optional[int] = None, topk_group: Optional[int] = None, group_score: str = "max",
                 correction_bias: bool = False, shared_size: int = 0, shared_gate: bool = False,
                 clamp: Optional[float] = None, naming: str = "qwen", checkpoint_prefix: Optional[str] = None,
                 expert_load=None, impl: str = "routed"):
        super().__init__()
        if naming not in NAMINGS:
            raise ValueError(f"naming must be one of {NAMINGS}, got {naming!r}")
        if impl not in IMPLS:
            raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
        if hidden_size < 1 or expert_size < 1 or num_experts < 1:
            raise ValueError(f"hidden_size={hidden_size}, expert_size={expert_size} and num_experts={num_experts} "
                             "must be >= 1")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")
        if shared_size < 0:
            raise ValueError(f"shared_size must be >= 0, got {shared_size}")
        if shared_gate and not shared_size:
            raise ValueError("shared_gate needs a shared expert (shared_size > 0)")
        # Fail at build time, not on the first token, on an inconsistent router setting.
        ref_moe._check_route(torch.empty(0, num_experts, device="meta"), top_k, scoring, n_group, topk_group,
                             group_score, None)
        d, Fe, E = hidden_size, expert_size, num_experts
        self.hidden_size, self.expert_size, self.num_experts, self.top_k = d, Fe, E, top_k
        self.ops, self.layer = ops, layer
        self.scoring, self.renormalize, self.scaling = scoring, renormalize, float(scaling)
        self.n_group, self.topk_group, self.group_score = n_group, topk_group, group_score
        self.clamp, self.naming, self.impl = clamp, naming, impl
        self.shared_size, self.has_shared_gate = shared_size, shared_gate
        self.checkpoint_prefix = checkpoint_prefix
        self.expert_load = expert_load
        self.placement = None  # EPLB: an ExpertPlacement (parallel/placement.py) once enabled

        self.gate_weight = nn.Parameter(torch.empty(E, d))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(E)) if correction_bias else None
        self.w13 = nn.Parameter(torch.empty(E, 2 * Fe, d))
        self.w2 = nn.Parameter(torch.empty(E, d, Fe))
        if shared_size:
            self.shared_w13 = nn.Parameter(torch.empty(2 * shared_size, d))
            self.shared_w2 = nn.Parameter(torch.empty(d, shared_size))
        else:
            self.shared_w13 = self.shared_w2 = None
        self.shared_gate_weight = nn.Parameter(torch.empty(1, d)) if shared_gate else None
        self._loaded: set = set()

    def extra_repr(self) -> str:
        return (f"d={self.hidden_size}, F={self.expert_size}, E={self.num_experts}, top_k={self.top_k}, "
                f"scoring={self.scoring}, shared={self.shared_size}, impl={self.impl}, layer={self.layer}")

    # Forward.
    def _apply(self, fn, recurse=True):
        # The router stays float32 whatever the model dtype (as transformers keeps it): a bf16 correction bias
        # can change which experts are chosen.
        super()._apply(fn, recurse)
        # FP8 experts' block scales stay float32 too.
        for name in ("gate_weight", "e_score_correction_bias", "w13_scale_inv", "w2_scale_inv"):
            p = getattr(self, name, None)
            if p is not None and p.is_floating_point() and p.dtype != torch.float32:
                p.data = p.data.float()
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x.float(), self.gate_weight.float())  # [T, E] float32 router logits
        bias = self.e_score_correction_bias
        kw = dict(scoring=self.scoring, renormalize=self.renormalize, scaling=self.scaling, n_group=self.n_group,
                  topk_group=self.topk_group, group_score=self.group_score, bias=bias)
        moe_route = getattr(self.ops, "moe_route", None)
        weights, ids = (moe_route(logits, self.top_k, **kw) if moe_route is not None
                        else ref_moe.route(logits, self.top_k, **kw))  # [T, k] float32, [T, k] int64
        if self.expert_load is not None:
            self.expert_load.record(self.layer, ids)
        if self.placement is not None:  # EPLB: each logical choice goes to one of its replicas' slots
            ids = self.placement.physical_ids(ids)
        moe_experts = getattr(self.ops, "moe_experts", None)
        scales = fp8_scales(self)  # FP8 experts' block scales, else None
        if moe_experts is not None:
            out = moe_experts(x, self.w13, self.w2, weights, ids, clamp=self.clamp, impl=self.impl, **scales)
        else:
            fn = ref_moe.experts_dense if self.impl == "dense" else ref_moe.experts_routed
            out = fn(x, self.w13, self.w2, weights, ids, clamp=self.clamp, **scales)  # [T, d]
        if self.shared_w13 is not None:
            h = F.linear(x, self.shared_w13)  # [T, 2Fs]
            gate, up = h.chunk(2, dim=-1)
            shared = F.linear(F.silu(gate) * up, self.shared_w2)  # [T, d]
            if self.shared_gate_weight is not None:
                shared = torch.sigmoid(F.linear(x, self.shared_gate_weight)) * shared  # [T, 1] * [T, d]
            out = out + shared
        return out

    # Checkpoint names.
    def _slots(self) -> dict:
        """Per-expert on-disk name -> (our param name, index into it). The order is the checkpoint's."""
        Fe, Fs = self.expert_size, self.shared_size
        g, u, dn = _EXPERT_PARTS[self.naming]
        out = {"gate.weight": ("gate_weight", ())}
        if self.e_score_correction_bias is not None:
            out["gate.e_score_correction_bias"] = ("e_score_correction_bias", ())
        nb = Fe // SCALE_BLOCK  # FP8 experts: scale blocks of one gate or up matrix (Fe is a multiple of 128)
        for e in range(self.num_experts):
            out[f"experts.{e}.{g}.weight"] = ("w13", (e, slice(0, Fe)))
            out[f"experts.{e}.{u}.weight"] = ("w13", (e, slice(Fe, 2 * Fe)))
            out[f"experts.{e}.{dn}.weight"] = ("w2", (e,))
            if self.fp8_experts:
                out[f"experts.{e}.{g}.weight{SCALE_SUFFIX}"] = ("w13_scale_inv", (e, slice(0, nb)))
                out[f"experts.{e}.{u}.weight{SCALE_SUFFIX}"] = ("w13_scale_inv", (e, slice(nb, 2 * nb)))
                out[f"experts.{e}.{dn}.weight{SCALE_SUFFIX}"] = ("w2_scale_inv", (e,))
        if Fs:
            s = _SHARED[self.naming]
            out[f"{s}.gate_proj.weight"] = ("shared_w13", (slice(0, Fs),))
            out[f"{s}.up_proj.weight"] = ("shared_w13", (slice(Fs, 2 * Fs),))
            out[f"{s}.down_proj.weight"] = ("shared_w2", ())
        if self.shared_gate_weight is not None:
            out["shared_expert_gate.weight"] = ("shared_gate_weight", ())
        return out

    def _fused(self) -> dict:
        """transformers-5 fused name -> (our param, the per-expert names it stands for)."""
        g, u, dn = _EXPERT_PARTS[self.naming]
        E = range(self.num_experts)
        out = {_FUSED_GATE_UP: ("w13", [f"experts.{e}.{p}.weight" for e in E for p in (g, u)]),
               _FUSED_DOWN: ("w2", [f"experts.{e}.{dn}.weight" for e in E])}
        if self.fp8_experts:
            out.update({name + SCALE_SUFFIX: (pname + SCALE_SUFFIX, [c + SCALE_SUFFIX for c in covers])
                        for name, (pname, covers) in list(out.items())})
        return out

    @property
    def fp8_experts(self) -> bool:
        """The experts are held FP8 with block scales (models/quant.py, store_experts_fp8)."""
        return self.w13.dtype == FP8

    def fp8_checkpoint_tensor(self, local_name: str) -> bool:
        """Whether this checkpoint tensor (name relative to this block) is an expert weight that loads as it is
        stored, FP8 with its scale beside it, rather than dequantized: so when the experts are held FP8."""
        parts = local_name.split(".")
        expert = len(parts) == 4 and parts[0] == "experts" and parts[3] == "weight" \
            and parts[2] in _EXPERT_PARTS[self.naming]
        return self.fp8_experts and (expert or local_name in (_FUSED_GATE_UP, _FUSED_DOWN))

    def _zero_width_shared(self, local_name: str, tensor: torch.Tensor) -> bool:
        """A tensor of the shared expert this block does not have because its width is 0 (n_shared_experts 0,
        shared_expert_intermediate_size 0): its empty projections, or the gate of its zero output."""
        if self.shared_size:
            return False
        s = _SHARED[self.naming]
        empty = tensor.numel() == 0 and local_name in (f"{s}.{p}_proj.weight" for p in ("gate", "up", "down"))
        return empty or local_name == "shared_expert_gate.weight"

    def load_checkpoint_tensor(self, local_name: str, tensor: torch.Tensor, full_name: Optional[str] = None) -> None:
        """Copy one checkpoint tensor (name relative to this block) into our weights."""
        full_name = full_name or local_name
        if self.placement is not None:
            raise WeightError(f"checkpoint tensor {full_name!r}: load the weights before enabling EPLB (the "
                              "experts are held as replicated physical slots)")
        fused = self._fused()
        if local_name in fused:
            pname, covers = fused[local_name]
            dst = getattr(self, pname).data
        else:
            slot = self._slots().get(local_name)
            if slot is None and self._zero_width_shared(local_name, tensor):
                return  # transformers writes a shared expert of width 0 (and its gate): it adds exactly 0
            if slot is None:
                raise WeightError(f"checkpoint tensor {full_name!r} is not a weight of this MoE block "
                                  f"({self.num_experts} experts, naming {self.naming!r}"
                                  f"{', shared expert' if self.shared_size else ', no shared expert'})")
            pname, idx = slot
            dst = getattr(self, pname).data[idx] if idx else getattr(self, pname).data
            covers = [local_name]
        if tuple(tensor.shape) != tuple(dst.shape):
            raise WeightError(f"checkpoint tensor {full_name!r} has shape {tuple(tensor.shape)}, "
                              f"expected {tuple(dst.shape)}")
        if dst.dtype == FP8 and tensor.dtype != FP8:
            raise WeightError(f"checkpoint tensor {full_name!r} is {tensor.dtype}, but this block holds its experts "
                              "as float8_e4m3fn with block scales (an FP8 checkpoint's); load with "
                              "fp8_experts='dequantize'")
        dst.copy_(tensor.to(dst.dtype))
        self._loaded.update(covers)

    def missing_checkpoint_tensors(self) -> list:
        return [n for n in self._slots() if n not in self._loaded]

    def checkpoint_tensors(self) -> dict:
        """Our weights under the per-expert on-disk names (copies: safetensors refuses shared storage)."""
        out = {}
        for name, (pname, idx) in self._slots().items():
            p = getattr(self, pname).data
            if self.placement is not None and pname in EXPERT_PARAMS:
                p = self.placement.logical(p)  # EPLB: [P, ...] slots -> [E, ...] logical experts
            out[name] = (p[idx] if idx else p).clone()
        return out


class MoEModel:
    """What every MoE model adds to the model contract: its blocks, the dense/routed switch, the step's
    expert-load record. Mixed into the model class (it reads ``self.expert_load``)."""

    def moe_blocks(self) -> list:
        return [m for m in self.modules() if isinstance(m, MoEBlock)]

    def set_moe_impl(self, impl: str) -> None:
        """Switch every MoE block to "routed" or "dense" experts (same function; dense is the oracle)."""
        if impl not in ("routed", "dense"):
            raise ValueError(f"impl must be 'routed' or 'dense', got {impl!r}")
        for m in self.moe_blocks():
            m.impl = impl

    def end_step(self) -> None:
        if getattr(self, "expert_load", None) is not None:
            self.expert_load.end_step()
        if getattr(self, "eplb", None) is not None:  # EPLB (parallel/placement.py): rebalance every step_interval
            self.eplb.end_step()

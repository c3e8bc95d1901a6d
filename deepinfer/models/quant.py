"""Block-scaled FP8 weights as DeepSeek-V3 ships them: float8_e4m3fn values and one float32
``weight_scale_inv`` per 128x128 block (the factor that multiplies the FP8 value back).

Expert weights of such a checkpoint can stay FP8 in memory (``store_experts_fp8``): a module holding stacked
experts in the layout of ``Ops.moe_experts`` (3-D parameters ``w13`` [E, 2F, d] and ``w2`` [E, d, F]: MoEBlock,
CEDLayer) then holds them as float8_e4m3fn with their block scales beside them, as parameters named like the
checkpoint's (``w13_scale_inv`` [E, cdiv(2F, 128), cdiv(d, 128)], ``w2_scale_inv`` [E, cdiv(d, 128), cdiv(F, 128)],
float32), and passes them to ``Ops.moe_experts`` (``fp8_scales``).
"""

from __future__ import annotations

import torch
from torch import nn

from ..backends.reference.moe import SCALE_BLOCK, dequantize_fp8_blocks

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
EXPERT_WEIGHTS = ("w13", "w2")
SCALE_SUFFIX = "_scale_inv"  # X (FP8) pairs with X_scale_inv, in checkpoints and in expert modules


def dequantize_fp8_block(w: torch.Tensor, scale_inv: torch.Tensor, block=(128, 128),
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """w: [R, C] float8_e4m3fn; scale_inv: [ceil(R/br), ceil(C/bc)] -> [R, C] in dtype."""
    if w.dim() != 2:
        raise ValueError(f"FP8 block dequantization expects a 2-D weight, got shape {tuple(w.shape)}")
    want = (-(-w.shape[0] // block[0]), -(-w.shape[1] // block[1]))
    if tuple(scale_inv.shape) != want:
        raise ValueError(f"weight_scale_inv has shape {tuple(scale_inv.shape)}, expected {want} for a weight of shape "
                         f"{tuple(w.shape)} with {block[0]}x{block[1]} blocks")
    return dequantize_fp8_blocks(w, scale_inv, block, dtype)


def quantize_fp8_block(w: torch.Tensor, block=(128, 128)) -> tuple:
    """The inverse, for writing test checkpoints: returns (float8 weight, float32 scale_inv)."""
    r, c = w.shape
    br, bc = block
    nr, nc = -(-r // br), -(-c // bc)
    pad = torch.zeros(nr * br, nc * bc, dtype=torch.float32)
    pad[:r, :c] = w.float()
    blocks = pad.reshape(nr, br, nc, bc)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12)  # [nr, nc]
    scale_inv = amax / FP8_MAX
    q = (blocks / scale_inv[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).reshape(nr * br, nc * bc)[:r, :c]
    return q.to(FP8), scale_inv


def fp8_block_size(hf_config: dict):
    """The checkpoint's FP8 block size, or None when it is not FP8 block-quantized."""
    q = hf_config.get("quantization_config") or {}
    if q.get("quant_method") != "fp8":
        return None
    bs = q.get("weight_block_size") or [128, 128]
    return (int(bs[0]), int(bs[1]))


# ------------------------------------------------------------------------------------------- FP8 experts
def holds_experts(module: nn.Module) -> bool:
    """Whether the module holds stacked experts as 3-D parameters w13 [E, 2F, d] and w2 [E, d, F]."""
    return all(isinstance(getattr(module, n, None), nn.Parameter) and getattr(module, n).dim() == 3
               for n in EXPERT_WEIGHTS)


def fp8_experts_servable(module: nn.Module, block) -> bool:
    """Whether the fused MoE kernel can take this module's experts as the checkpoint stores them: 128x128 blocks,
    and an expert width F that is a multiple of 128 (a per-expert gate/up pair on disk then fills whole blocks
    of the stacked w13)."""
    return tuple(block) == (SCALE_BLOCK, SCALE_BLOCK) and (module.w13.shape[1] // 2) % SCALE_BLOCK == 0


def store_experts_fp8(model: nn.Module, block) -> list:
    """Make every servable expert module (``fp8_experts_servable``) hold its experts as float8_e4m3fn with float32
    block scales beside them (``w13_scale_inv``, ``w2_scale_inv``, initialised to 1), on the weights' device
    (meta before loading). Returns the names of the modules converted; the rest keep their dtype (their
    checkpoint tensors are dequantized at load)."""
    done = []
    for name, m in model.named_modules():
        if not holds_experts(m) or not fp8_experts_servable(m, block):
            continue
        for w in EXPERT_WEIGHTS:
            p = getattr(m, w)
            E, R, C = p.shape
            setattr(m, w, nn.Parameter(torch.empty(p.shape, dtype=FP8, device=p.device), requires_grad=False))
            scale = torch.ones(E, -(-R // SCALE_BLOCK), -(-C // SCALE_BLOCK), dtype=torch.float32, device=p.device)
            m.register_parameter(w + SCALE_SUFFIX, nn.Parameter(scale, requires_grad=False))
        done.append(name)
    return done


def fp8_scales(module: nn.Module) -> dict:
    """The ``w13_scale``/``w2_scale`` keywords of Ops.moe_experts for this expert module: its block scales when
    its experts are FP8, else none."""
    return {w + "_scale": getattr(module, w + SCALE_SUFFIX, None) for w in EXPERT_WEIGHTS}

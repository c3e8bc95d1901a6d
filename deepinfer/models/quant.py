"""Block-scaled FP8 weights as DeepSeek-V3 ships them: float8_e4m3fn values and one float32
``weight_scale_inv`` per 128x128 block (the factor that multiplies the FP8 value back)."""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448


def _expand(scale: torch.Tensor, shape, block) -> torch.Tensor:
    """[ceil(R/br), ceil(C/bc)] block scales -> [R, C] per element."""
    br, bc = block
    r, c = shape
    return scale.repeat_interleave(br, 0)[:r].repeat_interleave(bc, 1)[:, :c]


def dequantize_fp8_block(w: torch.Tensor, scale_inv: torch.Tensor, block=(128, 128),
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """w: [R, C] float8_e4m3fn; scale_inv: [ceil(R/br), ceil(C/bc)] -> [R, C] in dtype."""
    if w.dim() != 2:
        raise ValueError(f"FP8 block dequantization expects a 2-D weight, got shape {tuple(w.shape)}")
    want = (-(-w.shape[0] // block[0]), -(-w.shape[1] // block[1]))
    if tuple(scale_inv.shape) != want:
        raise ValueError(f"weight_scale_inv has shape {tuple(scale_inv.shape)}, expected {want} for a weight of shape "
                         f"{tuple(w.shape)} with {block[0]}x{block[1]} blocks")
    return (w.float() * _expand(scale_inv.float(), w.shape, block)).to(dtype)


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

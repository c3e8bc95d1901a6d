"""KV-cache write in one Triton launch: k and v rows of the step's tokens stored at their cache slots.

Program (t, head tile) reads token t's slot and copies its k and v heads into k_cache[slot] and
v_cache[slot], converting to the cache's dtype. Caches may be strided views (one layer of a
[layers, slots, Hk, D] tensor, or any view whose channel dim has unit stride); k and v may be strided
views too (split out of a fused qkv projection). K and V may have different head dims.

Bit-identical to the reference (``index_copy_`` of ``k.to(cache.dtype)``): equal dtypes are copied as
is, other conversions go through float32 (exact for 16-bit inputs) with one round-to-nearest-even.
Slots must be valid, distinct rows: not checked (a host sync); with a repeated slot which token's row
lands there is unspecified, as with index_copy_ on CUDA.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_norm import cast_rne, to_f32
from deepinfer.backends.nvidia.host_math import cdiv, next_pow2

INTERPRET = bool(triton.knobs.runtime.interpret)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _copy_heads(x_ptr, c_ptr, t, slot, h, HK, D, stride_xt, stride_xh, stride_cs, stride_ch,
                BLOCK_D: tl.constexpr):
    d = tl.arange(0, BLOCK_D)
    m = (h < HK)[:, None] & (d < D)[None, :]
    x = tl.load(x_ptr + t * stride_xt + h[:, None] * stride_xh + d[None, :], mask=m)
    if x.dtype != c_ptr.dtype.element_ty:
        x = cast_rne(to_f32(x), c_ptr.dtype.element_ty)
    tl.store(c_ptr + slot * stride_cs + h[:, None] * stride_ch + d[None, :], x, mask=m)


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcs, stride_kch, stride_vcs, stride_vch, stride_slot,
    HK, DK, DV,
    BLOCK_H: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    slot = tl.load(slot_ptr + t * stride_slot).to(tl.int64)
    _copy_heads(k_ptr, kc_ptr, t, slot, h, HK, DK, stride_kt, stride_kh, stride_kcs, stride_kch, BLOCK_DK)
    _copy_heads(v_ptr, vc_ptr, t, slot, h, HK, DV, stride_vt, stride_vh, stride_vcs, stride_vch, BLOCK_DV)


def _problem(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor):
    """Why the kernel cannot take these inputs (an error message naming the argument), or None."""
    for name, x in (("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        if x.dim() != 3 or x.dtype not in SUPPORTED_DTYPES:
            return f"{name} must be 3-D float16/bfloat16/float32, got {tuple(x.shape)} {x.dtype}"
    T, Hk, Dk = k.shape
    if v.shape[:2] != (T, Hk) or v.shape[2] == 0 or Dk == 0:
        return f"v {tuple(v.shape)} must be [{T}, {Hk}, Dv] like k {tuple(k.shape)}"
    if slots.dim() != 1 or slots.shape[0] != T or slots.dtype not in (torch.int32, torch.int64):
        return f"slots must be [{T}] int32/int64, got {tuple(slots.shape)} {slots.dtype}"
    for name, c, x in (("k_cache", k_cache, k), ("v_cache", v_cache, v)):
        if c.shape[1:] != x.shape[1:]:
            return f"{name} {tuple(c.shape)} must be [num_slots, {x.shape[1]}, {x.shape[2]}]"
        if c.stride(2) != 1:
            return f"{name} must have unit-stride channels, got strides {c.stride()}"
    for name, x in (("v", v), ("k_cache", k_cache), ("v_cache", v_cache), ("slots", slots)):
        if x.device != k.device:
            return f"{name} is on {x.device}, k on {k.device}"
    return None


def supports(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slots: torch.Tensor) -> bool:
    return _problem(k_cache, v_cache, k, v, slots) is None


def launch_config(Hk: int, Dk: int, Dv: int) -> dict:
    """A tile of heads x channels of about 2048 elements per tensor."""
    block_d = next_pow2(max(Dk, Dv))
    return {
        "BLOCK_DK": next_pow2(Dk),
        "BLOCK_DV": next_pow2(Dv),
        "BLOCK_H": max(1, min(next_pow2(Hk), (64 if INTERPRET else 2048) // block_d)),
        "num_warps": 1 if INTERPRET else 4,
    }


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slots: torch.Tensor) -> None:
    """Ops.write_kv: k [T, Hk, Dk], v [T, Hk, Dv] -> k_cache[slots], v_cache[slots] ([num_slots, Hk, D]
    views, unit-stride channels), in place."""
    problem = _problem(k_cache, v_cache, k, v, slots)
    if problem is not None:
        raise ValueError(f"write_kv: {problem}")
    T, Hk, Dk = k.shape
    if T == 0 or Hk == 0:
        return
    k = k if k.stride(2) == 1 else k.contiguous()
    v = v if v.stride(2) == 1 else v.contiguous()
    cfg = launch_config(Hk, Dk, v.shape[2])
    grid = (T, cdiv(Hk, cfg["BLOCK_H"]))
    _write_kv_kernel[grid](
        k, v, k_cache, v_cache, slots,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1), slots.stride(0),
        Hk, Dk, v.shape[2],
        BLOCK_H=cfg["BLOCK_H"], BLOCK_DK=cfg["BLOCK_DK"], BLOCK_DV=cfg["BLOCK_DV"], num_warps=cfg["num_warps"],
    )

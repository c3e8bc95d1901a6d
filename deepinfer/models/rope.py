"""Rotary position embeddings (RoPE) with the scaling types real HF checkpoints use.

Two pieces:
  * ``rope_parameters`` reads a config.json dict (transformers 4 or 5 spelling) into one flat,
    fully resolved dict, so model code never has to know which spelling a checkpoint used.
  * ``RotaryEmbedding`` turns that dict into inverse frequencies and a cos/sin cache, and rotates
    q/k for a flat batch of tokens ``[T, heads, head_dim]``.

Supported ``rope_type``s: default, linear, dynamic, llama3, yarn. The inverse frequencies follow
``transformers.modeling_rope_utils`` (float32, same formulas) so logits match HF.

Dynamic NTK is implemented in its *static* form. HF recomputes the base on every forward from the
current sequence length, which makes a key rotated early in a sequence disagree with one rotated
later; a KV cache stores already-rotated keys, so it cannot follow that. Like vLLM we fix the base
once, for the longest context the scaling is meant for (``seq_len = original_max * factor``):

    base' = theta * (factor * factor - (factor - 1)) ** (rotary_dim / (rotary_dim - 2))

which is HF's formula evaluated at that sequence length. So logits match transformers' only for a sequence of
that length: below max_position_embeddings transformers keeps the unscaled base (the difference is deliberate,
the price of a cache of rotated keys).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")
DEFAULT_ROPE_THETA = 10000.0


# ---------------------------------------------------------------------------------------------
# Config normalisation
# ---------------------------------------------------------------------------------------------


def rope_parameters(hf_config: Mapping, head_dim: int, *, layer_type: str | None = None) -> dict:
    """Normalise the RoPE part of a config.json dict.

    Reads transformers-4 spelling (top-level ``rope_theta`` + optional ``rope_scaling`` whose type
    key is ``rope_type`` or legacy ``type``) and transformers-5 spelling (``rope_parameters`` dict,
    possibly nested per layer type). ``layer_type`` picks an entry of a nested dict; for a flat dict
    it is ignored because the same RoPE applies to every layer.

    Returns ``{"rope_type", "rope_theta", "rotary_dim"}`` plus the type's resolved scaling fields.
    """
    if not isinstance(hf_config, Mapping):
        raise TypeError(f"hf_config must be a dict (config.json), got {type(hf_config).__name__}")
    if not isinstance(head_dim, int) or head_dim <= 0:
        raise ValueError(f"head_dim must be a positive int, got {head_dim!r}")

    raw = _select_raw_params(hf_config, layer_type)

    rope_type = raw.get("rope_type") or raw.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope_type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )

    theta = _first(raw.get("rope_theta"), hf_config.get("rope_theta"), DEFAULT_ROPE_THETA)
    partial = _first(raw.get("partial_rotary_factor"), hf_config.get("partial_rotary_factor"), 1.0)
    rotary_dim = int(head_dim * partial)
    if rotary_dim <= 0 or rotary_dim > head_dim or rotary_dim % 2:
        raise ValueError(
            f"rotary_dim = int(head_dim * partial_rotary_factor) = int({head_dim} * {partial}) = "
            f"{rotary_dim}; it must be even and in (0, head_dim]"
        )

    out = {"rope_type": rope_type, "rope_theta": float(theta), "rotary_dim": rotary_dim}
    if rope_type == "default":
        return out

    out["factor"] = _optional_float(raw, "factor")
    if rope_type in ("linear", "dynamic", "llama3") and out["factor"] is None:
        raise ValueError(f"rope_type {rope_type!r} requires a 'factor' field in the rope parameters")
    if rope_type == "linear":
        return out

    original_max = _first(raw.get("original_max_position_embeddings"),
                          hf_config.get("max_position_embeddings"))
    if rope_type == "dynamic":
        # Only the ratio seq_len / original_max enters the static formula, so original_max is
        # informational here (a sensible cache length is original_max * factor).
        out["original_max_position_embeddings"] = None if original_max is None else int(original_max)
        return out

    if original_max is None:
        raise ValueError(
            f"rope_type {rope_type!r} needs 'original_max_position_embeddings' in the rope parameters "
            "or 'max_position_embeddings' in the config"
        )
    out["original_max_position_embeddings"] = int(original_max)

    if rope_type == "llama3":
        for key in ("low_freq_factor", "high_freq_factor"):
            out[key] = _optional_float(raw, key)
            if out[key] is None:
                raise ValueError(f"rope_type 'llama3' requires a {key!r} field in the rope parameters")
        if out["high_freq_factor"] <= out["low_freq_factor"]:
            raise ValueError(
                f"llama3 high_freq_factor ({out['high_freq_factor']}) must exceed "
                f"low_freq_factor ({out['low_freq_factor']})"
            )
        return out

    # yarn
    if out["factor"] is None:
        # DeepSeek-style configs leave factor implicit: post-yarn length / pre-yarn length.
        max_pos = hf_config.get("max_position_embeddings")
        if max_pos is None:
            raise ValueError("yarn without 'factor' needs 'max_position_embeddings' to infer it")
        out["factor"] = float(max_pos) / out["original_max_position_embeddings"]
    # HF treats 0/None as "unset" for the betas, hence `or`.
    out["beta_fast"] = float(raw.get("beta_fast") or 32.0)
    out["beta_slow"] = float(raw.get("beta_slow") or 1.0)
    out["mscale"] = _optional_float(raw, "mscale")
    out["mscale_all_dim"] = _optional_float(raw, "mscale_all_dim")
    out["truncate"] = bool(raw.get("truncate", True))
    attention_factor = _optional_float(raw, "attention_factor")
    if attention_factor is None:
        attention_factor = yarn_attention_factor(out["factor"], out["mscale"], out["mscale_all_dim"])
    out["attention_factor"] = attention_factor
    return out


def _select_raw_params(hf_config: Mapping, layer_type: str | None) -> Mapping:
    """The dict holding rope_type/theta/scaling fields, whichever spelling the config uses."""
    # transformers 5 lets `rope_scaling` override `rope_parameters` when both are given.
    raw = hf_config.get("rope_scaling") or hf_config.get("rope_parameters") or {}
    if not isinstance(raw, Mapping):
        raise ValueError(f"rope_scaling/rope_parameters must be a dict, got {raw!r}")
    nested = {k: v for k, v in raw.items() if isinstance(v, Mapping)}
    if not nested:
        return raw
    if layer_type is None:
        if len(raw) == 1:
            return next(iter(nested.values()))
        raise ValueError(
            f"rope_parameters is nested per layer type ({', '.join(map(str, raw))}); "
            "pass layer_type= to choose one"
        )
    if layer_type not in raw:
        raise ValueError(
            f"layer_type {layer_type!r} not in rope_parameters (have: {', '.join(map(str, raw))})"
        )
    if raw[layer_type] is None:
        raise ValueError(f"layer_type {layer_type!r} has no RoPE (rope_parameters entry is null)")
    return raw[layer_type]


def _first(*values):
    """First value that is not None (config fields are often present but null)."""
    return next((v for v in values if v is not None), None)


def _optional_float(raw: Mapping, key: str) -> float | None:
    value = raw.get(key)
    if value is None:
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"rope parameter {key!r} must be a number, got {value!r}") from None


def yarn_attention_factor(factor: float, mscale: float | None, mscale_all_dim: float | None) -> float:
    """YaRN's cos/sin multiplier. DeepSeek's mscale/mscale_all_dim turn it into a ratio."""

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if mscale and mscale_all_dim:
        return get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
    return get_mscale(factor)


# ---------------------------------------------------------------------------------------------
# Inverse frequencies (float32, same formulas as transformers so results match bit-for-bit-ish)
# ---------------------------------------------------------------------------------------------


def _base_inv_freq(theta: float, rotary_dim: int, device) -> torch.Tensor:
    exponent = torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device) / rotary_dim
    return 1.0 / (theta**exponent)  # [rotary_dim // 2]


def _llama3_inv_freq(p: dict, device) -> torch.Tensor:
    inv_freq = _base_inv_freq(p["rope_theta"], p["rotary_dim"], device)
    factor, lo, hi = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    # Short wavelengths (high freq) keep their value, long ones are divided by factor, and the
    # band between blends the two linearly in old_len / wavelen.
    smooth = (old_len / wavelen - lo) / (hi - lo)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > old_len / lo, inv_freq / factor, blended)
    return torch.where(wavelen < old_len / hi, inv_freq, scaled)


def _yarn_inv_freq(p: dict, device) -> torch.Tensor:
    theta, dim, factor = p["rope_theta"], p["rotary_dim"], p["factor"]
    orig = p["original_max_position_embeddings"]

    def dim_for_rotations(num_rotations: float) -> float:
        # Channel index whose wavelength fits `num_rotations` times into the original context.
        return dim * math.log(orig / (num_rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_for_rotations(p["beta_fast"]), dim_for_rotations(p["beta_slow"])
    if p["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp

    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim)
    extrapolated = 1.0 / pos_freqs  # original frequencies (fast channels)
    interpolated = 1.0 / (factor * pos_freqs)  # linearly scaled (slow channels)
    ramp = torch.arange(dim // 2, dtype=torch.float32, device=device)
    ramp = ((ramp - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1 -> keep original frequency, 0 -> fully interpolated
    return interpolated * (1 - keep) + extrapolated * keep


def compute_inv_freq(params: dict, device=None) -> tuple[torch.Tensor, float]:
    """(inv_freq [rotary_dim // 2] float32, attention_scaling) for normalised ``params``."""
    rope_type, dim = params["rope_type"], params["rotary_dim"]
    if rope_type == "default":
        return _base_inv_freq(params["rope_theta"], dim, device), 1.0
    if rope_type == "linear":
        # Dividing frequencies by factor == dividing positions by factor.
        return _base_inv_freq(params["rope_theta"], dim, device) / params["factor"], 1.0
    if rope_type == "dynamic":
        if dim <= 2:
            raise ValueError(f"dynamic rope needs rotary_dim > 2, got {dim}")
        factor = params["factor"]
        theta = params["rope_theta"] * (factor * factor - (factor - 1)) ** (dim / (dim - 2))
        return _base_inv_freq(theta, dim, device), 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(params, device), 1.0
    if rope_type == "yarn":
        scaling = params.get("attention_factor")
        if scaling is None:
            scaling = yarn_attention_factor(
                params["factor"], params.get("mscale"), params.get("mscale_all_dim")
            )
        return _yarn_inv_freq(params, device), float(scaling)
    raise ValueError(
        f"unsupported rope_type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
    )


# ---------------------------------------------------------------------------------------------
# Applying the rotation
# ---------------------------------------------------------------------------------------------


class RotaryEmbedding:
    """Rotates q/k of a flat token batch using a precomputed cos/sin cache.

    ``dtype`` is the precision of the cache and of the rotation math (keep float32 to match HF);
    outputs are cast back to the input dtype. ``is_neox_style`` rotates the two halves of the
    rotary channels (HF ``rotate_half``: Llama/Qwen/Mistral); False rotates adjacent pairs
    (GPT-J / DeepSeek interleaved layout). With ``ops`` (a backend) the rotation runs as
    ``ops.apply_rotary``; without, as ``rotate`` (the reference op's body).
    """

    def __init__(self, params: dict, max_position: int, dtype=torch.float32, device=None,
                 is_neox_style: bool = True, ops=None):
        if not dtype.is_floating_point:
            raise ValueError(f"dtype must be floating point, got {dtype}")
        if max_position <= 0:
            raise ValueError(f"max_position must be positive, got {max_position}")
        self.params = dict(params)
        self.rotary_dim = int(params["rotary_dim"])
        if self.rotary_dim <= 0 or self.rotary_dim % 2:
            raise ValueError(f"rotary_dim must be a positive even int, got {self.rotary_dim}")
        self.dtype = dtype
        self.device = device
        self.is_neox_style = is_neox_style
        self.ops = ops
        self.inv_freq, self.attention_scaling = compute_inv_freq(self.params, device)
        self.cos_sin_cache = self._build_cache(max_position)  # [P, rotary_dim] = cat(cos, sin)
        self._reserved = False  # set by reserve(): positions are guaranteed to fit, skip the bounds check

    @property
    def max_position(self) -> int:
        return self.cos_sin_cache.shape[0]

    def reserve(self, num_positions: int) -> None:
        """Grow the cache to cover positions < num_positions now and trust callers to stay below it:
        no per-call bounds check (a host sync on GPU; not allowed inside CUDA-graph capture)."""
        if num_positions > self.max_position:
            self.cos_sin_cache = self._build_cache(num_positions)
        self._reserved = True

    def _build_cache(self, num_positions: int) -> torch.Tensor:
        positions = torch.arange(num_positions, dtype=torch.float32, device=self.inv_freq.device)
        freqs = positions[:, None] * self.inv_freq[None, :]  # [P, rotary_dim // 2]
        cos = freqs.cos() * self.attention_scaling
        sin = freqs.sin() * self.attention_scaling
        return torch.cat((cos, sin), dim=-1).to(self.dtype)

    def __call__(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() != 1:
            raise ValueError(f"positions must be 1-D [T], got shape {tuple(positions.shape)}")
        for name, x in (("q", q), ("k", k)):
            if x.dim() != 3 or x.shape[0] != positions.shape[0]:
                raise ValueError(
                    f"{name} must be [T, heads, head_dim] with T={positions.shape[0]}, "
                    f"got shape {tuple(x.shape)}"
                )
            if x.shape[-1] < self.rotary_dim:
                raise ValueError(f"{name} head_dim {x.shape[-1]} < rotary_dim {self.rotary_dim}")
        if positions.numel() and not self._reserved:
            needed = int(positions.max()) + 1  # one host sync per call, not per token
            if needed > self.max_position:
                # Grow geometrically so a slowly lengthening sequence doesn't rebuild every step.
                self.cos_sin_cache = self._build_cache(max(needed, 2 * self.max_position))

        apply = rotate if self.ops is None else self.ops.apply_rotary
        return apply(q, k, positions, self.cos_sin_cache, not self.is_neox_style)


def rotate(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
           interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, H, D] and k [T, Hk, D] by the cache rows [P, R] = cat(cos, sin) of ``positions`` [T].

    The reference body of ``Ops.apply_rotary``: math in the cache's dtype, outputs in the inputs' dtypes,
    channels R.. passed through; new tensors, inputs untouched.
    """
    cos_sin = cos_sin_cache.index_select(0, positions.to(cos_sin_cache.device))
    cos, sin = cos_sin[:, None, :].chunk(2, dim=-1)  # each [T, 1, rotary_dim // 2]
    return _rotate(q, cos, sin, interleaved), _rotate(k, cos, sin, interleaved)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    rotary_dim = 2 * cos.shape[-1]
    rot = x[..., :rotary_dim].to(cos.dtype)
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
    else:
        x1, x2 = rot.chunk(2, dim=-1)
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    if interleaved:
        rotated = torch.stack((o1, o2), dim=-1).flatten(-2)  # re-interleave pairs
    else:
        rotated = torch.cat((o1, o2), dim=-1)
    rotated = rotated.to(x.dtype)
    if rotary_dim == x.shape[-1]:
        return rotated
    return torch.cat((rotated, x[..., rotary_dim:]), dim=-1)

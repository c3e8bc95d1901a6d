"""What a tier stores: one KV block's payload, its key, and the payload as raw bytes.

- A key is the block hash: ``bytes`` of 1 to 64 bytes (the engine chains a 32-byte sha256 digest).
- A payload is a ``dict[str, torch.Tensor]`` of CPU tensors: the bytes of one block across a model's cache
  tensors, named by the model. Any dtype in ``DTYPES``; any shape, zero-size and 0-d included.
- The tiers own a payload once it is put, and ``get`` returns the stored tensors without copying: neither
  side may write to them afterwards.
"""

from __future__ import annotations

import torch

Payload = dict  # dict[str, torch.Tensor]

MAX_KEY_BYTES = 64  # a hex file name of 128 characters stays well under the 255 a file system allows

# Canonical name (str(dtype) without "torch.") -> dtype; only whole-byte dtypes that view as uint8. Names that a
# torch build lacks (the float8 and float4 families came late) are left out.
_DTYPE_NAMES = ("bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64", "float16",
                "bfloat16", "float32", "float64", "complex64", "complex128", "float8_e4m3fn", "float8_e4m3fnuz",
                "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn_x2")
DTYPES = {name: getattr(torch, name) for name in _DTYPE_NAMES if isinstance(getattr(torch, name, None), torch.dtype)}


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if DTYPES.get(name) is not dtype:
        raise TypeError(f"dtype {dtype} cannot be stored in a KV tier (supported: {', '.join(DTYPES)})")
    return name


def check_key(key) -> bytes:
    """The key itself, or a ValueError naming it."""
    if not isinstance(key, bytes) or not 1 <= len(key) <= MAX_KEY_BYTES:
        raise ValueError(f"a KV tier key must be bytes of length 1..{MAX_KEY_BYTES}, got {key!r:.80}")
    return key


def check_payload(payload) -> int:
    """The payload's size in bytes, or a ValueError/TypeError naming the bad tensor."""
    if not isinstance(payload, dict):
        raise TypeError(f"a KV payload must be a dict of name -> CPU tensor, got {type(payload).__name__}")
    nbytes = 0
    for name, t in payload.items():
        if not isinstance(name, str) or not isinstance(t, torch.Tensor):
            raise TypeError(f"KV payload entry {name!r:.80}: expected str -> torch.Tensor, got {type(t).__name__}")
        if t.device.type != "cpu":
            raise ValueError(f"KV payload tensor {name!r} is on {t.device}; tiers take CPU tensors")
        dtype_name(t.dtype)
        nbytes += t.numel() * t.element_size()
    return nbytes


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The tensor's bytes in row-major order, without a copy where it is already contiguous."""
    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def tensor_from_bytes(buf: bytearray, offset: int, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
    """A tensor over buf[offset:] (shares buf's memory), the inverse of tensor_bytes."""
    numel = 1
    for s in shape:
        numel *= s
    if numel == 0:  # torch.frombuffer refuses an empty count
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(buf, dtype=dtype, count=numel, offset=offset).reshape(shape)

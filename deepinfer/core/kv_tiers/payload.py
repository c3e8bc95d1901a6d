"""What a tier stores: entries of KV payloads under keys, runs of blocks among them, payloads as raw bytes.

- A key is a block hash: ``bytes`` of 1 to 64 bytes (the engine chains a 32-byte sha256 digest).
- A payload is a ``dict[str, torch.Tensor]`` of CPU tensors, named by its writer. Any dtype in ``DTYPES``;
  any shape, zero-size and 0-d included.
- A run is an entry holding consecutive blocks of one chain: its ``members`` are their hashes in chain order
  (distinct, all as long as the key), its key is ``members[0]``, and every tensor's dim 0 is the block
  index (``shape[0] == len(members)``), so block i of the run is ``t[i]`` of every tensor and any stretch of
  blocks is a slice along dim 0 (``run_slice``). The tiers index every member of a run, so a lookup that
  starts at any of its blocks finds it (``find`` returns a ``Run``). An entry without members (a plain
  entry: the encoder-SWA pool's snapshots) is found by its key alone.
- The tiers own a payload once it is put, and ``get`` and ``find`` return the stored tensors without
  copying: neither side may write to them afterwards.
"""

from __future__ import annotations

import attrs
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


@attrs.frozen(eq=False)
class Run:
    """A run found through one of its members: the block asked for is ``members[position]``, whose bytes are
    row ``position`` of every tensor of ``payload``."""

    key: bytes
    members: tuple
    position: int
    payload: dict


def check_run(key: bytes, members, payload: dict) -> tuple:
    """members as a tuple, or a ValueError naming what breaks the run contract (see the module docstring)."""
    members = tuple(members)
    check_key(key)
    if not members or members[0] != key:
        raise ValueError(f"a run's members must start with its key {key.hex():.16}..., got {len(members)} members")
    for m in members:
        if not isinstance(m, bytes) or len(m) != len(key):
            raise ValueError(f"run member {m!r:.80} is not bytes of the key's length {len(key)}")
    if len(set(members)) != len(members):
        raise ValueError(f"a run's {len(members)} members are not distinct")
    for name, t in payload.items():
        if t.dim() == 0 or t.shape[0] != len(members):
            raise ValueError(f"run tensor {name!r} has shape {tuple(t.shape)}; dim 0 must be the run's "
                             f"{len(members)} blocks")
    return members


def run_slice(payload: dict, start: int, stop: int) -> dict:
    """Blocks [start, stop) of a run's payload (views, no copy)."""
    return {name: t[start:stop] for name, t in payload.items()}


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

"""KV tier round trips, bit for bit: what a tier's ``get`` returns is what its ``put`` was given.

The contract (``make() -> tier``, a new empty tier per call): ``tier.put(key: bytes, payload: dict[str, Tensor]) -> bool`` and
``tier.get(key) -> dict | None``, as deepinfer.core.kv_tiers' HostTier and DiskTier. The oracle puts a
drawn payload (every storable dtype, 0-d, empty and non-contiguous tensors, NaN bit patterns) and compares
names, dtypes, shapes and raw bytes of what comes back.
"""

from __future__ import annotations

import logging
from typing import Callable

import attrs
import torch
from hypothesis import strategies as st


@attrs.frozen
class TierCase:
    key: bytes
    payload: dict


def _storable_dtypes() -> list:
    from ...core.kv_tiers.payload import DTYPES

    return sorted(DTYPES)


@st.composite
def tier_cases(draw, max_tensors: int = 4) -> TierCase:
    key = draw(st.binary(min_size=1, max_size=64))
    payload = {}
    for i in range(draw(st.integers(0, max_tensors))):
        dtype = getattr(torch, draw(st.sampled_from(_storable_dtypes())))
        shape = tuple(draw(st.lists(st.integers(0, 5), max_size=3)))
        n = 1
        for d in shape:
            n *= d
        item = torch.empty((), dtype=dtype).element_size()
        raw = draw(st.binary(min_size=n * item, max_size=n * item))  # any bit pattern: NaNs, signed zeros
        t = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape) if n else \
            torch.empty(shape, dtype=dtype)
        if t.dim() >= 2 and draw(st.booleans()):
            t = t.transpose(0, 1)  # non-contiguous
        payload[f"t{i}"] = t
    return TierCase(key=key, payload=payload)


def raw_bytes(t: torch.Tensor) -> bytes:
    """A tensor's bytes in row-major order (the oracle's own view, independent of kv_tiers.payload)."""
    return bytes(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def assert_same_payload(got, want: dict) -> None:
    """got (a tier's ``get``) holds want's tensors in want's order: the same names, dtypes, shapes and bytes
    (NaN payloads included)."""
    assert got is not None and list(got) == list(want), (None if got is None else list(got), list(want))
    for name, t in want.items():
        assert (got[name].dtype, tuple(got[name].shape)) == (t.dtype, tuple(t.shape)), name
        assert raw_bytes(got[name]) == raw_bytes(t), name


def tier_warnings(caplog) -> list:
    """The warning (and worse) lines the kv tiers logged (``deepinfer.kv_tiers``)."""
    return [r.getMessage() for r in caplog.records if r.name == "deepinfer.kv_tiers" and r.levelno >= logging.WARNING]


def check_tier(make: Callable, case: TierCase) -> None:
    """put then get on ``make()``: the same names, dtypes, shapes and bytes (NaN payloads included)."""
    tier = make()
    want = {k: (v.dtype, tuple(v.shape), raw_bytes(v)) for k, v in case.payload.items()}
    assert tier.put(case.key, case.payload), f"{type(tier).__name__}.put refused a {len(want)}-tensor payload"
    got = tier.get(case.key)
    assert got is not None, f"{type(tier).__name__}.get missed the key just put"
    assert sorted(got) == sorted(want), f"tensor names {sorted(got)}, expected {sorted(want)}"
    for name, (dtype, shape, data) in want.items():
        t = got[name]
        assert (t.dtype, tuple(t.shape)) == (dtype, shape), (
            f"tensor {name!r}: {t.dtype} {tuple(t.shape)}, expected {dtype} {shape}")
        assert raw_bytes(t) == data, f"tensor {name!r} ({dtype}, {shape}): bytes differ after the round trip"


def host_tier() -> object:
    """Our host tier, roomy and without a TTL."""
    from ...core.kv_tiers import HostTier

    return HostTier(capacity_bytes=1 << 24, pin_memory=False)


def disk_tier(directory) -> Callable:
    """A factory of our disk tier: each call a DiskTier over a new empty directory under ``directory`` (a
    disk tier keeps the first entry put under a key: the key is a hash of what the entry holds)."""
    import tempfile

    from ...core.kv_tiers import DiskTier

    return lambda: DiskTier(tempfile.mkdtemp(dir=directory), capacity_bytes=1 << 24,
                            identity="deepinfer-equivalence-kit")

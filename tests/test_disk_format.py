"""The disk entry format, version 3 (issue 13): a sha256 over the head and a crc32 per payload chunk, checked
while the payload is read straight into the tensors it is served as. A flipped byte anywhere in a file, or a
file cut short anywhere, is a logged miss and the file is deleted; another version is foreign; chunks that span
tensors and padding round-trip bit for bit; another identity is refused before the payload is read."""

from __future__ import annotations

import io
import struct

import pytest
import torch

import deepinfer.core.kv_tiers.entry_format as fmt
from deepinfer.core.kv_tiers import DiskTier
from deepinfer.testing.equivalence.tiers import assert_same_payload, tier_warnings

ID = "demo-model|bfloat16|layout-1"
CHUNK = 3 * fmt.ALIGN  # small chunks (patched in): a few KB of payload spans many of them


def key(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8


def members(n: int) -> tuple:
    return tuple(key(i) for i in range(1, n + 1))


def run_payload(n: int) -> dict:
    """Tensors of odd sizes (so chunk edges fall inside tensors and inside the padding between them)."""
    g = torch.Generator().manual_seed(n)
    return {"kv": torch.randint(0, 256, (n, 37), dtype=torch.uint8, generator=g),
            "scale": torch.randn(n, 5, generator=g).to(torch.bfloat16),
            "idx": torch.randint(-9, 9, (n, 3), dtype=torch.int64, generator=g)}


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(fmt, "CHUNK_BYTES", CHUNK)


def written(tmp_path, n: int = 24) -> tuple:
    """(tier, path, payload, payload start, file bytes) of one run of n blocks."""
    tier = DiskTier(tmp_path, 1 << 30, ID, pin_memory=False)
    payload = run_payload(n)
    assert tier.put(key(1), payload, members=members(n))
    path = tier._files.path(key(1))
    data = path.read_bytes()
    with open(path, "rb") as f:
        _, _, start = fmt.read_head(f.read)
    return tier, path, payload, start, data


def test_chunks_spanning_tensors_round_trip(tmp_path, small_chunks):
    tier, path, payload, start, data = written(tmp_path)
    assert len(data) - start > 4 * CHUNK  # many chunks
    again = DiskTier(tmp_path, 1 << 30, ID, pin_memory=False)
    run = again.find(key(5))
    assert run is not None and run.position == 4 and run.members == members(24)
    assert_same_payload(run.payload, payload)
    assert all(t.is_contiguous() for t in run.payload.values())


def _positions(data_len: int, start: int) -> list:
    """Byte positions in every region of a file: the prefix fields, the header, the members, the chunk sums,
    the padding, every payload chunk (its first, middle and last byte), the last byte."""
    edges = {0, 8, 12, 16, 47, 48, 49, start - 1, start, data_len - 1}
    edges |= {start + c + d for c in range(0, data_len - start, CHUNK) for d in (0, CHUNK // 2, CHUNK - 1)}
    edges |= set(range(50, start, max(1, (start - 50) // 40)))  # the header, members and sums, 40 places
    return sorted(p for p in edges if 0 <= p < data_len)


def test_a_flipped_byte_anywhere_is_a_logged_miss_and_deleted(tmp_path, small_chunks, caplog):
    tier, path, payload, start, data = written(tmp_path)
    reasons = set()
    for i, pos in enumerate(_positions(len(data), start)):
        bad = bytearray(data)
        bad[pos] ^= 0x01 << (i % 8)
        with pytest.raises((fmt.EntryCorrupt, fmt.EntryForeign)) as why:
            fmt.read_entry(io.BytesIO(bad), len(bad), key(1), ID)
        reasons.add(str(why.value).split(" in payload chunk")[0] if pos >= start else str(why.value)[:14])
        path.write_bytes(bytes(bad))
        before = tier.stats()
        assert tier.find(key(1)) is None, pos
        after = tier.stats()
        if 8 <= pos < 12:  # the version field: another version, foreign, left alone
            assert path.exists() and after.foreign == before.foreign + 1, pos
        else:
            assert not path.exists() and after.corrupt == before.corrupt + 1, pos
        path.write_bytes(data)
        assert_same_payload(tier.find(key(1)).payload, payload)  # the intact file reads again
    assert_same_payload(tier.find(key(3)).payload, payload)
    assert tier_warnings(caplog)  # one line per damaged file (a name and inode: a new file may reuse one)
    # the payload's damage is found by its chunk's crc32; the head's by its sha256 (or before: the prefix)
    assert "checksum mismatch" in reasons and any(r.startswith("head checksum") for r in reasons), reasons


def test_a_file_cut_short_anywhere_is_a_logged_miss_and_deleted(tmp_path, small_chunks, caplog):
    tier, path, payload, start, data = written(tmp_path)
    for cut in _positions(len(data), start):
        path.write_bytes(data[:cut])
        assert tier.find(key(1)) is None and not path.exists(), cut
    path.write_bytes(data + b"\0")  # one byte too many is damage too
    assert tier.find(key(1)) is None and not path.exists()
    assert tier.stats().corrupt == len(_positions(len(data), start)) + 1 and tier.stats().foreign == 0
    assert tier_warnings(caplog) and all("corrupt" in m for m in tier_warnings(caplog))


def test_a_version_2_file_is_foreign_and_kept(tmp_path, caplog):
    tier, path, payload, start, data = written(tmp_path)
    old = bytearray(data)
    old[8:12] = struct.pack("<I", 2)  # the whole-file sha256 format this one replaced
    path.write_bytes(bytes(old))
    again = DiskTier(tmp_path, 1 << 30, ID, pin_memory=False)
    assert again.find(key(1)) is None and again.get(key(1)) is None
    assert path.exists() and again.stats().foreign == 2 and again.stats().corrupt == 0
    assert len(tier_warnings(caplog)) == 1 and "format version 2" in tier_warnings(caplog)[0]
    assert again.put(key(1), payload, members=members(24))  # a write replaces it
    assert_same_payload(again.find(key(1)).payload, payload)


class _Counting(io.BytesIO):
    def __init__(self, data):
        super().__init__(data)
        self.payload_reads = 0

    def readinto(self, b):
        self.payload_reads += 1
        return super().readinto(b)


def test_another_identity_is_refused_before_the_payload_is_read(tmp_path):
    tier, path, payload, start, data = written(tmp_path)
    f = _Counting(data)
    with pytest.raises(fmt.EntryForeign):
        fmt.read_entry(f, len(data), key(1), "another-model|float16|layout-1")
    assert f.payload_reads == 0 and f.tell() <= start
    f = _Counting(data)
    got, held = fmt.read_entry(f, len(data), key(1), ID)
    assert held == members(24) and f.tell() == len(data) and f.payload_reads >= 1
    assert_same_payload(got, payload)


def test_chunk_sums_cover_the_padding(tmp_path, small_chunks):
    """The zero padding between tensors is inside the checked payload: a byte set there is damage."""
    tier, path, payload, start, data = written(tmp_path, n=3)
    kv_end = start + 3 * 37  # the first tensor's bytes, then padding up to ALIGN
    assert (kv_end - start) % fmt.ALIGN and data[kv_end] == 0
    bad = bytearray(data)
    bad[kv_end] = 7
    path.write_bytes(bytes(bad))
    assert tier.find(key(1)) is None and tier.stats().corrupt == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory needs CUDA")
def test_payload_is_read_into_pinned_memory_where_cuda_is(tmp_path):
    DiskTier(tmp_path, 1 << 30, ID).put(key(1), run_payload(4), members=members(4))
    run = DiskTier(tmp_path, 1 << 30, ID).find(key(2))
    assert run is not None and all(t.is_pinned() for t in run.payload.values())
    run = DiskTier(tmp_path, 1 << 30, ID, pin_memory=False).find(key(2))
    assert not any(t.is_pinned() for t in run.payload.values())



def test_pinning_that_fails_falls_back_to_pageable_memory_with_one_warning(tmp_path, caplog, monkeypatch):
    tier, path, payload, start, data = written(tmp_path)
    real = torch.empty
    calls = []

    def empty(*args, pin_memory=False, **kw):
        calls.append(pin_memory)
        if pin_memory:
            raise RuntimeError("no pinned memory left")
        return real(*args, **kw)

    monkeypatch.setattr(torch, "empty", empty)
    pinning = DiskTier(tmp_path, 1 << 30, ID, pin_memory=True)
    for _ in range(2):
        assert_same_payload(pinning.find(key(1)).payload, payload)
    assert calls[0] is True and not any(calls[1:])  # one try, then pageable memory only
    assert pinning.stats().corrupt == 0 and pinning.stats().hits == 2
    msgs = tier_warnings(caplog)
    assert len(msgs) == 1 and "pinned memory failed" in msgs[0]

"""The host and disk KV tiers (issue 13.2): bit-exact round trips, LRU and byte caps, TTLs on an injected clock,
damaged and foreign files as misses, writers killed mid-entry, processes sharing a directory, and faults that
turn the disk tier off with one warning. Processes are synchronised through pipes; nothing waits on time."""

from __future__ import annotations

import errno
import fcntl
import json
import math
import os
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import deepinfer.core.kv_tiers.entry_files as files_mod
from deepinfer.core.kv_tiers import DiskTier, HostTier, TieredStore
from deepinfer.core.kv_tiers.entry_format import FORMAT_VERSION, PREFIX_BYTES
from deepinfer.core.kv_tiers.payload import DTYPES
from deepinfer.testing.equivalence.tiers import assert_same_payload, tier_warnings

ID = "demo-model|bfloat16|layout-1"


def key(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8  # 32 bytes, like the engine's sha256 chain


def block(i: int, n: int = 64) -> dict:
    """A payload whose bytes depend on i; all blocks of one n have one size."""
    return {"k": torch.full((2, n), i, dtype=torch.int32), "v": torch.arange(n, dtype=torch.float32) + i}


def entry_files(root) -> list:
    return sorted(p for p in Path(root).glob("??/*.kvb"))


def temp_files(root) -> list:
    return sorted(Path(root).rglob(".*.tmp"))


@st.composite
def payloads(draw):
    out = {}
    for name in draw(st.lists(st.text(max_size=6), max_size=4, unique=True)):
        dtype = DTYPES[draw(st.sampled_from(sorted(DTYPES)))]
        shape = tuple(draw(st.lists(st.integers(0, 4), max_size=3)))
        n = math.prod(shape) * dtype.itemsize
        raw = draw(st.binary(min_size=n, max_size=n))  # any bits: NaN payloads, subnormals, negative zeros
        t = torch.tensor(list(raw), dtype=torch.uint8)
        t = (t & 1).bool() if dtype == torch.bool else t.view(dtype)
        t = t.reshape(shape)
        if t.dim() >= 2 and draw(st.booleans()):
            t = t.transpose(0, 1)  # not contiguous: stored in row-major order of the transposed view
        out[name] = t
    return out


# -- host tier


@settings(max_examples=60, deadline=None)
@given(payloads())
def test_host_round_trip_is_bit_exact(payload):
    tier = HostTier(1 << 20, pin_memory=False)
    assert tier.put(key(1), payload)
    assert_same_payload(tier.get(key(1)), payload)


def test_host_lru_order_and_byte_cap():
    size = 2 * 64 * 4 + 64 * 4
    tier = HostTier(3 * size, pin_memory=False)
    for i in range(3):
        tier.put(key(i), block(i))
    assert tier.get(key(0)) is not None  # 0 is now the most recently used
    assert tier.put(key(3), block(3))
    assert [tier.contains(key(i)) for i in range(4)] == [True, False, True, True]
    s = tier.stats()
    assert (s.entries, s.bytes, s.evictions, s.hits) == (3, 3 * size, 1, 1)
    assert tier.get(key(1)) is None and tier.stats().misses == 1
    assert tier.put(key(2), block(2, n=32))  # replacing an entry recounts its bytes
    assert tier.stats().bytes == 2 * size + size // 2
    assert not tier.put(key(9), block(9, n=1000)) and not tier.contains(key(9))  # larger than the whole tier
    assert tier.evict(key(0)) and not tier.evict(key(0)) and tier.stats().entries == 2


def test_host_ttl_on_an_injected_clock():
    now = [100.0]
    tier = HostTier(1 << 20, ttl_s=60, clock=lambda: now[0], pin_memory=False)
    tier.put(key(0), block(0))  # the tier's default TTL
    tier.put(key(1), block(1), ttl_s=300)  # a per-entry TTL
    now[0] = 159.9
    assert tier.get(key(0)) is not None and tier.contains(key(1))
    now[0] = 160.0
    assert tier.get(key(0)) is None and tier.contains(key(1))
    tier.put(key(0), block(0), ttl_s=10)  # a replaced entry carries its new TTL, not the old one's
    now[0] = 169.0
    assert tier.contains(key(0))
    now[0] = 400.0
    s = tier.stats()
    assert (s.entries, s.bytes, s.expirations) == (0, 0, 3)
    untimed = HostTier(1 << 20, clock=lambda: now[0], pin_memory=False)
    untimed.put(key(0), block(0))
    now[0] = 1e12
    assert untimed.get(key(0)) is not None


def test_bad_arguments_are_named():
    tier = HostTier(1 << 20, pin_memory=False)
    with pytest.raises(ValueError, match="key"):
        tier.put("abc", block(0))
    with pytest.raises(ValueError, match="key"):
        tier.put(b"", block(0))
    with pytest.raises(TypeError, match="dict"):
        tier.put(key(0), [torch.zeros(1)])
    with pytest.raises(ValueError, match="'x'.*meta"):
        tier.put(key(0), {"x": torch.zeros(1, device="meta")})
    with pytest.raises(ValueError, match="ttl_s"):
        HostTier(10, ttl_s=0)
    with pytest.raises(ValueError, match="capacity_bytes"):
        HostTier(-1)


# -- disk tier: format and validation


@settings(max_examples=60, deadline=None)
@given(payloads())
def test_disk_round_trip_is_bit_exact_and_survives_a_restart(payload):
    with tempfile.TemporaryDirectory() as d:
        assert DiskTier(d, 1 << 20, ID).put(key(7), payload)
        again = DiskTier(d, 1 << 20, ID)  # a new process's view of the directory
        assert_same_payload(again.get(key(7)), payload)
        assert again.stats().entries == 1 and not temp_files(d)


def test_directory_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("DEEPINFER_CACHE_DIR", str(tmp_path / "env"))
    tier = DiskTier(None, 1 << 20, ID)
    assert tier.root == tmp_path / "env" and tier.put(key(0), block(0)) and len(entry_files(tmp_path / "env")) == 1
    monkeypatch.delenv("DEEPINFER_CACHE_DIR")
    with pytest.raises(ValueError, match="DEEPINFER_CACHE_DIR"):
        DiskTier(None, 1 << 20, ID)


def test_disk_lru_order_and_byte_cap(tmp_path):
    probe = DiskTier(tmp_path / "probe", 1 << 20, ID)
    probe.put(key(0), block(0))
    size = probe.stats().bytes
    tier = DiskTier(tmp_path / "c", 3 * size, ID, evict_to=1.0)
    for i in range(3):
        assert tier.put(key(i), block(i))
    assert tier.get(key(0)) is not None  # a hit stamps the file as recently used
    assert tier.put(key(3), block(3))
    assert [tier.contains(key(i)) for i in range(4)] == [True, False, True, True]
    assert (tier.stats().entries, tier.stats().bytes, tier.stats().evictions) == (3, 3 * size, 1)
    assert not tier.put(key(9), block(9, n=4096))  # larger than the whole tier
    # A restart with a smaller cap evicts the oldest down to evict_to of it.
    small = DiskTier(tmp_path / "c", 2 * size, ID, evict_to=0.5)
    assert [small.contains(key(i)) for i in range(4)] == [False, False, False, True]
    assert small.stats().entries == 1


def test_existing_entry_is_not_rewritten(tmp_path):
    tier = DiskTier(tmp_path, 1 << 20, ID)
    tier.put(key(0), block(0))
    (path,) = entry_files(tmp_path)
    inode = path.stat().st_ino
    assert tier.put(key(0), block(0)) and path.stat().st_ino == inode
    DiskTier(tmp_path, 1 << 20, "another-model").put(key(0), block(5))  # a foreign entry under our name is replaced
    assert path.stat().st_ino != inode and tier.get(key(0)) is None


def _damage(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "payload bit":
        data[-1] ^= 0x10
    elif how == "header bit":
        data[PREFIX_BYTES + 3] ^= 0x01
    elif how == "checksum bit":
        data[20] ^= 0x80
    elif how == "magic":
        data[0:8] = b"NOTKVBLK"
    elif how == "header length":
        data[12:16] = struct.pack("<I", 5)
    elif how == "appended":
        data += b"\0" * 64
    elif how.startswith("truncated "):
        data = data[:int(how.split()[1])]
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["payload bit", "header bit", "checksum bit", "magic", "header length", "appended",
                                 "truncated 0", "truncated 7", "truncated 47", "truncated 60", "truncated 300",
                                 "truncated -1"])
def test_corrupt_or_truncated_entry_is_a_logged_miss_and_removed(tmp_path, caplog, how):
    tier = DiskTier(tmp_path, 1 << 20, ID)
    tier.put(key(0), block(0))
    (path,) = entry_files(tmp_path)
    _damage(path, how)
    assert tier.get(key(0)) is None
    assert not path.exists() and tier.stats().corrupt == 1
    assert len(tier_warnings(caplog)) == 1 and "corrupt" in tier_warnings(caplog)[0]
    assert tier.put(key(0), block(0)) and tier.get(key(0)) is not None  # the name is usable again


def test_entry_under_another_keys_name_is_corrupt(tmp_path):
    tier = DiskTier(tmp_path, 1 << 20, ID)
    tier.put(key(0), block(0))
    wrong = tier._files.path(key(1))
    wrong.parent.mkdir(exist_ok=True)
    wrong.write_bytes(tier._files.path(key(0)).read_bytes())
    assert tier.get(key(1)) is None and tier.stats().corrupt == 1 and not wrong.exists()


@pytest.mark.parametrize("how", ["identity", "older version", "newer version"])
def test_foreign_entry_is_a_miss_logged_once_and_kept(tmp_path, caplog, how):
    if how == "identity":
        DiskTier(tmp_path, 1 << 20, "other-model|float16|layout-1").put(key(0), block(0))
    else:  # version 1 held one block per file, hashed alike: it must never read as a version-2 run
        DiskTier(tmp_path, 1 << 20, ID).put(key(0), block(0))
        (path,) = entry_files(tmp_path)
        data = bytearray(path.read_bytes())
        data[8:12] = struct.pack("<I", 1 if how == "older version" else FORMAT_VERSION + 1)
        path.write_bytes(bytes(data))
    tier = DiskTier(tmp_path, 1 << 20, ID)
    assert tier.get(key(0)) is None and tier.get(key(0)) is None
    assert tier.stats().foreign == 2 and tier.stats().misses == 2 and len(entry_files(tmp_path)) == 1
    assert len(tier_warnings(caplog)) == 1 and "foreign" in tier_warnings(caplog)[0]


def test_other_files_in_the_directory_are_left_alone(tmp_path):
    (tmp_path / "README").write_text("mine")
    (tmp_path / "ab").mkdir()
    (tmp_path / "ab" / "notes.txt").write_text("mine too")
    tier = DiskTier(tmp_path, 1, ID)  # a cap that forces every scan to evict all it may
    tier.put(key(0), {"x": torch.zeros(0)})
    assert (tmp_path / "README").exists() and (tmp_path / "ab" / "notes.txt").exists()


# -- disk tier: temporaries, killed writers, several processes

def test_dead_temporaries_are_removed_at_start_and_live_ones_kept(tmp_path):
    DiskTier(tmp_path, 1 << 20, ID).put(key(0), block(0))
    dead = tmp_path / "00" / ".dead.123.00.tmp"
    dead.write_bytes(b"DIKVBLK\0half an entry")
    live = tmp_path / "00" / ".live.123.01.tmp"
    with open(live, "wb") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)  # as a writer in another process holds it
        DiskTier(tmp_path, 1 << 20, ID)
        assert not dead.exists() and live.exists()
    DiskTier(tmp_path, 1 << 20, ID)
    assert not live.exists() and len(entry_files(tmp_path)) == 1


_CHILD = "import sys; sys.path.insert(0, {tests!r}); import test_kv_tiers as t; t.{fn}(*sys.argv[1:])"


def _spawn(fn: str, *args) -> subprocess.Popen:
    code = _CHILD.format(tests=str(Path(__file__).parent), fn=fn)
    return subprocess.Popen([sys.executable, "-c", code, *map(str, args)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)


def _stalled_writer(directory: str, i: str) -> None:
    """Child: write block(i) but stop halfway through its temporary file, say so, and wait to be killed."""
    tier = DiskTier(directory, 1 << 30, ID)

    def half(f, chunks):
        f.write(chunks[0])  # the prefix
        f.write(chunks[1])  # the header
        f.write(chunks[2][: len(chunks[2]) // 2])  # half the first tensor
        f.flush()
        print("half written", flush=True)
        sys.stdin.read()  # the parent never writes: SIGKILL ends this
    files_mod._write_chunks = half
    tier.put(key(int(i)), block(int(i), n=4096))


def test_writer_killed_mid_entry_leaves_nothing_valid(tmp_path, caplog):
    reader = DiskTier(tmp_path, 1 << 30, ID)
    child = _spawn("_stalled_writer", tmp_path, 5)
    try:
        assert child.stdout.readline() == "half written\n"
        (tmp,) = temp_files(tmp_path)
        assert 0 < tmp.stat().st_size
        assert reader.get(key(5)) is None and not reader.contains(key(5))
        DiskTier(tmp_path, 1 << 30, ID)  # a start-up scan while the writer lives keeps its temporary
        assert tmp.exists()
    finally:
        child.kill()
        child.wait()
    assert reader.get(key(5)) is None and not entry_files(tmp_path)
    fresh = DiskTier(tmp_path, 1 << 30, ID)  # start-up removes the dead writer's temporary
    assert not temp_files(tmp_path)
    assert fresh.put(key(5), block(5, n=4096))
    assert_same_payload(reader.get(key(5)), block(5, n=4096))
    assert not tier_warnings(caplog)


def _payload_for(i: int) -> dict:
    return block(i, n=16 + 8 * (i % 7))  # sizes differ between keys


def _busy_worker(directory: str, worker: str, capacity: str) -> None:
    """Child: wait for "go", then write the shared keys and its own many times over, reading and deleting shared
    keys in between; every hit must be exactly the payload of its key. Prints its stats as JSON."""
    tier = DiskTier(directory, int(capacity), ID)
    print("ready", flush=True)
    assert sys.stdin.readline() == "go\n"
    w, bad = int(worker), 0
    for r in range(12):
        for i in [*range(8), *range(100 * (w + 1), 100 * (w + 1) + 8)]:
            tier.put(key(i), _payload_for(i))
            j = (i * 7 + r) % 8
            got = tier.get(key(j))
            if got is not None:
                try:
                    assert_same_payload(got, _payload_for(j))
                except AssertionError:
                    bad += 1
            if r % 3 == 1:
                tier.evict(key(j))  # the next round writes it again, racing the other process's reads and writes
    s = tier.stats()
    print(json.dumps({"bad": bad, "corrupt": s.corrupt, "foreign": s.foreign, "enabled": s.enabled,
                      "hits": s.hits, "evictions": s.evictions}), flush=True)


def _run_together(directory, fn: str, *args) -> list:
    """Run fn(directory, worker, *args) in two processes started together; their JSON reports, each checked
    for no bad reads, no corrupt or foreign entries and the tier still on; no temporaries left behind."""
    children = [_spawn(fn, directory, w, *args) for w in range(2)]
    try:
        for c in children:
            assert c.stdout.readline() == "ready\n"
        for c in children:  # both start together: neither has anything to read until the other is ready too
            c.stdin.write("go\n")
            c.stdin.flush()
        reports = [json.loads(c.stdout.readline()) for c in children]
    finally:
        for c in children:
            c.stdin.close()
            c.wait()
    assert [c.returncode for c in children] == [0, 0]
    for rep in reports:
        assert (rep["bad"], rep["corrupt"], rep["foreign"], rep["enabled"]) == (0, 0, 0, True), rep
    assert not temp_files(directory)
    return reports


@pytest.mark.parametrize("capacity", [1 << 30, 6000])
def test_two_processes_share_a_directory(tmp_path, capacity):
    """Same and different keys from two processes at once, with and without evictions racing reads."""
    reports = _run_together(tmp_path, "_busy_worker", capacity)
    check = DiskTier(tmp_path, 1 << 30, ID)
    for path in entry_files(tmp_path):
        i = int.from_bytes(bytes.fromhex(path.stem)[:4], "little")
        assert_same_payload(check.get(key(i)), _payload_for(i))
    assert check.stats().corrupt == 0
    if capacity == 6000:
        assert sum(r["evictions"] for r in reports) > 0
    else:
        assert len(entry_files(tmp_path)) == 24


# -- disk tier: faults turn it off with one warning


def test_unusable_directory_disables_the_tier_with_one_warning(tmp_path, caplog):
    (tmp_path / "file").write_text("a file, not a directory")
    tier = DiskTier(tmp_path / "file" / "cache", 1 << 20, ID)
    assert not tier.enabled and not tier.stats().enabled
    assert not tier.put(key(0), block(0)) and tier.get(key(0)) is None and not tier.contains(key(0))
    assert len(tier_warnings(caplog)) == 1 and "disabled" in tier_warnings(caplog)[0]


def _raise(code):
    def fail(*args, **kwargs):
        raise OSError(code, os.strerror(code))
    return fail


def test_read_only_directory_at_start_disables_the_tier(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(files_mod, "_write_chunks", _raise(errno.EROFS))  # root makes chmod ineffective
    tier = DiskTier(tmp_path, 1 << 20, ID)
    assert not tier.enabled and "Read-only" in tier.disabled_reason and not temp_files(tmp_path)
    assert not tier.put(key(0), block(0))
    assert len(tier_warnings(caplog)) == 1


@pytest.mark.parametrize("where, code", [("_write_chunks", errno.ENOSPC), ("_write_chunks", errno.EDQUOT),
                                         ("replace", errno.EROFS), ("replace", errno.EACCES)])
def test_write_fault_disables_the_tier_with_one_warning(tmp_path, caplog, monkeypatch, where, code):
    tier = DiskTier(tmp_path, 1 << 20, ID)
    tier.put(key(0), block(0))
    if where == "replace":
        monkeypatch.setattr(files_mod.os, "replace", _raise(code))
    else:
        monkeypatch.setattr(files_mod, "_write_chunks", _raise(code))
    host = HostTier(1 << 20, pin_memory=False)
    store = TieredStore(host, tier)
    store.put(key(1), block(1))  # the host tier takes it; the disk write fails
    store.put(key(2), block(2))
    assert not tier.enabled and os.strerror(code) in tier.disabled_reason
    assert len(tier_warnings(caplog)) == 1 and "disabled" in tier_warnings(caplog)[0]
    assert not temp_files(tmp_path) and len(entry_files(tmp_path)) == 1
    assert_same_payload(store.get(key(1)), block(1)) and store.get(key(0)) is None  # disk off: its entries go unseen
    monkeypatch.undo()
    assert_same_payload(DiskTier(tmp_path, 1 << 20, ID).get(key(0)), block(0))  # the directory itself is intact


def test_write_racing_a_deletion_is_a_failed_put_not_a_fault(tmp_path, monkeypatch):
    tier = DiskTier(tmp_path, 1 << 20, ID)
    monkeypatch.setattr(files_mod.os, "replace", _raise(errno.ENOENT))
    assert not tier.put(key(0), block(0)) and tier.enabled and not temp_files(tmp_path)


# -- the store


def test_store_host_then_disk_with_promotion_and_ttl(tmp_path):
    now = [0.0]
    store = TieredStore(HostTier(1 << 20, clock=lambda: now[0], pin_memory=False), DiskTier(tmp_path, 1 << 20, ID))
    store.put(key(0), block(0))  # global KV: both tiers
    store.put(key(1), block(1), host_ttl=120, to_disk=False)  # encoder SWA KV: host only, with a TTL
    assert store.disk.contains(key(0)) and not store.disk.contains(key(1))
    assert_same_payload(store.get(key(1)), block(1))
    now[0] = 120.0
    assert store.get(key(1)) is None and not store.contains(key(1))
    # A restart: the host pool is empty, the disk entry is found there and promoted.
    again = TieredStore(HostTier(1 << 20, pin_memory=False), DiskTier(tmp_path, 1 << 20, ID))
    assert_same_payload(again.get(key(0)), block(0))
    assert again.host.contains(key(0))
    assert_same_payload(again.get(key(0)), block(0))
    s = again.stats()
    assert (s.host_hits, s.disk_hits, s.misses, s.disk.hits) == (1, 1, 0, 1)
    assert again.evict(key(0)) and not again.contains(key(0)) and again.get(key(0)) is None
    assert again.stats().misses == 1
    host_only = TieredStore(HostTier(1 << 20, pin_memory=False), None)
    host_only.put(key(3), block(3))
    assert_same_payload(host_only.get(key(3)), block(3)) and host_only.stats().disk is None


# -- runs: consecutive blocks of a chain as one entry, found from any member


def members(first: int, n: int) -> tuple:
    return tuple(key(first + i) for i in range(n))


def run_payload(first: int, n: int) -> dict:
    """Block first+i's rows are row i: each block's bytes depend on its own number only (the oracle below)."""
    return {"k": torch.stack([block(first + i)["k"] for i in range(n)]),
            "v": torch.stack([block(first + i)["v"] for i in range(n)])}


def assert_block(run, i: int) -> None:
    """run holds block i at its position: the run's row equals block(i), built independently."""
    assert run is not None and run.members[run.position] == key(i)
    assert_same_payload({name: t[run.position] for name, t in run.payload.items()}, block(i))


def test_host_runs_are_found_from_any_member_and_dropped_whole():
    size = 10 * (2 * 64 * 4 + 64 * 4)
    tier = HostTier(2 * size, pin_memory=False)
    assert tier.put(key(0), run_payload(0, 10), members=members(0, 10))
    assert tier.put(key(20), run_payload(20, 10), members=members(20, 10))
    for i in (0, 4, 9, 20, 29):
        assert_block(tier.find(key(i)), i)
    assert tier.find(key(10)) is None and tier.held([key(3), key(10), key(25)]) == [True, False, True]
    assert tier.find(key(5)) is not None  # run 0 is now the most recently used: run 20 goes first
    assert tier.put(key(40), run_payload(40, 10), members=members(40, 10))
    assert all(tier.find(key(i)) is None for i in range(20, 30))  # evicting a run drops every member
    assert tier.stats().entries == 2 and tier.stats().bytes == 2 * size and tier.stats().evictions == 1
    assert tier.evict(key(40)) and tier.find(key(45)) is None
    assert_same_payload(tier.get(key(0)), run_payload(0, 10))  # get by the run's key returns the whole run


def test_bad_runs_are_named():
    tier = HostTier(1 << 20, pin_memory=False)
    with pytest.raises(ValueError, match="start with its key"):
        tier.put(key(1), run_payload(0, 3), members=members(0, 3))
    with pytest.raises(ValueError, match="dim 0"):
        tier.put(key(0), run_payload(0, 2), members=members(0, 3))
    with pytest.raises(ValueError, match="distinct"):
        tier.put(key(0), run_payload(0, 2), members=(key(0), key(0)))
    with pytest.raises(ValueError, match="length"):
        tier.put(key(0), run_payload(0, 2), members=(key(0), b"short"))


def test_disk_runs_survive_a_restart_indexed_from_the_file_heads(tmp_path, monkeypatch):
    DiskTier(tmp_path, 1 << 30, ID).put(key(0), run_payload(0, 10), members=members(0, 10))
    DiskTier(tmp_path, 1 << 30, ID).put(key(50), block(50))  # a plain entry beside it
    reads = []
    real = files_mod.EntryFiles.opened
    monkeypatch.setattr(files_mod.EntryFiles, "opened", lambda self, path: reads.append(path) or real(self, path))
    again = DiskTier(tmp_path, 1 << 30, ID)
    assert not reads and again.stats().indexed == 10  # start-up read heads only
    for i in (9, 0, 5):
        assert_block(again.find(key(i)), i)
    assert len(reads) == 3 and again.find(key(10)) is None and again.find(key(50)) is None
    assert_same_payload(again.get(key(50)), block(50))


def test_a_live_reader_learns_other_processes_runs_at_its_next_scan(tmp_path):
    now = [0.0]
    reader = DiskTier(tmp_path, 1 << 30, ID, rescan_s=10, clock=lambda: now[0])
    DiskTier(tmp_path, 1 << 30, ID).put(key(0), run_payload(0, 10), members=members(0, 10))  # another process
    assert_block(reader.find(key(0)), 0)  # a run's first block: found by its file name at once
    DiskTier(tmp_path, 1 << 30, ID).put(key(20), run_payload(20, 10), members=members(20, 10))
    now[0] = 9.9
    assert reader.find(key(25)) is None  # mid-run, not indexed, the last scan too recent
    now[0] = 10.0
    assert_block(reader.find(key(25)), 25)  # the miss rescanned the directory
    with pytest.raises(ValueError, match="rescan_s"):
        DiskTier(tmp_path, 1 << 30, ID, rescan_s=-1)


def test_store_puts_in_each_tier_only_the_blocks_it_lacks(tmp_path):
    store = TieredStore(HostTier(1 << 20, pin_memory=False), DiskTier(tmp_path, 1 << 30, ID))
    store.put_run(members(0, 10), run_payload(0, 10))
    (first,) = entry_files(tmp_path)
    inode = first.stat().st_ino
    store.host.evict(key(0))
    # A chain whose head (0..3) is held and whose tail (100..105) is new, as after a hit that went on.
    chain = members(0, 4) + members(100, 6)
    payload = {n: torch.cat([run_payload(0, 4)[n], run_payload(100, 6)[n]]) for n in ("k", "v")}
    store.put_run(chain, payload)
    assert first.stat().st_ino == inode and len(entry_files(tmp_path)) == 2  # the long run is not replaced
    assert DiskTier(tmp_path, 1 << 30, ID).find(key(100)).members == members(100, 6)  # the tail, its own run
    assert store.host.find(key(100)).position == 4 and store.host.find(key(0)).members == chain  # host lacked all
    for i in (*range(10), *range(100, 106)):
        assert_block(store.find(key(i)), i)
    fresh = TieredStore(HostTier(1 << 20, pin_memory=False), DiskTier(tmp_path, 1 << 30, ID))
    assert_block(fresh.find(key(7)), 7)  # a disk hit, not promoted: its blocks go back to the device
    assert fresh.host.find(key(2)) is None and fresh.stats().disk_hits == 1
    assert_block(fresh.find(key(2)), 2)  # read from disk again
    assert fresh.stats().disk_hits == 2


def _run_writer(directory: str, worker: str) -> None:
    """Child: wait for "go", then write runs under shared names (every run starts at a block 0..39) whose
    other blocks differ between the processes (worker w's chain from block f goes on with 1000 w + f + 1, ...),
    cut at points that differ between rounds, evicting some, and look blocks of both chains up: every hit
    must hold the block's own bytes at the position found. Prints its stats as JSON."""
    tier = DiskTier(directory, 1 << 30, ID)
    print("ready", flush=True)
    assert sys.stdin.readline() == "go\n"
    w, bad, found = int(worker), 0, 0
    for r in range(6):
        cut = 3 + (r + w) % 5
        for first in range(0, 40, cut):
            ids = [first] + [1000 * w + first + j for j in range(1, min(cut, 40 - first))]
            payload = {n: torch.stack([block(i)[n] for i in ids]) for n in ("k", "v")}
            tier.put(key(first), payload, members=[key(i) for i in ids])
            for i in ((first * 7 + r) % 40, 1000 * (1 - w) + (first * 3 + w) % 40, 1000 * w + first + 1):
                run = tier.find(key(i))
                if run is not None:
                    found += 1
                    try:
                        assert_block(run, i)
                    except AssertionError:
                        bad += 1
            if r % 2:
                tier.evict(key((first * 5) % 40))
    s = tier.stats()
    print(json.dumps({"bad": bad, "found": found, "corrupt": s.corrupt, "foreign": s.foreign,
                      "enabled": s.enabled}), flush=True)


def test_two_processes_write_and_find_runs_in_one_directory(tmp_path):
    reports = _run_together(tmp_path, "_run_writer")
    assert all(rep["found"] > 0 for rep in reports)
    check = DiskTier(tmp_path, 1 << 30, ID)  # a restart: every indexed member reads as its own block
    assert check.stats().indexed > 0
    for i in (*range(40), *range(1000, 1040)):
        run = check.find(key(i))
        if run is not None:
            assert_block(run, i)
    assert check.stats().corrupt == 0


def _stalled_run_writer(directory: str) -> None:
    """Child: write a 64-block run but stop halfway through its payload, say so, and wait to be killed."""
    tier = DiskTier(directory, 1 << 30, ID)

    def half(f, chunks):
        for c in chunks[:3]:  # prefix, header, members
            f.write(c)
        f.write(chunks[3][: len(chunks[3]) // 2])
        f.flush()
        print("half written", flush=True)
        sys.stdin.read()
    files_mod._write_chunks = half
    tier.put(key(0), run_payload(0, 64), members=members(0, 64))


def test_run_writer_killed_mid_entry_leaves_nothing_any_member_finds(tmp_path, caplog):
    child = _spawn("_stalled_run_writer", tmp_path)
    try:
        assert child.stdout.readline() == "half written\n"
        reader = DiskTier(tmp_path, 1 << 30, ID)  # its start-up scan sees only the live writer's temporary
        assert reader.stats().indexed == 0 and all(reader.find(key(i)) is None for i in (0, 1, 63))
    finally:
        child.kill()
        child.wait()
    fresh = DiskTier(tmp_path, 1 << 30, ID)
    assert not temp_files(tmp_path) and fresh.stats().indexed == 0 and fresh.find(key(5)) is None
    assert not tier_warnings(caplog)

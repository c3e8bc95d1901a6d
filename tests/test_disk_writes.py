"""The disk tier's background write queue (core/kv_tiers/disk_writes.py): a queued run is found and counted as
held until its file is written, writes go in order, a full queue makes put wait, a failing write is logged
and the queue goes on; through TieredStore, a run is never queued twice and lands on disk after drain."""

from __future__ import annotations

import hashlib
import threading

import pytest
import torch

from deepinfer.core.kv_tiers import DiskTier, DiskWrites, TieredStore


def key(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


def run(first: int, n: int):
    members = [key(first + j) for j in range(n)]
    payload = {"k": torch.arange(first, first + n, dtype=torch.float32).repeat_interleave(6).reshape(n, 2, 3)}
    return members, payload


class GatedDisk:
    """A disk tier stand-in whose writes wait for ``gate`` and are logged in order."""

    def __init__(self, fail_first: bool = False):
        self.gate, self.log, self.fail_first = threading.Event(), [], fail_first

    def put(self, k, payload, members=()):
        self.gate.wait()
        if self.fail_first and not self.log:
            self.log.append(("failed", k))
            raise RuntimeError("disk on fire")
        self.log.append(("wrote", k))
        return True


def test_a_queued_run_is_found_and_held_until_written():
    disk = GatedDisk()
    writes = DiskWrites(disk)
    members, payload = run(0, 4)
    writes.put(members[0], payload, members)
    got = writes.find(members[2])
    assert got is not None and got.position == 2 and got.members == tuple(members)
    assert torch.equal(got.payload["k"][2], payload["k"][2])
    assert writes.held(members + [key(99)]) == [True] * 4 + [False]
    assert writes.pending_bytes == payload["k"].numel() * 4
    disk.gate.set()
    writes.drain()
    assert disk.log == [("wrote", members[0])]
    assert writes.find(members[2]) is None and writes.held(members) == [False] * 4 and writes.pending_bytes == 0


def test_writes_go_in_order_and_a_full_queue_makes_put_wait():
    disk = GatedDisk()
    (m1, p1), (m2, p2) = run(0, 3), run(10, 3)
    writes = DiskWrites(disk, max_pending_bytes=p1["k"].numel() * 4)  # one run fits
    writes.put(m1[0], p1, m1)
    events = []

    def second():
        writes.put(m2[0], p2, m2)  # over the cap until the first is written
        events.append(("put returned", len(disk.log)))

    t = threading.Thread(target=second)
    t.start()
    disk.gate.set()
    t.join()
    writes.drain()
    assert disk.log == [("wrote", m1[0]), ("wrote", m2[0])]
    assert events == [("put returned", events[0][1])] and events[0][1] >= 1  # the first write was done by then


def test_a_failing_write_is_logged_and_the_queue_goes_on(caplog):
    disk = GatedDisk(fail_first=True)
    writes = DiskWrites(disk)
    (m1, p1), (m2, p2) = run(0, 2), run(10, 2)
    writes.put(m1[0], p1, m1)
    writes.put(m2[0], p2, m2)
    disk.gate.set()
    writes.drain()
    assert disk.log == [("failed", m1[0]), ("wrote", m2[0])]
    assert writes.errors == 1 and writes.written == 1 and "background write" in caplog.text
    assert writes.find(m1[0]) is None  # not served from the queue after the failure either


def test_a_malformed_run_fails_at_put():
    writes = DiskWrites(GatedDisk())
    members, payload = run(0, 3)
    with pytest.raises(ValueError, match="members must start with its key"):
        writes.put(key(50), payload, members)
    with pytest.raises(ValueError, match="dim 0"):
        writes.put(members[0], payload, members[:2])
    assert writes.pending_bytes == 0 and writes.held(members) == [False] * 3


def test_store_queues_a_run_once_and_it_lands_on_disk(tmp_path):
    disk = DiskTier(tmp_path, 1 << 30, "writes-test")
    store = TieredStore(None, disk, DiskWrites(disk))
    members, payload = run(0, 5)
    store.put_run(members, payload)
    assert store.disk_held(members) == [True] * 5  # queued or written
    found = store.find(members[3])
    assert found is not None and torch.equal(found.payload["k"][found.position], payload["k"][3])
    store.put_run(members, payload)  # again: held, so not queued again
    store.drain()
    assert disk.stats().writes == 1
    fresh = DiskTier(tmp_path, 1 << 30, "writes-test")
    again = fresh.find(members[4])
    assert again is not None and torch.equal(again.payload["k"][again.position], payload["k"][4])

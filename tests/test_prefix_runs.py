"""Runs in the prefix cache's slower tiers (core/kv_offload.py, core/prefix_cache.py over core/kv_tiers): the
blocks an eviction moves are grouped into chains, stored as one entry per run, and found again from any of
their blocks. No model: a PrefixCache over a BlockPool and CPU cache tensors laid out as the Llama family's
(block dim 1) and CED's (block dim 0), whose blocks are filled with bytes an oracle records per prefix of
tokens (a dict, sharing no code with the tiers or the hashing)."""

from __future__ import annotations

import random
import tempfile

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer.core.kv_cache import BlockPool
from deepinfer.core.kv_offload import BlockMover, chain_runs
from deepinfer.core.kv_tiers import DiskTier, HostTier, TieredStore
from deepinfer.core.prefix_cache import PrefixCache, block_hashes, root_key

BS = 2  # tokens per block


class _Seq:
    def __init__(self, tokens, root=root_key("runs-test")):
        self.token_ids, self.cache_root = tokens, root
        self.block_hashes, self.block_table, self.num_committed_blocks = [], [], 0


def computed(prefix: tuple) -> tuple:
    """The KV a block 'computes' to: a function of the whole token prefix up to its end, as real KV is."""
    rng = random.Random(repr(prefix))
    kv = torch.tensor([rng.random() for _ in range(2 * BS * 3)]).reshape(2, BS, 3)
    ik = torch.tensor([rng.randrange(256) for _ in range(5)], dtype=torch.uint8)
    return kv, ik


def hashes_of(tokens: list) -> list:
    return block_hashes(_Seq(tokens).cache_root, tokens, BS)


class Rig:
    """A prefix cache over CPU cache tensors: 'kv' [2, slots, 3] (block dim 1, BS rows a block) and 'ik'
    [blocks, 5] of uint8 (block dim 0, one row a block). ``known`` holds every token prefix (a tuple, a whole
    number of blocks) whose last block was computed; its bytes are ``computed(prefix)``."""

    def __init__(self, num_blocks: int, host_bytes: int | None, directory: str | None, max_run_blocks=1024,
                 identity="runs-test"):
        self.kv = torch.zeros(2, num_blocks * BS, 3, dtype=torch.float32)
        self.ik = torch.zeros(num_blocks, 5, dtype=torch.uint8)
        self.views = [("kv", self.kv, 1, BS), ("ik", self.ik, 0, 1)]
        self.store = TieredStore(None if host_bytes is None else HostTier(host_bytes, pin_memory=False),
                                 None if directory is None else DiskTier(directory, 1 << 30, identity))
        self.pool = BlockPool(num_blocks)
        self.mover = BlockMover(self.views, self.store, "cpu", max_run_blocks=max_run_blocks)
        self.cache = PrefixCache(self.pool, BS, self.mover)
        self.known: set = set()

    def serve(self, tokens: list) -> list:
        """Admit a prompt as the engine does: look up all but its last token (checking every hit block's bytes
        against ``computed``), compute the rest of its full blocks, register them and free them all. Returns
        the hit's blocks."""
        seq = _Seq(tokens)
        hit = self.cache.lookup(seq, len(tokens) - 1)
        for j, b in enumerate(hit):
            kv, ik = computed(tuple(tokens[:(j + 1) * BS]))
            got_kv, got_ik = self.kv[:, b * BS:(b + 1) * BS], self.ik[b]
            assert torch.equal(got_kv, kv) and torch.equal(got_ik, ik), f"block {j} of the hit holds other bytes"
        seq.block_table = hit + self.pool.allocate(len(tokens) // BS - len(hit))
        for j in range(len(hit), len(seq.block_table)):
            prefix = tuple(tokens[:(j + 1) * BS])
            b = seq.block_table[j]
            self.kv[:, b * BS:(b + 1) * BS], self.ik[b] = computed(prefix)
            self.known.add(prefix)
        self.cache.commit(seq, len(tokens))
        self.pool.free(seq.block_table)
        return hit

    def evict(self, n: int | None = None, flush: bool = True) -> None:
        """Allocate (and free) n blocks, or all free ones: the oldest cached free blocks go to the tiers."""
        got = self.pool.allocate(self.pool.num_free if n is None else min(n, self.pool.num_free))
        self.pool.free(got)
        if flush:
            self.mover.flush(wait=True)

    def longest_known(self, tokens: list) -> int:
        """Blocks of the longest computed prefix a lookup may take (it leaves the prompt's last token)."""
        n = 0
        while (n + 1) * BS <= len(tokens) - 1 and tuple(tokens[:(n + 1) * BS]) in self.known:
            n += 1
        return n


# ----------------------------------------------------------------------------------------------------------
# Grouping evicted blocks into runs.

@st.composite
def forests(draw):
    """(items in eviction order, cap): blocks of a few trees of chains (shared prefixes that fork)."""
    n = draw(st.integers(1, 30))
    parents = [None]
    for i in range(1, n):
        parents.append(draw(st.one_of(st.none(), st.integers(0, i - 1))))
    order = draw(st.permutations(range(n)))
    keep = draw(st.lists(st.booleans(), min_size=n, max_size=n))  # some blocks are not in the batch
    items = [(f"h{i}".encode(), 100 + i, None if parents[i] is None else f"h{parents[i]}".encode())
             for i in order if keep[i] or i == order[0]]
    return items, draw(st.integers(1, 6))


@settings(max_examples=300, deadline=None)
@given(forests())
def test_chain_runs_cover_every_block_once_as_chains_that_cannot_be_joined(case):
    items, cap = case
    runs = chain_runs(items, cap)
    flat = [it for run in runs for it in run]
    assert sorted(flat) == sorted(items)
    parent = {h: p for h, _, p in items}
    run_of = {it[0]: (r, i) for r, run in enumerate(runs) for i, it in enumerate(run)}
    for run in runs:
        assert 1 <= len(run) <= cap
        for a, b in zip(run, run[1:]):
            assert parent[b[0]] == a[0], "a run is a chain: each block's parent comes right before it"
        p = parent[run[0][0]]
        if p in run_of:  # the run could have continued its parent's: only a full run or a sibling stops it
            r, i = run_of[p]
            assert i == len(runs[r]) - 1 and len(runs[r]) == cap or i < len(runs[r]) - 1


def test_a_batch_of_one_chain_is_one_run_in_chain_order_whatever_the_eviction_order():
    items = [(b"h%d" % i, i, b"h%d" % (i - 1) if i else None) for i in range(10)]
    shuffled = items[::-1]
    assert chain_runs(shuffled, 100) == [items]
    assert chain_runs(shuffled, 4) == [items[:4], items[4:8], items[8:]]


# ----------------------------------------------------------------------------------------------------------
# The prefix cache over runs.

def test_an_evicted_prompt_is_one_run_found_from_any_block_and_partly_matching_prompts(tmp_path):
    rig = Rig(num_blocks=16, host_bytes=None, directory=str(tmp_path))
    a = list(range(100, 121))  # 21 tokens: 10 cacheable blocks
    rig.serve(a)
    rig.evict()
    assert rig.mover.runs_saved == 1 and rig.mover.saved == 10
    assert len(list(tmp_path.rglob("*.kvb"))) == 1
    # A prompt sharing the first 6 blocks: the run covers more than it needs; it takes what matches.
    b = a[:12] + [7, 7, 7, 7, 7]
    assert len(rig.serve(b)) == 6
    # The first 6 blocks are back on the device; a lookup of the whole prompt continues mid-run at block 6.
    fetched = []
    find = rig.store.find
    rig.store.find = lambda h: fetched.append(h) or find(h)
    assert len(rig.serve(a)) == 10
    assert fetched == [hashes_of(a)[6]]  # one entry read, from its seventh block
    assert rig.cache.summary()["tier_hit_blocks"] == 6 + 4


def test_a_run_already_held_is_not_written_again_and_a_new_tail_is_its_own_run(tmp_path):
    rig = Rig(num_blocks=16, host_bytes=1 << 20, directory=str(tmp_path))
    a = list(range(100, 121))
    rig.serve(a)
    rig.evict()
    files = sorted(tmp_path.rglob("*.kvb"))
    inodes = [f.stat().st_ino for f in files]
    assert rig.serve(a) and rig.cache.summary()["tier_hit_blocks"] == 10
    c = a[:8] + list(range(300, 313))  # 4 blocks shared, then 6 new ones (21 tokens: 10 blocks)
    assert len(rig.serve(c)) == 4
    rig.evict()  # a's blocks again (held: stamped, not rewritten) and c's 6 new blocks: one new run
    now = sorted(tmp_path.rglob("*.kvb"))
    assert len(now) == 2 and [f.stat().st_ino for f in now if f in files] == inodes
    restarted = Rig(num_blocks=16, host_bytes=None, directory=str(tmp_path))
    assert len(restarted.serve(c)) == 10 and len(restarted.serve(a)) == 10


def test_runs_are_capped_and_a_lookup_crosses_from_run_to_run(tmp_path):
    rig = Rig(num_blocks=16, host_bytes=1 << 20, directory=str(tmp_path), max_run_blocks=3)
    a = list(range(100, 121))
    rig.serve(a)
    rig.evict()
    assert rig.mover.runs_saved == 4 and len(list(tmp_path.rglob("*.kvb"))) == 4
    assert len(rig.serve(a)) == 10


def test_a_large_eviction_is_gathered_in_pieces_of_max_gather_bytes(tmp_path, monkeypatch):
    from deepinfer.core import kv_offload

    rig = Rig(num_blocks=12, host_bytes=1 << 20, directory=str(tmp_path), max_run_blocks=3)
    monkeypatch.setattr(kv_offload, "MAX_GATHER_BYTES", 2 * rig.mover.block_bytes)  # one 3-block run is over it
    gathers = []
    inner = rig.mover._save_runs
    monkeypatch.setattr(rig.mover, "_save_runs", lambda runs: (gathers.append(len(runs)), inner(runs)))
    a, b = list(range(100, 113)), list(range(200, 211))  # 6 and 5 blocks
    rig.serve(a)
    rig.serve(b)
    rig.evict()
    assert sum(gathers) == 4 and max(gathers) == 1  # runs 3+3 and 3+2, one run per gather
    assert rig.mover.saved == 11 and len(rig.serve(a)) == 6 and len(rig.serve(b)) == 5  # bytes checked


def test_evictions_of_one_chain_between_two_flushes_are_joined_into_one_run(tmp_path):
    rig = Rig(num_blocks=10, host_bytes=1 << 20, directory=str(tmp_path), max_run_blocks=8)
    a = list(range(100, 121))  # 10 blocks, freed in chain order: evicted oldest (first) block first
    rig.serve(a)
    held = [rig.pool.allocate(1) for _ in range(10)]  # one block per allocation, as decode steps evict
    assert len(rig.mover.pending) == 10
    rig.mover.flush(wait=True)
    rig.pool.free([b for (b,) in held])
    assert (rig.mover.runs_saved, rig.mover.saved) == (2, 10)  # 8 joined (the cap), then 2
    assert len(list(tmp_path.rglob("*.kvb"))) == 2
    assert len(rig.serve(a)) == 10  # bytes checked


def test_a_restart_finds_runs_by_any_member_and_a_corrupt_run_is_a_miss_for_all(tmp_path, caplog):
    rig = Rig(num_blocks=16, host_bytes=None, directory=str(tmp_path))
    a = list(range(100, 121))
    rig.serve(a)
    rig.evict()
    hashes = hashes_of(a)
    for start in (0, 3, 9):  # a restarted engine finds the run from any of its blocks
        fresh = Rig(num_blocks=16, host_bytes=None, directory=str(tmp_path))
        assert fresh.store.disk.stats().indexed == 10
        got = fresh.mover.fetch(hashes[start:])
        assert [(s, n) for _, s, n in got] == [(start, 10 - start)]
        assert len(fresh.serve(a[:2 * start + 2] + [0])) == start + 1  # and serves it, bytes checked
    (path,) = tmp_path.rglob("*.kvb")
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x40
    path.write_bytes(bytes(data))
    damaged = Rig(num_blocks=16, host_bytes=None, directory=str(tmp_path))
    for h in hashes[::-1]:  # from any member, last or first: a miss, never served
        assert damaged.mover.find(h) is None
    assert damaged.store.disk.stats().corrupt == 1 and not path.exists()
    assert damaged.store.disk.stats().indexed == 0


def test_a_file_replaced_by_another_run_under_the_same_name_is_a_miss_for_the_blocks_it_lost(tmp_path):
    one = Rig(num_blocks=16, host_bytes=None, directory=str(tmp_path))
    a = list(range(100, 121))
    one.serve(a)
    reader = Rig(num_blocks=16, host_bytes=None, directory=str(tmp_path))  # started before the run exists
    one.evict()
    two = Rig(num_blocks=16, host_bytes=None, directory=str(tmp_path))  # indexes a's run at start
    # Another engine writes a run starting at the same block whose chain leaves a's after it: the same
    # positions hold other blocks. Its file replaces a's (a rename, as any writer's).
    other = Rig(num_blocks=16, host_bytes=None, directory=str(tmp_path / "elsewhere"))
    other.serve(a[:2] + [7] * 19)
    other.evict()
    (src,) = (tmp_path / "elsewhere").rglob("*.kvb")
    (dst,) = [p for p in tmp_path.glob("??/*.kvb")]
    assert src.name == dst.name
    tmp = dst.with_name(".replace.tmp")
    tmp.write_bytes(src.read_bytes())
    tmp.replace(dst)
    hashes = hashes_of(a)
    assert two.mover.find(hashes[5]) is None  # indexed at start at position 5, which now holds another block
    assert [(s, n) for _, s, n in two.mover.fetch(hashes)] == [(0, 1)]
    # The reader started before any run existed: it finds the run from its first block, by name.
    assert [(s, n) for _, s, n in reader.mover.fetch(hashes)] == [(0, 1)]
    assert len(two.serve(a)) == 1 and len(reader.serve(a[:2] + [7] * 19)) == 10


@pytest.mark.parametrize("host, disk", [(True, False), (False, True), (True, True)])
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_hits_always_hold_the_bytes_written_and_nothing_stored_is_lost(host, disk, data):
    """Prompts sharing prefixes, served and evicted in drawn batches and orders; every hit block holds the bytes
    its prefix was computed with (the oracle), and with roomy tiers every block ever computed is found."""
    with tempfile.TemporaryDirectory() as d:
        cap = data.draw(st.sampled_from([2, 5, 1024]), label="max_run_blocks")
        rig = Rig(num_blocks=12, host_bytes=1 << 20 if host else None, directory=d if disk else None,
                  max_run_blocks=cap)
        stems = [[1, 2, 3, 4], [1, 2, 9, 9], [5, 6]]
        for _ in range(data.draw(st.integers(1, 8), label="prompts")):
            stem = data.draw(st.sampled_from(stems))
            tail = data.draw(st.lists(st.integers(1, 4), max_size=14))
            tokens = stem + tail + [0]
            want = rig.longest_known(tokens)
            assert len(rig.serve(tokens)) == want  # serve checks every hit block's bytes
            how = data.draw(st.sampled_from(["none", "some", "all", "pending", "drip"]))
            if how == "drip":  # a block per allocation (decode-like), joined into runs at the flush
                held = [rig.pool.allocate(1) for _ in range(data.draw(st.integers(1, rig.pool.num_free)))]
                rig.mover.flush(wait=True)
                rig.pool.free([b for (b,) in held])
            elif how == "some":
                rig.evict(data.draw(st.integers(1, 12)))
            elif how == "all":
                rig.evict()
            elif how == "pending":  # evicted, not stored yet: found among the pending runs
                rig.evict(flush=False)

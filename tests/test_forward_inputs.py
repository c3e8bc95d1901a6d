"""The step's model inputs: the device-side builder (persistent block tables, gathers on the device) against
the host-side one (build_inputs, the oracle), and the stream layout of a mixed step (decode rows first,
every sampling row mapped to its own last token). Block tables are synced incrementally across steps in
which sequences grow, finish, are preempted and give their slots to others."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings, strategies as st

from deepinfer.core.block_tables import BlockTables
from deepinfer.core.params import SamplingParams
from deepinfer.core.state import ScheduledBatch, Sequence
from deepinfer.core.inputs import build_inputs, device_inputs, plan

FIELDS = ("positions", "slot_mapping", "seq_lens", "q_index", "q_valid", "kv_slots", "q_pos", "block_table", "cu_q")


def _seq(i, n_tokens, slot, blocks):
    return Sequence(seq_id=i, request_id=str(i), index=0, token_ids=list(range(3, 3 + n_tokens)),
                    num_prompt_tokens=n_tokens, params=SamplingParams(), arrival=i, block_table=blocks, state_slot=slot)


@settings(max_examples=40, deadline=None)
@given(steps=st.lists(st.lists(st.tuples(st.integers(0, 60), st.integers(1, 12), st.booleans()), min_size=1,
                               max_size=6), min_size=1, max_size=4),
       block_size=st.sampled_from([1, 4, 16]), seed=st.integers(0, 2**16))
def test_device_inputs_match_the_host_oracle(steps, block_size, seed):
    rng = random.Random(seed)
    max_seqs, max_blocks = 8, 80
    tables = BlockTables(max_seqs, max_blocks, "cpu")
    free_blocks = list(range(400))
    rng.shuffle(free_blocks)
    for rows in steps:  # each step: fresh sequences in random slots (a slot changing hands between steps)
        slots = rng.sample(range(max_seqs), len(rows))
        seqs, starts, nums, samples = [], [], [], []
        for i, ((prefix, n, smp), slot) in enumerate(zip(rows, slots)):
            nb = -(-(prefix + n) // block_size)
            blocks, free_blocks = free_blocks[:nb], free_blocks[nb:] + free_blocks[:nb]
            seqs.append(_seq(i, prefix + n, slot, list(blocks)))
            starts.append(prefix)
            nums.append(n)
            samples.append(smp)
        batch = ScheduledBatch(seqs=seqs, num_tokens=nums, start=starts, samples=samples)
        tables.sync(seqs)
        inp = plan(batch, block_size, "cpu")
        ids_h, meta_h, q_h = build_inputs(batch, inp.rows, block_size, torch.device("cpu"))
        ids_d, meta_d, q_d = device_inputs(batch, inp.rows, block_size, tables)
        assert q_h == q_d and torch.equal(ids_h, ids_d)
        for f in FIELDS:
            assert torch.equal(getattr(meta_h, f), getattr(meta_d, f)), f
        # The layout: decode rows (one token, sampling) lead; each sampling row reads its own last token.
        dec = [i for i in range(len(rows)) if nums[i] == 1 and samples[i]]
        assert inp.rows[:inp.num_decodes] == dec and sorted(inp.rows) == list(range(len(rows)))
        want = [inp.qstart[inp.rows.index(i) + 1] - 1 for i in range(len(rows)) if samples[i]]
        assert inp.sample_index == want


def test_sync_writes_only_what_changed():
    tables = BlockTables(4, 10, "cpu")
    a = _seq(0, 5, 2, [7, 3])
    tables.sync([a])
    assert tables.table[2, :2].tolist() == [7, 3]
    tables.table[2, 0] = -1  # a sentinel: an incremental sync must not rewrite entries it already wrote
    a.block_table.append(9)
    tables.sync([a])
    assert tables.table[2, :3].tolist() == [-1, 3, 9]
    a.block_table = [4]  # preempted and re-admitted: a new list, so the whole row is rewritten
    tables.sync([a])
    assert tables.table[2, :1].tolist() == [4]
    b = _seq(1, 5, 2, [5, 6, 8])  # the slot changes hands
    tables.sync([b])
    assert tables.table[2, :3].tolist() == [5, 6, 8]


_INT64 = st.integers(-2**63, 2**63 - 1)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(data=st.one_of(st.lists(_INT64, max_size=40),
                      st.integers(1, 4).flatmap(lambda n: st.lists(st.lists(_INT64, min_size=n, max_size=n),
                                                                   max_size=5)),
                      st.lists(st.booleans(), max_size=20),
                      st.lists(st.floats(-1e6, 1e6, allow_nan=False), max_size=20)),
       dtype=st.sampled_from([torch.int64, torch.int32, torch.bool, torch.float32]))
def test_host_tensor_is_torch_tensor(data, dtype):
    """layout.host_tensor (numpy's conversion: 3.5x faster on long id lists) gives torch.tensor's values, dtype and
    shape for the lists the engine hands it: ints over all of int64, rectangular nests, bools, floats into any of
    its dtypes (truncated toward zero into ints). Values an int32 cannot hold go to torch's own conversion."""
    from deepinfer.layout import host_tensor

    try:
        want = torch.tensor(data, dtype=dtype)
    except (RuntimeError, OverflowError) as e:  # torch refuses: host_tensor refuses too
        with pytest.raises(type(e)):
            host_tensor(data, dtype)
        return
    got = host_tensor(data, dtype)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got, want)


def test_host_tensor_refuses_what_torch_refuses():
    """Ragged nests and None reach torch.tensor, whose error names them."""
    from deepinfer.layout import host_tensor

    for bad in ([[1, 2], [3]], [1, None]):
        with pytest.raises((TypeError, ValueError, RuntimeError)):
            torch.tensor(bad, dtype=torch.long)
        with pytest.raises((TypeError, ValueError, RuntimeError)):
            host_tensor(bad, torch.long)

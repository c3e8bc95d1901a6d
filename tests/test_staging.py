"""staging.Staging: reused pinned buffers for the step's index-list copy. On the CPU the buffers are unpinned and
the events are stand-ins whose completion the test decides, so the reuse rule (never rewrite a buffer whose copy
may still be queued; never wait) is checked without a GPU."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from deepinfer import staging
from deepinfer.models.ced import engine_path as ep


class Ev:
    """A copy's completion marker: done when the test says so."""

    def __init__(self, log):
        self.done = False
        log.append(self)

    def record(self):
        pass

    def query(self):
        return self.done


def make(slots=2):
    log = []
    return staging.Staging("cpu", slots=slots, event=lambda: Ev(log), pin=False), log


def test_copies_hold_the_values_and_reuse_a_buffer_only_after_its_copy_ran():
    s, log = make(slots=2)
    a = s.copy([np.arange(2), np.arange(2, 5)])  # joined end to end
    b = s.copy([np.arange(10, 13)])
    assert a.tolist() == list(range(5)) and b.tolist() == [10, 11, 12]
    first = s.slots[0][0].data_ptr()
    # both buffers in flight: a one-off copy, which leaves both untouched
    c = s.copy([np.array([7, 8])])
    assert c.tolist() == [7, 8] and s.fresh == 1
    assert s.slots[0][0][:5].tolist() == list(range(5)) and s.slots[1][0][:3].tolist() == [10, 11, 12]
    log[0].done = True  # the first copy ran: its buffer is reused, not reallocated
    d = s.copy([np.array([4, 4, 4])])
    assert d.tolist() == [4, 4, 4] and s.slots[0][0].data_ptr() == first and s.fresh == 1


def test_a_larger_list_regrows_a_free_buffer():
    s, log = make(slots=1)
    s.copy([np.arange(3)])
    log[-1].done = True
    out = s.copy([np.arange(100)])
    assert out.tolist() == list(range(100)) and s.slots[0][0].numel() >= 100


def test_empty_list():
    s, _ = make()
    assert s.copy([np.zeros(0, np.int64)]).shape == (0,)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.integers(0, 40), st.lists(st.booleans(), min_size=4, max_size=4)), max_size=12),
       st.integers(1, 3))
def test_no_busy_buffer_is_rewritten(steps, slots):
    """Any mix of sizes and completions: each copy returns its list, and a buffer whose event is not done keeps
    the list its copy read (the device could still be reading it)."""
    s, log = make(slots=slots)
    rng = np.random.default_rng(0)
    for n, dones in steps:
        for ev, done in zip(log, dones):
            ev.done = ev.done or done
        busy = [(buf.clone(), buf) for buf, ev in (x for x in s.slots if x is not None) if ev is not None
                and not ev.query()]
        arr = rng.integers(-10**12, 10**12, size=n)
        assert s.copy([arr[: n // 2], arr[n // 2:]]).tolist() == arr.tolist()
        for before, buf in busy:
            assert torch.equal(before, buf)


def test_on_device_views_match_the_lists():
    lists = [[1, 2], [], np.array([3, -4]), range(5)]
    out = ep._on_device(lists, "cpu")
    assert [t.tolist() for t in out] == [[1, 2], [], [3, -4], list(range(5))]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (pinned buffers, events)")
def test_gpu_staged_copy_matches_and_reuses():
    arr = np.arange(1 << 16, dtype=np.int64)
    a = staging.staged_copy([arr[:7], arr[7:]], "cuda")
    torch.cuda.synchronize()
    b = staging.staged_copy([arr[::-1].copy()], "cuda")
    torch.cuda.synchronize()
    assert torch.equal(a.cpu(), torch.from_numpy(arr)) and torch.equal(b.cpu(), torch.from_numpy(arr[::-1].copy()))
    st_ = staging._local.pools[torch.cuda.current_device()]
    assert st_.fresh == 0 and all(x is None or x[0].is_pinned() for x in st_.slots)

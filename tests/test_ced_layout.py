"""The CED engine path's host layout of a step (engine_path.Pass, _Compression), built with numpy segment arithmetic
so a 16K-token prefill takes a few numpy calls, against an oracle written here position by position from what each
list means (engine_path's module doc): hypothesis-drawn rows, chunks, queried ranges (a restored row's decoder
starting before its chunk, a scoring pass ending early), rings, compression ratios and prefix-hit floors."""

from __future__ import annotations

import types

import torch
from hypothesis import given, settings, strategies as st

from deepinfer.models.ced import engine_path as ep


@st.composite
def layouts(draw):
    R = draw(st.integers(0, 5))
    starts = [draw(st.integers(0, 60)) for _ in range(R)]
    nums = [draw(st.integers(0, 40)) for _ in range(R)]
    ends = [a + k for a, k in zip(starts, nums)]
    lo = [draw(st.integers(max(0, a - 12), e)) for a, e in zip(starts, ends)]
    hi = [draw(st.integers(max(0, l - 3), e)) for l, e in zip(lo, ends)]
    cut = [draw(st.integers(0, a)) for a in starts]
    floors = draw(st.one_of(st.none(), st.lists(st.integers(0, 90), min_size=R, max_size=R)))
    ring = draw(st.one_of(st.none(), st.tuples(st.integers(1, 12), st.one_of(st.none(), st.just(99)))))
    return dict(starts=starts, nums=nums, lo=lo, hi=hi, cut=cut, floors=floors, ring=ring,
                slots=[7 + 2 * r for r in range(R)], m=draw(st.sampled_from([1, 2, 3, 4, 8])),
                size=draw(st.integers(1, 14)))


def meta_of(L):
    ends = [a + k for a, k in zip(L["starts"], L["nums"])]
    return types.SimpleNamespace(starts=L["starts"], nums=L["nums"], state_slots=L["slots"],
                                 write_floors=L["floors"], cache={}, block_table=None,
                                 block_tables=[list(range(3 * r, 3 * r + e // 16 + 1)) for r, e in enumerate(ends)])


def token_index(L, r, p):
    """Row r's position p among the step's tokens (rows' chunks in order), or -1 outside its chunk."""
    a, k = L["starts"][r], L["nums"][r]
    return sum(L["nums"][:r]) + p - a if a <= p < a + k else -1


def pass_oracle(L, size=None):
    q = [(r, p) for r in range(len(L["starts"])) for p in range(L["lo"][r], L["hi"][r])]
    first = {r: next(i for i, (rr, _) in enumerate(q) if rr == r) for r, _ in q}
    out = dict(rows_t=[r for r, _ in q], pos=[p for _, p in q], tok=[token_index(L, r, p) for r, p in q],
               cut_t=[L["cut"][r] for r, _ in q], lo_t=[L["lo"][r] for r, _ in q],
               lstart_t=[first[r] for r, _ in q], ring_slot=[L["slots"][r] for r, _ in q])
    size = size or (L["ring"][0] if L["ring"] else None)
    if size is not None:  # each row's last `size` queries
        keep = [i for i, (r, p) in enumerate(q) if sum(1 for rr, pp in q if rr == r and pp > p) < size]
        out.update(keep=keep, keep_slot=[L["slots"][q[i][0]] for i in keep], keep_pos=[q[i][1] for i in keep])
        if L["ring"] and L["ring"][1] is not None:
            out["ring_dst"] = [L["slots"][r] if i in keep else L["ring"][1] for i, (r, _) in enumerate(q)]
    if any(t < 0 for t in out["tok"]):
        out["early"] = [i for i, t in enumerate(out["tok"]) if t < 0]
        out["late"] = [i for i, t in enumerate(out["tok"]) if t >= 0]
    return out


def compression_oracle(L):
    m, size, R = L["m"], L["size"], len(L["starts"])
    tails = [(r, p) for r in range(R) for p in range(L["starts"][r] - L["starts"][r] % m, L["starts"][r])] \
        if m > 1 else []
    floors = L["floors"] or [0] * R
    src, ids, id_rows, keep = [], [], [], []
    for r in range(R):
        a, b = L["starts"][r], L["starts"][r] + L["nums"][r]
        for j in range(a // m, b // m):  # groups whose last position this chunk computes
            if j < floors[r] // m:
                continue  # a prefix hit's shared block: its entry is cached already
            ids.append(j)
            id_rows.append(r)
            for p in range(j * m, (j + 1) * m):
                src.append(tails.index((r, p)) if p < a else len(tails) + token_index(L, r, p))
        if m > 1:
            keep += [(r, p) for p in range(max(a, b - size), b)]
    return dict(tail_slot=[L["slots"][r] for r, _ in tails], tail_pos=[p % size for _, p in tails], src=src,
                ids=ids, id_rows=id_rows, keep_slot=[L["slots"][r] for r, _ in keep],
                keep_pos=[p % size for _, p in keep], keep_src=[token_index(L, r, p) for r, p in keep])


def lists_of(obj) -> dict:
    return {k: obj._up.get(i).tolist() for k, i in obj._dev.items()}


@settings(max_examples=300, deadline=None, derandomize=True)
@given(L=layouts())
def test_pass_and_compression_layouts_match_the_oracle(L):
    meta = meta_of(L)
    up = ep.Upload("cpu")
    P = ep.Pass(meta, L["lo"], L["hi"], "cpu", cut=L["cut"], up=up, ring=L["ring"])
    C = ep._Compression(meta, L["m"], L["size"] if L["m"] > 1 else 0, types.SimpleNamespace(block_size=16), "cpu", up)
    got, want = lists_of(P), pass_oracle(L)
    assert got == want
    assert P.n == len(want["pos"]) and P.min_pos == (min(want["pos"]) if want["pos"] else None)
    assert (P.early is None) == ("early" not in want)
    if L["ring"]:
        assert P.has_last == bool(want["keep"])
    for size in (1, 3):  # a ring size the step's copy did not hold: a copy of its own
        last, w = ep._last_queries(P, size, "cpu"), pass_oracle(L, size)
        assert (last is None) == (not w["keep"])
        if last is not None:
            assert [t.tolist() for t in last] == [w["keep"], w["keep_slot"], w["keep_pos"]]
    cw = compression_oracle(L)
    assert lists_of(C) == cw
    assert C.n_tail == len(cw["tail_slot"]) and C.n_entries == len(cw["ids"]) and C.n_keep == len(cw["keep_slot"])
    assert C.identity == (not cw["tail_slot"] and cw["src"] == list(range(sum(L["nums"]))))


def test_block_table_pads_each_row_with_block_zero():
    meta = types.SimpleNamespace(block_tables=[[4, 5, 6], [], [9]], cache={}, block_table=None)
    up = ep.Upload("cpu")
    ep._register_block_table(meta, up)
    assert ep._block_table(meta, "cpu").tolist() == [[4, 5, 6], [0, 0, 0], [9, 0, 0]]
    assert torch.equal(ep._on_device([[1, 2], [], [3]], "cpu")[2], torch.tensor([3]))

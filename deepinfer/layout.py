"""The layouts core and backends share: how a step's tokens map onto sequences and KV slots (AttnMetadata)
and how its sampling rows' parameters sit in tensors (SamplingBatch). Core builds them; backends read them.
This module imports neither core nor stages nor backends, so the layers depend one way.
"""

from __future__ import annotations

from typing import Optional, Sequence

import attrs
import numpy as np
import torch


def to_device(data, dtype: torch.dtype, device) -> torch.Tensor:
    """A host list (or CPU tensor) on ``device`` without blocking the host. ``torch.tensor(data, device="cuda")``
    copies synchronously: the host waits for every kernel queued before it, which would undo overlap
    scheduling; a pinned staging copy and a non-blocking transfer do not (the caching host allocator keeps
    the staging buffer until the copy has run)."""
    t = data.to(dtype) if isinstance(data, torch.Tensor) else host_tensor(data, dtype)
    device = torch.device(device)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


# The dtypes host_tensor converts through numpy (what the engine's host lists hold).
_NUMPY = {torch.int64: np.int64, torch.int32: np.int32, torch.bool: np.bool_, torch.float32: np.float32}


def host_tensor(data, dtype: torch.dtype) -> torch.Tensor:
    """A host list (nested lists: rectangular) as a CPU tensor of ``dtype``, converted through numpy: for a list of
    Python ints ~3.5x faster than ``torch.tensor`` (16K token ids: 0.44 against 1.5 ms on a 2-core x86 host), the
    same values (floats truncate toward zero either way). Input numpy refuses (ragged, None) goes to torch.tensor,
    whose error the caller then sees."""
    to = _NUMPY.get(dtype)
    if to is not None and isinstance(data, (list, tuple)):
        try:
            return torch.from_numpy(np.array(data, dtype=to))
        except (TypeError, ValueError, OverflowError):
            pass
    return torch.tensor(data, dtype=dtype)


def to_host(t: torch.Tensor) -> torch.Tensor:
    """``to_device``'s way back: a copy of t on the host, into pinned memory without blocking when t is on CUDA
    (read it after an event the copy precedes, as a step's collection does)."""
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
    return out.copy_(t, non_blocking=t.is_cuda)


def resolve_future(ids: torch.Tensor, future) -> torch.Tensor:
    """Replace pending references (-1 - i) by future[i], on the device: the token a launched step sampled
    (overlap scheduling) is read where it lies, without waiting for it on the host."""
    if future is None:
        raise RuntimeError("input ids hold pending token references but the batch carries no future buffer")
    return torch.where(ids < 0, future.reshape(-1)[(-1 - ids).clamp_(min=0)], ids)


@attrs.define(eq=False)
class AttnMetadata:
    """How the step's ragged tokens map onto sequences and KV slots. Built once per forward."""

    positions: torch.Tensor  # [T] int64 absolute position of each token
    slot_mapping: torch.Tensor  # [T] int64 cache slot each token's K/V is written to
    seq_lens: torch.Tensor  # [B] int64 tokens in the cache after this step (context length)
    q_index: torch.Tensor  # [B, max_q] int64 row in T of each sequence's i-th query (0 where padded)
    q_valid: torch.Tensor  # [B, max_q] bool
    kv_slots: torch.Tensor  # [B, max_kv] int64 cache slot of each sequence's positions 0..max_kv-1 (0 where padded)
    q_pos: torch.Tensor  # [B, max_q] int64 position of each padded query
    block_table: Optional[torch.Tensor] = None  # [B, max_kv // block_size] int64 block ids (0 where padded)
    block_size: int = 0
    cu_q: Optional[torch.Tensor] = None  # [B + 1] int32: row b's queries are rows cu_q[b] .. cu_q[b+1]-1 of T
    max_q: int = 0  # host copy of q_index.shape[1] (most queries of any row this step)
    num_decodes: int = 0  # host: the leading rows with exactly one query (a backend may give them its decode kernel)
    # Per-row state on the device, for models with per-sequence state read without the host (CED decode):
    state_rows: Optional[torch.Tensor] = None  # [B] int64 each row's state slot (a CUDA graph's padded rows: scratch)
    replay_rows: Optional[torch.Tensor] = None  # [B] int64 each row's decoder SWA cut (replay start; core/block_tables.py)
    swa_cut_rows: Optional[torch.Tensor] = None  # [B] int64 the other layers' SWA cut (a prefix hit's replay start)
    # [B] int64 real tokens of each row of a padded verify batch (CUDA graphs: every row max_q tokens, the rest
    # padding, which must not write per-sequence state); None: no padding.
    q_nums: Optional[torch.Tensor] = None
    # Per-row facts for models with per-sequence state (CED rings, compressors); host lists, read on the host.
    starts: list = attrs.field(factory=list)  # [B] first position computed this step
    nums: list = attrs.field(factory=list)  # [B] tokens computed this step
    block_tables: list = attrs.field(factory=list)  # [B] the sequences' block tables
    state_slots: list = attrs.field(factory=list)  # [B] per-sequence state slot (scheduler-assigned)
    replay_starts: list = attrs.field(factory=list)  # [B] bounded-replay start of each sequence
    # [B] after a prefix-cache hit: the SWA cut of the layers whose window state the hit did not bring back
    # (CED's encoder, recomputed from here), and the position below which the row writes no paged KV (the
    # hit's shared blocks). Empty, or 0s: no hit.
    swa_cuts: list = attrs.field(factory=list)
    write_floors: list = attrs.field(factory=list)
    # [B] True: the row's encoder window state was restored from the encoder-SWA pool before this step (its
    # decoder starts at its replay start, reading the cached encoder outputs of positions before the chunk).
    enc_restored: list = attrs.field(factory=list)
    cache: dict = attrs.field(factory=dict)  # per-window masks, built lazily and shared by layers

    def split(self, nd: int) -> tuple:
        """(rows [0, nd), rows [nd, B)) as two metadata objects over the first nd and the remaining tokens,
        for nd leading rows of one query each (a mixed step's decode rows: see ``num_decodes``)."""
        def host(lst, sl):  # a host list or a device tensor of per-row facts (absent: None or empty)
            return lst if lst is None or len(lst) == 0 else lst[sl]

        head, tail = slice(0, nd), slice(nd, None)
        dec = AttnMetadata(positions=self.positions[:nd], slot_mapping=self.slot_mapping[:nd],
                           seq_lens=self.seq_lens[head], q_index=self.q_index[head, :1], q_valid=self.q_valid[head, :1],
                           kv_slots=self.kv_slots[head], q_pos=self.q_pos[head, :1],
                           block_table=None if self.block_table is None else self.block_table[head],
                           block_size=self.block_size, cu_q=None if self.cu_q is None else self.cu_q[:nd + 1],
                           max_q=1, num_decodes=nd, **{k: host(getattr(self, k), head) for k in _HOST_ROWS},
                           **{k: host(getattr(self, k), head) for k in _DEVICE_ROWS})
        pre = AttnMetadata(positions=self.positions[nd:], slot_mapping=self.slot_mapping[nd:],
                           seq_lens=self.seq_lens[tail], q_index=(self.q_index[tail] - nd).clamp_(min=0),
                           q_valid=self.q_valid[tail], kv_slots=self.kv_slots[tail], q_pos=self.q_pos[tail],
                           block_table=None if self.block_table is None else self.block_table[tail],
                           block_size=self.block_size, cu_q=None if self.cu_q is None else self.cu_q[nd:] - nd,
                           max_q=self.max_q, num_decodes=0, **{k: host(getattr(self, k), tail) for k in _HOST_ROWS},
                           **{k: host(getattr(self, k), tail) for k in _DEVICE_ROWS})
        return dec, pre

    def mask(self, window: Optional[int] = None) -> torch.Tensor:
        """[B, max_q, max_kv] bool: key visible to query (causal, inside the context, inside the window)."""
        key = ("mask", window)
        if key not in self.cache:
            kv_pos = torch.arange(self.kv_slots.shape[1], device=self.kv_slots.device)
            qp = self.q_pos[:, :, None]
            m = (kv_pos[None, None, :] <= qp) & (kv_pos[None, None, :] < self.seq_lens[:, None, None])
            if window is not None:
                m &= kv_pos[None, None, :] > qp - window
            self.cache[key] = m
        return self.cache[key]


_HOST_ROWS = ("starts", "nums", "block_tables", "state_slots", "replay_starts", "swa_cuts", "write_floors",
              "enc_restored")
_DEVICE_ROWS = ("state_rows", "replay_rows", "swa_cut_rows")


GREEDY_EPS = 1e-5  # same threshold as SamplingParams.greedy


@attrs.define(eq=False)
class SamplingBatch:
    temperature: torch.Tensor  # [S] float32, 0 for greedy rows
    top_k: torch.Tensor  # [S] int64, 0 = disabled
    top_p: torch.Tensor  # [S] float32
    min_p: torch.Tensor  # [S] float32
    presence_penalty: torch.Tensor | None  # [S] float32; None when no row uses penalties
    frequency_penalty: torch.Tensor | None  # [S] float32
    repetition_penalty: torch.Tensor | None  # [S] float32
    output_counts: torch.Tensor | None  # [S, V] float32 count of each token in the output so far
    prompt_mask: torch.Tensor | None  # [S, V] bool, token occurs in the prompt
    banned: torch.Tensor | None  # [S, V] bool, tokens not to sample now (min_tokens, allowed_token_ids, bad_words)
    generators: list  # [S] torch.Generator | None; None for greedy rows (they never draw)
    all_greedy: bool
    all_random: bool
    max_num_logprobs: int  # max requested SamplingParams.logprobs, -1 if no row asks
    # Host-side flags so `sample` can skip a filter without reading a device tensor.
    # They default to True (apply) so a hand-built batch is always correct.
    use_top_k: bool = True
    use_top_p: bool = True
    use_min_p: bool = True
    logit_bias: torch.Tensor | None = None  # [S, V] float32 added to the logits; None when no row has a bias
    # [S] None or (fns, prompt ids, output ids): SamplingParams.logits_processors of the rows that have them.
    processors: list | None = None
    # Written by sampling: {row: message} of rows whose logits processor raised (they drew from raw logits).
    processor_errors: dict = attrs.field(factory=dict)

    @classmethod
    def build(
        cls,
        params: Sequence,  # SamplingParams (read by attribute)
        prompt_ids: Sequence[Sequence[int]],
        output_ids: Sequence[Sequence[int]],
        generators: Sequence[torch.Generator | None],
        vocab_size: int,
        eos_token_ids: Sequence[int],
        device,
    ) -> "SamplingBatch":
        S = len(params)
        if not (len(prompt_ids) == len(output_ids) == len(generators) == S):
            raise ValueError("params, prompt_ids, output_ids and generators must have one entry per row")

        def f32(vals) -> torch.Tensor:
            return to_device(vals, torch.float32, device)

        greedy = [p.greedy for p in params]
        top_k = [p.effective_top_k for p in params]
        batch = dict(
            temperature=f32([0.0 if g else float(p.temperature) for p, g in zip(params, greedy)]),
            top_k=to_device(top_k, torch.int64, device),
            top_p=f32([float(p.top_p) for p in params]),
            min_p=f32([float(p.min_p) for p in params]),
            generators=[None if g else gen for g, gen in zip(greedy, generators)],
            all_greedy=all(greedy),
            all_random=not any(greedy),
            max_num_logprobs=max((p.logprobs for p in params if p.logprobs is not None), default=-1),
            # Filters only matter on random rows; greedy rows take the argmax anyway.
            use_top_k=any(k > 0 and not g for k, g in zip(top_k, greedy)),
            use_top_p=any(p.top_p < 1.0 and not g for p, g in zip(params, greedy)),
            use_min_p=any(p.min_p > 0.0 and not g for p, g in zip(params, greedy)),
        )
        batch.update(_build_penalties(params, prompt_ids, output_ids, vocab_size, device))
        batch["banned"] = _build_banned(params, output_ids, vocab_size, eos_token_ids, device)
        batch["logit_bias"] = _build_bias(params, vocab_size, device)
        if any(p.logits_processors for p in params):
            batch["processors"] = [(p.logits_processors, list(pr), list(out)) if p.logits_processors else None
                                   for p, pr, out in zip(params, prompt_ids, output_ids)]
        return cls(**batch)


def _row_index(rows: Sequence[Sequence[int]], keep: Sequence[bool], device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, token) index pairs for every token of the kept rows, for scatter on `device`."""
    r = [i for i, (ids, k) in enumerate(zip(rows, keep)) if k for _ in ids]
    c = [int(t) for ids, k in zip(rows, keep) if k for t in ids]
    return to_device(r, torch.int64, device), to_device(c, torch.int64, device)


def _build_penalties(params, prompt_ids, output_ids, vocab_size, device) -> dict:
    keep = [p.needs_penalties for p in params]
    if not any(keep):
        return dict(presence_penalty=None, frequency_penalty=None, repetition_penalty=None,
                    output_counts=None, prompt_mask=None)
    S = len(params)
    # Rows without penalties keep neutral values and empty counts, so they are untouched.
    counts = torch.zeros(S, vocab_size, dtype=torch.float32, device=device)  # [S, V]
    idx = _row_index(output_ids, keep, device)
    counts.index_put_(idx, torch.ones(idx[0].numel(), dtype=torch.float32, device=device), accumulate=True)
    prompt_mask = torch.zeros(S, vocab_size, dtype=torch.bool, device=device)  # [S, V]
    prompt_mask[_row_index(prompt_ids, keep, device)] = True
    return dict(
        presence_penalty=to_device([float(p.presence_penalty) for p in params], torch.float32, device),
        frequency_penalty=to_device([float(p.frequency_penalty) for p in params], torch.float32, device),
        repetition_penalty=to_device([float(p.repetition_penalty) for p in params], torch.float32, device),
        output_counts=counts,
        prompt_mask=prompt_mask,
    )


def _bad_word_ends(p, out: Sequence[int]) -> set[int]:
    """Last tokens of the bad words whose other tokens end the output: sampling one would complete the word."""
    ends = set()
    for ids in p.bad_words_token_ids:
        k = len(ids) - 1
        if k == 0 or (len(out) >= k and list(out[len(out) - k:]) == list(ids[:k])):
            ends.add(ids[-1])
    return ends


def _build_banned(params, output_ids, vocab_size, eos_token_ids, device) -> torch.Tensor | None:
    """Tokens a row may not sample now: its stop tokens while under min_tokens (EOS too unless ignore_eos),
    the tokens that would complete a bad word, and every token outside allowed_token_ids."""
    rows = []
    for p, out in zip(params, output_ids):
        ids: set[int] = _bad_word_ends(p, out) if p.bad_words_token_ids else set()
        if len(out) < p.min_tokens:
            ids.update(p.stop_token_ids)
            if not p.ignore_eos:
                ids.update(eos_token_ids)
        rows.append(sorted(t for t in ids if 0 <= t < vocab_size))  # an id outside the vocab can't be sampled anyway
    restrict = [p.allowed_token_ids is not None for p in params]
    if not any(rows) and not any(restrict):
        return None
    banned = torch.zeros(len(params), vocab_size, dtype=torch.bool, device=device)  # [S, V]
    banned[_row_index(rows, [True] * len(rows), device)] = True
    if any(restrict):
        allowed = torch.zeros_like(banned)  # [S, V]
        allowed[_row_index([p.allowed_token_ids or () for p in params], restrict, device)] = True
        banned |= ~allowed & to_device(restrict, torch.bool, device).unsqueeze(1)
    return banned


def _build_bias(params, vocab_size, device) -> torch.Tensor | None:
    keep = [bool(p.logit_bias) for p in params]
    if not any(keep):
        return None
    bias = torch.zeros(len(params), vocab_size, dtype=torch.float32, device=device)  # [S, V]
    ids = [list(p.logit_bias or ()) for p in params]
    vals = [float(b) for p, k in zip(params, keep) if k for b in p.logit_bias.values()]
    bias[_row_index(ids, keep, device)] = to_device(vals, torch.float32, device)
    return bias


class HiddenRow:
    """Row ``row`` of ``rows``, a step's kept hidden states (a DSpark drafter's context, ``seq.draft_context``),
    indexed only when read: the engine keeps one for every sequence after every step, and most are replaced
    unread (a step the gate keeps plain); a view per row cost ~3 us each, 0.4 ms a step at 128 rows."""

    __slots__ = ("rows", "row")

    def __init__(self, rows: torch.Tensor, row: int):
        self.rows, self.row = rows, row

    @property
    def dtype(self) -> torch.dtype:
        return self.rows.dtype

    def tensor(self) -> torch.Tensor:
        return self.rows[self.row]


def stack_rows(contexts: Sequence, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """torch.stack of contexts (tensors or HiddenRows); rows of one step's states in one gather, no view each."""
    first = contexts[0]
    if isinstance(first, HiddenRow) and all(isinstance(c, HiddenRow) and c.rows is first.rows for c in contexts):
        index = to_device([c.row for c in contexts], torch.long, first.rows.device)
        return torch.index_select(first.rows, 0, index, out=out)
    return torch.stack([c.tensor() if isinstance(c, HiddenRow) else c for c in contexts], out=out)

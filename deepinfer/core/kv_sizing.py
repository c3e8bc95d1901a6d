"""How many KV blocks the engine allocates, found as vLLM does: by a profile run on CUDA.

On CUDA, with no ``num_kv_blocks`` and no ``kv_cache_memory_gb``, ``profile_memory`` runs the model once at
the largest step the scheduler can form (``max_num_batched_tokens`` tokens, over temporary KV blocks) and the
sampler over ``max_num_seqs`` rows, and measures the peak memory that step takes beyond the weights; it
also runs one eager decode step at the largest CUDA-graph batch, whose peak the graphs' memory pool will
need. The pool then gets ``gpu_memory_utilization`` (default 0.9) of the device's total memory, less what is
in use after loading (weights, CUDA context), that peak, the graphs' reserve and the fixed per-sequence state
(CED's SWA rings and compressor tails). Elsewhere the budget is ``kv_cache_memory_gb`` (default 0.5 GiB on
the CPU). The bytes a KV block costs, and the fixed state, are measured by allocating the model's own cache
on the meta device, so every architecture's layout (paged low-bit CED caches included) is counted as it is.
"""

from __future__ import annotations

import logging
from typing import Optional

import attrs
import torch

from .kv_cache import blocks_needed

log = logging.getLogger(__name__)
GiB = 2**30


def tensor_bytes(obj, seen=None) -> int:
    """Bytes of every tensor reachable from obj (tensors, sequences, dicts, objects' attributes)."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return 0
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(o, seen) for o in obj)
    if isinstance(obj, dict):
        return sum(tensor_bytes(o, seen) for o in obj.values())
    if hasattr(obj, "__dict__"):
        return sum(tensor_bytes(o, seen) for o in vars(obj).values())
    return 0


def cache_layout(model, dtype, block_size: int, max_seqs: int) -> tuple:
    """(bytes per block, fixed bytes for max_seqs sequences) of the model's cache, measured on the meta device."""
    def size(blocks):
        return tensor_bytes(model.allocate_kv_cache(blocks * block_size, dtype, torch.device("meta"),
                                                    block_size=block_size, max_seqs=max_seqs))

    one, two = size(1), size(2)
    return two - one, one - (two - one)


@attrs.frozen
class MemoryProfile:
    """What the profile run found on a CUDA device (bytes)."""

    total: int  # device memory
    in_use: int  # in use after loading the weights (weights, CUDA context, other processes)
    peak_step: int  # the largest step's activations and the sampler's, beyond what was in use
    graph_reserve: int  # the largest captured decode step's activations (the graphs' pool)


@attrs.frozen
class KVPlan:
    num_blocks: int
    block_size: int
    bytes_per_block: int
    fixed_bytes: int  # per-sequence state allocated with the cache (CED rings), whatever the block count
    max_model_len: int
    source: str  # num_kv_blocks | kv_cache_memory_gb | profile | default
    profile: Optional[MemoryProfile] = None

    @property
    def tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def max_concurrency(self) -> float:
        return self.tokens / self.max_model_len

    def describe(self) -> str:
        gib = (self.num_blocks * self.bytes_per_block + self.fixed_bytes) / GiB
        s = (f"KV cache: {self.num_blocks} blocks, {self.tokens} tokens, {gib:.2f} GiB; max concurrency "
             f"{self.max_concurrency:.2f} at max_model_len {self.max_model_len} (sized by {self.source})")
        if self.profile is not None:
            p = self.profile
            s += (f"; device {p.total / GiB:.1f} GiB, in use after loading {p.in_use / GiB:.2f} GiB, peak step "
                  f"{p.peak_step / GiB:.2f} GiB, CUDA-graph reserve {p.graph_reserve / GiB:.2f} GiB")
        return s


def plan_kv(config, bytes_per_block: int, fixed_bytes: int, max_model_len: int, explicit_len: bool,
            profile: Optional[MemoryProfile] = None) -> KVPlan:
    """The number of blocks. ``explicit_len``: max_model_len was asked for (not the checkpoint's default):
    if one sequence of it cannot fit, that is an error with the numbers; a default length is capped instead."""
    cap = config.max_num_seqs * blocks_needed(max_model_len, config.block_size)  # no use for more
    if config.num_kv_blocks is not None:
        num, source, budget = config.num_kv_blocks, "num_kv_blocks", None
    else:
        if config.kv_cache_memory_gb is not None:
            budget, source = int(config.kv_cache_memory_gb * GiB), "kv_cache_memory_gb"
        elif profile is not None:
            util = 0.9 if config.gpu_memory_utilization is None else config.gpu_memory_utilization
            budget = int(util * profile.total) - profile.in_use - profile.peak_step - profile.graph_reserve
            source = f"profile, gpu_memory_utilization {util}"
        else:
            budget, source = int(0.5 * GiB), "default 0.5 GiB"
        num = min(max(0, budget - fixed_bytes) // bytes_per_block, cap)
    plan = KVPlan(int(num), config.block_size, bytes_per_block, fixed_bytes, max_model_len, source, profile)
    need = blocks_needed(max_model_len, config.block_size)
    if num < need:
        msg = (f"max_model_len {max_model_len} needs {need} KV blocks of {config.block_size} tokens, but the cache "
               f"holds {num} ({plan.describe()})")
        if explicit_len or num < 1:
            raise ValueError(msg + "; lower max_model_len, or give the cache more memory (gpu_memory_utilization, "
                             "kv_cache_memory_gb or num_kv_blocks)")
        log.warning("%s; capping max_model_len at %d", msg, num * config.block_size)
        plan = attrs.evolve(plan, max_model_len=num * config.block_size)
    return plan


def _dummy_batch(lens: list, block_size: int, model):
    from .params import SamplingParams
    from .state import ScheduledBatch, Sequence

    seqs, first = [], 0
    for i, n in enumerate(lens):
        nb = blocks_needed(n, block_size)
        seq = Sequence(seq_id=i, request_id=f"profile-{i}", index=0, token_ids=[1] * n, num_prompt_tokens=n,
                       params=SamplingParams(), arrival=i, block_table=list(range(first, first + nb)), state_slot=i)
        replay = getattr(model, "replay_start_for", None)
        seq.replay_start = replay(n) if replay is not None else 0
        seqs.append(seq)
        first += nb
    return ScheduledBatch(seqs=seqs, num_tokens=list(lens), start=[0] * len(lens), samples=[True] * len(lens)), first


def run_dummy_step(model, ops, dtype, block_size: int, num_tokens: int, max_model_len: int, sample_rows: int,
                   vocab_size: int, decode_rows: int = 0) -> int:
    """One step at the given size over temporary KV blocks: a prefill of num_tokens tokens in rows of at most
    max_model_len (or decode_rows rows of one new token each), then the LM head and the sampler (top-p, so
    its sort runs) over sample_rows rows. Device-agnostic; the caller measures memory around it. Returns the
    bytes of the temporary KV cache (not part of the step's own peak)."""
    from ..layout import SamplingBatch
    from .inputs import build_inputs
    from .params import SamplingParams

    if decode_rows:
        lens = [1] * decode_rows
    else:
        n_rows = -(-num_tokens // max_model_len)
        lens = [num_tokens // n_rows + (i < num_tokens % n_rows) for i in range(n_rows)]
    batch, blocks = _dummy_batch(lens, block_size, model)
    kv = model.allocate_kv_cache(blocks * block_size, dtype, ops.device, block_size=block_size, max_seqs=len(lens))
    with torch.no_grad():
        ids, meta, qstart = build_inputs(batch, list(range(len(lens))), block_size, ops.device)
        hidden = model(ids, meta, kv)
        rows = hidden[torch.tensor(qstart[1:], device=hidden.device) - 1]
        rows = rows.repeat(-(-sample_rows // rows.shape[0]), 1)[:sample_rows]
        logits = model.compute_logits(rows)
        params = [SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=i) for i in range(sample_rows)]
        sampling = SamplingBatch.build(params, [[1]] * sample_rows, [[]] * sample_rows, [None] * sample_rows,
                                       vocab_size, (), ops.device)
        ops.sample(logits, sampling, torch.Generator(device=ops.device).manual_seed(0))
    return tensor_bytes(kv)


def profile_memory(model, ops, dtype, config, max_model_len: int, graph_batch: int) -> MemoryProfile:
    """Measure on CUDA (see the module docstring). graph_batch: the largest CUDA-graph batch (0: none)."""
    dev = ops.device
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(dev)
    base = torch.cuda.memory_allocated(dev)

    def peak_of(**kw) -> int:
        torch.cuda.reset_peak_memory_stats(dev)
        kv = run_dummy_step(model, ops, dtype, config.block_size, max_model_len=max_model_len,
                            vocab_size=model.vocab_size, **kw)
        torch.cuda.synchronize(dev)
        return torch.cuda.max_memory_allocated(dev) - base - kv

    step = peak_of(num_tokens=config.max_num_batched_tokens, sample_rows=config.max_num_seqs)
    graphs = peak_of(num_tokens=graph_batch, sample_rows=1, decode_rows=graph_batch) if graph_batch else 0
    torch.cuda.empty_cache()
    return MemoryProfile(total=total, in_use=total - free, peak_step=step, graph_reserve=graphs)

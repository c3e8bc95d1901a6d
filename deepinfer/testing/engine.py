"""Driving a model's engine forward by hand, for tests that compare it with the full-sequence path."""

from __future__ import annotations

import torch

from ..core.kv_cache import blocks_needed
from ..core.params import SamplingParams
from ..core.state import ScheduledBatch, Sequence
from ..core.inputs import build_inputs


def paged_prefill_logits(net, prompts: list, block_size: int, chunk: int, seed: int = 0,
                         spare_blocks: int = 2) -> list:
    """Prefill every prompt through the engine forward, all in one batch, ``chunk`` tokens per row per step.

    Blocks are handed out in a shuffled order (from a pool with ``spare_blocks`` unused ones), so block
    tables are non-contiguous and interleaved between sequences. Returns the logits [L, V] of every prompt
    position, float32 on the CPU.
    """
    total = sum(blocks_needed(len(p), block_size) for p in prompts) + spare_blocks
    perm = torch.randperm(total, generator=torch.Generator().manual_seed(seed)).tolist()
    kv = net.allocate_kv_cache(total * block_size, torch.float32, torch.device("cpu"))
    seqs = []
    for i, p in enumerate(prompts):
        nb = blocks_needed(len(p), block_size)
        seqs.append(Sequence(seq_id=i, request_id=str(i), index=0, token_ids=list(p), num_prompt_tokens=len(p),
                             params=SamplingParams(), arrival=i, block_table=perm[:nb]))
        perm = perm[nb:]
    done, pieces = [0] * len(prompts), [[] for _ in prompts]
    while any(d < len(p) for d, p in zip(done, prompts)):
        rows = [i for i, p in enumerate(prompts) if done[i] < len(p)]
        nums = [min(chunk, len(prompts[i]) - done[i]) for i in rows]
        batch = ScheduledBatch(seqs=[seqs[i] for i in rows], num_tokens=nums, start=[done[i] for i in rows],
                               samples=[done[i] + n == len(prompts[i]) for i, n in zip(rows, nums)])
        ids, meta, qstart = build_inputs(batch, list(range(len(rows))), block_size, torch.device("cpu"))
        with torch.no_grad():
            logits = net.compute_logits(net(ids, meta, kv))
        for r, i in enumerate(rows):
            pieces[i].append(logits[qstart[r]:qstart[r + 1]])
            done[i] += nums[r]
    return [torch.cat(p) for p in pieces]


def step_greedy(engine, prompts: list, max_tokens: int, on_step=None, max_steps: int = 5000) -> tuple:
    """Add every prompt at once (request ids r0, r1, ...; greedy, EOS ignored) and call ``engine.step()`` until
    all are done, asserting that no request fails and that the engine finishes within ``max_steps`` steps;
    ``on_step(engine)`` runs after each step. Returns (output token ids per prompt, its first Sequence)."""
    rids = [f"r{i}" for i in range(len(prompts))]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    seqs = {}
    for rid, p in zip(rids, prompts):
        req = engine.add_request(rid, p, params)
        assert req.error is None, req.error
        seqs[rid] = req.seqs[0]
    outs, steps = {}, 0
    while engine.has_unfinished():
        for out in engine.step():
            assert out.error is None, out.error
            if out.finished:
                outs[out.request_id] = list(out.outputs[0].token_ids)
        if on_step is not None:
            on_step(engine)
        steps += 1
        assert steps < max_steps, "the engine made no progress"
    return [outs[r] for r in rids], [seqs[r] for r in rids]


def wait_idle(async_engine, timeout: float = 20.0) -> dict:
    """AsyncLLM.stats() once no request is left and every KV block is free again (or at ``timeout`` seconds,
    whatever it is then: the caller's assertions say what was expected)."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = async_engine.stats()
        if st["requests"] == 0 and st["kv_blocks_free"] == st["kv_blocks_total"]:
            return st
        time.sleep(0.05)
    return async_engine.stats()

"""Parallel serving over torch.distributed (deepinfer/parallel/workers.py, tp_layers.py, expert_parallel.py).

The oracle is the single-process engine on the same checkpoint (it shares no sharding code): 2 and 4 gloo ranks
give its greedy tokens, and its top logprobs (float32, prompt logprobs too) within a tolerance scaled by their
magnitude, for a dense Llama under tensor parallelism and for tiny Mixtral, Qwen3-MoE and DeepSeek-V3 under
expert parallelism (all-to-all and the all-reduce fallback). Prompts spread over the whole vocabulary (every
shard of the vocabulary-parallel embedding is read) and a small token budget chunks the prefills. Rank 0's
shard is checked to hold only its slice (the work is spread, not replicated).

Faults: a worker killed mid-generation fails the requests in flight with an error naming the rank and its exit
code, later requests fail at once, nothing hangs, and a new parallel engine starts in the same process; a worker
that stops answering fails the step after distributed_timeout_s. Bad layouts are refused before any process
starts, naming the numbers.

The multi-process tests are marked ``multiprocess``; each spawns its workers (about 5 s on two busy cores).
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch
from hypothesis import given, settings, strategies as st

from deepinfer import LLM, SamplingParams
from deepinfer.parallel.dist import rank_device, torchrun_env
from deepinfer.testing.models import build_tiny_hf_model
from deepinfer.testing.parallel import assert_same_outputs, logprob_close as close

# Every tiny checkpoint with 4 KV heads, so 4 ranks divide them.
MODELS = {"llama": {"num_key_value_heads": 4}, "mixtral": {"num_key_value_heads": 4},
          "qwen3-moe": {"num_key_value_heads": 4}, "qwen2-moe": {}, "deepseek_v3": {}}
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, logprobs=4)
ENGINE = dict(num_kv_blocks=64, threads=1, max_num_batched_tokens=24)


def tiny(root, name: str, **kw) -> str:
    build_tiny_hf_model(root / name, name, **kw)
    return str(root / name)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("parallel")
    return {name: tiny(root, name, **kw) for name, kw in MODELS.items()}


def prompts(vocab: int) -> list:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (5, 19, 41)]


def run(llm) -> list:
    sps = [GREEDY, SamplingParams(max_tokens=6, temperature=0.0, logprobs=4, prompt_logprobs=3), GREEDY]
    return llm.generate(prompts(llm.engine.model.vocab_size), sps, use_tqdm=False)


@pytest.fixture(scope="module")
def reference(checkpoints):
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = run(LLM(checkpoints[name], **ENGINE))
        return cache[name]

    return get


def assert_same(ref: list, out: list) -> None:
    assert_same_outputs(ref, out)
    assert ref[1].prompt_logprobs  # the comparison covered prompt logprobs


def test_tolerance_catches_a_small_change():
    """The comparison can fail: a logprob off by 1e-3 is caught."""
    assert close(-2.5, -2.5 + 5e-5) and not close(-2.5, -2.501)


CASES = [("llama", 2, "alltoall"), ("llama", 4, "alltoall"), ("mixtral", 2, "alltoall"),
         ("qwen3-moe", 4, "alltoall"), ("qwen2-moe", 2, "allreduce"), ("deepseek_v3", 2, "allreduce"),
         ("deepseek_v3", 4, "alltoall")]


@pytest.mark.multiprocess
@pytest.mark.parametrize("name,world,comm", CASES, ids=[f"{n}-{w}ranks-{c}" for n, w, c in CASES])
def test_parallel_matches_single_process(checkpoints, reference, name, world, comm):
    ep = name != "llama"
    llm = LLM(checkpoints[name], tensor_parallel_size=world, enable_expert_parallel=ep, expert_parallel_comm=comm,
              distributed_timeout_s=60, **ENGINE)
    try:
        out = run(llm)
        shard = llm.engine.model.inner
        if ep:
            blocks = shard.moe_blocks()
            assert blocks and all(type(b).__name__ == "ExpertParallelMoE" for b in blocks)
            assert all(b.w13.shape[0] == b.num_experts // world and b.first == 0 for b in blocks)
        if name != "deepseek_v3":  # the Llama family: attention and vocabulary sharded
            c = shard.config
            assert c.num_kv_heads * world == MODELS[name].get("num_key_value_heads", 2)
            assert llm.engine.kv_cache[0].shape[2] == c.num_kv_heads  # each rank caches its own KV heads
            assert shard.model.embed_tokens.num_embeddings == -(-shard.vocab_size // world)
    finally:
        llm.shutdown()
    assert_same(reference(name), out)
    after = llm.generate([[1, 2]], SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert after.outputs[0].finish_reason == "error" and "was shut down (LLM.shutdown())" in after.error


DP_CASES = [("deepseek_v3", 4), ("qwen3-moe", 2)]


@pytest.mark.multiprocess
@pytest.mark.parametrize("name,world", DP_CASES, ids=[f"{n}-dp{w}" for n, w in DP_CASES])
def test_data_parallel_attention_matches_single_process(checkpoints, reference, name, world):
    """data_parallel_size=D: each rank attends over its own sequences (state slot mod D; with 3 requests on 4
    ranks one rank has none and still joins the experts' all-to-all) and holds only their KV; experts sharded."""
    llm = LLM(checkpoints[name], data_parallel_size=world, enable_expert_parallel=True, enable_prefix_caching=False,
              distributed_timeout_s=60, **ENGINE)
    try:
        out = run(llm)
        blocks = llm.engine.model.inner.moe_blocks()
        assert all(b.tokens_local and b.w13.shape[0] == b.num_experts // world for b in blocks)
        # Each rank's cache holds one partition of the block ids (rank 0's: the MLA latents of 64 blocks).
        assert llm.engine.model.kv_blocks == 64 and llm.engine.pool.num_blocks == 64 * world
        if name == "deepseek_v3":
            assert llm.engine.kv_cache.shape[1] == 64 * llm.engine.config.block_size
    finally:
        llm.shutdown()
    assert_same(reference(name), out)


@pytest.mark.multiprocess
def test_data_parallel_prefix_cache_hits_equal_cold_run(checkpoints):
    """Prefix caching with data-parallel attention (core/rank_pools.py): each rank caches its own sequences'
    blocks, and a request goes to the rank holding its longest cached prefix unless that rank runs ROUTE_SLACK
    more sequences than another. Four requests share a 4-block prefix, twice: the prefix ends up cached on both
    ranks, both ranks serve hits, and every output is the cold run's (MLA's cached latents are what a cold
    prefill writes)."""
    g = torch.Generator().manual_seed(1)
    shared = torch.randint(0, 500, (16,), generator=g).tolist()
    prompts = [shared + torch.randint(0, 500, (n,), generator=g).tolist() for n in (3, 9, 5, 14)]
    sps = [SamplingParams(max_tokens=m, temperature=0.0, logprobs=4) for m in (2, 4, 3, 6)]
    kw = dict(ENGINE, block_size=4, max_num_batched_tokens=12)
    cold = LLM(checkpoints["deepseek_v3"], enable_prefix_caching=False, **kw).generate(prompts, sps, use_tqdm=False)
    llm = LLM(checkpoints["deepseek_v3"], data_parallel_size=2, enable_expert_parallel=True, **kw)
    try:
        first = llm.generate(prompts, sps, use_tqdm=False)
        again = llm.generate(prompts[::-1], sps[::-1], use_tqdm=False)[::-1]
        caches = llm.engine.prefix_cache.caches
        per_rank = llm.cache_stats()["cached_blocks_per_rank"]
    finally:
        llm.shutdown()
    assert all(n > 0 for n in per_rank), per_rank
    assert all(c.stats["hit_tokens"] > 0 for c in caches), [c.stats for c in caches]
    assert all(o.num_cached_tokens >= 16 for o in again) and any(o.num_cached_tokens for o in first)
    assert_same_outputs(cold, first)
    assert_same_outputs(cold, again)


@pytest.mark.multiprocess
def test_data_parallel_attention_under_preemption(checkpoints):
    """A pool too small for the batch: preempted sequences come back in other state slots, so on other ranks, and
    recompute their KV there; the tokens stay the single-process engine's."""
    prompts = [[i * 7 % 500 + j for j in range(20)] for i in range(6)]
    sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    kw = dict(num_kv_blocks=8, block_size=8, threads=1, enable_prefix_caching=False, max_num_seqs=6)
    ref = LLM(checkpoints["deepseek_v3"], **kw)
    want = [o.outputs[0].token_ids for o in ref.generate(prompts, sp, use_tqdm=False)]
    assert ref.engine.scheduler.num_preemptions > 0
    llm = LLM(checkpoints["deepseek_v3"], data_parallel_size=2, enable_expert_parallel=True, **kw)
    try:
        got = llm.generate(prompts, sp, use_tqdm=False)
        assert llm.engine.scheduler.num_preemptions > 0
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in got] == want


@pytest.mark.multiprocess
def test_killed_worker_fails_requests_and_engine_shuts_down(checkpoints):
    llm = LLM(checkpoints["llama"], tensor_parallel_size=2, distributed_timeout_s=30, **ENGINE)
    pid = llm.engine.model.runtime.procs[0].pid
    killer = threading.Timer(0.5, os.kill, (pid, signal.SIGKILL))
    t0 = time.monotonic()
    killer.start()
    try:
        outs = llm.generate([[1, 2, 3]] * 4, SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True),
                            use_tqdm=False)
    finally:
        killer.cancel()
    assert time.monotonic() - t0 < 20  # no hang: the step fails as soon as the peer's sockets close
    for o in outs:
        assert o.outputs[0].finish_reason == "error"
        assert f"worker rank 1 (pid {pid}) exited with code -9" in o.error
    t0 = time.monotonic()
    later = llm.generate([[4, 5]], SamplingParams(max_tokens=3), use_tqdm=False)[0]
    assert later.outputs[0].finish_reason == "error" and "start a new LLM" in later.error
    llm.shutdown()
    assert time.monotonic() - t0 < 5
    # The process group was left cleanly: a new parallel engine starts in this process.
    again = LLM(checkpoints["llama"], tensor_parallel_size=2, distributed_timeout_s=30, **ENGINE)
    try:
        assert again.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)[0].error is None
    finally:
        again.shutdown()


@pytest.mark.multiprocess
def test_stopped_worker_times_out(checkpoints):
    """A worker that stops answering (SIGSTOP) fails the step after distributed_timeout_s, not never."""
    llm = LLM(checkpoints["llama"], tensor_parallel_size=2, distributed_timeout_s=3, **ENGINE)
    proc = llm.engine.model.runtime.procs[0]
    os.kill(proc.pid, signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)[0]
    finally:
        llm.shutdown()  # kills the stopped worker
    assert 2 < time.monotonic() - t0 < 30
    assert out.outputs[0].finish_reason == "error" and "distributed serving failed" in out.error
    assert proc.exitcode is not None


@pytest.mark.gpu
@pytest.mark.multiprocess
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL)")
@pytest.mark.parametrize("name", ["llama", "qwen3-moe"])
def test_nccl_matches_one_gpu(checkpoints, name):
    """The same on 2 GPUs over NCCL (float32): the one-GPU engine's greedy tokens and logprobs."""
    kw = dict(ENGINE, device="cuda", dtype="float32", enforce_eager=True)
    ref = run(LLM(checkpoints[name], **kw))
    llm = LLM(checkpoints[name], tensor_parallel_size=2, enable_expert_parallel=name != "llama",
              distributed_timeout_s=60, **kw)
    try:
        out = run(llm)
    finally:
        llm.shutdown()
    assert_same(ref, out)


TORCHRUN_SCRIPT = """
import sys
from deepinfer import LLM, SamplingParams
if __name__ == "__main__":
    llm = LLM(sys.argv[1], tensor_parallel_size=2, num_kv_blocks=64, threads=1)  # ranks != 0 serve here, then exit
    out = llm.generate([[1, 5, 9, 17, 33, 2, 7]], SamplingParams(max_tokens=6, temperature=0.0), use_tqdm=False)
    print("TOKENS", out[0].outputs[0].token_ids, flush=True)
    llm.shutdown()
"""


@pytest.mark.multiprocess
def test_torchrun_launch(checkpoints, tmp_path):
    """The same script on every rank under torchrun (README 'Parallel serving'): rank 0 generates what one process
    does, the other rank serves inside LLM() and exits 0 when rank 0 shuts down."""
    import subprocess
    import sys

    from deepinfer.parallel.dist import free_port

    script = tmp_path / "serve.py"
    script.write_text(TORCHRUN_SCRIPT)
    ref = LLM(checkpoints["llama"], num_kv_blocks=64, threads=1).generate(
        [[1, 5, 9, 17, 33, 2, 7]], SamplingParams(max_tokens=6, temperature=0.0), use_tqdm=False)[0]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT")}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                           f"--master_port={free_port()}", str(script), checkpoints["llama"]],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"TOKENS {ref.outputs[0].token_ids}" in proc.stdout


# ------------------------------------------------------------------------------------------ in one process


@given(st.data())
@settings(max_examples=30, deadline=None)
def test_step_message_round_trip(data):
    """What a worker rebuilds from the header and payload is what rank 0 sent, field by field."""
    from deepinfer.layout import AttnMetadata
    from deepinfer.parallel.workers import META_TENSORS, pack_forward, payload_size, unpack_forward

    T, B, Q, K = (data.draw(st.integers(1, 9)) for _ in range(4))
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))

    def ints(*shape, dtype=torch.long):
        return torch.randint(-5, 1000, shape, generator=g).to(dtype)

    fields = dict(positions=ints(T), slot_mapping=ints(T), seq_lens=ints(B), q_index=ints(B, Q),
                  q_valid=ints(B, Q, dtype=torch.bool), kv_slots=ints(B, K), q_pos=ints(B, Q))
    for name in ("block_table", "cu_q", "state_rows"):
        if data.draw(st.booleans()):
            fields[name] = ints(B, 2) if name == "block_table" else ints(B + 1, dtype=torch.int32)
    meta = AttnMetadata(**fields, block_size=data.draw(st.integers(1, 64)), max_q=Q, num_decodes=data.draw(
        st.integers(0, B)))
    ids = ints(T)
    header, payload = pack_forward(ids, meta)
    words = header.tolist()
    assert payload.numel() == payload_size(words)
    ids2, meta2 = unpack_forward(words, payload)
    assert torch.equal(ids2, ids)
    for name in META_TENSORS:
        a, b = getattr(meta, name), getattr(meta2, name)
        assert (a is None and b is None) or (a.dtype == b.dtype and torch.equal(a, b)), name
    assert (meta2.block_size, meta2.max_q, meta2.num_decodes) == (meta.block_size, meta.max_q, meta.num_decodes)


@pytest.mark.parametrize("world", [2, 3])
def test_each_rank_reads_its_slices(tmp_path, world):
    """The checkpoint plan of a tensor-parallel Llama: rank r's tensors are rows/columns r of the full ones (the
    vocabulary zero-padded), stacked over the ranks they give the whole tensor back; norms whole."""
    from safetensors.torch import load_file

    from deepinfer.parallel.tp_layers import iter_shard, llama_plan

    path = tiny(tmp_path, "llama", hidden_size=48, num_attention_heads=6, num_key_value_heads=6, head_dim=8,
                intermediate_size=96)
    full = load_file(f"{path}/model.safetensors")
    V = full["model.embed_tokens.weight"].shape[0]
    Vl = -(-V // world)
    shards = [dict(iter_shard(path, lambda n: True, llama_plan(
        {"T": world, "r": r, "heads": 6, "kv_heads": 6, "head_dim": 8, "inter": 96, "vocab": V,
         "vocab_local": Vl}))) for r in range(world)]
    for name, t in full.items():
        parts = [s[name] for s in shards]
        if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight", "up_proj.weight")):
            assert torch.equal(torch.cat(parts, 0), t) and parts[0].shape[0] == t.shape[0] // world, name
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            assert torch.equal(torch.cat(parts, 1), t) and parts[0].shape[1] == t.shape[1] // world, name
        elif name.endswith(("embed_tokens.weight", "lm_head.weight")):
            assert all(p.shape[0] == Vl for p in parts)
            assert torch.equal(torch.cat(parts, 0)[:V], t) and not torch.cat(parts, 0)[V:].any(), name
        else:
            assert all(torch.equal(p, t) for p in parts), name


# ------------------------------------------------------------------------------------------ refused layouts
# None of these starts a process: the layout is checked on rank 0's meta-device shard first.


@pytest.mark.parametrize("name,kw,match", [
    ("llama-kv2", dict(tensor_parallel_size=4),
     r"tensor_parallel_size=4 does not divide LlamaForCausalLM's num_key_value_heads=2"),
    ("llama", dict(tensor_parallel_size=2, data_parallel_size=2),
     r"data_parallel_size=2 with tensor_parallel_size=2 is not supported yet"),
    ("deepseek_v3", dict(data_parallel_size=2, enable_expert_parallel=True, enable_prefix_caching=False,
                         expert_parallel_comm="allreduce"), r"data-parallel attention needs 'alltoall'"),
    ("mixtral", dict(tensor_parallel_size=2), r"needs enable_expert_parallel=True"),
    ("deepseek_v3", dict(tensor_parallel_size=3, enable_expert_parallel=True),
     r"8 experts do not divide over 3 ranks"),
    ("mixtral", dict(tensor_parallel_size=2, enable_eplb=True),
     r"enable_eplb with 2 ranks needs enable_expert_parallel=True"),
    ("mixtral", dict(tensor_parallel_size=2, enable_expert_parallel=True, enable_eplb=True,
                     eplb_config={"num_redundant_experts": 1}), r"8 experts and 9 physical slots .* divide over"),
    ("mixtral", dict(tensor_parallel_size=2, enable_expert_parallel=True, enable_eplb=True,
                     eplb_config={"num_ranks": 4}), r"eplb_config\['num_ranks'\]=4 does not match the 2 "),
    ("llama", dict(tensor_parallel_size=2, host_cache_gb=1.0), r"host and disk tiers"),
    ("llama", dict(tensor_parallel_size=0), r"tensor_parallel_size=0 is invalid"),
    ("llama", dict(tensor_parallel_size=2, expert_parallel_comm="nccl"), r"expert_parallel_comm='nccl' is invalid"),
])
def test_bad_layouts_are_refused(checkpoints, tmp_path, name, kw, match):
    path = checkpoints.get(name)
    if path is None:  # the stock tiny Llama: 2 KV heads
        path = tiny(tmp_path, "llama")
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=match):
        LLM(path, **{**ENGINE, **kw})
    assert time.monotonic() - t0 < 10


def test_launcher_mismatch_is_refused(checkpoints, monkeypatch):
    env = {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValueError, match=r"WORLD_SIZE=4 .* does not match .* = 2 x 1 = 2"):
        LLM(checkpoints["llama"], tensor_parallel_size=2, **ENGINE)
    monkeypatch.delenv("MASTER_PORT")
    with pytest.raises(ValueError, match=r"MASTER_PORT missing"):
        torchrun_env()


def test_too_few_devices_is_refused():
    n = torch.cuda.device_count()
    with pytest.raises(ValueError, match=rf"needs cuda:{n}, but this machine has {n} GPU\(s\) visible; world size "
                                         rf"{n + 1}"):
        rank_device("cuda", n, n + 1)


def test_cli_flags_reach_the_engine():
    from deepinfer.cli import build_parser, parallel_kwargs

    for cmd in (["generate", "x"], ["chat"], ["bench"]):
        args = build_parser().parse_args([*cmd, "-tp", "2", "--enable-expert-parallel", "--expert-parallel-comm",
                                          "allreduce"])
        assert parallel_kwargs(args) == {"tensor_parallel_size": 2, "enable_expert_parallel": True,
                                         "expert_parallel_comm": "allreduce"}
    serve = build_parser().parse_args(["serve", "--tensor-parallel-size", "4", "--enable-expert-parallel"])
    assert serve.engine_tensor_parallel_size == 4 and serve.engine_enable_expert_parallel is True

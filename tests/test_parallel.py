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

from deepinfer import LLM, SamplingParams
from deepinfer.parallel.dist import rank_device, torchrun_env
from deepinfer.testing.models import build_tiny_hf_model

# Every tiny checkpoint with 4 KV heads, so 4 ranks divide them.
MODELS = {"llama": {"num_key_value_heads": 4}, "mixtral": {"num_key_value_heads": 4},
          "qwen3-moe": {"num_key_value_heads": 4}, "deepseek_v3": {}}
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


def close(a: float, b: float) -> bool:
    return abs(a - b) <= 3e-5 * max(1.0, abs(a))


def assert_same(ref: list, out: list) -> None:
    for r, o in zip(ref, out):
        assert o.error is None, o.error
        assert o.outputs[0].token_ids == r.outputs[0].token_ids
        for pos, (x, y) in enumerate(zip(r.outputs[0].logprobs, o.outputs[0].logprobs)):
            assert x.keys() == y.keys(), f"position {pos}: top tokens {list(x)} vs {list(y)}"
            bad = {t: (x[t].logprob, y[t].logprob) for t in x if not close(x[t].logprob, y[t].logprob)}
            assert not bad, f"position {pos}: logprobs differ {bad}"
        for x, y in zip(r.prompt_logprobs or [], o.prompt_logprobs or []):
            if x is not None:
                assert all(close(x[t].logprob, y[t].logprob) for t in x)
    assert ref[1].prompt_logprobs and len(out[1].prompt_logprobs) == len(ref[1].prompt_logprobs)


def test_tolerance_catches_a_small_change():
    """The comparison can fail: a logprob off by 1e-3 is caught."""
    assert close(-2.5, -2.5 + 5e-5) and not close(-2.5, -2.501)


CASES = [("llama", 2, "alltoall"), ("llama", 4, "alltoall"), ("mixtral", 2, "alltoall"),
         ("qwen3-moe", 4, "alltoall"), ("deepseek_v3", 2, "allreduce"), ("deepseek_v3", 4, "alltoall")]


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
            assert c.num_kv_heads * world == MODELS[name]["num_key_value_heads"]
            assert llm.engine.kv_cache[0].shape[2] == c.num_kv_heads  # each rank caches its own KV heads
            assert shard.model.embed_tokens.num_embeddings == -(-shard.vocab_size // world)
    finally:
        llm.shutdown()
    assert_same(reference(name), out)


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


# ------------------------------------------------------------------------------------------ refused layouts
# None of these starts a process: the layout is checked on rank 0's meta-device shard first.


@pytest.mark.parametrize("name,kw,match", [
    ("llama-kv2", dict(tensor_parallel_size=4),
     r"tensor_parallel_size=4 does not divide LlamaForCausalLM's num_key_value_heads=2"),
    ("llama", dict(tensor_parallel_size=2, data_parallel_size=2), r"data_parallel_size=2 is not supported yet"),
    ("mixtral", dict(tensor_parallel_size=2), r"needs enable_expert_parallel=True"),
    ("deepseek_v3", dict(tensor_parallel_size=3, enable_expert_parallel=True),
     r"8 experts do not divide over 3 ranks"),
    ("mixtral", dict(tensor_parallel_size=2, enable_expert_parallel=True, enable_eplb=True),
     r"enable_eplb=True is not implemented with parallel workers yet \(tensor_parallel_size=2"),
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

"""Training the CED demo model: the batched training path equals forward_full, the losses learn, and the
training script writes a checkpoint that DeepInfer loads and generates from."""

from __future__ import annotations

import importlib.util
import json
import math
import os
from pathlib import Path

import pytest
import torch

from deepinfer.backends.reference import lowbit
from deepinfer.models.ced import functional as fn
from deepinfer.models.ced import train as T
from deepinfer.models.ced.config import CEDConfig
from deepinfer.models.ced.model import CEDForCausalLM
from deepinfer.testing.compare import MODEL_FACTOR, assert_logits_close

ROOT = Path(__file__).resolve().parent.parent


def small_model(seed=0, std=0.02, **kw) -> CEDForCausalLM:
    """Every mechanism of the toy model (all layer modes, pool, MoE, fake quant) at a smaller width."""
    cfg = dict(vocab_size=320, hidden_size=64, num_heads=2, head_dim=32, rope_dim=8, q_lora_rank=32, out_groups=2,
               out_group_dim=32, n_win=8, index_heads=2, index_head_dim=32, index_topk=6, pool_block=2,
               pool_blocks=3, n_routed_experts=4, moe_intermediate_size=32, tie_word_embeddings=True)
    cfg.update(kw)
    m = CEDForCausalLM(CEDConfig(**cfg))
    m.init_weights(seed, std=std)
    return m


def load_script():
    spec = importlib.util.spec_from_file_location("train_demo", ROOT / "scripts" / "train_demo.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# The batched path is forward_full.

@pytest.mark.parametrize("std", [0.02, 0.3])
def test_rows_match_forward_full_per_replay_start(std):
    m = small_model(std=std)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 320, (4, 37), generator=g)
    starts = torch.tensor([0, 5, 21, 29])  # 37 - n_win = 29: the largest cut training draws
    with torch.no_grad():
        h = T.forward_rows(m, ids, starts)
        for b in range(4):
            s = int(starts[b])
            logits, hid = m.forward_full(ids[b], replay_start=s, return_hidden=True)
            assert_logits_close(h[b, s:], hid, factor=MODEL_FACTOR, what=f"hidden, row {b}")
            assert_logits_close(m.logits(h[b, s:]), logits, factor=MODEL_FACTOR, what=f"logits, row {b}")


def test_bounded_rows_are_engine_prefills():
    """Each bounded row predicts the next token exactly as forward_full over the prompt with s = len - n_win."""
    m = small_model(std=0.3)
    W = m.config.n_win
    ids = torch.randint(0, 320, (2, 30), generator=torch.Generator().manual_seed(2))
    seq = torch.tensor([0, 0, 0, 1, 1, 1])
    last = torch.tensor([0, 5, 29, 7, 8, 22])  # shorter than, equal to and longer than the window
    with torch.no_grad():
        h_enc, _ = T.encode(m, ids)
        got = T.bounded_last_hidden(m, h_enc, seq, last, rows_per_chunk=4)
        for r in range(len(seq)):
            i = int(last[r])
            _, hid = m.forward_full(ids[seq[r], :i + 1], replay_start=max(0, i + 1 - W), return_hidden=True)
            assert_logits_close(got[r], hid[-1], factor=MODEL_FACTOR, what=f"row {r}")


def test_eval_stream_scores_every_target_once_and_exact_matches_forward_full():
    for L, N in [(1, 8), (2, 8), (8, 8), (9, 8), (40, 8), (41, 9), (100, 16)]:
        plan = T.window_plan(L, N)
        scored = [a + t for a, n, f in plan for t in range(f, n)]
        assert sorted(scored) == list(range(1, L)), (L, N)
        assert all(n == min(N, L) and a + n <= L for a, n, f in plan)
    m = small_model(std=0.3)
    stream = torch.randint(0, 320, (53,), generator=torch.Generator().manual_seed(3))
    res = T.eval_stream(m, stream, 16, batch=3)
    with torch.no_grad():
        logits = m.forward_full(stream[:16])
    assert res["exact"]["tokens"] == res["bounded"]["tokens"] == 52
    want = torch.nn.functional.cross_entropy(logits[:-1], stream[1:16], reduction="sum")
    first = T.eval_stream(m, stream[:16], 16, batch=3, modes=("exact",))
    assert math.isclose(first["exact"]["nats"], float(want), rel_tol=1e-5)
    s = T.summarize(res, n_bytes=100)
    assert math.isclose(s["exact"]["bits_per_byte"], res["exact"]["nats"] / math.log(2) / 100)


# Fake quantization passes gradients straight through, without changing values.

@pytest.mark.parametrize("fmt", ["fp4_e2m1_e4m3", "mxfp4", "fp8_e4m3_pow2"])
def test_fake_quant_straight_through(fmt):
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(4))
    want = lowbit.fake_quantize(x, fmt)
    assert torch.equal(fn.fake(x, fmt, True), want)  # no grad: the plain path
    xg = x.clone().requires_grad_(True)
    y = fn.fake(xg, fmt, True)
    assert torch.equal(y.detach(), want)
    w = torch.randn(5, 64)
    (y * w).sum().backward()
    assert torch.equal(xg.grad, w)
    assert fn.fake(xg, fmt, False) is xg


# Losses.

INDEXER = ("wiq", "wiw", "wik", "wzi")


def is_indexer(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in INDEXER


def test_ce_and_kl_reach_disjoint_weights():
    m = small_model(std=0.2)
    ids = torch.randint(0, 320, (2, 33), generator=torch.Generator().manual_seed(5))
    starts = torch.tensor([0, 12])
    loss, ce, kl, per = T.lm_loss(m, ids, starts, kl_weight=0.1)
    assert sorted(per) == [1, 4, 6]  # the full and reindex layers
    assert torch.isfinite(kl) and kl > 0
    ce.backward(retain_graph=True)
    grads = {n: p.grad for n, p in m.named_parameters()}
    assert all(g is None or not g.any() for n, g in grads.items() if is_indexer(n))
    assert grads["layers.4.wq_a"] is not None and grads["layers.4.wq_a"].any()
    m.zero_grad(set_to_none=True)
    kl.backward()
    for n, p in m.named_parameters():
        if not is_indexer(n):
            assert p.grad is None or not p.grad.any(), n
    assert m.layers[1].wik.grad.any() and m.layers[6].wiq.grad.any() and m.layers[1].wzi.grad.any()
    assert m.layers[0].gate_bias.grad is None


def test_a_few_steps_reduce_the_loss_and_the_indexer_kl():
    torch.manual_seed(0)
    m = small_model(std=0.05)
    ids = torch.randint(0, 320, (4, 33), generator=torch.Generator().manual_seed(6))
    starts = torch.tensor([0, 0, 9, 25])
    opt = torch.optim.AdamW(T.param_groups(m, 0.1), lr=3e-3, betas=(0.9, 0.95))
    ces = []
    for _ in range(10):
        loss, ce, kl, _ = T.lm_loss(m, ids, starts, kl_weight=0.1)
        assert torch.isfinite(loss)
        opt.zero_grad()
        loss.backward()
        opt.step()
        ces.append(float(ce.detach()))
    assert ces[-1] < ces[0] - 0.5, ces
    assert all(float(b.detach().abs().max()) == 0 for n, b in m.named_parameters() if n.endswith("gate_bias"))
    # The KL alone, on the indexer weights alone, from a model whose attention is far from uniform.
    m = small_model(std=0.3)
    params = [p for n, p in m.named_parameters() if is_indexer(n)]
    opt = torch.optim.Adam(params, lr=1e-2)
    kls = []
    for _ in range(12):
        _, _, kl, _ = T.lm_loss(m, ids, starts, kl_weight=1.0)
        opt.zero_grad()
        kl.backward()
        opt.step()
        kls.append(float(kl.detach()))
    assert all(math.isfinite(k) for k in kls)
    assert kls[-1] < 0.8 * kls[0], kls


def test_lr_schedule_and_replay_starts():
    assert T.lr_factor(0.0) > 0 and T.lr_factor(0.03) == pytest.approx(1.0)
    assert T.lr_factor(1.0) == pytest.approx(0.1)
    assert all(T.lr_factor(a / 10) >= T.lr_factor(b / 10) for a, b in zip(range(1, 10), range(2, 11)))
    s = T.draw_starts(4000, 64, 16, 0.25, torch.Generator().manual_seed(0))
    assert int(s.min()) == 0 and int(s.max()) == 48
    assert 0.2 < float((s == 0).float().mean()) < 0.3


# Checkpoints and baselines.

def test_sharded_checkpoint_loads(tmp_path):
    from deepinfer.models import loader

    m = small_model()
    info = T.save_checkpoint(m, tmp_path, {"dtype": "bfloat16"}, max_shard_bytes=60_000)
    assert len(info["files"]) > 1 and (tmp_path / "model.safetensors.index.json").exists()
    assert all(b <= 60_000 for b in info["file_bytes"].values())
    got = dict(loader.iter_weights(tmp_path))
    assert set(got) == set(dict(m.named_parameters()))
    for n, p in m.named_parameters():
        assert got[n].dtype == torch.bfloat16 and torch.equal(got[n], p.detach().to(torch.bfloat16))
    info = T.save_checkpoint(m, tmp_path, {"dtype": "bfloat16"})  # a later unsharded save leaves no stale shards
    assert info["files"] == ["model.safetensors"]
    assert sorted(p.name for p in tmp_path.glob("model*")) == ["model.safetensors"]
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"


def test_kneser_ney_is_a_distribution():
    demo = load_script()
    V, pad = 6, 5
    train = torch.randint(0, 5, (300,), generator=torch.Generator().manual_seed(7))
    for a in range(V):
        for b in range(V):
            tests = torch.tensor([[a, b, c] for c in range(V)])
            p = torch.stack([demo.kneser_ney_logprobs(train, t, V, pad)[-1] for t in tests]).exp()
            assert float(p.sum()) == pytest.approx(1.0, abs=1e-9), (a, b)
            assert bool((p > 0).all())


# The script, end to end.

def test_script_writes_a_checkpoint_that_loads_and_generates(tmp_path):
    from deepinfer import LLM, SamplingParams

    demo = load_script()
    out = tmp_path / "ckpt"
    ev = demo.main(["--out", str(out), "--max-files", "14", "--seq-len", "32", "--batch", "2", "--steps", "4",
                    "--minutes", "1", "--eval-frac", "0.05", "--sample-tokens", "4", "--device", "cpu",
                    "--log-every-s", "1000"])
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json", "train_log.jsonl",
              "loss.png", "eval.json", "heldout_files.txt", "heldout_sample.txt", "README.md"):
        assert (out / f).is_file(), f
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["dtype"] == "bfloat16" and cfg["tie_word_embeddings"] and cfg["architectures"] == ["CEDForCausalLM"]
    assert ev["model"]["checkpoint_bytes"] <= 18_000_000
    assert max(ev["model"]["files"].values()) <= 15_000_000
    steps = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    train_rows = [r for r in steps if "loss" in r]
    assert [r["step"] for r in train_rows] == [1, 2, 3, 4]
    assert all(set(r) >= {"step", "tokens", "loss", "ce", "index_kl", "lr", "elapsed"} for r in train_rows)
    for mode in ("exact", "bounded"):
        assert math.isfinite(ev["heldout"][mode]["bits_per_byte"]) and ev["heldout"][mode]["tokens"] > 0
        assert math.isfinite(ev["heldout_sample"][mode]["nats_per_token"])
    assert 0 < ev["baselines"]["gzip9"]["bits_per_byte"] < 8
    assert 0 < ev["baselines"]["kneser_ney_trigram"]["bits_per_byte"] < 8
    held = (out / "heldout_files.txt").read_text().split()
    assert held and all(h.endswith(".py") for h in held)
    assert (out / "heldout_sample.txt").read_text().strip()

    llm = LLM(str(out), num_kv_blocks=32, block_size=16, device="cpu")
    tok = llm.get_tokenizer()
    assert tok.bos_token_id == 0 and set(tok.eos_token_ids) == {1, 4} and tok.add_bos_token
    assert "<|im_start|>assistant" in tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                                              add_generation_prompt=True)
    res = llm.generate(["import os\n\ndef "], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
                       use_tqdm=False)
    assert len(res[0].outputs[0].token_ids) == 6
    # The engine's greedy tokens are the ones the checkpoint's own forward_full picks (bounded replay).
    net = llm.engine.model
    ids = tok.encode("import os\n\ndef ")
    with torch.no_grad():
        first = int(net.forward_full(torch.tensor(ids), replay_start=max(0, len(ids) - net.config.n_win))[-1].argmax())
    assert res[0].outputs[0].token_ids[0] == first

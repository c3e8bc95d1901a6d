"""The bundled demo model: loads with no arguments, is deterministic, and its held-out loss through the
engine stays at the figure recorded when it was trained (a regression test of the engine's numerics on
real weights)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.models.loader import DEMO_DIR

GOLDEN = json.loads((Path(__file__).parent / "data" / "demo_greedy.json").read_text())


@pytest.fixture(scope="module")
def demo():
    return LLM()


def test_demo_is_small_and_complete():
    files = {p.name: p.stat().st_size for p in DEMO_DIR.iterdir()}
    for name in ("config.json", "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json", "README.md", "eval.json", "train_log.jsonl", "loss.png"):
        assert name in files, name
    assert sum(files.values()) <= 20 * 10**6
    assert max(files.values()) < 16 * 2**20


def test_loads_without_arguments_and_greedy_is_reproducible(demo):
    assert demo.model_path == DEMO_DIR
    assert type(demo.engine.model).__name__ == "CEDForCausalLM"
    sp = SamplingParams(max_tokens=GOLDEN["max_tokens"], temperature=0)
    prompts = [c["prompt"] for c in GOLDEN["cases"]]
    first = demo.generate(prompts, sp, use_tqdm=False)
    again = demo.generate(prompts[::-1], sp, use_tqdm=False)[::-1]  # another batch order
    for case, a, b in zip(GOLDEN["cases"], first, again):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids == case["token_ids"]
        assert a.outputs[0].text == case["text"]


def _windows(ids, n=512, stride=256):
    """The training script's protocol: windows of n at stride n/2, each target scored once."""
    count = max(1, -(-(len(ids) - n) // stride) + 1)
    return [(ids[w * stride: w * stride + n], 1 if w == 0 else n - stride) for w in range(count)]


def test_heldout_sample_loss_stays_below_the_recorded_bound():
    recorded = json.loads((DEMO_DIR / "eval.json").read_text())["heldout_sample"]["exact"]["nats_per_token"]
    llm = LLM(hf_overrides={"replay_mode": "exact"}, max_num_batched_tokens=2048)
    tok = llm.tokenizer
    text = (DEMO_DIR / "heldout_sample.txt").read_text()
    ids = [tok.bos_token_id] + tok.encode(text, add_special_tokens=False) + [tok.eos_token_ids[0]]
    wins = _windows(ids)
    outs = llm.generate([w for w, _ in wins], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    nats, n = 0.0, 0
    for (win, first), o in zip(wins, outs):
        for p in range(first, len(win)):
            nats -= o.prompt_logprobs[p][win[p]].logprob
            n += 1
    assert n == len(ids) - 1
    got = nats / n
    assert got <= recorded * 1.005, f"held-out sample {got:.4f} nats/token, recorded {recorded:.4f}"
    assert got >= recorded * 0.98  # a much lower loss would mean the protocol changed, not the model improved


def test_quickstart_generate_command_runs():
    res = subprocess.run([sys.executable, "-m", "deepinfer.cli", "generate", "--max-tokens", "8", "--temperature", "0",
                          "def fibonacci(n):"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip()

"""scripts/pad_demo.py: the demo with widened shared experts computes what the demo computes (its drafter still
drafts for it), while each step reads the padding."""

import json
import sys
from pathlib import Path

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.testing.compare import NEAR_TIE, assert_same_or_near_tie

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import pad_demo  # noqa: E402


@pytest.fixture(scope="module")
def padded(tmp_path_factory):
    from deepinfer.models.loader import resolve_model_path

    src = resolve_model_path(None)
    out = tmp_path_factory.mktemp("padded")
    summary = pad_demo.pad(src, out, n_shared=4)
    return src, out, summary


def test_padded_checkpoint_widens_only_the_shared_experts(padded):
    src, out, summary = padded
    a, b = pad_demo.load_tensors(src), pad_demo.load_tensors(out)
    assert a.keys() == b.keys()
    cfg = json.loads((out / "config.json").read_text())
    Fe, d = cfg["moe_intermediate_size"], cfg["hidden_size"]
    assert cfg["n_shared_experts"] == 4 and summary["shared_intermediate"] == 4 * Fe
    for k in a:
        if k.endswith(".shared_w13"):
            assert b[k].shape == (2 * 4 * Fe, d)
            assert torch.equal(b[k][:Fe], a[k][:Fe]) and torch.equal(b[k][4 * Fe:5 * Fe], a[k][Fe:])
            assert b[k][Fe:4 * Fe].abs().sum() > 0  # real rows, read and multiplied
        elif k.endswith(".shared_w2"):
            assert b[k].shape == (d, 4 * Fe)
            assert torch.equal(b[k][:, :Fe], a[k]) and not b[k][:, Fe:].any()
        else:
            assert torch.equal(a[k], b[k]), k
    assert (out / "dspark" / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    with pytest.raises(ValueError, match="must exceed"):
        pad_demo.pad(src, out / "again", n_shared=1)


def test_padded_model_generates_what_the_demo_generates_and_its_drafts_stand(padded):
    src, out, _ = padded
    ps = ["import os\n\n\ndef ", "class Stack:\n    def __init__(self):\n        self.items = []\n"]
    ref = LLM(str(src)).generate(ps, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, logprobs=2),
                                 use_tqdm=False)
    sp = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    got = LLM(str(out)).generate(ps, sp, use_tqdm=False)
    spec = LLM(str(out), speculative_config={"method": "dspark", "num_speculative_tokens": 4})
    fast = spec.generate(ps, sp, use_tqdm=False)
    dtype = "bfloat16" if torch.cuda.is_available() else "float32"
    for a, b, r in zip(got, fast, ref):
        assert_same_or_near_tie(a.outputs[0].token_ids, r.outputs[0].token_ids, r.outputs[0].logprobs, NEAR_TIE[dtype])
        assert_same_or_near_tie(b.outputs[0].token_ids, r.outputs[0].token_ids, r.outputs[0].logprobs, NEAR_TIE[dtype])
    assert spec.spec_stats()["acceptance_rate"] > 0.1  # the demo's drafter drafts for it

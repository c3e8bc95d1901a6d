"""CED layers' input products joined into one (CEDLayer.fuse_input_projections / project_input): the loader joins
W_q_a, W_kv (and W_iw) into one tensor; the engine's products from it equal the separate products, the weights keep
their names and values, anything that re-seats a weight ends the fusion, and a checkpoint saved from a joined model
loads back (safetensors refuses shared storage)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from deepinfer import LLM, SamplingParams
from deepinfer.testing.ced import build_ced_checkpoint

CFG = dict(hidden_size=64, num_heads=2, head_dim=64, rope_dim=16, q_lora_rank=32, out_groups=2, out_group_dim=32,
           n_win=8, swa_allowance=2, index_heads=2, index_head_dim=32, index_topk=4, pool_block=2, pool_blocks=4,
           n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, num_layers=4, num_encoder_layers=2,
           layer_modes=("swa", "full", "full", "reindex"), max_position_embeddings=256)


def _llm(path):
    return LLM(str(path), device="cpu", block_size=4, num_kv_blocks=64, max_num_seqs=2, enable_prefix_caching=False)


def test_loader_joins_the_input_products(tmp_path):
    build_ced_checkpoint(tmp_path / "m", seed=1, **CFG)
    model = _llm(tmp_path / "m").engine.model
    files = load_file(str(tmp_path / "m" / "model.safetensors"))
    x = torch.randn(5, CFG["hidden_size"], generator=torch.Generator().manual_seed(0)).to(model.layers[0].wq_a.dtype)
    for i, layer in enumerate(model.layers):
        names = ["wq_a", "wkv"] + (["wiw"] if layer.mode in ("full", "reindex") else [])
        fused = layer._input_fused
        assert fused.shape[0] == sum(getattr(layer, n).shape[0] for n in names)
        for n in names:  # each weight is rows of the joined tensor, with the checkpoint's values
            w = getattr(layer, n)
            assert w.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()
            assert torch.equal(w.detach(), files[f"layers.{i}.{n}"].to(w.dtype))
        with torch.no_grad():
            parts = layer.project_input(x)
            assert parts is not None and (parts[2] is None) == (layer.wiw is None)
            for got, n in zip(parts, names):
                want = F.linear(x.double(), getattr(layer, n).double())
                assert got.shape == want.shape
                assert (got.double() - want).abs().max() <= 1e-2 * want.abs().max()


def test_reseating_a_weight_ends_the_fusion(tmp_path):
    build_ced_checkpoint(tmp_path / "m", seed=2, **CFG)
    layer = _llm(tmp_path / "m").engine.model.layers[1]
    x = torch.randn(3, CFG["hidden_size"]).to(layer.wq_a.dtype)
    with torch.no_grad():
        assert layer.project_input(x) is not None
        layer.wkv.data = layer.wkv.data.clone() + 1  # a new tensor: the joined one no longer holds it
        assert layer.project_input(x) is None
        # the layer's own products read the new weight
        y = layer.swa_kv(x, torch.arange(3))
        ref = layer.swa_kv(x, torch.arange(3), y=F.linear(x, layer.wkv))
        assert torch.equal(y, ref)
    layer.wq_a.requires_grad_(True)
    layer.fuse_input_projections()
    assert layer.project_input(x) is None  # under autograd: the joined tensor is no parameter
    with torch.no_grad():
        assert layer.project_input(x) is not None


def test_joined_model_saves_and_generates_as_loaded(tmp_path):
    build_ced_checkpoint(tmp_path / "m", seed=3, **CFG)
    llm = _llm(tmp_path / "m")
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22]]
    a = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    sd = llm.engine.model.hf_state_dict()
    out = tmp_path / "copy"
    out.mkdir()
    save_file(sd, str(out / "model.safetensors"))  # raises on shared storage
    back = load_file(str(out / "model.safetensors"))
    src = load_file(str(tmp_path / "m" / "model.safetensors"))
    assert back.keys() == src.keys() and all(torch.equal(back[k], src[k].to(back[k].dtype)) for k in src)
    # unjoined (the separate products): the same greedy tokens on this tiny model
    for layer in llm.engine.model.layers:
        layer._input_fused = None
    b = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert a == b

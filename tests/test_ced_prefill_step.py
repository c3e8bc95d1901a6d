"""Host work of a CED prefill step (engine_path.forward_engine) on the nvidia backend's CUDA dispatch, run on the CPU
under Triton's interpreter with the dispatch CUDA tensors get (deepinfer.testing.ced.as_on_cuda: CEDLayer._kernels
returns the ops). A prefix hit whose encoder state the encoder-SWA pool restores:
- its index lists reach the device in two host-to-device copies (engine_path.Upload: the passes' before the
  first layer, the compression plans' once the SWA-only first layer is queued), and it runs no op that would
  wait for the device on CUDA (a scalar read, nonzero, boolean-mask indexing, unique);
- its SWA keys run the decode step's one-kernel op (before attention with the ring writes on the scratch slot,
  after it with the real ones), its compression the fused compress-write, its residual adds ride on the norms'
  kernel; and it leaves the rings, the encoder outputs and the paged entries as the composition leaves them,
  with the same hidden states;
- in batch-invariant mode the SWA key is the composition (no fused CED op runs)."""

from __future__ import annotations

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from deepinfer.testing.kernels import skip_module_without_kernels

skip_module_without_kernels()
if not __import__("deepinfer.backends.nvidia.ops", fromlist=["INTERPRET"]).INTERPRET:
    # The CUDA dispatch run on CPU tensors: only under Triton's interpreter. On a GPU the real dispatch's copies
    # and syncs are what benchmarks/profile_prefill.py reports (its ``forward`` field).
    pytest.skip("runs the CUDA dispatch on the CPU under TRITON_INTERPRET=1", allow_module_level=True)

from deepinfer import LLM, SamplingParams  # noqa: E402
from deepinfer.models.ced import engine_path  # noqa: E402
from deepinfer.testing.ced import REPLAY_CONFIG, as_on_cuda, build_ced_checkpoint  # noqa: E402

# A block boundary (block_size 4) past the SWA window: the encoder-SWA pool snapshots the state there. Its 12
# compressed entries (ratio 2) are 3x index_topk, so the hit's attention still selects (40 cost ~14 s a run).
PREFIX = 24
SYNCING = {"_local_scalar_dense", "nonzero", "masked_select", "_unique2", "unique_dim", "unique_consecutive",
           "is_nonzero", "equal", "masked_scatter"}


class Syncs(TorchDispatchMode):
    """Ops that would make the host wait for the device on CUDA."""

    def __init__(self):
        super().__init__()
        self.seen = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        bool_index = name in ("index", "index_put", "index_put_") and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or []) if i is not None)
        if name in SYNCING or bool_index or (name == "repeat_interleave" and "output_size" not in (kwargs or {})):
            self.seen[name] += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def ced(tmp_path_factory):
    d = tmp_path_factory.mktemp("ced_prefill_step")
    cfg = build_ced_checkpoint(d, seed=5, **REPLAY_CONFIG)
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(3, cfg.vocab_size, (PREFIX + 12,), generator=g).tolist()
    # The hit ends on a block boundary, so its prefill is the one chunk compared (a tail past the boundary would
    # be a second, unread chunk: ~15 s of interpreter per run).
    return str(d), cfg, ids[:PREFIX + 1], ids[:PREFIX] + ids[PREFIX + 1:PREFIX + 9]


def hit_step(ced, monkeypatch, fused: bool = True, invariant: bool = False, dtype: str = "float32"):
    """Serve the prefix, then the hit; returns what the hit's prefill forward saw and left behind."""
    path, cfg, first, hit = ced
    llm = LLM(path, backend="nvidia", device="cpu", dtype=dtype, num_kv_blocks=64, block_size=4, max_num_seqs=2,
              host_cache_gb=0.01, enable_prefix_caching=True)
    ops = llm.engine.ops
    ops.batch_invariant = invariant
    if not fused:  # the composition (the path before the fused SWA key): the equivalence's oracle
        monkeypatch.setattr(engine_path.Pass, "_fused_swa", lambda self, layer, x, ops: False)
    sp = SamplingParams(max_tokens=1, temperature=0.0)
    got = {}
    inner = engine_path.forward_engine
    real_copy = engine_path.to_device

    def copy(*a, **k):
        if got.get("inside"):
            got["copies"] += 1
        return real_copy(*a, **k)

    def forward(model, input_ids, meta, cache):
        if not got.get("armed") or "out" in got:
            return inner(model, input_ids, meta, cache)
        got["copies"], got["calls"] = 0, collections.Counter(ops.kernel_calls)
        syncs = Syncs()
        got["inside"] = True
        with syncs:
            out = inner(model, input_ids, meta, cache)
        got["inside"] = False
        got["syncs"], got["out"], got["calls"] = syncs.seen, out.clone(), ops.kernel_calls - got["calls"]
        slot = meta.state_slots[0]
        got["ring"] = {l: (c[slot].clone(), s[slot].clone()) for l, (c, s) in cache.ring.items()}
        got["henc"] = cache.henc[slot].clone()
        got["kv"] = {l: (c.clone(), s.clone()) for l, (c, s) in cache.kv.items()}
        got["meta"] = (list(meta.starts), list(meta.nums), list(meta.enc_restored), list(meta.write_floors))
        return out

    monkeypatch.setattr(engine_path, "forward_engine", forward)
    monkeypatch.setattr(engine_path, "to_device", copy)
    real_staged = engine_path.staged_copy

    def staged(*a, **k):  # (the step's index lists go through the reused pinned buffers)
        if got.get("inside"):
            got["copies"] += 1
        return real_staged(*a, **k)

    monkeypatch.setattr(engine_path, "staged_copy", staged)
    # The prefix is served on the plain CPU dispatch (the interpreter would take a minute over it): the hit
    # steps compared here all start from the state it leaves.
    llm.generate([first], sp, use_tqdm=False)
    with as_on_cuda():
        got["armed"] = True
        llm.generate([hit], sp, use_tqdm=False)
    assert llm.cache_stats()["swa_restores"] >= 1
    starts, nums, restored, floors = got["meta"]
    assert starts == [PREFIX] and nums[0] > 1 and restored == [True] and floors == [PREFIX], got["meta"]
    monkeypatch.undo()
    return got


@pytest.fixture(scope="module")
def fused_hit(ced):
    """The fused hit step, run once for the tests that read it (each run is ~80 s under the interpreter)."""
    with pytest.MonkeyPatch.context() as mp:
        return hit_step(ced, mp)


def test_a_hit_step_copies_twice_and_never_waits(fused_hit):
    got = fused_hit
    assert REPLAY_CONFIG["layer_modes"][0] == "swa"  # (the plans' copy comes once that layer is queued)
    assert got["copies"] == 2, got["copies"]
    assert not got["syncs"], dict(got["syncs"])
    L, E = REPLAY_CONFIG["num_layers"], REPLAY_CONFIG["num_encoder_layers"]
    calls = got["calls"]
    assert calls["ced_swa_kv"] == 2 * L  # each layer's SWA key: before attention, then its ring write
    assert calls["ced_compress_write"] > 0 and calls["ced_add_rms_norm"] >= L - 2
    # (each layer's MoE output added by the next layer's norm kernel: every layer but the encoder's and
    # the decoder's last)
    assert calls["ced_add_rms_norm"] == L + (E - 1) + (L - E - 1), dict(calls)
    assert calls["ced_add"] + calls["ced_add_pairs"] == 2, dict(calls)  # finish: the encoder's and the decoder's


def test_the_fused_prefill_leaves_the_composition_state(ced, fused_hit, monkeypatch):
    fused = fused_hit
    comp = hit_step(ced, monkeypatch, fused=False)
    assert fused["calls"]["ced_swa_kv"] > 0 and comp["calls"]["ced_swa_kv"] == 0
    for l in comp["ring"]:
        for a, b in zip(fused["ring"][l], comp["ring"][l]):
            assert torch.equal(a, b), f"ring of layer {l}"
    for l in comp["kv"]:
        for a, b in zip(fused["kv"][l], comp["kv"][l]):
            assert torch.equal(a, b), f"entries of layer {l}"
    assert torch.equal(fused["henc"], comp["henc"])
    torch.testing.assert_close(fused["out"], comp["out"], rtol=1e-5, atol=1e-5)


def test_batch_invariant_prefill_runs_the_composition(ced, monkeypatch):
    got = hit_step(ced, monkeypatch, invariant=True)
    calls = got["calls"]
    assert got["copies"] == 2 and not got["syncs"]
    assert not any(calls[k] for k in ("ced_swa_kv", "ced_add_rms_norm", "ced_compress_write", "ced_add",
                                      "ced_add_pairs")), dict(calls)


def test_upload_copies_what_was_added_since_its_last_copy(monkeypatch):
    copies = []
    real = engine_path._on_device
    monkeypatch.setattr(engine_path, "_on_device",
                        lambda lists, device: copies.append(len(lists)) or real(lists, device))
    up = engine_path.Upload("cpu")
    i = up.add([1, 2], [3])
    assert up.get(i + 1).tolist() == [3] and up.get(i).tolist() == [1, 2] and copies == [2]
    j = up.add([4], [], [5, 6, 7])
    assert j == 2 and up.get(i).tolist() == [1, 2] and copies == [2]  # (nothing copied before it is read)
    assert up.get(j + 2).tolist() == [5, 6, 7] and copies == [2, 3]
    assert up.get(j).tolist() == [4] and up.get(j + 1).tolist() == [] and up.get(i + 1).tolist() == [3]
    assert copies == [2, 3]

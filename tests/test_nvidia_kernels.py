"""The nvidia backend's Triton kernels against the reference ops (and against float64 oracles).

Without CUDA the kernels run on the CPU through Triton's interpreter (TRITON_INTERPRET=1, set in conftest.py before
any kernel module is imported), on tiny generated shapes; with CUDA the same property tests run compiled
kernels, and the GPU-only tests add realistic shapes, bf16/fp16 tolerances and CUDA-graph capture.

Error bounds (docs: METHOD.md): float32 kernels are compared with a float64 oracle by
||out - ref|| / ||ref|| well under 1e-3 (here 1e-5) and elementwise with the reference op; bf16/fp16
attention under 1e-2. Norm and activation kernels round exactly where the reference rounds, so low
precision outputs may differ from it by at most two units in the last place (float32 sums in another
order). The FP8 KV kernels must be bit-exact with reference.lowbit. Every kernel output is checked on
fresh random data, with the caches' unused rows poisoned with NaN and the allocator's free memory
poisoned before the launch. A compile test builds every kernel for sm_90 (no GPU needed) and reads the
SASS, since CPU CI otherwise never runs the compiled code path.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import example, given, strategies as st

from deepinfer.testing.kernels import (DEV, HAS_CUDA, capture_graph, examples, gen, gpu, poison_free_memory, rel_err,
                                       run_compile_script, skip_module_without_kernels)

skip_module_without_kernels()

from deepinfer.backends.base import AttnMetadata  # noqa: E402
from deepinfer.backends.nvidia import triton_act, triton_attention, triton_kvquant, triton_norm  # noqa: E402
from deepinfer.backends.nvidia.ops import NvidiaOps  # noqa: E402
from deepinfer.backends.reference import lowbit  # noqa: E402
from deepinfer.backends.reference.ops import ReferenceOps  # noqa: E402

REF = ReferenceOps(DEV)
OPS = NvidiaOps(DEV)
FAST = examples(20)


def ulp_close(out: torch.Tensor, ref: torch.Tensor, ulps: int = 2, rounded: torch.dtype = None) -> None:
    """Same dtype and every element within `ulps` units in the last place of the reference (float32 exact
    values compare at a few float32 ulps: the reduction order differs). ``rounded``: the values passed
    through that (lower) precision on the way (RMSNorm rounds x-normalised to x's dtype before a float32
    weight multiplies it), so a reduction-order difference at a rounding tie moves them by its ulps."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert not torch.isnan(out).any()
    eps = torch.finfo(rounded or ref.dtype).eps
    if ref.dtype == torch.float32 and rounded in (None, torch.float32):
        ulps, tiny = 8, 1e-6
    else:
        tiny = torch.finfo(ref.dtype).tiny
    diff = (out.double() - ref.double()).abs()
    bound = ulps * eps * ref.double().abs() + tiny
    assert bool((diff <= bound).all()), f"max diff {diff.max().item():.3g}, worst ratio {(diff / bound).max():.3g}"


# ------------------------------------------------------------------------------------------- norms
dtypes = st.sampled_from([torch.float32, torch.bfloat16, torch.float16])


@FAST
@given(rows=st.integers(1, 5), n=st.sampled_from([16, 48, 100, 128, 257]), dtype=dtypes,
       w_fp32=st.booleans(), eps=st.sampled_from([1e-6, 1e-5]), lead3=st.booleans(), seed=st.integers(0, 2**16))
@example(rows=3, n=257, dtype=torch.float16, w_fp32=True, eps=1e-5, lead3=False, seed=4561)  # a rounding tie
def test_rms_norm_matches_reference(rows, n, dtype, w_fp32, eps, lead3, seed):
    g = gen(seed)
    shape = (rows, 2, n) if lead3 else (rows, n)
    x = (torch.randn(shape, generator=g) * 3).to(dtype).to(DEV)
    w = (1 + 0.5 * torch.randn(n, generator=g)).to(torch.float32 if w_fp32 else dtype).to(DEV)
    x0 = x.clone()
    poison_free_memory(x.numel() * 4)
    out = triton_norm.rms_norm(x, w, eps)
    ref = REF.rms_norm(x, w, eps)
    assert torch.equal(x, x0)
    ulp_close(out, ref, rounded=x.dtype)


@FAST
@given(rows=st.integers(1, 5), n=st.sampled_from([16, 64, 96, 130]), dtype=dtypes, seed=st.integers(0, 2**16))
def test_add_rms_norm_matches_reference(rows, n, dtype, seed):
    g = gen(seed)
    x = (torch.randn(rows, n, generator=g) * 2).to(dtype).to(DEV)
    r = (torch.randn(rows, n, generator=g) * 2).to(dtype).to(DEV)
    w = (1 + 0.5 * torch.randn(n, generator=g)).to(dtype).to(DEV)
    x0, r0 = x.clone(), r.clone()
    poison_free_memory(x.numel() * 8)
    out, h = triton_norm.add_rms_norm(x, r, w, 1e-6)
    ref_out, ref_h = REF.add_rms_norm(x, r, w, 1e-6)
    assert torch.equal(x, x0) and torch.equal(r, r0), "inputs must not be modified"
    assert torch.equal(h, ref_h), "the residual sum rounds exactly like the reference's"
    ulp_close(out, ref_out)


def test_rms_norm_non_contiguous_rows():
    """q/k norms see a strided view ([T, H, D] split out of the fused qkv projection)."""
    qkv = torch.randn(3, 5 * 16, generator=gen(0)).to(DEV)
    q = qkv[:, :4 * 16].view(3, 4, 16)
    w = torch.randn(16, generator=gen(1)).to(DEV)
    ulp_close(triton_norm.rms_norm(q, w, 1e-6), REF.rms_norm(q, w, 1e-6))


# ------------------------------------------------------------------------------------------- activation
@FAST
@given(rows=st.integers(1, 6), f=st.sampled_from([1, 8, 33, 64, 1100]), dtype=dtypes, lead3=st.booleans(),
       seed=st.integers(0, 2**16))
def test_silu_and_mul_matches_reference(rows, f, dtype, lead3, seed):
    g = gen(seed)
    shape = (rows, 2, 2 * f) if lead3 else (rows, 2 * f)
    x = (torch.randn(shape, generator=g) * 4).to(dtype).to(DEV)
    poison_free_memory(x.numel() * 2)
    out = triton_act.silu_and_mul(x)
    ulp_close(out, REF.silu_and_mul(x))


# ------------------------------------------------------------------------------------------- FP8 KV quant
def interesting_values(g: torch.Generator, rows: int, C: int) -> torch.Tensor:
    """Random values over wide magnitudes per group, with exact E4M3 grid points and midpoints (ties),
    zero and -0.0 groups, float32 subnormals and exact powers of two mixed in."""
    x = torch.randn(rows, C, generator=g)
    mag = torch.pow(2.0, torch.randint(-140, 120, (rows, C // 32, 1), generator=g).float())
    x = (x.view(rows, C // 32, 32) * mag).view(rows, C)
    grid = torch.tensor([m / 8 * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
                         for e in range(16) for m in range(8) if (e, m) != (15, 7)])
    mids = (grid[:-1] + grid[1:]) / 2
    pick = torch.randint(0, 4, (rows, C), generator=g)
    special = torch.where(pick == 0, grid[torch.randint(0, len(grid), (rows, C), generator=g)],
                          mids[torch.randint(0, len(mids), (rows, C), generator=g)])
    sign = torch.where(torch.rand(rows, C, generator=g) < 0.5, -1.0, 1.0)
    scale = torch.pow(2.0, torch.randint(-20, 20, (rows, C // 32, 1), generator=g).float())
    special = (special * sign).view(rows, C // 32, 32) * scale
    use = (torch.rand(rows, C // 32, 1, generator=g) < 0.4).expand(rows, C // 32, 32)
    x = torch.where(use, special, x.view(rows, C // 32, 32)).view(rows, C)
    if rows * C >= 64:
        x.view(-1)[:32] = 0.0  # an all-zero group
        x.view(-1)[3] = -0.0
        x.view(-1)[32:64] = torch.randn(32, generator=g) * 2.0**-135  # subnormal float32 group
    return x


@FAST
@given(rows=st.integers(1, 6), groups=st.integers(1, 5), dtype=dtypes, sliced=st.booleans(),
       seed=st.integers(0, 2**16))
def test_fp8_quantize_bit_exact(rows, groups, dtype, sliced, seed):
    C = 32 * groups
    x = interesting_values(gen(seed), rows, C)
    if dtype != torch.float32:
        x = x.clamp(-6e4, 6e4) if dtype == torch.float16 else x
    if sliced:  # rows further apart than their channels (the kernel's row stride)
        x = torch.cat([x, torch.full_like(x[:, :32], 7.0)], dim=1)[:, :C]
    x = x.to(dtype).to(DEV)
    codes, scales = triton_kvquant.quantize_fp8_pow2(x)
    ref_codes, ref_scales = lowbit.quantize(x.cpu(), "fp8_e4m3_pow2")
    assert codes.dtype == torch.uint8 and scales.dtype == torch.uint8
    assert torch.equal(scales.cpu(), ref_scales)
    assert torch.equal(codes.cpu(), ref_codes)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # scale bytes near 254: inf, as the reference
@FAST
@given(lead=st.lists(st.integers(1, 3), min_size=1, max_size=3), groups=st.integers(1, 4),
       dtype=dtypes, seed=st.integers(0, 2**16))
def test_fp8_dequantize_bit_exact(lead, groups, dtype, seed):
    g = gen(seed)
    C = 32 * groups
    codes = torch.randint(0, 256, (*lead, C), generator=g, dtype=torch.uint8)
    scales = torch.randint(0, 256, (*lead, groups), generator=g, dtype=torch.uint8)
    # Scale bytes near both ends too (the subnormal 2^-127 and the largest ones).
    scales = torch.where(torch.rand(scales.shape, generator=g) < 0.3, scales % 8, scales)
    out = triton_kvquant.dequantize_fp8_pow2(codes.to(DEV), scales.to(DEV), dtype)
    ref = lowbit.dequantize(codes, scales, "fp8_e4m3_pow2", dtype)
    out = out.cpu()
    assert out.dtype == dtype
    nan = torch.isnan(ref)
    assert torch.equal(torch.isnan(out), nan)
    assert torch.equal(out[~nan], ref[~nan])
    assert torch.equal(torch.signbit(out[~nan]), torch.signbit(ref[~nan]))  # -0.0 stays -0.0


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the largest values round up to inf
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp8_quantize_every_16bit_value(dtype):
    """Every finite bf16 / fp16 bit pattern, in groups of neighbours and in shuffled groups: bit-exact both ways."""
    bits = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(dtype)
    x = bits[torch.isfinite(bits.float())]
    x = x[: x.numel() // 256 * 256]
    x = torch.cat([x, x[torch.randperm(x.numel(), generator=gen(0))]]).view(-1, 256)  # 8 groups per row
    codes, scales = triton_kvquant.quantize_fp8_pow2(x.to(DEV))
    ref_codes, ref_scales = lowbit.quantize(x, "fp8_e4m3_pow2")
    assert torch.equal(codes.cpu(), ref_codes) and torch.equal(scales.cpu(), ref_scales)
    back = triton_kvquant.dequantize_fp8_pow2(codes, scales, dtype).cpu()
    ref = lowbit.dequantize(ref_codes, ref_scales, "fp8_e4m3_pow2", dtype)
    assert torch.equal(back, ref) and torch.equal(torch.signbit(back), torch.signbit(ref))


def test_fp8_round_trip_through_ops():
    x = interesting_values(gen(3), 4, 96).to(DEV)
    codes, scales = OPS.quantize_kv(x, "fp8_e4m3_pow2")
    back = OPS.dequantize_kv(codes, scales, "fp8_e4m3_pow2")
    assert torch.equal(back.cpu(), lowbit.fake_quantize(x.cpu(), "fp8_e4m3_pow2"))
    # Other formats go to the reference code.
    c4, s4 = OPS.quantize_kv(x.cpu(), "mxfp4")
    ref4 = lowbit.quantize(x.cpu(), "mxfp4")
    assert torch.equal(c4, ref4[0]) and torch.equal(s4, ref4[1])


# ------------------------------------------------------------------------------------------- decode attention
def decode_case(g, lens, block_size, H, Hk, D, Dv, dtype, extra_width=0, mla=False):
    """A decode batch over a shuffled paged cache: (q, k_cache, v_cache, meta, clean caches). Cache rows no
    visible key uses are NaN in the returned caches (clean copies have random values there)."""
    B = len(lens)
    need = [-(-n // block_size) for n in lens]
    width = max(need) + extra_width
    total = sum(need) + 3
    perm = torch.randperm(total, generator=g)
    bt = torch.zeros(B, width, dtype=torch.long)
    used, k = [], 0
    for b, n in enumerate(need):
        bt[b, :n] = perm[k:k + n]
        k += n
    slots = total * block_size
    kc = torch.randn(slots, Hk, D, generator=g)
    vc = torch.randn(slots, Hk, Dv, generator=g)
    lens_t = torch.tensor(lens)
    q_pos = (lens_t - 1)[:, None]
    max_kv = width * block_size
    kv_pos = torch.arange(max_kv)
    kv_slots = bt[:, kv_pos // block_size] * block_size + kv_pos % block_size
    for b, n in enumerate(lens):
        used.append(kv_slots[b, :n])
    visible = torch.zeros(slots, dtype=torch.bool)
    visible[torch.cat(used)] = True
    q = torch.randn(B, H, D, generator=g)
    to = dict(device=DEV)
    if mla:  # V is the first Dv channels of K's storage
        kc_clean = kc.to(dtype).to(**to)
        vc_clean = kc_clean[..., :Dv]
        kc_p = kc.clone()
        kc_p[~visible] = float("nan")
        kc_p = kc_p.to(dtype).to(**to)
        vc_p = kc_p[..., :Dv]
    else:
        kc_clean, vc_clean = kc.to(dtype).to(**to), vc.to(dtype).to(**to)
        kc_p, vc_p = kc.clone(), vc.clone()
        kc_p[~visible] = float("nan")
        vc_p[~visible] = float("nan")
        kc_p, vc_p = kc_p.to(dtype).to(**to), vc_p.to(dtype).to(**to)
    meta = AttnMetadata(positions=q_pos[:, 0].to(**to), slot_mapping=kv_slots[torch.arange(B), q_pos[:, 0]].to(**to),
                        seq_lens=lens_t.to(**to), q_index=torch.arange(B)[:, None].to(**to),
                        q_valid=torch.ones(B, 1, dtype=torch.bool, device=DEV), kv_slots=kv_slots.to(**to),
                        q_pos=q_pos.to(**to), block_table=bt.to(**to), block_size=block_size)
    return q.to(dtype).to(**to), kc_p, vc_p, meta, kc_clean, vc_clean


def oracle_decode(q, kc, vc, meta, scale, window, sinks):
    """float64, row by row, gathering only the visible keys through the block table."""
    B, H, D = q.shape
    Hk = kc.shape[1]
    G = H // Hk
    bs = meta.block_size
    out = torch.zeros(B, H, vc.shape[-1], dtype=torch.float64)
    bt, lens, qpos = meta.block_table.cpu(), meta.seq_lens.cpu(), meta.q_pos[:, 0].cpu()
    kc64, vc64, q64 = kc.cpu().double(), vc.cpu().double(), q.cpu().double()
    for b in range(B):
        pos = torch.arange(int(lens[b]))
        pos = pos[pos <= qpos[b]]
        if window is not None:
            pos = pos[pos > qpos[b] - window]
        slots = bt[b, pos // bs] * bs + pos % bs
        K, V = kc64[slots], vc64[slots]  # [n, Hk, D], [n, Hk, Dv]
        for h in range(H):
            s = K[:, h // G] @ q64[b, h] * scale
            if sinks is not None:
                s = torch.cat([s, sinks[h].cpu().double().reshape(1)])
            p = torch.softmax(s, 0)[: len(pos)]
            out[b, h] = p @ V[:, h // G]
    return out


@examples(30)
@given(lens=st.lists(st.integers(1, 41), min_size=1, max_size=4), block_size=st.sampled_from([4, 8, 16]),
       Hk=st.sampled_from([1, 2]), G=st.sampled_from([1, 2, 3, 4]), D=st.sampled_from([16, 32, 64]),
       window=st.one_of(st.none(), st.integers(1, 12)), with_sinks=st.booleans(),
       splits=st.sampled_from([None, 1, 2, 3]), extra_width=st.integers(0, 2), seed=st.integers(0, 2**16))
def test_paged_decode_float32(lens, block_size, Hk, G, D, window, with_sinks, splits, extra_width, seed):
    g = gen(seed)
    H = Hk * G
    q, kc, vc, meta, kc_clean, vc_clean = decode_case(g, lens, block_size, H, Hk, D, D, torch.float32, extra_width)
    sinks = (torch.randn(H, generator=g) * 2).to(DEV) if with_sinks else None
    scale = D ** -0.5
    poison_free_memory(q.numel() * 4 * 8)
    out = triton_attention.paged_decode(q, kc, vc, meta.block_table, block_size, meta.seq_lens, meta.q_pos[:, 0],
                                        scale, window, sinks, num_splits=splits)
    assert out.shape == (len(lens), H, D) and out.dtype == torch.float32
    ref64 = oracle_decode(q, kc, vc, meta, scale, window, sinks)
    assert rel_err(out, ref64) < 1e-5
    ref = REF.paged_attention(q, kc_clean, vc_clean, meta, scale, window, sinks)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


@examples(12)
@given(lens=st.lists(st.integers(1, 30), min_size=1, max_size=3), block_size=st.sampled_from([4, 16]),
       G=st.sampled_from([1, 4]), dtype=st.sampled_from([torch.bfloat16, torch.float16]),
       window=st.one_of(st.none(), st.integers(1, 9)), with_sinks=st.booleans(), seed=st.integers(0, 2**16))
def test_paged_decode_low_precision(lens, block_size, G, dtype, window, with_sinks, seed):
    g = gen(seed)
    Hk, D = 2, 32
    H = Hk * G
    q, kc, vc, meta, _, _ = decode_case(g, lens, block_size, H, Hk, D, D, dtype)
    sinks = torch.randn(H, generator=g).to(DEV) if with_sinks else None
    out = OPS.paged_attention(q, kc, vc, meta, D ** -0.5, window, sinks)
    assert out.dtype == dtype
    assert rel_err(out, oracle_decode(q, kc, vc, meta, D ** -0.5, window, sinks)) < 1e-2


@examples(8)
@given(lens=st.lists(st.integers(1, 25), min_size=1, max_size=3), r=st.sampled_from([16, 32]),
       rope=st.sampled_from([8, 16]), H=st.sampled_from([1, 4]), seed=st.integers(0, 2**16))
def test_paged_decode_mla_strided_values(lens, r, rope, H, seed):
    """MLA: one KV head, key = the whole latent row (r + rope channels, not a power of two), value = a
    strided view of its first r channels."""
    g = gen(seed)
    D = r + rope
    q, kc, vc, meta, kc_clean, vc_clean = decode_case(g, lens, 4, H, 1, D, r, torch.float32, mla=True)
    assert vc.data_ptr() == kc.data_ptr() and not vc.is_contiguous()
    out = OPS.paged_attention(q, kc, vc, meta, 0.2)
    assert rel_err(out, oracle_decode(q, kc, vc, meta, 0.2, None, None)) < 1e-5
    torch.testing.assert_close(out, REF.paged_attention(q, kc_clean, vc_clean, meta, 0.2), rtol=1e-4, atol=1e-5)


def test_ops_dispatch_decode_kernel_and_prefill_fallback():
    g = gen(7)
    q, kc, vc, meta, kc_clean, vc_clean = decode_case(g, [5, 12], 4, 4, 2, 16, 16, torch.float32)
    ops = NvidiaOps(DEV)
    ops.paged_attention(q, kc, vc, meta, 0.25)
    assert ops.kernel_calls["paged_attention"] == 1
    # A prefill step (several queries per row) goes to the reference op: same function, no kernel call.
    B, max_q = 2, 3
    lens = torch.tensor([5, 12])
    q_pos = lens[:, None] - max_q + torch.arange(max_q)[None, :]
    q_index = torch.arange(B * max_q).view(B, max_q)
    pre = AttnMetadata(positions=q_pos.reshape(-1).to(DEV), slot_mapping=meta.slot_mapping, seq_lens=meta.seq_lens,
                       q_index=q_index.to(DEV), q_valid=torch.ones(B, max_q, dtype=torch.bool, device=DEV),
                       kv_slots=meta.kv_slots, q_pos=q_pos.to(DEV), block_table=meta.block_table,
                       block_size=meta.block_size)
    qp = torch.randn(B * max_q, 4, 16, generator=g).to(DEV)
    out = ops.paged_attention(qp, kc_clean, vc_clean, pre, 0.25)
    assert ops.kernel_calls["paged_attention"] == 1
    assert torch.equal(out, REF.paged_attention(qp, kc_clean, vc_clean, pre, 0.25))
    # Unsupported dtype: reference op.
    q64, k64, v64 = q.double(), kc_clean.double(), vc_clean.double()
    torch.testing.assert_close(ops.paged_attention(q64, k64, v64, meta, 0.25),
                               REF.paged_attention(q64, k64, v64, meta, 0.25))
    assert ops.kernel_calls["paged_attention"] == 1


def test_backend_registered_and_lazy():
    import subprocess
    import sys

    code = ("import sys, deepinfer; from deepinfer.core.plugins import get_registry; "
            "r = get_registry(); assert 'nvidia' in r.names('backend'); "
            "assert 'triton' not in sys.modules, 'import deepinfer must not import triton'")
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    from deepinfer.core.plugins import get_registry

    entry = get_registry().get("backend", "nvidia")
    assert entry.available() == HAS_CUDA
    assert isinstance(entry.obj(str(DEV)), NvidiaOps)


# ------------------------------------------------------------------------------------------- end to end
# GQA; sliding window (window 12: 14 new tokens after the 3-token prompt make decode slide); MLA (strided V). Each
# decode step costs seconds in Triton's interpreter, so the others decode 6 (past a 4-token block either way).
@pytest.mark.parametrize("arch,max_tokens", [("llama", 6), ("mistral", 14), ("deepseek_v2", 6)])
def test_llm_greedy_tokens_match_reference(tmp_path, arch, max_tokens):
    from deepinfer import LLM, SamplingParams
    from deepinfer.testing.models import build_tiny_hf_model

    pytest.importorskip("transformers")
    build_tiny_hf_model(tmp_path, arch)
    g = gen(11)
    prompts = [torch.randint(5, 500, (n,), generator=g).tolist() for n in (3, 17, 9)]
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    tokens = {}
    for backend in ("reference", "nvidia"):
        llm = LLM(str(tmp_path), backend=backend, device=str(DEV), num_kv_blocks=64, block_size=4)
        tokens[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        if backend == "nvidia":
            calls = llm.engine.ops.kernel_calls
            decode = calls["mla_decode"] if arch.startswith("deepseek") else calls["paged_attention"]
            assert decode > 0 and calls["paged_prefill"] > 0 and calls["silu_and_mul"] > 0 \
                and calls["add_rms_norm"] > 0
    assert tokens["nvidia"] == tokens["reference"]


# ------------------------------------------------------------------------------------------- GPU only
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window,with_sinks", [(None, False), (700, True)])
def test_gpu_paged_decode_llama8b_shape(dtype, window, with_sinks):
    g = gen(1)
    lens = [1, 17, 1000, 2049, 513, 4096, 77, 3000]
    q, kc, vc, meta, _, _ = decode_case(g, lens, 16, 32, 8, 128, 128, dtype, extra_width=3)
    sinks = torch.randn(32, generator=g).to(DEV) if with_sinks else None
    want = oracle_decode(q, kc, vc, meta, 128 ** -0.5, window, sinks)
    for splits in (None, 1, 7):
        out = triton_attention.paged_decode(q, kc, vc, meta.block_table, 16, meta.seq_lens, meta.q_pos[:, 0],
                                            128 ** -0.5, window, sinks, num_splits=splits)
        torch.cuda.synchronize()
        assert rel_err(out, want) < 1e-2


@gpu
def test_gpu_paged_decode_float32_and_mla():
    g = gen(2)
    q, kc, vc, meta, _, _ = decode_case(g, [300, 1, 999], 16, 16, 2, 128, 128, torch.float32)
    out = OPS.paged_attention(q, kc, vc, meta, 0.1, None, None)
    assert rel_err(out, oracle_decode(q, kc, vc, meta, 0.1, None, None)) < 1e-5
    q, kc, vc, meta, _, _ = decode_case(g, [64, 700, 5], 16, 16, 1, 576, 512, torch.bfloat16, mla=True)
    out = OPS.paged_attention(q, kc, vc, meta, 576 ** -0.5)
    assert rel_err(out, oracle_decode(q, kc, vc, meta, 576 ** -0.5, None, None)) < 1e-2


@gpu
def test_gpu_paged_decode_in_cuda_graph():
    """The launch has no host sync and its split count depends on shapes only: capture once, replay with
    other lengths and block tables."""
    g = gen(3)
    lens = [40, 900, 7, 256]
    q, kc, vc, meta, kc_clean, vc_clean = decode_case(g, lens, 16, 8, 2, 64, 64, torch.bfloat16, extra_width=4)
    static = dict(q=q.clone(), bt=meta.block_table.clone(), lens=meta.seq_lens.clone(), pos=meta.q_pos[:, 0].clone())

    def run():
        return triton_attention.paged_decode(static["q"], kc_clean, vc_clean, static["bt"], 16, static["lens"],
                                             static["pos"], 0.125)

    graph, out = capture_graph(run)
    for new_lens in ([40, 900, 7, 256], [1, 1, 1, 1], [33, 64, 950, 2]):
        lt = torch.tensor(new_lens, device=DEV)
        static["lens"].copy_(lt)
        static["pos"].copy_(lt - 1)
        static["q"].copy_(torch.randn(q.shape, generator=g).to(q))
        graph.replay()
        torch.cuda.synchronize()
        m = AttnMetadata(positions=lt - 1, slot_mapping=meta.slot_mapping, seq_lens=lt, q_index=meta.q_index,
                         q_valid=meta.q_valid, kv_slots=meta.kv_slots, q_pos=(lt - 1)[:, None],
                         block_table=static["bt"], block_size=16)
        assert rel_err(out, oracle_decode(static["q"], kc_clean, vc_clean, m, 0.125, None, None)) < 1e-2


@gpu
def test_gpu_norm_act_quant_realistic_shapes():
    g = gen(4)
    x = torch.randn(256, 4096, generator=g).to(DEV, torch.bfloat16)
    r = torch.randn(256, 4096, generator=g).to(DEV, torch.bfloat16)
    w = (1 + 0.1 * torch.randn(4096, generator=g)).to(DEV, torch.bfloat16)
    ulp_close(OPS.rms_norm(x, w, 1e-5), REF.rms_norm(x, w, 1e-5))
    out, h = OPS.add_rms_norm(x, r, w, 1e-5)
    ref_out, ref_h = REF.add_rms_norm(x, r, w, 1e-5)
    assert torch.equal(h, ref_h)
    ulp_close(out, ref_out)
    y = torch.randn(64, 2 * 14336, generator=g).to(DEV, torch.bfloat16)
    ulp_close(OPS.silu_and_mul(y), REF.silu_and_mul(y))
    kv = interesting_values(g, 512, 128).to(DEV)
    codes, scales = OPS.quantize_kv(kv, "fp8_e4m3_pow2")
    ref_codes, ref_scales = lowbit.quantize(kv.cpu(), "fp8_e4m3_pow2")
    assert torch.equal(codes.cpu(), ref_codes) and torch.equal(scales.cpu(), ref_scales)
    back = OPS.dequantize_kv(codes, scales, "fp8_e4m3_pow2", torch.bfloat16)
    assert torch.equal(back.cpu(), lowbit.dequantize(ref_codes, ref_scales, "fp8_e4m3_pow2", torch.bfloat16))


# ------------------------------------------------------------------------------------------- compiled path
_COMPILE_SCRIPT = r'''
import json
from deepinfer.backends.nvidia import triton_act, triton_attention, triton_kvquant, triton_norm
from deepinfer.testing.kernels import compile_sm90, sass_row

assert not triton_attention.INTERPRET
report = {}
SASS = ("decode_bf16_D128", "decode_fp32_D128", "rms_bf16", "silu_bf16")  # the rows the test reads SASS on


def compile_(fn, name, sig, const, div16=(), **opts):
    k = compile_sm90(fn, sig, const, div16, **opts)
    row = dict(smem=k.metadata.shared, ftz=".ftz" in k.asm.get("ptx", ""))
    # SASS (cuobjdump, ~0.5 s a kernel) only for the rows whose SASS the test reads
    report[name] = (sass_row(k, r"\b(LDG\.E\.128|LDGSTS\.E\.BYPASS\.128|HMMA|STL|LDL)\b", **row)
                    if name.startswith(SASS) else row)


ints = lambda *names: {n: "i32" for n in names}
for dt in ("bf16", "fp32"):
    p = "*" + dt
    compile_(triton_norm._rms_norm_kernel, f"rms_{dt}",
             dict(x_ptr=p, r_ptr=p, w_ptr=p, out_ptr=p, h_ptr=p, eps="fp32",
                  **ints("stride_x", "stride_r", "stride_o", "stride_h", "N")),
             dict(HAS_RESIDUAL=True, BLOCK=4096), div16=("stride_x", "stride_r", "stride_o", "stride_h", "N"),
             num_warps=8)
    compile_(triton_act._silu_and_mul_kernel, f"silu_{dt}", dict(x_ptr=p, out_ptr=p, **ints("stride_x", "stride_o", "F")),
             dict(BLOCK=1024), div16=("stride_x", "stride_o", "F"), num_warps=4)
    compile_(triton_kvquant._quant_kernel, f"quant_{dt}",
             dict(x_ptr=p, codes_ptr="*u8", scales_ptr="*u8", **ints("stride_x", "stride_c", "stride_s", "M", "NG")),
             dict(BLOCK_G=4, GROUP_SIZE=32, ROWS=1), num_warps=1)
    compile_(triton_kvquant._dequant_kernel, f"dequant_{dt}",
             dict(codes_ptr="*u8", scales_ptr="*u8", out_ptr=p, **ints("stride_c", "stride_s", "stride_o", "M", "NG")),
             dict(BLOCK_G=4, GROUP_SIZE=32, ROWS=1), num_warps=1)
    for D, Dv in ((128, 128), (576, 512)):
        cfg = triton_attention.launch_config(4, D, Dv)  # what paged_decode launches for GQA groups of 4
        for direct in (True, False):
            sig = dict(q_ptr=p, k_ptr=p, v_ptr=p, bt_ptr="*i64", lens_ptr="*i64", qpos_ptr="*i64", sinks_ptr="*fp32",
                       out_ptr=p, mid_m_ptr="*fp32", mid_l_ptr="*fp32", mid_o_ptr="*fp32", qk_scale="fp32",
                       **ints("stride_qt", "stride_qh", "stride_ks", "stride_kh", "stride_vs", "stride_vh", "stride_bt",
                              "stride_qpos", "stride_ot", "stride_oh", "window", "H", "G", "D", "DV", "NUM_SPLITS"))
            compile_(triton_attention._decode_kernel, f"decode_{dt}_D{D}_{'direct' if direct else 'split'}", sig,
                     dict(NUM_GT=1, DIRECT=direct, BLOCK_SIZE=16, BLOCK_G=cfg["BLOCK_G"], BLOCK_N=cfg["BLOCK_N"],
                          BLOCK_D=cfg["BLOCK_D"], BLOCK_DV=cfg["BLOCK_DV"], HAS_WINDOW=True,
                          HAS_SINKS=True, DOT_PRECISION="ieee" if dt == "fp32" else "tf32", INTERP_LOOP=False,
                          MAX_TILES=0),
                     div16=("stride_qt", "stride_qh", "stride_ks", "stride_kh", "stride_vs", "stride_vh", "stride_bt",
                            "stride_ot", "stride_oh", "H", "D", "DV"), num_warps=cfg["num_warps"])
    compile_(triton_attention._merge_kernel, f"merge_{dt}",
             dict(mid_m_ptr="*fp32", mid_l_ptr="*fp32", mid_o_ptr="*fp32", sinks_ptr="*fp32", out_ptr=p,
                  **ints("stride_ot", "stride_oh", "H", "DV", "NUM_SPLITS")),
             dict(BLOCK_S=16, BLOCK_DV=128, HAS_SINKS=True), num_warps=4)
print(json.dumps(report))
'''


def test_kernels_compile_for_hopper():
    """The compiled (non-interpreter) code path, which CPU CI never runs: every kernel compiles for sm_90
    through the bundled ptxas, and the decode kernel's SASS has tensor-core MMAs and 16-byte loads and no
    local-memory spills at the Llama head size."""
    report = run_compile_script(_COMPILE_SCRIPT)
    assert len(report) == 2 * (4 + 4 + 1)
    for name in ("decode_bf16_D128_direct", "decode_bf16_D128_split", "decode_fp32_D128_direct",
                 "decode_fp32_D128_split"):
        sass = report[name].get("sass")
        if sass is None:
            continue  # no cuobjdump in this triton install
        if "bf16" in name:
            assert sass.get("HMMA", 0) > 0, (name, sass)
        assert sass.get("LDG.E.128", 0) + sass.get("LDGSTS.E.BYPASS.128", 0) > 0, (name, sass)
        assert sass.get("STL", 0) == 0 and sass.get("LDL", 0) == 0, f"{name}: local-memory spills: {sass}"
    for dt in ("bf16", "fp32"):  # subnormals must survive for the FP8 kernels to stay bit-exact
        assert not report[f"quant_{dt}"]["ftz"] and not report[f"dequant_{dt}"]["ftz"]
    for name in ("rms_bf16", "silu_bf16"):
        sass = report[name].get("sass")
        if sass is not None:
            assert sass.get("LDG.E.128", 0) > 0, (name, sass)


def test_benchmark_script_help_runs_without_gpu():
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "kernels_gpu.py"
    proc = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "--out" in proc.stdout, proc.stderr

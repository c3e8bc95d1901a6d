"""Scaffolding shared by the Triton kernel tests (tests/test_nvidia_kernels.py, tests/test_triton_*.py).

- the module prelude: ``skip_module_without_kernels()`` skips a test module when triton is missing, or when
  there is no CUDA and the kernels were not built for Triton's interpreter (tests/conftest.py sets
  TRITON_INTERPRET=1 without CUDA, before anything imports triton); ``HAS_CUDA``, ``DEV``, the ``gpu`` skip
  marker and ``examples(n)``, the hypothesis settings of the property tests;
- data helpers: ``gen`` (seeded CPU generators), ``fp8_weights`` (block-scaled FP8 expert weights), ``bf16x3`` (a
  float32 tensor as three exact bf16 terms), ``rel_err`` (||out - ref|| / ||ref||, NaN-checked),
  ``assert_same_bits`` (bit-exact up to NaN payloads) and ``poison_free_memory`` (so an output a kernel leaves
  unwritten shows up as NaN);
- ``capture_graph``: the warm-up-then-capture dance of the CUDA-graph tests, and ``no_host_sync``;
- the sm_90 compile tests: ``run_compile_script`` runs a script in a fresh interpreter without
  TRITON_INTERPRET and returns the JSON report its last line prints; inside such a script, ``compile_sm90``
  builds a kernel for Hopper (no GPU needed) and ``cuobjdump`` / ``sass_counts`` read its cubin.

Importable without CUDA (and without triton: triton is imported only inside the functions that need it).
"""

from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from typing import Callable, Optional

import pytest
import torch
from hypothesis import HealthCheck, settings

HAS_CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if HAS_CUDA else "cpu")
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


def skip_module_without_kernels() -> None:
    """Call at the top of a kernel test module, before it imports any kernel module: skips the module when
    triton is missing, or when there is no CUDA and the kernels were not built for the interpreter."""
    pytest.importorskip("triton")
    from deepinfer.backends.nvidia.ops import INTERPRET

    if not HAS_CUDA and not INTERPRET:
        pytest.skip("no CUDA and the kernels were not built for Triton's interpreter (TRITON_INTERPRET=0?)",
                    allow_module_level=True)


def examples(n: int) -> settings:
    """Hypothesis settings of a kernel property test: n examples, no deadline (the first calls compile or
    interpret slowly), slow data generation allowed."""
    return settings(max_examples=n, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def gen(seed: int, device="cpu") -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def fp8_weights(g: torch.Generator, E: int, rows: int, cols: int, device=DEV) -> tuple:
    """Random block-scaled FP8 weights [E, rows, cols] and their [E, cdiv(rows,128), cdiv(cols,128)] scales,
    with the weights that models.quant dequantizes from them (float32): the MoE kernels' tests and benches."""
    from deepinfer.models.quant import FP8, dequantize_fp8_block

    q = (torch.randn(E, rows, cols, generator=g) * 64).clamp(-448, 448).to(FP8).to(device)
    nb = (-(-rows // 128), -(-cols // 128))
    s = (torch.rand(E, *nb, generator=g) + 0.5).mul(cols ** -0.5 / 64).to(device)
    deq = torch.stack([dequantize_fp8_block(q[e], s[e]) for e in range(E)])
    return q, s, deq


def bf16x3(w: torch.Tensor) -> tuple:
    """A float32 tensor as three bf16 tensors summing to it exactly (asserted), built with torch's casts: the terms
    the kernels' float32-weight paths multiply (CED's router logits), for their tests' error bounds."""
    hi = w.bfloat16()
    mid = (w - hi.float()).bfloat16()
    lo = (w - hi.float() - mid.float()).bfloat16()
    assert torch.equal(hi.double() + mid.double() + lo.double(), w.double())
    return hi, mid, lo


def rel_err(out: torch.Tensor, ref: torch.Tensor, device=None) -> float:
    """||out - ref|| / ||ref|| in float64, on ``device`` (default: out's); asserts out has no NaN."""
    device = out.device if device is None else device
    out, ref = out.double().to(device), ref.double().to(device)
    assert not torch.isnan(out).any(), "NaN in the kernel output"
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


_INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16,
             torch.float64: torch.int64}


def assert_same_bits(out: torch.Tensor, ref: torch.Tensor) -> None:
    """out and ref hold the same dtype, shape and bit patterns, except that any NaN equals any NaN.

    NaN positions must match exactly, and every other element bit for bit (so -0.0 != +0.0, inf keeps its sign,
    and a flushed subnormal fails). A NaN's sign and payload are not compared because no kernel can promise them:
    PyTorch's CPU float math returns the NaN operand it was given (e.g. 0x7FC00000 or 0xFFC00000), CUDA
    arithmetic returns the canonical NaN 0x7FFFFFFF (the PTX rule for mul/add/fma results), the compiler may
    fold a NaN constant through a select, and the float32 -> bf16 conversions pick their own patterns (PyTorch's
    CPU 0x7FC0, the H200's cvt.rn.bf16.f32 0x7FFF). Triton's interpreter runs numpy, which propagates payloads
    like the CPU reference, so a payload-exact test passes there and fails on the GPU."""
    assert out.dtype == ref.dtype and out.shape == ref.shape, (out.dtype, tuple(out.shape), ref.dtype, tuple(ref.shape))
    out, ref = out.detach().cpu(), ref.detach().cpu()
    nan = torch.isnan(ref)
    bad_nan = torch.isnan(out) != nan
    assert not bad_nan.any(), (f"{int(bad_nan.sum())} elements NaN on one side only, first at "
                               f"{bad_nan.nonzero()[0].tolist()}")
    view = _INT_VIEW[out.dtype]
    ob, rb = out.contiguous().view(view), ref.contiguous().view(view)
    diff = (ob != rb) & ~nan
    if diff.any():
        i = tuple(diff.nonzero()[0].tolist())
        raise AssertionError(f"{int(diff.sum())} non-NaN elements differ in their bits, first at {list(i)}: "
                             f"{out[i].item()!r} vs the reference's {ref[i].item()!r}")


def poison_free_memory(nbytes: int) -> None:
    """Fill, then free, a block of the allocator's memory with NaN so an unwritten output shows up."""
    junk = torch.full((max(1, nbytes // 4) + 64,), float("nan"), device=DEV)
    del junk


# ------------------------------------------------------------------------------------------- CUDA graphs
def capture_graph(fn: Callable, warmup: Optional[Callable] = None):
    """Run ``warmup`` (default ``fn``) once on a side stream (compiles, allocates), then capture ``fn`` in a
    CUDA graph. Returns (graph, what the captured call returned: the tensors each replay rewrites)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        (warmup or fn)()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def no_host_sync(fn: Callable):
    """Call fn with torch's sync debug mode on "error": a host sync inside it raises."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        return fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")


# ------------------------------------------------------------------------------------------- sm_90 builds
def run_compile_script(script: str, timeout: int = 300, cwd=None) -> dict:
    """Run ``script`` in a fresh interpreter without TRITON_INTERPRET (so the kernels build for real) and
    return the JSON report its last stdout line holds. Skips where this triton has no ASTSource/GPUTarget."""
    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.compiler import ASTSource  # noqa: F401
    except ImportError:
        pytest.skip("this triton has no ASTSource/GPUTarget API")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=cwd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def compile_sm90(fn, sig: dict, const: dict, div16=(), **options):
    """Compile a @triton.jit kernel for sm_90 as a launch with 16-byte-aligned pointers and these 16-divisible
    ints would (Triton specialises every int argument divisible by 16, and every 16-byte-aligned pointer).
    sig: argument -> type ("*bf16", "i32", ...); the rest are constexprs, given in const or left at their
    defaults (as a launch leaves them)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    const = dict({p.name: p.default for p in fn.params if p.has_default and p.name not in sig}, **const)
    full = {a: sig.get(a, "constexpr") for a in fn.arg_names}
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]]
             for a in list(div16) + [a for a, t in sig.items() if t.startswith("*")]}
    return triton.compile(ASTSource(fn, full, const, attrs), target=GPUTarget("cuda", 90, 32), options=options)


def cuobjdump(kernel, flag: str = "-sass") -> Optional[str]:
    """cuobjdump's output (``-sass``, ``-res-usage``) on a compiled kernel's cubin; None where this triton
    install has no cuobjdump."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if "cubin" not in kernel.asm or not os.path.exists(tool):
        return None
    path = os.path.join(tempfile.mkdtemp(), "k.cubin")
    with open(path, "wb") as f:
        f.write(kernel.asm["cubin"])
    return subprocess.run([tool, flag, path], capture_output=True, text=True).stdout


def sass_counts(kernel, pattern: str) -> Optional[dict]:
    """How often each match of ``pattern`` (e.g. r"\\b(HMMA|STL|LDL)\\b") occurs in the kernel's SASS; None
    without cuobjdump."""
    sass = cuobjdump(kernel)
    return None if sass is None else dict(collections.Counter(re.findall(pattern, sass)))


def sass_row(kernel, pattern: str, **fields) -> dict:
    """A compile report's row: ``fields``, plus "sass": sass_counts(kernel, pattern) where cuobjdump is
    available (tests skip their SASS checks on rows without it)."""
    sass = sass_counts(kernel, pattern)
    return fields if sass is None else {**fields, "sass": sass}


__all__ = ["DEV", "HAS_CUDA", "capture_graph", "compile_sm90", "cuobjdump", "examples", "gen", "gpu",
           "no_host_sync", "poison_free_memory", "rel_err", "run_compile_script", "sass_counts", "sass_row",
           "skip_module_without_kernels"]

"""Programmatic dependent launch (backends/nvidia/triton_pdl.py): every PDL-aware kernel waits for the previous grid
before anything else, only such kernels are launched with the attribute, the compiled kernels carry the wait, and
on a Hopper GPU a CED model generates bit for bit the same in every mode (off, waiting, signalling early or late)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deepinfer.backends.nvidia import triton_pdl
from deepinfer.testing.kernels import run_compile_script

NVIDIA = Path(__file__).resolve().parents[1] / "deepinfer" / "backends" / "nvidia"


def _jit_kernels(tree: ast.Module) -> dict:
    """name -> FunctionDef of the module's @triton.jit functions."""
    out = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and any(ast.unparse(d) == "triton.jit" for d in node.decorator_list):
            out[node.name] = node
    return out


def _body(fn: ast.FunctionDef) -> list:
    """The function's statements without its docstring."""
    body = fn.body
    if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value,
                                                                                                 str):
        body = body[1:]
    return body


def _modules() -> dict:
    return {p.name: ast.parse(p.read_text()) for p in sorted(NVIDIA.glob("triton_*.py"))}


# Kernels that may read a weight before the wait (weights are parameters: nothing in a step writes them), under
# the knob that turns it on: (module, kernel) -> (the knob, the names a pointer read before the wait may use).
EARLY_READS = {("triton_gemv.py", "_gemv_kernel"): ("EARLY_W", {"w_rows", "kk"})}
PRE_WAIT_CALLS = {"tl.program_id", "tl.arange", "tl.load"}


def _before_the_wait(name: str, kname: str, fn: ast.FunctionDef) -> str:
    """The kernel's wait as written (its first statement; for an EARLY_READS kernel, the first after index and
    weight-pointer arithmetic and an ``if KNOB:`` holding only loads of the allowed names)."""
    body = _body(fn)
    first = ast.unparse(body[0])
    if (name, kname) not in EARLY_READS or first.startswith("pdl_start"):
        return first
    knob, names = EARLY_READS[(name, kname)]
    i = next(j for j, st in enumerate(body) if ast.unparse(st).startswith("pdl_start"))
    for st in body[:i]:
        assert not any(isinstance(n, (ast.Return, ast.For, ast.While)) for n in ast.walk(st)), ast.unparse(st)
        calls = [n for n in ast.walk(st) if isinstance(n, ast.Call)]
        for c in calls:
            f = ast.unparse(c.func)
            assert f in PRE_WAIT_CALLS or f.endswith(".to"), f"{name}:{kname}: {f} before the wait"
            if f == "tl.load":
                assert isinstance(st, ast.If) and ast.unparse(st.test) == knob, \
                    f"{name}:{kname}: a load before the wait outside `if {knob}:`"
                used = {n.id for n in ast.walk(c.args[0]) if isinstance(n, ast.Name)}
                assert used <= names, f"{name}:{kname}: a load before the wait reads {used - names}"
    return ast.unparse(body[i])


def test_every_pdl_kernel_waits_first():
    """A PDL kernel that touched memory (or returned) before its wait could race the previous grid, or let the
    next one run before the grid ahead of it finished: the wait must be its first statement (EARLY_READS: but
    index arithmetic and, under its knob, loads of its weight)."""
    seen = []
    for name, tree in _modules().items():
        for kname, fn in _jit_kernels(tree).items():
            args = [a.arg for a in fn.args.args]
            if "PDL" not in args or name == "triton_pdl.py":
                continue
            seen.append(kname)
            assert args[-1] == "PDL" and fn.args.defaults and ast.unparse(fn.args.defaults[-1]) == "0", \
                f"{name}:{kname}: PDL must be the last parameter, default 0 (off where launch_kw passes nothing)"
            first = _before_the_wait(name, kname, fn)
            assert first in ("pdl_start(PDL)", "pdl_start(PDL, True)"), \
                f"{name}:{kname}: the first statement must be pdl_start(PDL[, True]), is {first}"
            signals = sum(isinstance(n, ast.Call) and ast.unparse(n.func) == "pdl_signal" for n in ast.walk(fn))
            assert (signals > 0) == (first == "pdl_start(PDL, True)"), \
                f"{name}:{kname}: a LATE kernel signals with pdl_signal after its main loop, and only it does"
    assert {"_gemv_kernel", "_ced_attn_kernel", "_pairs_up_kernel", "_ced_rope_kernel"} <= set(seen), seen


def test_only_pdl_kernels_launch_with_the_attribute():
    """launch_kw sets launch_pdl: a kernel without the wait launched so would race its predecessor."""
    kernels = {}
    for tree in _modules().values():
        kernels.update(_jit_kernels(tree))
    launches = 0
    for name, tree in _modules().items():
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript)):
                continue
            if not any(kw.arg is None and "launch_kw" in ast.unparse(kw.value) for kw in node.keywords):
                continue
            launches += 1
            kname = ast.unparse(node.func.value)
            assert kname in kernels, f"{name}: launch_kw passed to {kname}, not a kernel of the backend"
            assert "PDL" in [a.arg for a in kernels[kname].args.args], f"{name}: {kname} has no PDL parameter"
    assert launches >= 15


def test_off_where_no_hopper():
    assert triton_pdl.launch_kw(torch.device("cpu")) == {}
    assert triton_pdl.mode_for(torch.device("cpu")) == 0


def test_bad_mode_is_refused():
    env = dict(os.environ, DEEPINFER_PDL="4")
    proc = subprocess.run([sys.executable, "-c", "import deepinfer.backends.nvidia.triton_pdl"], env=env,
                          capture_output=True, text=True)
    assert proc.returncode != 0 and "DEEPINFER_PDL" in proc.stderr and "'4'" in proc.stderr, proc.stderr[-500:]


_COMPILE = r'''
import json
from deepinfer.backends.nvidia import triton_ced_fused as f, triton_gemv as g
from deepinfer.testing.kernels import compile_sm90
report = {}
for pdl in (0, 1, 2, 3):
    opts = {"launch_pdl": True} if pdl else {}
    rms = compile_sm90(f._ced_rms_kernel, dict(x_ptr="*bf16", w_ptr="*bf16", o_ptr="*bf16", stride_x="i32",
                       stride_o="i32", N="i32", eps="fp32"), dict(BLOCK=512, PDL=pdl), **opts)
    gemv = compile_sm90(g._gemv_kernel, dict(x_ptr="*bf16", w_ptr="*bf16", out_ptr="*bf16", M="i32", N="i32",
                        K="i32", stride_xm="i32", stride_xg="i32", stride_wg="i32", stride_wn="i32", stride_om="i32",
                        stride_og="i32"), dict(BLOCK_M=1, BLOCK_N=8, BLOCK_K=1024, K_I=0, PDL=pdl), **opts)
    for name, k in (("rms", rms), ("gemv", gemv)):
        ptx = k.asm["ptx"]
        report[f"{name}_{pdl}"] = dict(wait=ptx.count("griddepcontrol.wait"),
                                       signal=ptx.count("griddepcontrol.launch_dependents"),
                                       launch_pdl=bool(getattr(k.metadata, "launch_pdl", False)))
print(json.dumps(report))
'''


def test_compiled_kernels_carry_the_wait():
    report = run_compile_script(_COMPILE, timeout=300, cwd=Path(__file__).resolve().parents[1])
    for name in ("rms", "gemv"):
        assert report[f"{name}_0"] == dict(wait=0, signal=0, launch_pdl=False), report
        assert report[f"{name}_1"] == dict(wait=1, signal=0, launch_pdl=True), report
        assert report[f"{name}_2"] == dict(wait=1, signal=1, launch_pdl=True), report
        assert report[f"{name}_3"] == dict(wait=1, signal=1, launch_pdl=True), report  # at the start / after the loop


hopper = pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9),
                            reason="programmatic dependent launch needs a Hopper (sm_90) or later GPU")


@hopper
def test_ced_generates_the_same_bits_in_every_mode(tmp_path, monkeypatch):
    """PDL changes when a kernel starts, never what it computes: CED greedy decoding in CUDA graphs, with
    log-probabilities, is identical bit for bit with PDL off, waiting (1), signalling early (2) or late (3)."""
    from deepinfer import LLM, SamplingParams
    from deepinfer.testing.ced import build_ced_checkpoint
    from test_ced_decode_path import GPU_CFG

    build_ced_checkpoint(tmp_path, seed=11, **GPU_CFG)
    prompts = [list(range(5, 5 + n)) for n in (3, 17, 40, 9, 26)]
    sp = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=2)
    results = {}
    for mode in (0, 1, 2, 3):
        monkeypatch.setattr(triton_pdl, "MODE", mode)
        monkeypatch.setattr(triton_pdl, "_by_device", {})
        llm = LLM(str(tmp_path), device="cuda", dtype="bfloat16", num_kv_blocks=96, block_size=4, backend="nvidia",
                  enforce_eager=False)
        outs = llm.generate(prompts, sp, use_tqdm=False)
        assert llm.engine.decode_graphs is not None and llm.engine.decode_graphs.num_replays > 0
        results[mode] = [(list(o.outputs[0].token_ids),
                          [sorted((t, lp.logprob) for t, lp in d.items()) for d in o.outputs[0].logprobs])
                         for o in outs]
        del llm
        torch.cuda.empty_cache()
    assert results[1] == results[0]
    assert results[2] == results[0]
    assert results[3] == results[0]

"""Suite-wide settings: the test models are tiny, so one torch thread is fastest, and on a shared 2-core
machine it avoids OpenMP spin-waits that cost 5-10x. Triton's interpreter on machines without CUDA. Under
``--dist loadfile`` the slowest files are handed out first."""

import os

import pytest
import torch
from hypothesis import settings

# Hypothesis draws the same examples on every run (a CI failure reproduces, and one run's luck cannot fail a
# clean clone); DEEPINFER_HYPOTHESIS_RANDOM=1 draws fresh ones to explore (and found real bugs that way).
settings.register_profile("deepinfer", derandomize=not os.environ.get("DEEPINFER_HYPOTHESIS_RANDOM"))
settings.load_profile("deepinfer")

# Without CUDA the nvidia backend's Triton kernels run in Triton's interpreter, which must be chosen before
# anything imports triton (transformers does, so a test module cannot rely on being first).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _lighter_interpreter_bookkeeping():
    """Two of Triton's interpreter (3.6) helpers redo constant work on every call; they get the same results from
    tables built once, here:
    - _patch_builtin: triton.language is re-patched at every launch and at every call of a @triton.jit helper
      inside a kernel (interpreter._patch_lang), and each time each package was scanned with inspect.getmembers
      for the builtins to wrap (about 30% of an interpreted CED prefill step). The packages hold the same names
      throughout, so they are listed once, before any kernel has patched them; a call wraps the same members in
      the same order as the scan did (a name only while it still holds a builtin);
    - _get_np_dtype built its 18-entry dtype table at each of its calls (about 7%).
    Unknown packages, and a triton without these functions, go the original way."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    import inspect

    original = getattr(interpreter, "_patch_builtin", None)
    if original is not None and hasattr(interpreter, "_patch_attr"):
        pkgs = [tl, tl.core, tl.tensor, tl.math, getattr(tl.core, "tensor_descriptor_base", None)]
        names = {id(p): (p, [n for n, m in inspect.getmembers(p) if tl.core.is_builtin(m)])
                 for p in pkgs if p is not None}

        def _patch_builtin(pkg, builder, scope):
            known = names.get(id(pkg))
            if known is None or known[0] is not pkg:
                return original(pkg, builder, scope)
            for name in known[1]:
                member = getattr(pkg, name, None)
                if tl.core.is_builtin(member):
                    interpreter._patch_attr(pkg, name, member, builder, scope)

        interpreter._patch_builtin = _patch_builtin

    np_dtype = getattr(interpreter, "_get_np_dtype", None)
    if np_dtype is not None:
        import numpy as np

        # the function's own table, read back through it (bfloat16 and the float8 types as their storage)
        table = {t: np_dtype(t) for t in (tl.int1, tl.float16, tl.float32, tl.float64, tl.int8, tl.uint8, tl.int16,
                                          tl.uint16, tl.int32, tl.uint32, tl.int64, tl.uint64, tl.bfloat16,
                                          tl.float8e5, tl.float8e5b16, tl.float8e4nv, tl.float8e4b8, tl.float8e4b15)}
        pointer = np.dtype(np.uint64)

        def _get_np_dtype(tt_dtype):
            if isinstance(tt_dtype, tl.pointer_type):
                return pointer
            if isinstance(tt_dtype, tl.block_type):
                if isinstance(tt_dtype.element_ty, tl.pointer_type):
                    return pointer
                tt_dtype = tt_dtype.element_ty
            found = table.get(tt_dtype)
            return np_dtype(tt_dtype) if found is None else found  # (a type the table lacks: the original)

        interpreter._get_np_dtype = _get_np_dtype


_lighter_interpreter_bookkeeping()

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def spec_llama(tmp_path_factory):
    """A tiny random Llama checkpoint (seed 3) for the speculative-decoding tests, built once per process."""
    from deepinfer.testing.models import build_tiny_hf_model

    d = tmp_path_factory.mktemp("spec_llama")
    build_tiny_hf_model(d, "llama", seed=3)
    return str(d)


# The files that take longest on the 2-core CI machine (seconds of a whole-suite run, most of it Triton's interpreter),
# longest first. xdist's loadfile scheduler orders files by their number of tests, which left test_ced_prefill_step
# (4 tests, ~140 s) to start near the end of the run with one worker idle beside it; handing these out first lets
# the many short files fill in around them. A name missing here only costs time.
SLOW_FILES = ("test_triton_ced.py", "test_ced_prefill_step.py", "test_parallel.py", "test_triton_moe.py",
              "test_nvidia_kernels.py", "test_ced.py", "test_batch_invariant.py", "test_triton_moe_pairs.py",
              "test_triton_prefill.py", "test_gpu_bench.py", "test_route_tail.py", "test_triton_gemv.py",
              "test_train.py", "test_parallel_ced.py", "test_spec_host.py", "test_triton_sampling.py")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    if not hasattr(LoadFileScheduling, "_assign_work_unit"):  # (a private method of xdist 3.x: else its own order)
        return None

    class SlowFilesFirst(LoadFileScheduling):
        def _assign_work_unit(self, node):
            if not getattr(self, "_slow_first", False) and hasattr(self, "workqueue"):  # built by now: reorder once
                self._slow_first = True
                for name in reversed(SLOW_FILES):
                    for scope in [s for s in self.workqueue if s.rsplit("/", 1)[-1] == name]:
                        self.workqueue.move_to_end(scope, last=False)
            super()._assign_work_unit(node)

    return SlowFilesFirst(config, log)

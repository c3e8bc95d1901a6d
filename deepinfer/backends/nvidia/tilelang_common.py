"""What the TileLang kernel modules share: the lazy import, the compile target and the per-config kernel cache.

tilelang is imported only when a TileLang kernel is built (``tilelang()``), so ``import deepinfer`` and the
nvidia backend work without it; ``importable()`` says whether it is there. ``compile_kernel(build, key)``
builds a kernel once per (builder, config key) in this process: ``build(T)`` returns the prim_func for that
config, compiled for ``target()``, the running GPU's architecture (sm_90a on Hopper, for its wgmma and TMA),
or DEEPINFER_TILELANG_ARCH where set (compile checks on a machine without a GPU). tilelang's own disk cache
(~/.tilelang/cache) keeps the built kernels across processes, so a second process pays no nvcc time.
"""

import functools  # no "from __future__ import annotations": TileLang evaluates the prim_func's annotations
import importlib.util
import os
import threading
from typing import Callable, Hashable

import torch

ARCH_ENV = "DEEPINFER_TILELANG_ARCH"  # e.g. "sm_90a": build for this architecture (no GPU needed)


@functools.lru_cache(maxsize=1)
def importable() -> bool:
    """tilelang can be imported here (a broken install counts as absent)."""
    if importlib.util.find_spec("tilelang") is None:
        return False
    try:
        import tilelang  # noqa: F401
        import tilelang.language  # noqa: F401
    except Exception:
        return False
    return True


def tilelang():
    """(tilelang, tilelang.language): imported on first use."""
    import tilelang as tl
    import tilelang.language as T

    return tl, T


def target(device: torch.device | None = None) -> dict:
    """The compile target: DEEPINFER_TILELANG_ARCH, else the device's compute capability (the "a" variant on
    sm_90, whose wgmma and setmaxnreg TileLang uses)."""
    arch = os.environ.get(ARCH_ENV, "").strip()
    if not arch:
        major, minor = torch.cuda.get_device_capability(device)
        arch = f"sm_{major}{minor}" + ("a" if (major, minor) == (9, 0) else "")
    return {"kind": "cuda", "arch": arch}


_LOCK = threading.Lock()
_KERNELS: dict = {}


# What every kernel here is compiled with: no automatic warp specialisation (with it, TileLang 0.1.15 dropped the
# software pipeline of a loop with a data-dependent trip count), and no bounds guards on memory accesses (the
# kernels clamp every index themselves).
PASS_FLAGS = ("TL_DISABLE_WARP_SPECIALIZED", "TL_DISABLE_SAFE_MEMORY_ACCESS")


def compile_kernel(build: Callable, key: Hashable, device: torch.device | None = None, **options):
    """The compiled kernel of ``build(T)`` for config ``key`` (a hashable of Python scalars), built on first use
    and kept for the process, with PASS_FLAGS set. ``options`` go to tilelang.compile (compile_flags, ...)."""
    tgt = target(device)
    full = (build.__module__, build.__qualname__, key, tgt["arch"])
    kernel = _KERNELS.get(full)
    if kernel is not None:
        return kernel
    with _LOCK:
        kernel = _KERNELS.get(full)
        if kernel is None:
            tl, T = tilelang()
            from tilelang.transform import PassConfigKey

            flags = {getattr(PassConfigKey, name): True for name in PASS_FLAGS}
            kernel = tl.compile(build(T), target=tgt, pass_configs=flags, **options)
            _KERNELS[full] = kernel
    return kernel


@functools.lru_cache(maxsize=1)
def stream_from_torch() -> bool:
    """Whether tvm-ffi (TileLang's launcher) reads torch's current stream by itself, through torch's DLPack C
    exchange API (recent torch, or the torch-c-dlpack-ext addon); when not, launch() hands it over, so that a
    kernel runs on torch's stream (a side stream, a CUDA graph being captured) rather than the default one."""
    import tvm_ffi  # noqa: F401  (installs the exchange API where it can)

    return hasattr(torch.Tensor, "__dlpack_c_exchange_api__")


def launch(kernel, *args) -> None:
    """Run a compiled kernel (every argument given, outputs included) on torch's current stream. It calls the
    kernel's executable directly where TileLang exposes it: its compiled host code checks every argument's
    dtype, shape and device, so the Python wrapper's own pass over the arguments is only host time."""
    run = getattr(kernel, "_deepinfer_run", None)
    if run is None:
        adapter = getattr(kernel, "adapter", None)
        run = adapter._get_executable() if hasattr(adapter, "_get_executable") else kernel
        kernel._deepinfer_run = run
    if stream_from_torch():
        run(*args)
        return
    import tvm_ffi

    with tvm_ffi.use_torch_stream():
        run(*args)


def cached_configs() -> int:
    """How many kernels this process has compiled (tests check that a second call compiles nothing)."""
    return len(_KERNELS)


_SMS: dict = {}


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (cached)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SMS:
        _SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SMS[idx]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, int(n) - 1).bit_length()


LOG2E = 1.4426950408889634


def softmax_fragments(T, BH: int, DV: int) -> tuple:
    """Allocate (in the kernel being built) a running softmax's float32 fragments: (o [BH, DV], m [BH], l [BH],
    scratch); ``scratch`` is what online_softmax's step needs besides. The caller starts them with
    softmax_reset's macro (a statement here, outside a macro, would not reach the kernel: TileLang records
    statements only from prim_func and macro bodies)."""
    acc = "float32"
    o = T.alloc_fragment((BH, DV), acc)
    m, l, m_prev, m_use, alpha, lsum = (T.alloc_fragment((BH,), acc) for _ in range(6))
    return o, m, l, (m_prev, m_use, alpha, lsum)


def softmax_reset(T):
    """A macro: reset(o, m, l) starts a running softmax (o, l = 0; m = -inf)."""

    @T.macro
    def reset(o, m, l):
        T.fill(o, 0)
        T.fill(l, 0)
        T.fill(m, -T.infinity("float32"))

    return reset


def online_softmax(T, BH: int, BN: int, DV: int):
    """A macro that folds one score tile into a running softmax, shared by the attention kernels:
    step(s, m, l, o, scratch, p, qk), qk = the softmax scale times log2(e) (a kernel argument, so one build
    serves every scale). s [BH, BN] holds raw scores (-inf where masked); m [BH] the running max in raw units,
    l [BH] the denominator, o [BH, DV] the unnormalised output and scratch come from softmax_fragments. After it,
    s holds 2^((s - m) qk) and ``p`` (shared, the operand dtype) the same, rounded for P @ V, which the caller
    adds into o. A row with nothing visible yet keeps l = o = 0 (its max stays -inf; no NaN)."""
    acc = "float32"

    @T.macro
    def step(s, m, l, o, scratch, p, qk):
        m_prev, m_use, alpha, lsum = scratch
        T.copy(m, m_prev)
        T.reduce_max(s, m, dim=1, clear=False)
        for i in T.Parallel(BH):
            m_use[i] = T.Select(m[i] == -T.infinity(acc), T.float32(0), m[i])
            alpha[i] = T.exp2((m_prev[i] - m_use[i]) * qk)
        for i, j in T.Parallel(BH, BN):
            s[i, j] = T.exp2((s[i, j] - m_use[i]) * qk)
        T.reduce_sum(s, lsum, dim=1)
        for i in T.Parallel(BH):
            l[i] = l[i] * alpha[i] + lsum[i]
        for i, d in T.Parallel(BH, DV):
            o[i, d] *= alpha[i]
        T.copy(s, p)

    return step


def partials_writer(T, H: int, BH: int, DV: int):
    """A macro storing one split's softmax state for merge(): write(MID_M, MID_L, MID_O, row, h0, sp, o, m, l, qk)
    puts heads h0 .. h0 + BH - 1 (those < H) of o [BH, DV], m (raw units, stored in log2 units) and l [BH]."""

    @T.macro
    def write(MID_M, MID_L, MID_O, row, h0, sp, o, m, l, qk):
        for i, d in T.Parallel(BH, DV):
            if h0 + i < H:
                MID_O[row, h0 + i, sp, d] = o[i, d]
        for i in T.Parallel(BH):
            if h0 + i < H:
                MID_M[row, h0 + i, sp] = m[i] * qk  # -inf for an empty split
                MID_L[row, h0 + i, sp] = l[i]

    return write


def merge_builder(H: int, DV: int, dtype: str, has_sinks: bool, sink_dtype: str = "float32", threads: int = 128):
    """The split-merge prim_func builder (flash-decoding's second pass), shared by the split kernels.

    Partials per (row, head, split): m [NT, H, S] the running max in log2 units (-inf for an empty split),
    l [NT, H, S] the denominator and o [NT, H, S, DV] the unnormalised output, float32. out[t, h] =
    sum_s w_s o_s / (sum_s w_s l_s + 2^(sink_h log2 e - M)) with w_s = 2^(m_s - M), M the largest of the m_s
    (and the sink); a row that saw no key gives 0. One program per (row, head), DV / threads values a thread.
    """

    def build(T):
        acc = "float32"
        NT, NS = T.dynamic("NT"), T.dynamic("NS")

        @T.prim_func
        def merge(MID_M: T.Tensor((NT, H, NS), acc), MID_L: T.Tensor((NT, H, NS), acc),
                  MID_O: T.Tensor((NT, H, NS, DV), acc), SINKS: T.Tensor((H,), sink_dtype),
                  O: T.Tensor((NT, H, DV), dtype)):
            with T.Kernel(NT, H, threads=threads) as (t, h):
                num = T.alloc_fragment((DV,), acc)
                mx = T.alloc_var(acc)
                ref = T.alloc_var(acc)
                den = T.alloc_var(acc)
                w = T.alloc_var(acc)
                mx = -T.infinity(acc)
                for sp in T.serial(NS):
                    mx = T.max(mx, MID_M[t, h, sp])
                if has_sinks:
                    mx = T.max(mx, T.Cast(acc, SINKS[h]) * T.float32(LOG2E))
                ref = T.Select(mx == -T.infinity(acc), T.float32(0), mx)  # all splits empty: no NaN
                den = T.float32(0)
                T.clear(num)
                for sp in T.serial(NS):
                    w = T.exp2(MID_M[t, h, sp] - ref)  # 0 for an empty split (m = -inf)
                    den = den + MID_L[t, h, sp] * w
                    for d in T.Parallel(DV):
                        num[d] += MID_O[t, h, sp, d] * w
                if has_sinks:
                    den = den + T.exp2(T.Cast(acc, SINKS[h]) * T.float32(LOG2E) - ref)
                den = T.Select(den > 0, den, T.float32(1))
                for d in T.Parallel(DV):
                    O[t, h, d] = T.Cast(dtype, num[d] / den)

        return merge

    return build


def merge(mid_m: torch.Tensor, mid_l: torch.Tensor, mid_o: torch.Tensor, sinks, out: torch.Tensor) -> torch.Tensor:
    """Combine split partials into ``out`` [NT, H, DV] (see merge_builder); sinks [H] or None."""
    _, T = tilelang()
    H, DV = out.shape[1], out.shape[2]
    has_sinks = sinks is not None
    sink_dtype = DTYPES[sinks.dtype] if has_sinks else "float32"
    kernel = compile_kernel(merge_builder(H, DV, DTYPES[out.dtype], has_sinks, sink_dtype),
                            ("merge", H, DV, DTYPES[out.dtype], has_sinks, sink_dtype), out.device)
    launch(kernel, mid_m, mid_l, mid_o, sinks if has_sinks else dummy(out.device, (H,), torch.float32), out)
    return out


DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}
_DUMMIES: dict = {}


def dummy(device: torch.device, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """A cached zero tensor for an argument a kernel variant never reads (absent sinks, entries)."""
    key = (str(device), tuple(shape), dtype)
    t = _DUMMIES.get(key)
    if t is None:
        t = _DUMMIES[key] = torch.zeros(shape, dtype=dtype, device=device)
    return t

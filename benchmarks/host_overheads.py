"""Host-side costs that bound a short prefill step and a disk hit, each measured alone on this machine: a
pinned allocation (fresh and from torch's caching host allocator), reading an 11 MB entry-sized file from
the page cache, crc32 over it (one thread and several), a Triton launch through the JIT and through the
compiled kernel's own launcher, and the host time of one small bf16 linear.

    python benchmarks/host_overheads.py --out $OUT/host_overheads.jsonl   # device (CUDA); the CPU rows only elsewhere

One JSONL row per measurement ({"what", "us" or "ms", ...}) and a table.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
import zlib
from concurrent.futures import ThreadPoolExecutor

import torch

from deepinfer.bench import append_jsonl

MB = 1 << 20


def best(fn, reps: int = 5) -> float:
    """Fastest of reps calls of fn, seconds."""
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return min(out)


def rows_cpu(nbytes: int) -> list:
    rows = []
    data = os.urandom(nbytes)
    with tempfile.NamedTemporaryFile(delete=False) as f:
        f.write(data)
        path = f.name
    buf = bytearray(nbytes)

    def read():
        with open(path, "rb", buffering=0) as g:
            g.readinto(memoryview(buf))
    rows.append({"what": "read file (page cache) into memory", "mb": nbytes / MB, "ms": best(read) * 1e3})
    rows.append({"what": "crc32, 1 thread", "mb": nbytes / MB, "ms": best(lambda: zlib.crc32(data)) * 1e3})
    view = memoryview(data)
    chunks = [view[i:i + MB] for i in range(0, nbytes, MB)]
    for n in (2, 4, 8):
        with ThreadPoolExecutor(n) as ex:
            ms = best(lambda: list(ex.map(zlib.crc32, chunks))) * 1e3
        rows.append({"what": f"crc32 per MB, {n} threads", "mb": nbytes / MB, "ms": ms})
    os.unlink(path)
    return rows


def rows_cuda(nbytes: int) -> list:
    import triton
    import triton.language as tl

    rows = []
    torch.cuda.synchronize()
    sizes = [nbytes // 12 + 64 * i for i in range(12)]  # distinct sizes: nothing cached yet
    t0 = time.perf_counter()
    held = [torch.empty(s, dtype=torch.uint8, pin_memory=True) for s in sizes]
    rows.append({"what": "12 pinned allocations, fresh", "mb": nbytes / MB, "ms": (time.perf_counter() - t0) * 1e3})
    del held
    t0 = time.perf_counter()
    held = [torch.empty(s, dtype=torch.uint8, pin_memory=True) for s in sizes]
    rows.append({"what": "12 pinned allocations, cached", "mb": nbytes / MB, "ms": (time.perf_counter() - t0) * 1e3})
    del held
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")

    def h2d():
        dev.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
    rows.append({"what": "pinned host-to-device copy", "mb": nbytes / MB, "ms": best(h2d) * 1e3})

    @triton.jit
    def add_one(x_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=m) + 1, mask=m)

    x = torch.zeros(4096, device="cuda")
    compiled = add_one[(4,)](x, 4096, BLOCK=1024)
    torch.cuda.synchronize()
    reps = 2000

    def jit_loop():
        for _ in range(reps):
            add_one[(4,)](x, 4096, BLOCK=1024)
    jit_us = best(jit_loop, 3) / reps * 1e6
    rows.append({"what": "Triton launch through the JIT", "us": jit_us})
    direct = getattr(compiled, "__getitem__", None)
    if direct is not None:
        def direct_loop():
            run = compiled[(4, 1, 1)]
            for _ in range(reps):
                run(x, 4096)
        try:
            direct_loop()
            torch.cuda.synchronize()
            rows.append({"what": "Triton launch through the compiled kernel", "us": best(direct_loop, 3) / reps * 1e6})
        except Exception as e:  # the compiled kernel's calling convention differs between Triton versions
            rows.append({"what": "Triton launch through the compiled kernel", "error": repr(e)[:200]})
    torch.cuda.synchronize()
    a = torch.randn(192, 2048, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)

    def linears():
        for _ in range(reps):
            torch.nn.functional.linear(a, w)
    linears()
    torch.cuda.synchronize()
    rows.append({"what": "bf16 linear [192,2048]x[2048,2048]^T, host", "us": best(linears, 3) / reps * 1e6})
    torch.cuda.synchronize()

    def empties():
        for _ in range(reps):
            torch.empty(192, 2048, device="cuda", dtype=torch.bfloat16)
    rows.append({"what": "torch.empty on the device", "us": best(empties, 3) / reps * 1e6})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=float, default=11.2, help="the entry size (a 16K-token CED bench run: 11.2 MB)")
    ap.add_argument("--out", default="host_overheads.jsonl")
    args = ap.parse_args()
    nbytes = int(args.mb * MB)
    rows = rows_cpu(nbytes) + (rows_cuda(nbytes) if torch.cuda.is_available() else [])
    append_jsonl(args.out, [{"bench": "host_overheads", **r} for r in rows])
    for r in rows:
        val = f"{r['ms']:.3f} ms" if "ms" in r else (f"{r['us']:.2f} us" if "us" in r else r.get("error", ""))
        print(f"{r['what']:48} {val}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

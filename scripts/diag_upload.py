"""How long the host spends putting a step's index arrays on the GPU (issue 12, 16th session): layout.to_device
(pinned staging from the caching host allocator, non-blocking copy) against a pageable blocking copy, for the
sizes a cold CED prefill uploads. Prints per-call host microseconds; run on the GPU machine."""
import time

import torch

from deepinfer.layout import to_device


def host_us(fn, n=50):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    dt = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return dt


for numel in (128, 4096, 16384, 65536, 262144):
    t = torch.arange(numel, dtype=torch.int64)
    a = host_us(lambda: to_device(t, torch.long, "cuda"))
    b = host_us(lambda: t.pin_memory())
    c = host_us(lambda: t.to("cuda"))
    x = torch.randn(8192, 8192, device="cuda")
    for _ in range(4):
        x @ x  # the GPU busy: does either copy wait for it?
    t0 = time.perf_counter()
    to_device(t, torch.long, "cuda")
    busy_a = (time.perf_counter() - t0) * 1e6
    torch.cuda.synchronize()
    for _ in range(4):
        x @ x
    t0 = time.perf_counter()
    t.to("cuda")
    busy_c = (time.perf_counter() - t0) * 1e6
    torch.cuda.synchronize()
    print(f"{numel:7d} int64: to_device {a:7.1f} us (pin_memory alone {b:7.1f}), pageable .to {c:7.1f} us; "
          f"behind busy GPU: to_device {busy_a:8.1f} us, pageable {busy_c:8.1f} us", flush=True)

"""Host time of a step's index-list copy to the GPU: a fresh pinned staging tensor a call (layout.to_device) against
staging.Staging's reused pinned buffers, at the sizes a CED prefill's Upload has (~1-2 MB at 16K tokens), with a
millisecond of device work queued before each copy (as in a step) so a copy that waited for the device would show.

    python benchmarks/pinned_upload.py --out $OUT/pinned_upload.jsonl    # device

Writes a JSONL row per (size, variant): the median / min host microseconds over --repeats, and prints a table."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from deepinfer import staging  # noqa: E402
from deepinfer.layout import to_device  # noqa: E402


def timed(fn, repeats: int) -> list:
    out = []
    for _ in range(repeats):
        torch.cuda._sleep(2_000_000)  # ~1 ms of queued device work ahead of the copy
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize()  # (a step's copies are one a step: the last one has run by the next)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes-kb", type=int, nargs="+", default=[128, 512, 1024, 2048, 4096])
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--out", default="pinned_upload.jsonl")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs CUDA")
    dev = torch.device("cuda")
    st = staging.Staging(dev)
    rows = []
    for kb in a.sizes_kb:
        arr = np.arange(kb * 1024 // 8, dtype=np.int64)
        ref = torch.from_numpy(arr)
        parts = np.array_split(arr, 40)  # (an Upload joins ~40 lists: 1.6 MB at a 16K prefill)
        variants = {
            "pin_memory alone": lambda: ref.pin_memory(),
            "to_device (fresh pinned)": lambda: to_device(ref, torch.long, dev),
            "Staging.copy of 40 lists (joined into reused pinned)": lambda: st.copy(parts),
            "the same joined, then to_device": lambda: to_device(torch.from_numpy(np.concatenate(parts)), torch.long, dev),
            "numpy concatenate (the Upload's join)": lambda: np.concatenate([arr[: arr.size // 2], arr[arr.size // 2:]]),
        }
        for name, fn in variants.items():
            for _ in range(3):
                fn()
            ts = timed(fn, a.repeats)
            rows.append({"bench": "pinned_upload", "kb": kb, "variant": name, "median_us": statistics.median(ts),
                         "min_us": min(ts), "repeats": a.repeats, "device": torch.cuda.get_device_name()})
        got = st.copy(parts)
        torch.cuda.synchronize()
        assert torch.equal(got.cpu(), ref), "Staging.copy returned other values"
    rows.append({"bench": "pinned_upload", "variant": "Staging fresh fallbacks", "count": st.fresh})
    with open(a.out, "a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    print("| KB | variant | median us | min us |\n|--:|--|--:|--:|")
    for r in rows:
        if "kb" in r:
            print(f"| {r['kb']} | {r['variant']} | {r['median_us']:.1f} | {r['min_us']:.1f} |")
    print(f"Staging fresh fallbacks: {st.fresh}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

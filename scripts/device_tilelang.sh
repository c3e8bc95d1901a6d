#!/usr/bin/env bash
# Issue 12.4 (TileLang beside Triton) on the GPU machine (the device tool), from the repo root there.
#
# tilelang 0.1.15, apache-tvm-ffi 0.1.12, z3-solver 4.15.4.0 and torch-c-dlpack-ext 0.1.5 (the rest of tilelang's
# needs are in the device image) come to ~83 MB of wheels, more than one call carries beside the ~19 MB tree, so
# they travel as one tar split in two parts, .whl_tl/a and .whl_tl/b (ignored through .git/info/exclude), over
# two consecutive calls; the machine keeps /tmp between calls while it stays warm (30 s after a call).
#
#   here:   bash scripts/device_tilelang.sh pack        # download the wheels, tar, split into .whl_tl/a, .whl_tl/b
#   device: bash scripts/device_tilelang.sh stage1      # carry [".whl_tl/a"]: part a -> /tmp/tl_parts
#   device: bash scripts/device_tilelang.sh stage2      # carry [".whl_tl/b"]: part b, join, check, install into
#                                                       # /tmp/tlsite, precompile the kernels (16 processes), run
#                                                       # tests/test_tilelang_kernels.py -> $OUT/tl_tests.log
#   device: bash scripts/device_tilelang.sh bench       # no carry: benchmarks/tilelang_vs_triton.py ->
#                                                       # $OUT/tilelang_vs_triton.jsonl, $OUT/tl_bench.log
# ("tests" reruns the tests without installing again; each device subcommand ends well inside one call.)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
PARTS=/tmp/tl_parts
SITE=/tmp/tlsite
WHEELS=("tilelang==0.1.15" "apache-tvm-ffi==0.1.12" "z3-solver==4.15.4.0" "torch-c-dlpack-ext==0.1.5")
LIMIT=$((64 * 1024 * 1024))  # what one device call carries, tree included

copy_part() {  # .whl_tl/$1 -> $PARTS
  [ -d ".whl_tl/$1" ] || { echo "no .whl_tl/$1 here: pass carry=[\".whl_tl/$1\"]" >&2; exit 1; }
  mkdir -p "$PARTS" && cp -f ".whl_tl/$1"/* "$PARTS/" && ls -l "$PARTS"
}

use_site() {
  export PYTHONPATH="$SITE:$PWD" PYTHONUNBUFFERED=1
  python3 -c "import tilelang, tvm_ffi, torch, triton; print('tilelang', tilelang.__version__, 'tvm_ffi',
tvm_ffi.__version__, 'torch', torch.__version__, 'triton', triton.__version__)" || exit 1
}

precompile() {  # every kernel config the tests and the benchmark build, 16 at a time, into tilelang's disk cache
  DEEPINFER_TILELANG_ARCH=sm_90a timeout "${TL_PRECOMPILE_TIMEOUT:-300}" python3 - <<'EOF'
import multiprocessing as mp, time
import torch
bf, fp = torch.bfloat16, torch.float16
CED = [(16, 512, bf, f, e, torch.float32, d, None) for f in ("fp4_e2m1_e4m3", "mxfp4") for e in (True, False)
       for d in (True, False)]
CED += [(4, 64, fp, "fp4_e2m1_e4m3", True, None, d, None) for d in (True, False)]
CED += [(16, 512, bf, "fp4_e2m1_e4m3", True, torch.float32, d, 64) for d in (True, False)]  # bench's other tile
MLA = [(16, 64, 32, fp, 4, 96, torch.int32, torch.int64, d, None) for d in (True, False)]
MLA += [(128, 512, 64, bf, 16, 576, torch.int64, torch.int64, d, bn) for d in (True, False) for bn in (None, 32)]
MLA += [(16, 128, 64, bf, 16, 200, torch.int64, torch.int64, d, None) for d in (True, False)]
MERGE = [(16, 512, "bfloat16", True), (4, 64, "float16", False), (128, 512, "bfloat16", False),
         (16, 64, "float16", False), (16, 128, "bfloat16", False)]

def build(job):
    kind, cfg = job
    t = time.time()
    try:
        if kind == "ced":
            from deepinfer.backends.nvidia.tilelang_ced_attention import kernel_for
            kernel_for(*cfg)
        elif kind == "mla":
            from deepinfer.backends.nvidia.tilelang_mla import kernel_for
            kernel_for(*cfg[:9], block_n=cfg[9])
        else:
            from deepinfer.backends.nvidia import tilelang_common as tlc
            tlc.compile_kernel(tlc.merge_builder(*cfg), ("merge", *cfg, "float32"))
        return f"{kind} {cfg}: {time.time() - t:.1f}s"
    except Exception as e:
        return f"{kind} {cfg}: FAILED {type(e).__name__}: {str(e)[-300:]}"

jobs = [("ced", c) for c in CED] + [("mla", c) for c in MLA] + [("merge", c) for c in MERGE]
t0 = time.time()
with mp.get_context("fork").Pool(16) as pool:  # the parent never touches CUDA
    for line in pool.imap_unordered(build, jobs):
        print(line, flush=True)
print(f"precompiled {len(jobs)} kernels in {time.time() - t0:.0f}s")
EOF
}

run_tests() {
  timeout "${1:-420}" python3 -m pytest -q -p no:cacheprovider -rfEs tests/test_tilelang_kernels.py 2>&1 \
    | grep -v "Warning: T.vectorized" | tee "$OUT/tl_tests.log" | tail -40
}

mkdir -p "$OUT"
case "${1:-}" in
pack)  # here, with network: wheels -> one tar -> two parts that each fit a call beside the tree
  rm -rf .whl_tl/a .whl_tl/b && mkdir -p .whl_tl/dl
  for w in "${WHEELS[@]}"; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl_tl/dl "$w" || exit 1
  done
  tar -C .whl_tl/dl -cf .whl_tl/tl_wheels.tar $(cd .whl_tl/dl && ls *.whl) || exit 1
  mkdir -p .whl_tl/a .whl_tl/b
  split -n 2 -d .whl_tl/tl_wheels.tar .whl_tl/tl_wheels.tar.part- || exit 1
  mv .whl_tl/tl_wheels.tar.part-00 .whl_tl/a/ && mv .whl_tl/tl_wheels.tar.part-01 .whl_tl/b/
  (cd .whl_tl && sha256sum tl_wheels.tar) | tee .whl_tl/a/SHA256SUMS > .whl_tl/b/SHA256SUMS
  rm -f .whl_tl/tl_wheels.tar
  tree=$( (git ls-files -z; git ls-files -z --others --exclude-standard) | xargs -0 du -cb 2>/dev/null \
    | awk 'END {print $1}')
  for p in a b; do
    part=$(du -cb .whl_tl/$p | awk 'END {print $1}')
    echo "a call with .whl_tl/$p: tree $((tree >> 20)) MiB + part $((part >> 20)) MiB" \
      "= $(((tree + part) >> 20)) MiB (limit 64)"
    [ $((tree + part)) -lt $LIMIT ] || { echo "too big for one call: split in three parts instead" >&2; exit 1; }
  done ;;
stage1)
  copy_part a ;;
stage2)
  copy_part b
  [ -f "$PARTS/tl_wheels.tar.part-00" ] \
    || { echo "part a missing in $PARTS: run stage1 first, on the same warm machine" >&2; exit 1; }
  cat "$PARTS"/tl_wheels.tar.part-* > /tmp/tl_wheels.tar && (cd /tmp && sha256sum -c "$PARTS/SHA256SUMS") || exit 1
  rm -rf /tmp/tl_whl && mkdir -p /tmp/tl_whl && tar -C /tmp/tl_whl -xf /tmp/tl_wheels.tar || exit 1
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    /tmp/tl_whl/*.whl || exit 1
  use_site
  nvidia-smi -L; which nvcc g++ && nvcc --version | tail -1
  precompile 2>&1 | grep -v "Warning: T.vectorized\|INFO" | tee "$OUT/tl_precompile.log" | tail -30
  run_tests "${TL_TEST_TIMEOUT:-420}" ;;
tests)
  use_site
  run_tests 540 ;;
bench)
  use_site
  timeout "${TL_BENCH_TIMEOUT:-540}" python3 benchmarks/tilelang_vs_triton.py --out "$OUT/tilelang_vs_triton.jsonl" 2>&1 \
    | grep -v "Warning: T.vectorized\|INFO" | tee "$OUT/tl_bench.log" | tail -45 ;;
*)
  echo "usage: $0 pack | stage1 | stage2 | tests | bench" >&2; exit 2 ;;
esac

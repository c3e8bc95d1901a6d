#!/usr/bin/env bash
# Issue 16 (the deterministic recipe) on the H200, from the repo root there (the image's torch and triton; nothing
# to install). Rows, logs and junit xml land in $OUT. Two calls cover it all (~2 + ~8 min):
#   bash scripts/device_issue16.sh tests         # the GPU tests: the Triton kernels compiled, the CUDA overrides on
#                                                # a Llama-sized linear (cuBLAS failing the same check), the CED
#                                                # demo's guarantee on the nvidia backend (bf16 and float32)
#   bash scripts/device_issue16.sh all COMMIT    # the 1000-run check on the Llama-3.1-8B shape (deterministic, then
#                                                # throughput), then the cost benchmark
#   bash scripts/device_issue16.sh check COMMIT [SHAPE] [RUNS]  # determinism_check.py alone (default llama-3.1-8b,
#                                                # 1000): distinct outputs of one prompt among random traffic
#   bash scripts/device_issue16.sh bench COMMIT  # determinism_bench.py alone: output tok/s, deterministic vs
#                                                # throughput, Llama-3.1-8B shape and CED bench config, batch 1/16/64
#   bash scripts/device_issue16.sh splits COMMIT # the split-K matmul: GPU tests, split vs unsplit vs cuBLAS, bench
#   bash scripts/device_issue16.sh final COMMIT  # tests, the matmuls on CED's products, the bench, the 1000-run check
#   bash scripts/device_issue16.sh cpu-tests     # tests/test_batch_invariant.py (the CPU guarantee; CI runs it too)
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi -L
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
cmd=${1:-}
shift || true

run_tests() {  # TIMEOUT FILES...
  local t=$1; shift
  timeout -s INT "$t" python3 -m pytest -p no:cacheprovider -q -rfE --durations=12 \
    --junitxml="$OUT/issue16_tests.xml" "$@" 2>&1 | tee "$OUT/issue16_tests.log" | tail -25
}

run_check() {  # COMMIT SHAPE RUNS BUDGET_PER_RECIPE
  timeout "$(( ${4:-130} * 2 + 100 ))" python3 benchmarks/determinism_check.py --shape "${2:-llama-3.1-8b}" \
    --runs "${3:-1000}" --per-round 200 --budget-s "${4:-130}" --commit "${1:-?}" \
    --out "$OUT/determinism_check.jsonl" \
    2>&1 | tee "$OUT/determinism_check_${2:-llama-3.1-8b}.log" | grep -v Warning | tail -16
}

run_bench() {
  timeout "${2:-230}" python3 benchmarks/determinism_bench.py --shapes llama-3.1-8b ced-bench --batches 1 16 64 \
    --in-len 128 --out-len 64 --commit "${1:-?}" --out "$OUT/determinism_bench.jsonl" \
    2>&1 | tee "$OUT/determinism_bench.log" | grep -v Warning | tail -20
}

case "$cmd" in
tests) run_tests 500 tests/test_triton_batch_invariant.py ;;
splits)
  # The split-K matmul and sized row kernels: their GPU tests, the dispatched path vs unsplit vs cuBLAS on the
  # CED bench config's and Llama's products, then the cost bench (~8 min in all).
  run_tests 150 tests/test_triton_batch_invariant.py
  timeout 90 python3 benchmarks/bi_matmul_tiles.py --picked --shape ced-bench --ms 1 16 64 1024 \
    --out "$OUT/bi_matmul_picked.jsonl" 2>&1 | grep -v Warning | tail -42
  timeout 60 python3 benchmarks/bi_matmul_tiles.py --picked --shape llama-3.1-8b --ms 1 64 2048 \
    --out "$OUT/bi_matmul_picked.jsonl" 2>&1 | grep -v Warning | tail -16
  run_bench "${1:-?}" 230 ;;
final)
  # The last kernel change checked in one call: the GPU tests, the dispatched matmuls on CED's products, the cost
  # bench, then the 1000-run check on the Llama-3.1-8B shape.
  run_tests 150 tests/test_triton_batch_invariant.py
  timeout 60 python3 benchmarks/bi_matmul_tiles.py --picked --shape ced-bench --ms 1 64 1024 \
    --out "$OUT/bi_matmul_picked.jsonl" 2>&1 | grep -v Warning | tail -32
  run_bench "${1:-?}" 150
  run_check "${1:-?}" llama-3.1-8b 1000 95 ;;
cpu-tests) run_tests 500 tests/test_batch_invariant.py ;;
check) run_check "${1:-?}" "${2:-llama-3.1-8b}" "${3:-1000}" 200 ;;
bench) run_bench "${1:-?}" 500 ;;
all)
  run_check "${1:-?}" llama-3.1-8b 1000 110
  run_bench "${1:-?}" 200 ;;
*)
  echo "usage: bash scripts/device_issue16.sh tests | all COMMIT | check COMMIT [SHAPE] [RUNS] | bench COMMIT | cpu-tests" >&2
  exit 2 ;;
esac

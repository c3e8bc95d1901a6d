#!/usr/bin/env bash
# Issue 18 (parallel serving) on a 2-GPU machine (the device tool's nvidia-h200-x2), from the repo root there:
#   bash scripts/device_issue18.sh          # NCCL parity tests, then the Qwen3-30B-A3B expert-parallel bench
#   bash scripts/device_issue18.sh tests    # only the parity tests (tiny models, float32, 1 GPU vs 2)
#   bash scripts/device_issue18.sh bench    # only the bench
#   bash scripts/device_issue18.sh dp       # the bench with data-parallel attention instead
# The bench (benchmarks/parallel_gpu_bench.py): Qwen3-30B-A3B shape (dummy bf16 weights), expert parallelism over
# 2 GPUs (attention tensor-parallel, experts by all-to-all over NCCL) against 1 GPU, both eager: decode at batch
# 64 and 256, prefill of one 16K prompt; then balancedness with a skewed router before/after one EPLB rebalance
# (simulated 2 ranks on one GPU: EPLB does not drive the workers yet). Rows go to $OUT/parallel_gpu.jsonl.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
tests() {
  timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_parallel.py -k "nccl or llama-2ranks" 2>&1 | tail -4
}
bench() {
  timeout 500 python3 benchmarks/parallel_gpu_bench.py --out "$OUT/parallel_gpu.jsonl" 2>&1 | grep -v Warn | tail -12
}
bench_dp() {  # the same with data-parallel attention (each GPU its own sequences)
  timeout 500 python3 benchmarks/parallel_gpu_bench.py --layout dp --out "$OUT/parallel_gpu.jsonl" 2>&1 \
    | grep -v Warn | tail -12
}
case "${1:-all}" in
tests) tests ;;
bench) bench ;;
dp) bench_dp ;;
all) tests; bench; bench_dp ;;
*) echo "usage: bash scripts/device_issue18.sh [all|tests|bench|dp]" >&2; exit 2 ;;
esac

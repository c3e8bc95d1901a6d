#!/usr/bin/env bash
# Issue 18 (parallel serving) on a 2-GPU machine (the device tool's nvidia-h200-x2), from the repo root there:
#   bash scripts/device_issue18.sh          # NCCL parity tests, then the Qwen3-30B-A3B expert-parallel bench (+ dp)
#   bash scripts/device_issue18.sh tests    # only the parity tests (tiny models, float32, 1 GPU vs 2; EPLB's move)
#   bash scripts/device_issue18.sh bench    # only the bench
#   bash scripts/device_issue18.sh dp       # the bench with data-parallel attention instead
#   bash scripts/device_issue18.sh cpu      # a dry run on the CPU (gloo, tiny shape): checks the script's path
# The bench (benchmarks/parallel_gpu_bench.py): Qwen3-30B-A3B shape (dummy bf16 weights), expert parallelism over
# 2 GPUs (attention tensor-parallel, experts by all-to-all over NCCL) against 1 GPU, both eager: decode at batch
# 64 and 256, prefill of one 16K prompt; then EPLB on the 2-GPU engine itself: a skewed router (a fixed bias on
# 8 hot experts per layer, on both ranks), 16 redundant slots, balancedness before/after one rebalance (expert
# weights moved between the GPUs) and the decode tokens/s it wins back at batch 256. Rows: $OUT/parallel_gpu.jsonl.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
tests() {
  timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_parallel.py tests/test_parallel_eplb.py \
    -k "nccl or llama-2ranks" 2>&1 | tail -4
}
bench() {
  timeout 560 python3 benchmarks/parallel_gpu_bench.py --out "$OUT/parallel_gpu.jsonl" 2>&1 | grep -v Warn | tail -12
}
bench_dp() {  # the same with data-parallel attention (each GPU its own sequences and their KV)
  timeout 560 python3 benchmarks/parallel_gpu_bench.py --layout dp --out "$OUT/parallel_gpu.jsonl" 2>&1 \
    | grep -v Warn | tail -12
}
cpu() {  # no GPU needed: the same bench path on two gloo ranks, a tiny shape, a few steps
  timeout 300 python3 benchmarks/parallel_gpu_bench.py --shape qwen3-moe-tiny --device cpu --dtype float32 \
    --batches 4 --prefill 64 --decode-steps 4 --repeats 2 --hot 2 --redundant 2 --kv-gb 0.05 \
    --out "$OUT/parallel_cpu_dryrun.jsonl" 2>&1 | grep -v -i warn | tail -6
}
case "${1:-all}" in
tests) nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; tests ;;
bench) bench ;;
dp) bench_dp ;;
cpu) cpu ;;
all) nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; tests; bench; bench_dp ;;
*) echo "usage: bash scripts/device_issue18.sh [all|tests|bench|dp|cpu]" >&2; exit 2 ;;
esac

#!/usr/bin/env bash
# GPU session script: kernel/engine tests on the device, then the Llama-shape benchmark (one device call).
# Usage there: bash scripts/device_run1.sh <commit>
set -uo pipefail
OUT=${OUT:-/tmp/out}
timeout 330 bash scripts/device_check.sh tests/test_gpu_parity.py tests/test_cuda_graphs.py \
  tests/test_triton_prefill.py tests/test_triton_mla.py tests/test_triton_moe.py tests/test_triton_sampling.py \
  tests/test_triton_rope.py tests/test_triton_kv_write.py tests/test_triton_ced.py tests/test_nvidia_kernels.py \
  tests/test_overlap.py -k "gpu or greedy or graph or parity or overlap or Parity" -s -rfE --durations=15 \
  2>&1 | tee $OUT/tests.log | grep -v "^\s*$" | tail -150
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
python3 benchmarks/gpu_bench.py --out $OUT/bench1.jsonl --commit "$1" --phases roofline,llama \
  --batches 1 16 64 256 --prefill-tokens 4096 16384 65536 --budget-s 230 2>&1 | tee $OUT/bench1.log | tail -40

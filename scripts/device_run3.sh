#!/usr/bin/env bash
# GPU session script 3: the GPU tests of the engine paths, a decode profile and the full benchmark.
# Usage there: bash scripts/device_run3.sh <commit>
set -uo pipefail
OUT=${OUT:-/tmp/out}
timeout 170 bash scripts/device_check.sh tests/test_overlap.py tests/test_cuda_graphs.py tests/test_gpu_parity.py \
  tests/test_triton_ced.py tests/test_triton_sampling.py -k "gpu or greedy or graph or parity or Parity or overlap" \
  -rfE 2>&1 | tee $OUT/tests3.log | grep -E "passed|failed|FAILED|Error" | tail -20
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
timeout 80 python3 benchmarks/profile_decode.py --batches 1 64 --out $OUT/profile.jsonl > $OUT/profile.log 2>&1
grep -E "== batch|sync" $OUT/profile.log
python3 benchmarks/gpu_bench.py --out $OUT/gpu_bench.jsonl --commit "$1" --phases roofline,llama,hf,moe,ced \
  --batches 1 16 64 256 --prefill-tokens 4096 16384 65536 --budget-s 250 2>&1 | tee $OUT/bench.log | tail -30
python3 benchmarks/plot_rows.py $OUT/gpu_bench.jsonl --png $OUT/gpu_bench.png > /dev/null 2>&1 || true

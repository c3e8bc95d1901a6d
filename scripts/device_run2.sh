#!/usr/bin/env bash
# GPU session script 2: re-run the GPU tests that failed, CED/MLA diagnostics, a decode profile and the
# full benchmark (Llama + HF + MoE + CED). Usage there: bash scripts/device_run2.sh <commit>
set -uo pipefail
OUT=${OUT:-/tmp/out}
timeout 200 bash scripts/device_check.sh tests/test_gpu_parity.py tests/test_cuda_graphs.py tests/test_triton_mla.py \
  tests/test_triton_ced.py -k "gpu or greedy or graph or parity or Parity" -s -rfE 2>&1 | tee $OUT/tests2.log \
  | grep -E "passed|failed|FAILED|Error|split|us |GB/s|nats|max\|logit" | tail -60
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
[ -f scripts/diag_ced_attention.py ] && timeout 60 python3 scripts/diag_ced_attention.py 2>&1 | tee $OUT/diag_ced.log | tail -40
timeout 90 python3 benchmarks/profile_decode.py --batches 1 64 --out $OUT/profile.jsonl 2>&1 | tail -45
python3 benchmarks/gpu_bench.py --out $OUT/bench2.jsonl --commit "$1" --phases roofline,llama,hf,moe,ced \
  --batches 1 16 64 256 --prefill-tokens 4096 16384 65536 --budget-s 240 2>&1 | tee $OUT/bench2.log | tail -32

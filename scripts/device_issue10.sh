#!/usr/bin/env bash
# Issue 10 on the GPU machine (the device tool), from the repo root there:
#   bash scripts/device_issue10.sh tests        # GPU tests of the engine loop (graphs at start-up, profile, mixed steps)
#   bash scripts/device_issue10.sh bench COMMIT # mixed-step and decode/prefill figures, gpt-fast beside them
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi -L
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
case "${1:-tests}" in
tests)
  timeout 560 python3 -m pytest -q -p no:cacheprovider -rfE --durations=15 tests/test_kv_sizing.py \
    tests/test_cuda_graphs.py tests/test_gpu_parity.py tests/test_overlap.py tests/test_triton_prefill.py \
    tests/test_faults.py tests/test_sampling_state.py tests/test_forward_inputs.py \
    -k "profile or graph or parity or Parity or overlap or mixed or gpu or fault or persistent or device" 2>&1 \
    | tee "$OUT/tests.log" | tail -40 ;;
bench)
  timeout 150 python3 benchmarks/mixed_step.py --shape llama-3.1-8b --dtype bfloat16 --batch 16 64 --chunk 512 \
    --out "$OUT/mixed_step.jsonl" 2>&1 | grep -v Warning | tail -8
  timeout 230 python3 benchmarks/gpu_bench.py --out "$OUT/gpu_bench.jsonl" --commit "${2:-?}" --phases roofline,llama \
    --batches 1 64 256 --prefill-tokens 16384 --budget-s 220 2>&1 | tail -25
  if [ -f peers/gptfast_model.py ]; then
    timeout 200 python3 peers/peer_gptfast.py 1 64 > "$OUT/gptfast.jsonl" 2> "$OUT/gptfast.err"; cat "$OUT/gptfast.jsonl"
  fi ;;
esac

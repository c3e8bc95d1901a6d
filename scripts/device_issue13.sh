#!/usr/bin/env bash
# Issue 13 (prefix caching) on the GPU machine (the device tool), from the repo root there, one call:
#   bash scripts/device_issue13.sh prefix   # TTFT per tier (cold, device, host, disk; CED also device+swa and
#                                           # host+swa, restored by the encoder-SWA pool) for the CED bench config
#                                           # at 16K and 64K and the Llama-3.1-8B shape at 8K and 32K; the 20-turn
#                                           # agent workload on both; CED's bounded vs exact replay work.
# Rows go to $OUT/prefix_bench_*.jsonl, logs beside them; the table is printed at the end of each run.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
case "${1:-}" in
prefix)
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  git log --oneline -1
  timeout 330 python3 benchmarks/prefix_bench.py --model ced-bench --prefixes 16384 65536 --repeats 2 --turns 20 \
    --out "$OUT/prefix_bench_ced.jsonl" > "$OUT/prefix_ced.log" 2>&1
  echo "ced rc=$?"; grep -v "^row\|Warning\|warn" "$OUT/prefix_ced.log" | tail -16
  timeout 220 python3 benchmarks/prefix_bench.py --model llama-3.1-8b --prefixes 8192 32768 --repeats 2 --turns 20 \
    --kv-gb 40 --skip tiers --out "$OUT/prefix_bench_llama.jsonl" > "$OUT/prefix_llama.log" 2>&1
  echo "llama rc=$?"; grep -v "^row\|Warning\|warn" "$OUT/prefix_llama.log" | tail -6 ;;
*)
  echo "usage: bash scripts/device_issue13.sh prefix" >&2; exit 2 ;;
esac

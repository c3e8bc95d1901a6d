#!/usr/bin/env bash
# Issue 17 (the HTTP server) on the GPU machine (the device tool), from the repo root there, one call each:
#   bash scripts/device_issue17.sh overhead   # Llama-3.1-8B shape (random weights, bf16): the server against the
#                                             # offline engine on one workload at concurrency 64 (4 alternating
#                                             # pairs; the API's overhead in output tok/s should be under 5%)
#   bash scripts/device_issue17.sh rates      # the server's TTFT / ITL / E2E percentiles at 8, 16 and 32 req/s
#   bash scripts/device_issue17.sh interval   # overhead again with --stream-interval 4 (a chunk per 4 tokens: what
#                                             # the event loop's per-chunk work costs the engine thread)
# Needs the server's dependencies (pip install -e . brings fastapi, uvicorn, prometheus_client; httpx comes with
# huggingface_hub). Rows go to $OUT/serve_h200.jsonl, logs beside them; the table is printed at the end.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# The device has no index: carry the wheels in .whl_srv/ (cp312; pip download fastapi uvicorn prometheus_client httpx).
if ls .whl_srv/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/srvsite .whl_srv/*.whl && export PYTHONPATH=/tmp/srvsite:$PYTHONPATH
fi
python3 -c "import fastapi, uvicorn, prometheus_client, httpx" 2>/dev/null || python3 -m pip install -q fastapi uvicorn prometheus_client httpx
COMMON=(--model llama-3.1-8b --device cuda --dtype bfloat16 --kv-gb 24 --concurrency 64
        --input-len-range 256 1024 --output-len-range 128 256 --gpu-hour-cost 3.5 --out "$OUT/serve_h200.jsonl")
case "${1:-}" in
overhead)
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  git log --oneline -1
  timeout 560 python3 benchmarks/serve_bench.py "${COMMON[@]}" --num-prompts 256 --repeats 4 --full-warmup --rates \
    > "$OUT/serve_overhead.log" 2>&1
  echo "rc=$?"; tail -12 "$OUT/serve_overhead.log" ;;
rates)
  timeout 560 python3 benchmarks/serve_bench.py "${COMMON[@]}" --num-prompts 256 --repeats 1 --rates 8 16 32 \
    > "$OUT/serve_rates.log" 2>&1
  echo "rc=$?"; tail -12 "$OUT/serve_rates.log" ;;
interval)
  timeout 560 python3 benchmarks/serve_bench.py "${COMMON[@]}" --num-prompts 256 --repeats 4 --full-warmup --rates \
    --stream-interval 4 > "$OUT/serve_interval.log" 2>&1
  echo "rc=$?"; tail -12 "$OUT/serve_interval.log" ;;
*)
  echo "usage: bash scripts/device_issue17.sh overhead|rates|interval" >&2; exit 2 ;;
esac

#!/usr/bin/env bash
# Issue 13 (prefix caching) on the GPU machine (the device tool), from the repo root there, one call:
#   bash scripts/device_issue13.sh prefix   # TTFT per tier (cold, device, host, disk; CED also device+swa and
#                                           # host+swa, restored by the encoder-SWA pool) for the CED bench config
#                                           # at 16K and 64K and the Llama-3.1-8B shape at 8K and 32K; the 20-turn
#                                           # agent workload on both; CED's bounded vs exact replay work.
#   bash scripts/device_issue13.sh check COMMIT  # < 8 min, carry .whl312: the GPU tests of the disk tier, prefix
#                                           # cache, CED prefill/decode and speculation (xdist), the CED 16K hit
#                                           # step's profile, CED tiers at 16K/64K (no agent/replay parts), then
#                                           # the demo's speculative sweep with settings timed in alternating rounds
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
check)
  git log --oneline -1
  tests="tests/test_disk_format.py tests/test_kv_tiers.py tests/test_prefix_tiers.py tests/test_prefix_edges.py
    tests/test_disk_write_through.py tests/test_swa_pool.py tests/test_ced_decode_path.py tests/test_triton_ced.py
    tests/test_triton_ced_fused.py tests/test_triton_ced_glue.py tests/test_ced_verify_graphs.py tests/test_dspark.py
    tests/test_spec_edges.py tests/test_ced_host_work.py tests/test_ced_prefill_step.py"
  timeout -s INT 200 python3 -m pytest -n 8 --dist loadfile -p no:cacheprovider -q -rfE --junitxml="$OUT/check_tests.xml" \
    $(ls $tests 2>/dev/null) 2>&1 | tee "$OUT/check_tests.log" | grep -v -i "warn" | tail -12
  timeout 60 python3 benchmarks/profile_prefill.py --shape ced-bench --prefix 16384 --out "$OUT/profile_prefill" \
    2>&1 | grep -v -i warn | tail -12
  timeout 170 python3 benchmarks/prefix_bench.py --model ced-bench --prefixes 16384 65536 --repeats 2 \
    --skip agent replay --out "$OUT/prefix_bench_ced.jsonl" > "$OUT/prefix_ced.log" 2>&1
  echo "ced rc=$?"; grep -v "^row\|Warning\|warn" "$OUT/prefix_ced.log" | tail -12
  timeout 100 python3 benchmarks/spec_sweep.py --targets demo --rounds 3 --steps 32 --warmup-steps 32 \
    --concurrency 1 16 64 128 --budget-s 80 --commit "${2:-?}" \
    --out "$OUT/spec_sweep_rounds.jsonl" 2>&1 | grep -v -i warn | tail -14 ;;
*)
  echo "usage: bash scripts/device_issue13.sh prefix | check" >&2; exit 2 ;;
esac

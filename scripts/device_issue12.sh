#!/usr/bin/env bash
# Issue 12 (CED at full speed) on the GPU machine (the device tool), from the repo root there:
#   bash scripts/device_issue12.sh tests K   # group K of the GPU test suite (scripts/gpu_tests.py --list shows
#                                            # the groups; one device call each, junit xml and log in $OUT)
#   bash scripts/device_issue12.sh ced-prefill COMMIT # the 16K bounded / exact prefill ratio alone (LENGTHS=...)
#   bash scripts/device_issue12.sh moe-pairs          # the two-launch decode MoE: GPU tests and its bench
#   bash scripts/device_issue12.sh next COMMIT        # the pair-MoE bench and the 16K prefill ratio in one call
#   bash scripts/device_issue12.sh sweep              # GEMV kernel vs cuBLAS, CED attention's launch knobs
#   bash scripts/device_issue12.sh sweep2             # the same at batch 64 / the second GEMV kernel, the decode profile
#   bash scripts/device_issue12.sh check              # the touched kernels' GPU tests, the decode profile at 1/16/64
#   bash scripts/device_issue12.sh suite-short        # every GPU test file but kv_sizing, 12 workers, 330 s
#   bash scripts/device_issue12.sh moe-graphs         # the files the pair MoE and the GEMV touch, ~3 min
#   bash scripts/device_issue12.sh next13             # the router-logits GEMV bench, the decode profile's device split
#   bash scripts/device_issue12.sh prefill-attn       # CED attention's launch knobs on a 16K prefill chunk
#   bash scripts/device_issue12.sh check14            # 14th session (carry .whl312): every GPU test file but
#                                            # kv_sizing, the shared expert on the pair kernels, the decode profile
#   bash scripts/device_issue12.sh final14 COMMIT     # 14th session's last call: the files check14 failed in
#                                            # (shared expert now off), the decode profile, the 16K prefill ratio
#   bash scripts/device_issue12.sh final14s           # final14 without the 16K prefill (~2.5 min)
#   bash scripts/device_issue12.sh diag15             # the shared expert's divergence, cold prefill profiles
#   bash scripts/device_issue12.sh check15            # the shared expert on (its roundings), decode and prefill profiles
#   bash scripts/device_issue12.sh suite15            # GPU files (carry .whl312), a cold 16K prefill's idle spans
#   bash scripts/device_issue12.sh final15 COMMIT     # 4K / 16K prefill ratios, a 16K prefill's idle time, GPU files
#   bash scripts/device_issue12.sh check16            # CED kernel tests, prefill kernel variants, 16K profile, decode
#   bash scripts/device_issue12.sh sweep16            # CED kernel tests, prefill kernel variants, attention knobs
#   bash scripts/device_issue12.sh final16 COMMIT     # prefill ratios, 16K profile, decode profile, GPU files
#   bash scripts/device_issue12.sh diag17            # PDL on a chain of small kernels; a 4K prefill's host time
#   bash scripts/device_issue12.sh check17           # PDL's variants, the touched kernels' tests, decode per PDL mode
#   bash scripts/device_issue12.sh final17a          # (carry .whl312) GPU files but kv_sizing, the decode profile
#   bash scripts/device_issue12.sh final17b COMMIT   # (warm) 4K / 16K prefill ratios, test_kv_sizing alone
#   bash scripts/device_issue12.sh final17c          # (carry .whl312) GPU files, decode profile at 16 / 64
#   bash scripts/device_issue12.sh diag18            # a 4K prefill's host profile in both modes, decode at batch 1
#   bash scripts/device_issue12.sh check18 COMMIT    # decoder-pass graphs: their GPU tests and the CED graph files,
#                                            # a 4K prefill's wall / busy per mode, the 4K / 16K prefill ratios
#   bash scripts/device_issue12.sh check18b COMMIT   # RoPE / pass-graph GPU tests; the prefill ratios with each
#                                            # prefill's GC time, then again
#                                            # with --gc-freeze (5 repeats each)
#   bash scripts/device_issue12.sh s21               # (carry .whl312 .baseline) GPU files but kv_sizing; the decode
#                                            # profile of this tree and of .baseline/base.tgz's (git archive)
#   bash scripts/device_issue12.sh s21b COMMIT       # (carry .baseline) base / this tree's decode profiles alternating;
#                                            # gpu_bench roofline + CED decode 1/16/64 and the 4K prefill ratio
#   bash scripts/device_issue12.sh final18           # (carry .whl312) GPU files but kv_sizing, kv_sizing alone,
#                                            # the decode profile at 1 / 16 / 64
#   bash scripts/device_issue12.sh diag19            # pass-graph GPU tests; a 16K bounded prefill's torch ops with
#                                            # shapes; decode kernels (PDL off) at 1 / 16 / 64, 45 a row
#   bash scripts/device_issue12.sh check19           # skinny-product tests (split-K kernel), gemv_bench at 4-64 rows
#   bash scripts/device_issue12.sh moe19             # fused_experts' GEMM knobs at 16-128 tokens (moe_launch_sweep)
#   bash scripts/device_issue12.sh diag20 COMMIT     # the 4K prefill ratio under three engine shapes (gpu_bench)
#   bash scripts/device_issue12.sh diag20b           # a bounded 4K prefill's profile in gpu_bench's engine shape and its own
#   bash scripts/device_issue12.sh s22a              # CED kernel tests; attention knobs with the entry loop pipelined
#   bash scripts/device_issue12.sh s22b              # (219a8d9 only) GEMV tests; decode profile, L2 prefetch off / on
#   bash scripts/device_issue12.sh s22c              # (carry .whl312) GPU files but kv_sizing, then kv_sizing alone
#   bash scripts/device_issue12.sh s22e COMMIT       # (carry .whl312 .baseline) s22c, base / this tree's profiles,
#                                            # gpu_bench: over 480 s at c427fbb (gpu_bench cut off): split it
#   bash scripts/device_issue12.sh s23a COMMIT       # (carry .baseline) the GEMV tails' GPU tests, then s21b COMMIT
#   bash scripts/device_issue12.sh s23b              # decode profiles as shipped, then each GEMV epilogue / the
#                                            # norm prologue on in turn
#   bash scripts/device_issue12.sh s25a              # decode profiles with each untimed knob (fused_experts' PDL
#                                            # chain, the dynamic entry loop, EARLY_W, split-K swap), gemv_bench
#   bash scripts/device_issue12.sh s26a              # decode-step A/Bs: the tensor-core GEMV variant at 16 / 64
#                                            # rows, pending ids resolved in the graphs; their GPU tests
#   bash scripts/device_issue12.sh s27               # (carry .whl312) GPU files but kv_sizing, the 16K entry table
#                                            # A/B, the decode profile with the tensor-core GEMV to 64 rows
#   bash scripts/device_issue12.sh s27t              # the GPU files of what no GPU ran yet, then the entry table A/B
#   bash scripts/device_issue12.sh s27m              # the least: the GPU tests of what is on by default and untested
#   bash scripts/device_issue12.sh s28a COMMIT       # s28a-c: the 28th session's A/Bs (see each target's comment)
#   bash scripts/device_issue12.sh s29a              # the raw-entry launch sweep (stages), the 16K prefill with the best
#   bash scripts/device_issue12.sh s29b              # moe_launch_sweep --prefill: the MoE GEMMs' large-M tiles
#   bash scripts/device_issue12.sh s29c              # GPU files but kv_sizing, then s29a's sweep narrowed (one call)
#   bash scripts/device_issue12.sh s29d KNOB=V ...   # the 16K bounded prefill as shipped / with knobs, alternating
#   bash scripts/device_issue12.sh s29e              # the MoE GPU files, the 16K prefill with WIDE_PREFILL_TILES 0 / 1
#   bash scripts/device_issue12.sh s30a              # Nsight Compute on the 16K prefill chunk's CED attention
#   bash scripts/device_issue12.sh s30b              # moe_launch_sweep --prefill at 64-row M-blocks (2K / 4K tokens)
#   bash scripts/device_issue12.sh s30c              # moe_launch_sweep --prefill --fp8 (block-scaled FP8 experts)
#   bash scripts/device_issue12.sh s31a              # the transposed products' GPU tests, swept, 16K prefill A/B
#   bash scripts/device_issue12.sh s31b              # s31a in ~3 min (64 keys only; one A/B)
#   bash scripts/device_issue12.sh s31c COMMIT       # trans on: CED kernel tests, decode with trans, gpu_bench, ncu
#   bash scripts/device_issue12.sh s31f              # the CED kernel files and GPU parity on 8 workers (~4 min)
#   bash scripts/device_issue12.sh s31g              # ncu stall reasons on the transposed chunk; 16 / 32 keys x 2 / 3 stages
#   bash scripts/device_issue12.sh s32a              # the transposed chunk with maxnreg 168 / 128, ring in kernel / copied
#   bash scripts/device_issue12.sh s32b              # CED kernel files + parity at the cap; its neighbours; 16K A/B
#   bash scripts/device_issue12.sh s32c              # MoE GPU tests at the new prefill tiles; s30b / s30c's sweeps again
#   bash scripts/device_issue12.sh s33a              # router logits GPU tests + model files; 16K prefill, tiled logits off / on
#   bash scripts/device_issue12.sh s33d              # router logits + key-table tests, indexer / top-K chunk sweeps,
#                                            # one 16K run per variant
#   bash scripts/device_issue12.sh s33b              # the host's idle spans in a cold 16K / 4K prefill, by Python frame;
#                                            # the router logits kernel's launch sweep
#   bash scripts/device_issue12.sh s34a              # pinned upload bench; 16K prefill staging off / on with
#                                            # layer-boundary marks; the 4K prefill's marks
#   bash scripts/device_issue12.sh s35a              # the router, several tokens a program, and its logits on
#                                            # 128-deep K steps: GPU tests, 16K A/B
#   bash scripts/device_issue12.sh s35b              # the prefill chunk on FP4 entries, transposed, beside the
#                                            # shipped raw-table launch (ced_attn_sweep)
#   bash scripts/device_issue12.sh s36a              # top-K a radix digit a pass (histogram), the k-sum in the
#                                            # norm: GPU tests, top-K variants, 16K prefill A/Bs (--marks)
#   bash scripts/device_issue12.sh s37a              # top-K by interpolation, lazy ties: GPU tests, variants,
#                                            # 16K prefill A/B
#   bash scripts/device_issue12.sh s38a              # the 37th session's untimed changes: their GPU tests, the 16K
#                                            # prefill A/B of the plans' place, the decode profile with finish's
#                                            # one launch off / on (~8 min)
#   bash scripts/device_issue12.sh s30d              # s30a, then moe-graphs (the MoE launch guard's first GPU run)
#   bash scripts/device_issue12.sh s26b              # gemv_bench's dot rows at 8-64; CED attention's splits at 256
#                                            # tokens of context
#   bash scripts/device_issue12.sh ced-bench COMMIT   # the issue's CED figures in one call: gpu_bench phases
#                                            # roofline,ced (cache bytes, prefill 4K/16K bounded and exact,
#                                            # decode at batch 1/16/64 against the HBM roofline); rows, log, plot
# Wheels the machine lacks travel gitignored in .whl/ (pass carry=[".whl"]). A wheel too large for one call travels
# in parts: split -b 30M x.whl .whl-a/x.whl.part-, then move the later parts to .whl-b/, ...; each call carries
# one folder while the machine stays warm (`echo "/.whl-*/" >> .git/info/exclude` keeps them out of git). Every
# .whl*/NAME.whl.part-* series is joined, in suffix order, into NAME.whl before installing.
# A new subcommand is one more case below; install_wheels and the environment are shared.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"

install_wheels() {
  local dir=/tmp/wheels part name
  rm -rf "$dir"; mkdir -p "$dir"
  for part in .whl*/*.whl.part-*; do
    [ -e "$part" ] || continue
    name=$(basename "${part%.part-*}")
    [ -e "$dir/$name" ] && continue
    cat $(ls .whl*/"$name".part-* | sort -t/ -k2) > "$dir/$name"  # parts in suffix order, whatever the folder
  done
  for w in .whl*/*.whl; do [ -e "$w" ] && cp "$w" "$dir/"; done
  if ls "$dir"/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      "$dir"/*.whl || exit 1
  fi
}

install_wheels
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
source scripts/ngram_ep.sh  # the n-gram plugin tests (test_draft_gate) select it by name
nvidia-smi -L
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
prefill_ratios() {  # final15 / final16: 4K and 16K bounded / exact prefill, gpu_bench, 3 alternating repeats
  local commit=$1 tag=${2:-}; shift; shift 2>/dev/null  # (further arguments go to gpu_bench)
  timeout 200 python3 benchmarks/gpu_bench.py --out "$OUT/gpu_bench_ced_prefill$tag.jsonl" --commit "$commit" \
    --phases roofline,ced --ced-prefill-tokens 4096 16384 --ced-batches --ced-repeats 3 \
    --budget-s 180 "$@" 2>&1 | tee "$OUT/gpu_bench_ced_prefill$tag.log" | grep -v Warning | tail -12
}

gpu_files_but_kv_sizing() {  # final15 / final16: every GPU test file but kv_sizing (which runs alone), 12 workers
  # (370 s: at a4b3f05 the 449 tests finished just inside 330 s and the timeout struck xdist's teardown, so no junit)
  local files
  files=$(python3 -c "import sys; sys.path.insert(0, 'scripts'); import gpu_tests; print(' '.join(f for f in gpu_tests.gpu_test_files() if 'kv_sizing' not in f))")
  timeout -s INT 370 python3 -m pytest -n 12 --dist loadfile -p no:cacheprovider -q -rfE \
    --junitxml="$OUT/gpu_tests_all.xml" $files tests/test_triton_ced_launch.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -8
}

ced_kernels16() {  # 16th session: tests/test_triton_ced.py, then ced_prefill_kernels.py (the table's last $1 lines)
  timeout -s INT 220 python3 -m pytest -n 8 -p no:cacheprovider -q -rfE tests/test_triton_ced.py \
    --junitxml="$OUT/test_triton_ced.xml" 2>&1 | tee "$OUT/test_triton_ced.log" | tail -8
  timeout 150 python3 benchmarks/ced_prefill_kernels.py --out "$OUT/ced_prefill_kernels.jsonl" 2>&1 \
    | tee "$OUT/ced_prefill_kernels.log" | grep -v Warning | tail -"$1"
}

raw_entry_sweep() {  # 26th session: a 2048-query prefill chunk at 16K on its FP4 entries against the same entries
  # decoded once to bf16 (entry_fmt "bf16", what ENTRY_TABLE attends), each launch both ways
  timeout 120 python3 benchmarks/ced_attn_sweep.py --batches --prefill-chunk 2048 --context 16384 --block-n 16 32 64 \
    --warps 4 8 --stages 1 --split-scale 0 --prefetch 0 --raw 0 1 --out "$OUT/ced_attn_raw.jsonl" 2>&1 \
    | grep -v Warning | tail -3
  python3 - "$OUT/ced_attn_raw.jsonl" <<'PY'
import json, sys
for r in map(json.loads, open(sys.argv[1])):
    if "us" in r: print(f"{r['setting']:<28} {r['us']:9.1f} us  err {r.get('rel_l2_err', float('nan')):.1e}")
PY
}

table_prefill_ab() {  # 26th session: a cold 16K bounded prefill with its entries read in place (FP4), then from a
  # bf16 table decoded once per full layer (ENTRY_TABLE=1); $1 seconds each, $2 repeats, the $3 top kernels
  for k in "" "ENTRY_TABLE=1"; do
    timeout "$1" python3 benchmarks/profile_cold_prefill.py --tokens 16384 --modes bounded --repeats "$2" \
      --top "$3" ${k:+--knob $k} --out "$OUT/cold_prefill_16k${k:+_table}" 2>&1 | grep -v Warning \
      | grep -A$(($3 + 2)) "^== " | cut -c 1-150
  done
}

prefill_ab() {  # s29d / s29e: the cold bounded prefill of TOKENS (16384 unless set) with knobs "$4" then "$5"
  # (space-separated NAME=VALUE, "" as shipped), alternating twice (or $6 runs in all); $1 seconds a run, the $2 top
  # kernels, rows to cold_prefill_<TOKENS / 1024>k_$3<run>.jsonl; PREFILL_EXTRA: more of its arguments (--marks)
  local n=0 k a args runs tokens=${TOKENS:-16384}
  runs=("$4" "$5" "$4" "$5")
  for k in "${runs[@]:0:${6:-4}}"; do
    n=$((n + 1)); args=""
    for a in $k; do args="$args --knob $a"; done
    timeout "$1" python3 benchmarks/profile_cold_prefill.py --tokens "$tokens" --modes bounded --repeats 3 \
      --top "$2" $args ${PREFILL_EXTRA:-} --out "$OUT/cold_prefill_$((tokens / 1024))k_$3$n" 2>&1 | grep -v Warning \
      | grep -A$(($2 + 1)) "^== " \
      | sed "s/^/[${k:-as shipped}] /" | cut -c 1-150
  done
}

raw_sweeps() {  # s31a / s32a: the prefill chunk's launch on raw entries (2048 queries at 16K), one sweep per grid
  # "SECONDS BLOCK_N WARPS STAGES TRANS MAXNREG" (lists joined by _), each with the shipped launch beside it (until
  # a4b7116 a SHADOW field came before MAXNREG: the ring copy, removed in the 32nd session)
  local grid
  for grid in "$@"; do
    set -- $grid
    timeout "$1" python3 benchmarks/ced_attn_sweep.py --batches --prefill-chunk 2048 --context 16384 \
      --block-n ${2//_/ } --warps ${3//_/ } --stages ${4//_/ } --split-scale 0 --prefetch 0 --raw 1 \
      --trans ${5//_/ } --maxnreg ${6//_/ } --out "$OUT/ced_attn_raw_$2_w$3_s$4_t$5_r$6.jsonl" \
      2>&1 | grep -v Warning | tail -1
  done
}

raw_best() {  # the timed rows of $OUT/ced_attn_raw*.jsonl, fastest first, on stderr; the fastest of those within
  # the error bound as RAW_* knobs (none where the shipped launch wins) on stdout
  cat "$OUT"/ced_attn_raw*.jsonl | python3 -c "
import json, re, sys
timed = [r for r in map(json.loads, sys.stdin) if r.get('chunk', 1) > 1 and 'us' in r]
for r in sorted(timed, key=lambda r: r['us']):
    print(f\"{r['setting']:<32} {r['us']:9.1f} us  err {r['rel_l2_err']:.1e}{'' if r['ok'] else '  (not ok)'}\",
          file=sys.stderr)
rows = [r for r in timed if r['ok']]
m = re.match(r'bn(\d+) w(\d+) s(\d+) x0 p0(?: t(1))?(?: r(\d+))?',
             min(rows, key=lambda r: r['us'])['setting']) if rows else None
if m:
    names = ('RAW_BLOCK_N', 'RAW_WARPS', 'RAW_STAGES', 'RAW_TRANS', 'RAW_MAXNREG')
    # (no t1 / r: RAW_TRANS / RAW_MAXNREG 0, since the shipped choice sets both)
    print(' '.join(f'triton_ced_attention.{k}={v or 0}' for k, v in zip(names, m.groups())))
"
}

raw_ab() {  # s31a: raw_best's knobs, then the 16K bounded prefill as shipped / with them, alternating: $1 runs in
  # all; where the shipped launch wins, the prefill as shipped ${2:-0} times
  local knobs
  knobs=$(raw_best)
  echo "fastest: ${knobs:-none (the shipped launch)}"
  if [ -n "$knobs" ]; then prefill_ab 50 4 raw "" "$knobs" "$1"; elif [ "${2:-0}" -gt 0 ]; then
    prefill_ab 50 4 raw "" "" "$2"; fi
}

dot_rows_profiles() {  # s26all / s27: the decode profile at 16 / 64 as shipped, then with the tensor-core GEMV up
  # to 64 rows; $1 seconds each, rows to profile_ced_$2.jsonl
  local k
  for k in "" "GEMV_DOT_MAX_ROWS=64"; do
    timeout "$1" python3 benchmarks/profile_decode.py --shape ced-bench --batches 16 64 --steps 16 ${k:+--knob $k} \
      --out "$OUT/profile_ced_$2.jsonl" 2>&1 | grep "== batch" | sed "s/^/[${k:-as shipped}] /" | cut -c 1-140
  done
}

knob_profiles() {  # s24b / s25a: the decode profile as shipped ("") and with each knob set ("A=1 B=2"), each at
  # the batches it touches (triton_ced*: 1 / 16 / 64; triton_gemv*: 1, the CUDA-core GEMV's; the rest 16 / 64)
  local k a args b
  for k in "$@"; do
    args=""; for a in $k; do args="$args --knob $a"; done
    case "$k" in ""|triton_ced*) b="1 16 64" ;; triton_gemv*) b="1" ;; *) b="16 64" ;; esac
    timeout 100 python3 benchmarks/profile_decode.py --shape ced-bench --batches $b --steps 16 $args \
      --out "$OUT/profile_ced_knobs.jsonl" 2>&1 | grep "== batch\|^timeline" | sed "s/^/[${k:-as shipped}] /" \
      | cut -c 1-120
  done
}

splitk_swap_bench() {  # s24b / s25a: gemv_bench's split-K knobs with and without swap against cuBLAS, 16 / 64 rows
  timeout 150 python3 benchmarks/gemv_bench.py --rows 16 64 --tiles 8192 --per-sm 4 --warps 8 --splitk-knobs \
    4,128,64,16,3 4,128,64,16,3,1 2,128,64,16,3,1 4,128,128,16,3,1 4,256,64,16,3,1 8,128,64,16,4,1 \
    --out "$OUT/gemv_swap.jsonl" 2>&1 | grep -v "done$" | grep -v Warning | tail -12
}

decode_ab() {  # s21b / s23a: the base tree's and this tree's decode profiles alternating, then gpu_bench ($1 commit)
  # 21st session (~8 min): the decode profile of the baseline tree (.baseline/base.tgz: git archive of deepinfer
  # without assets, benchmarks, recipes, the n-gram plugin) and of this tree, alternating twice on this GPU; then
  # gpu_bench's roofline and CED decode at 1 / 16 / 64 with the 4K prefill ratio, this tree.
  rm -rf /tmp/base && mkdir -p /tmp/base && tar xzf .baseline/base.tgz -C /tmp/base
  for r in 1 2; do
    (cd /tmp/base && PYTHONPATH=/tmp/base:/tmp/base/plugins/deepinfer-ngram:/tmp/ngram_ep:/tmp/site timeout 150 \
      python3 benchmarks/profile_decode.py --shape ced-bench --batches 1 16 64 --steps 16 \
      --out "$OUT/profile_ced_base.jsonl" 2>&1 | grep "== batch" | sed "s/^/base $r /" | cut -c 1-110)
    timeout 150 python3 benchmarks/profile_decode.py --shape ced-bench --batches 1 16 64 --steps 16 \
      --out "$OUT/profile_ced_new.jsonl" 2>&1 | grep "== batch" | sed "s/^/new  $r /" | cut -c 1-110
  done
  timeout 250 python3 benchmarks/gpu_bench.py --out "$OUT/gpu_bench_ced.jsonl" --commit "$1" \
    --phases roofline,ced --ced-prefill-tokens 4096 --ced-batches 1 16 64 --ced-repeats 2 --budget-s 230 2>&1 \
    | tee "$OUT/gpu_bench_ced.log" | grep -v Warning | tail -14
}

cmd=${1:-}
shift || true
case "$cmd" in
tests)
  # The runner's groups fit 480 s; the timeout leaves the call's 600 s a margin for the install and the copy back.
  timeout 570 python3 scripts/gpu_tests.py --group "${1:?usage: device_issue12.sh tests K}" ;;
smoke)
  # CED decode on the device (graphs, no sync), FP8 experts, then the decode profile and the CED bench phase.
  timeout -s INT 200 python3 -m pytest -v -p no:cacheprovider -rfE --durations=8 tests/test_ced_decode_path.py tests/test_moe_fp8.py \
    2>&1 | tee "$OUT/smoke_tests.log" | tail -25
  timeout 150 python3 benchmarks/profile_decode.py --shape ced-bench --batches 1 16 64 --steps 16 \
    --out "$OUT/profile_ced.jsonl" 2>&1 | grep -v Warning | tail -45
  timeout 220 python3 benchmarks/gpu_bench.py --phases roofline,ced --out "$OUT/gpu_bench_ced.jsonl" --budget-s 200 \
    2>&1 | tail -30 ;;
ced-bench)
  timeout 560 python3 benchmarks/gpu_bench.py --out "$OUT/gpu_bench_ced.jsonl" --commit "${1:-?}" \
    --phases roofline,ced --budget-s 520 2>&1 | tee "$OUT/gpu_bench_ced.log" | grep -v Warning | tail -40
  python3 benchmarks/plot_rows.py "$OUT/gpu_bench_ced.jsonl" --png "$OUT/gpu_bench_ced.png" > /dev/null 2>&1 || true ;;
moe-pairs)
  # The decode MoE in two launches (triton_moe_pairs) against the fused MoE: its GPU tests, then the bench at the
  # CED bench shape, bf16 and FP8, 1..64 tokens (~1 min); where it wins is where the backend should take it.
  timeout 200 python3 -m pytest -q -p no:cacheprovider -rfE tests/test_triton_moe_pairs.py tests/test_triton_moe.py \
    -k pairs 2>&1 | tail -4  # (test_triton_moe.py's tests run on both implementations: its [pairs] ones)
  timeout 200 python3 benchmarks/moe_pairs_bench.py --out "$OUT/moe_pairs.jsonl" 2>&1 | grep -v Warning | tail -16 ;;
ced-prefill)
  # The 16K bounded / exact prefill ratio alone (gpu_bench phases roofline,ced with no decode batch): the CED
  # bench config built twice, each 16K prefill once untimed, then REPEATS alternating repeats; < 5 min.
  timeout 300 python3 benchmarks/gpu_bench.py --out "$OUT/gpu_bench_ced_prefill.jsonl" --commit "${1:-?}" \
    --phases roofline,ced --ced-prefill-tokens ${LENGTHS:-16384} --ced-batches --ced-repeats "${REPEATS:-3}" \
    --budget-s 270 2>&1 | tee "$OUT/gpu_bench_ced_prefill.log" | grep -v Warning | tail -20 ;;
next)
  # The twelfth session's open measurements in one call (~7 min): the pair MoE against the fused one (its last line
  # gives MOE_PAIRS_MAX for backends/nvidia/ops.py), then the 16K bounded / exact prefill ratio.
  timeout 120 python3 benchmarks/moe_pairs_bench.py --out "$OUT/moe_pairs.jsonl" 2>&1 | grep -v Warning | tail -17
  timeout 300 python3 benchmarks/gpu_bench.py --out "$OUT/gpu_bench_ced_prefill.jsonl" --commit "${1:-?}" \
    --phases roofline,ced --ced-prefill-tokens ${LENGTHS:-16384} --ced-batches --ced-repeats "${REPEATS:-3}" \
    --budget-s 270 2>&1 | tee "$OUT/gpu_bench_ced_prefill.log" | grep -v Warning | tail -20 ;;
sweep)
  # The thirteenth session's kernel sweeps (~5 min): the GEMV kernel's GPU tests, then triton_gemv against cuBLAS at
  # the bench projections (its last lines: the knobs, GEMV_MAX_ROWS), then CED attention's launch knobs.
  timeout 100 python3 -m pytest -q -p no:cacheprovider -rfE tests/test_triton_gemv.py 2>&1 | tail -3
  timeout 240 python3 benchmarks/gemv_bench.py --out "$OUT/gemv.jsonl" 2>&1 | grep -v Warning | tail -9
  timeout 230 python3 benchmarks/ced_attn_sweep.py --out "$OUT/ced_attn_sweep.jsonl" 2>&1 | grep -v Warning | tail -6 ;;
sweep2)
  # The GEMV kernel (at d9f9d5a its per-lane variant) tests and bench, CED attention's knobs at batch 64, the decode
  # profile at batch 1 and 16.
  timeout 60 python3 -m pytest -q -p no:cacheprovider -rfE tests/test_triton_gemv.py 2>&1 | tail -2
  timeout 170 python3 benchmarks/gemv_bench.py --out "$OUT/gemv.jsonl" 2>&1 | grep -v Warning | tail -8
  timeout 150 python3 benchmarks/ced_attn_sweep.py --batches 64 --stages 1 2 --out "$OUT/ced_attn_sweep_b64.jsonl" \
    2>&1 | grep -v Warning | tail -3
  timeout 120 python3 benchmarks/profile_decode.py --shape ced-bench --batches 1 16 --steps 16 \
    --out "$OUT/profile_ced.jsonl" 2>&1 | grep -v Warning | tail -45 ;;
check)
  # After the sweeps' choices: the touched kernels' GPU tests, the pair MoE with GEMV-sized tiles against the fused
  # one (its last line: MOE_PAIRS_MAX), then the decode profile at batch 1, 16, 64.
  timeout -s INT 200 python3 -m pytest -n 4 -q -p no:cacheprovider -rfE tests/test_triton_gemv.py \
    tests/test_triton_ced_launch.py tests/test_triton_ced.py tests/test_ced_decode_path.py \
    tests/test_triton_moe_pairs.py 2>&1 | tail -4
  timeout 100 python3 benchmarks/moe_pairs_bench.py --tokens 1 2 4 8 16 --out "$OUT/moe_pairs.jsonl" 2>&1 \
    | grep -v Warning | tail -12
  timeout 150 python3 benchmarks/profile_decode.py --shape ced-bench --batches 1 16 64 --steps 16 \
    --out "$OUT/profile_ced.jsonl" 2>&1 | grep -v Warning | grep -B1 -A22 "== batch" | grep -v "^host\|cProfile" ;;
final)
  # One call (carry .whl_tl/a): the first TileLang part, every GPU test file at once (xdist, a file per worker;
  # kv_sizing alone after, since it measures the device's free memory), the CED bench, the prefix-cache bench.
  bash scripts/device_tilelang.sh stage1 > /dev/null
  files=$(python3 -c "import sys; sys.path.insert(0, 'scripts'); import gpu_tests; print(' '.join(f for f in gpu_tests.gpu_test_files() if 'kv_sizing' not in f))")
  timeout -s INT 300 python3 -m pytest -n 8 --dist loadfile -p no:cacheprovider -q -rfE \
    --junitxml="$OUT/gpu_tests_all.xml" $files 2>&1 | tee "$OUT/gpu_tests.log" | tail -30
  timeout -s INT 60 python3 -m pytest -p no:cacheprovider -q -rfE tests/test_kv_sizing.py 2>&1 | tail -5
  timeout 80 python3 benchmarks/gpu_bench.py --phases roofline,ced --out "$OUT/gpu_bench_ced.jsonl" --budget-s 70 \
    --commit "${1:-?}" 2>&1 | tail -22
  timeout 110 python3 benchmarks/prefix_bench.py --model llama-3.1-8b --prefixes 8192 32768 --repeats 2 --turns 20 \
    --kv-gb 40 --out "$OUT/prefix_bench.jsonl" 2>&1 | grep -v Warning | tail -12 ;;
suite)
  # Every GPU test file at once under xdist (a file per worker), without TileLang (its tests skip); kv_sizing alone
  # after, since it measures the device's free memory. Carry .whl312 (xgrammar) so the grammar tests run.
  files=$(python3 -c "import sys; sys.path.insert(0, 'scripts'); import gpu_tests; print(' '.join(f for f in gpu_tests.gpu_test_files() if 'kv_sizing' not in f))")
  timeout -s INT 420 python3 -m pytest -n 8 --dist loadfile -p no:cacheprovider -q -rfE --durations=15 \
    --junitxml="$OUT/gpu_tests_all.xml" $files 2>&1 | tee "$OUT/gpu_tests.log" | tail -45
  timeout -s INT 90 python3 -m pytest -p no:cacheprovider -q -rfE tests/test_kv_sizing.py 2>&1 | tail -5 ;;
next13)
  # What the thirteenth session left for the next one's first call (~5 min): the GEMV bench with the router's logits
  # row and the tensor-core variant at 2-16 rows (its last lines: GEMV_DOT_MAX_ROWS, CED_ROUTE_LOGITS_GEMV_MAX_ROWS),
  # then the decode profile with the GPU's busy time a step
  # and the kernels launched outside the graph (the 0.9 ms between replay and step at batch 16 and 64).
  timeout 200 python3 benchmarks/gemv_bench.py --tiles 8192 --per-sm 2 4 --warps 4 8 --out "$OUT/gemv.jsonl" 2>&1 \
    | grep -v Warning | tail -20
  timeout 170 python3 benchmarks/profile_decode.py --shape ced-bench --batches 1 16 64 --steps 16 \
    --out "$OUT/profile_ced.jsonl" 2>&1 | grep -v Warning | grep -B1 -A22 "== batch" | grep -v "^host\|cProfile" ;;
prefill-attn)
  # CED attention's launch knobs on a 2048-query prefill chunk at 16K (2.4 ms a layer on the default launch, most
  # of a 16K prefill; the decode sweep's winners cut batch 64 by 2.6x).
  timeout 300 python3 benchmarks/ced_attn_sweep.py --batches --prefill-chunk 2048 --stages 1 2 \
    --out "$OUT/ced_attn_sweep_prefill.jsonl" 2>&1 | grep -v Warning | tail -3 ;;
check14)
  # After the 14th session's kernel changes (the wide attention launch for prefill chunks, the GEMV knobs, the
  # shared expert on the pair kernels): the GPU files under xdist (300 s), the shared-expert bench, the decode
  # profile at batch 1, 16 and 64 (~2.5 min).
  files=$(python3 -c "import sys; sys.path.insert(0, 'scripts'); import gpu_tests; print(' '.join(f for f in gpu_tests.gpu_test_files() if 'kv_sizing' not in f))")
  timeout -s INT 300 python3 -m pytest -n 12 --dist loadfile -p no:cacheprovider -q -rfE --durations=10 \
    --junitxml="$OUT/gpu_tests_all.xml" $files tests/test_triton_ced_launch.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
  timeout 60 python3 benchmarks/moe_pairs_bench.py --shared --tokens 1 2 4 --out "$OUT/moe_pairs_shared.jsonl" 2>&1 \
    | grep -v Warning | tail -5
  timeout 150 python3 benchmarks/profile_decode.py --shape ced-bench --batches 1 16 64 --steps 16 \
    --out "$OUT/profile_ced.jsonl" 2>&1 | grep -v Warning | grep -B1 -A22 "== batch" | grep -v "^host\|cProfile" ;;
final14)
  # The three tests check14 saw fail with the shared expert on the pair kernels (off now), that kernel's tests, the
  # decode profile at batch 1, 16 and 64, then the 16K bounded / exact prefill (one repeat each): ~5.5 min.
  timeout -s INT 100 python3 -m pytest -n 4 -q -p no:cacheprovider -rfE tests/test_triton_moe_pairs.py \
    "tests/test_speculative.py::test_greedy_speculation_reproduces_plain_decoding" \
    tests/test_swa_pool.py 2>&1 | tail -4
  timeout 110 python3 benchmarks/profile_decode.py --shape ced-bench --batches 1 16 64 --steps 16 \
    --out "$OUT/profile_ced.jsonl" 2>&1 | grep -v Warning | grep -A8 "== batch" | grep -v "^host\|cProfile"
  timeout 170 python3 benchmarks/gpu_bench.py --out "$OUT/gpu_bench_ced_prefill.jsonl" --commit "${1:-?}" \
    --phases roofline,ced --ced-prefill-tokens 16384 --ced-batches --ced-repeats 1 \
    --budget-s 160 2>&1 | tee "$OUT/gpu_bench_ced_prefill.log" | grep -v Warning | tail -14 ;;
final14s)
  timeout -s INT 100 python3 -m pytest -n 4 -q -p no:cacheprovider -rfE tests/test_triton_moe_pairs.py \
    "tests/test_speculative.py::test_greedy_speculation_reproduces_plain_decoding" \
    tests/test_swa_pool.py 2>&1 | tail -4
  timeout 110 python3 benchmarks/profile_decode.py --shape ced-bench --batches 1 16 64 --steps 16 \
    --out "$OUT/profile_ced.jsonl" 2>&1 | grep -v Warning | grep -A8 "== batch" | grep -v "^host\|cProfile" ;;
suite-short)
  # The GPU test files under xdist in one shorter call (a device budget's end), a 330 s limit; kv_sizing left out (it
  # measures the device's free memory, so it runs alone: `suite` runs it after the rest).
  files=$(python3 -c "import sys; sys.path.insert(0, 'scripts'); import gpu_tests; print(' '.join(f for f in gpu_tests.gpu_test_files() if 'kv_sizing' not in f))")
  timeout -s INT 330 python3 -m pytest -n 12 --dist loadfile -p no:cacheprovider -q -rfE --durations=10 \
    --junitxml="$OUT/gpu_tests_all.xml" $files 2>&1 | tee "$OUT/gpu_tests.log" | tail -30 ;;
moe-graphs)
  # What the pair-MoE dispatch and the one-row GEMV touch, in one short call (~3 min): the MoE kernels and FP8 experts,
  # CUDA graphs and GPU parity of every model family (MoE models decode a few tokens on the pair kernel now), CED
  # decode, speculative decoding, the GEMV and attention-launch tests.
  timeout -s INT 180 python3 -m pytest -n 9 --dist loadfile -p no:cacheprovider -q -rfE --durations=6 \
    --junitxml="$OUT/gpu_tests_moe_graphs.xml" tests/test_triton_moe.py tests/test_moe_fp8.py \
    tests/test_cuda_graphs.py tests/test_gpu_parity.py tests/test_ced_decode_path.py tests/test_triton_moe_pairs.py \
    tests/test_speculative.py tests/test_triton_gemv.py tests/test_triton_ced_launch.py 2>&1 | tail -20 ;;
prefix)
  # The prefix-cache bench on the Llama-8B shape (with the first TileLang part copied, carry .whl_tl/a).
  bash scripts/device_tilelang.sh stage1 > /dev/null
  timeout 200 python3 benchmarks/prefix_bench.py --model llama-3.1-8b --prefixes 8192 32768 --repeats 2 --turns 20 \
    --kv-gb 40 --out "$OUT/prefix_bench.jsonl" 2>&1 | grep -v Warning | tail -14 ;;
final2)
  # The next call, warm (carry .whl_tl/b): TileLang installed, its kernels precompiled and tested, then timed.
  TL_PRECOMPILE_TIMEOUT=150 TL_TEST_TIMEOUT=170 bash scripts/device_tilelang.sh stage2
  TL_BENCH_TIMEOUT=150 bash scripts/device_tilelang.sh bench
  timeout 100 python3 benchmarks/prefix_bench.py --model ced-bench --prefixes 16384 --repeats 1 --turns 0 \
    --skip agent --out "$OUT/prefix_bench_ced.jsonl" 2>&1 | grep -v Warning | tail -10 ;;
mla)
  # After stage1 on a warm machine (carry .whl_tl/b): TileLang installed, then the engine's MLA tests with
  # TileLang's MLA decode as the default (kernel_choice), and the kernel counts that show it ran.
  TL_PRECOMPILE_TIMEOUT=100 TL_TEST_TIMEOUT=100 bash scripts/device_tilelang.sh stage2 > "$OUT/tl_stage2.log" 2>&1
  tail -3 "$OUT/tl_stage2.log"
  PYTHONPATH=/tmp/tlsite:$PWD timeout -s INT 300 python3 -m pytest -n 4 -p no:cacheprovider -q -rfE \
    tests/test_triton_mla.py tests/test_gpu_parity.py tests/test_cuda_graphs.py -k "mla or deepseek or MLA" \
    2>&1 | tail -15
  PYTHONPATH=/tmp/tlsite:$PWD timeout 120 python3 scripts/mla_kernel_calls.py ;;
diag15)
  # 15th session's first call (~7 min): the shared expert on the pairs switched on with every eager call checked
  # against its parts and a float64 oracle while the tests that parted run (scripts/diag_shared_pairs.py), then a
  # cold 16K and 4K prefill profiled in both replay modes (benchmarks/profile_cold_prefill.py).
  timeout -s INT 170 python3 scripts/diag_shared_pairs.py 2>&1 | grep -v Warning | tail -14
  timeout 200 python3 benchmarks/profile_cold_prefill.py --tokens 16384 --repeats 3 \
    --out "$OUT/profile_cold_prefill_16k" 2>&1 | grep -v "Warning\|^-\|^ \|USDT" | tail -72
  timeout 120 python3 benchmarks/profile_cold_prefill.py --tokens 4096 --repeats 3 --top 12 \
    --out "$OUT/profile_cold_prefill_4k" 2>&1 | grep "^== " ;;
check15)
  # After the shared expert's roundings matched the unfused path and it went on (~6 min): the tests that parted and
  # the files around the MoE and CED decode, the decode profile at batch 1, 16 and 64, a cold 16K prefill profiled.
  timeout -s INT 220 python3 -m pytest -n 6 --dist loadfile -q -p no:cacheprovider -rfE tests/test_triton_moe_pairs.py \
    tests/test_swa_pool.py tests/test_speculative.py tests/test_ced_decode_path.py tests/test_moe_fp8.py \
    tests/test_cuda_graphs.py 2>&1 | tail -6
  timeout 110 python3 benchmarks/profile_decode.py --shape ced-bench --batches 1 16 64 --steps 16 \
    --out "$OUT/profile_ced.jsonl" 2>&1 | grep -v Warning | grep -A8 "== batch" | grep -v "^host\|cProfile"
  timeout 150 python3 benchmarks/profile_cold_prefill.py --tokens 16384 --repeats 3 --top 16 \
    --out "$OUT/profile_cold_prefill_16k" 2>&1 | grep -v "Warning\|^-\|^ \|USDT\|Self" | tail -40 ;;
suite15)
  # 15th session (carry .whl312): every GPU test file but kv_sizing under xdist (330 s), then a cold 16K prefill in
  # both replay modes with the device's idle spans and a cProfile of the host (~2.5 min).
  files=$(python3 -c "import sys; sys.path.insert(0, 'scripts'); import gpu_tests; print(' '.join(f for f in gpu_tests.gpu_test_files() if 'kv_sizing' not in f))")
  timeout -s INT 330 python3 -m pytest -n 12 --dist loadfile -p no:cacheprovider -q -rfE --durations=5 \
    --junitxml="$OUT/gpu_tests_all.xml" $files tests/test_triton_ced_launch.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -14
  timeout 170 python3 benchmarks/profile_cold_prefill.py --tokens 16384 --repeats 2 --top 10 --host \
    --out "$OUT/profile_cold_prefill_16k" > "$OUT/profile_cold_prefill_16k.log" 2>&1
  grep "^== \|idle\|  at " "$OUT/profile_cold_prefill_16k.log" | head -60 ;;
final15)
  # 15th session's last call (carry .whl312, ~6.5 min): the 4K and 16K bounded / exact prefill (gpu_bench, three
  # alternating repeats), a cold 16K prefill's device busy and idle time, then every GPU test file but kv_sizing.
  prefill_ratios "${1:-?}"
  timeout 90 python3 benchmarks/profile_cold_prefill.py --tokens 16384 --repeats 2 --top 8 \
    --out "$OUT/profile_cold_prefill_16k" > "$OUT/profile_cold_prefill_16k.log" 2>&1
  grep "^== \|idle\|  at " "$OUT/profile_cold_prefill_16k.log" | head -20
  gpu_files_but_kv_sizing ;;
check16)
  # 16th session (~6 min): the CED kernel tests (the fast FP4 decoder, query-blocked indexer scores), the prefill
  # kernels' variants (benchmarks/ced_prefill_kernels.py), a cold 16K prefill by kernel, the decode profile.
  ced_kernels16 12
  timeout 90 python3 benchmarks/profile_cold_prefill.py --tokens 16384 --repeats 2 --top 10 \
    --out "$OUT/profile_cold_prefill_16k" > "$OUT/profile_cold_prefill_16k.log" 2>&1
  grep -A 12 "^== " "$OUT/profile_cold_prefill_16k.log" | cut -c 1-60,90-120
  timeout 100 python3 benchmarks/profile_decode.py --shape ced-bench --batches 1 16 64 --steps 16 \
    --out "$OUT/profile_ced.jsonl" 2>&1 | grep -v Warning | tail -12 ;;
sweep16)
  # 16th session (~6 min): the CED kernel tests, the prefill kernels' variants (top-K tiles too), then CED
  # attention's launch knobs again with the fast FP4 decoder: a 2048-query prefill chunk and decode at 1 / 16 / 64.
  ced_kernels16 13
  timeout 240 python3 benchmarks/ced_attn_sweep.py --prefill-chunk 2048 --block-n 16 32 64 --warps 4 8 \
    --stages 1 2 --split-scale 0 0.5 1 2 --reps 20 --out "$OUT/ced_attn_sweep.jsonl" 2>&1 | grep -v Warning | tail -8 ;;
final16)
  # 16th session's last call (carry .whl312, ~7.5 min): final15's 4K / 16K prefill ratios, the cold 16K prefill by
  # kernel and the GPU files, plus the decode profile at 1 / 16 / 64.
  prefill_ratios "${1:-?}"
  timeout 90 python3 benchmarks/profile_cold_prefill.py --tokens 16384 --repeats 2 --top 12 \
    --out "$OUT/profile_cold_prefill_16k" > "$OUT/profile_cold_prefill_16k.log" 2>&1
  grep -A 8 "^== " "$OUT/profile_cold_prefill_16k.log" | cut -c 1-60,90-120
  timeout 100 python3 benchmarks/profile_decode.py --shape ced-bench --batches 1 16 64 --steps 16 \
    --out "$OUT/profile_ced.jsonl" 2>&1 | grep -v Warning | tail -6
  gpu_files_but_kv_sizing ;;
diag17)
  # 17th session (~3 min): does programmatic dependent launch shorten a graph's chain of small kernels
  # (scripts/diag_pdl.py), and where a bounded 4K prefill's host time goes (cProfile, by own and cumulative time).
  timeout 120 python3 scripts/diag_pdl.py --out "$OUT/diag_pdl.jsonl" 2>&1 | grep -v Warning | tail -14
  timeout 120 python3 benchmarks/profile_cold_prefill.py --tokens 4096 --modes bounded --repeats 3 --host --top 12 \
    --out "$OUT/profile_cold_prefill_4k" > "$OUT/profile_cold_prefill_4k.log" 2>&1
  tail -5 "$OUT/profile_cold_prefill_4k.log" ;;
check17)
  # 17th session (~8.5 min): PDL's variants on a chain of GEMVs, the GPU tests of the kernels it and the new pair
  # down kernel touch, the pair MoE against the fused one (with the shared expert), the decode profile per PDL mode.
  timeout 100 python3 scripts/diag_pdl.py --out "$OUT/diag_pdl.jsonl" 2>&1 | grep -v Warning | tail -22
  timeout -s INT 200 python3 -m pytest -n 8 -q -p no:cacheprovider -rfE tests/test_triton_pdl.py \
    tests/test_triton_moe_pairs.py tests/test_triton_moe.py tests/test_triton_ced.py tests/test_triton_ced_fused.py \
    tests/test_triton_ced_glue.py tests/test_triton_gemv.py tests/test_ced_decode_path.py \
    --junitxml="$OUT/check17_tests.xml" 2>&1 | tee "$OUT/check17_tests.log" | tail -6
  timeout 80 python3 benchmarks/moe_pairs_bench.py --shared --tokens 1 2 4 8 16 --out "$OUT/moe_pairs.jsonl" 2>&1 \
    | grep -v Warning | tail -8
  for m in 0 1 2; do
    echo "== DEEPINFER_PDL=$m"
    DEEPINFER_PDL=$m timeout 90 python3 benchmarks/profile_decode.py --shape ced-bench --batches 1 16 64 --steps 16 \
      --out "$OUT/profile_ced_pdl$m.jsonl" 2>&1 | grep "== batch" | cut -c 1-150
  done ;;
final17a)
  # 17th session's last calls (a: carry .whl312, ~7 min): every GPU file but kv_sizing, the decode profile (PDL
  # mode 2, the default); b (warm, ~6 min): the 4K / 16K prefill ratios, test_kv_sizing alone, the decode profile
  # with PDL mode 3 (the streaming kernels signalling late).
  gpu_files_but_kv_sizing
  timeout 140 python3 benchmarks/profile_decode.py --shape ced-bench --batches 1 16 64 --steps 16 \
    --out "$OUT/profile_ced_pdl2.jsonl" 2>&1 | grep "== batch" | cut -c 1-150 ;;
final17b)
  prefill_ratios "${1:-?}"
  timeout -s INT 100 python3 -m pytest -q -p no:cacheprovider -rfE tests/test_kv_sizing.py 2>&1 | tail -3
  DEEPINFER_PDL=3 timeout 140 python3 benchmarks/profile_decode.py --shape ced-bench --batches 1 16 64 --steps 16 \
    --out "$OUT/profile_ced_pdl3.jsonl" 2>&1 | grep "== batch" | cut -c 1-150 ;;
final17c)
  # 17th session's closing call (carry .whl312, ~4.5 min): the GPU files but kv_sizing after grouped_linear's
  # strided batched GEMM, then the decode profile at 16 and 64 rows (where out_proj takes it).
  gpu_files_but_kv_sizing
  timeout 80 python3 benchmarks/profile_decode.py --shape ced-bench --batches 16 64 --steps 16 \
    --out "$OUT/profile_ced.jsonl" 2>&1 | grep "== batch" | cut -c 1-150 ;;
diag18)
  # 18th session (~4 min): where the 4K prefill's host time goes in both modes (cProfile by own and cumulative
  # time, 45 rows), and the batch-1 decode step's host functions.
  timeout 200 python3 benchmarks/profile_cold_prefill.py --tokens 4096 --modes bounded exact --repeats 3 --host \
    --top 45 --out "$OUT/profile_cold_prefill_4k" > "$OUT/profile_cold_prefill_4k.log" 2>&1
  grep -v Warning "$OUT/profile_cold_prefill_4k.log" | grep -i "wall\|busy" | head -8
  timeout 100 python3 benchmarks/profile_decode.py --shape ced-bench --batches 1 --steps 16 \
    --out "$OUT/profile_ced.jsonl" 2>&1 | grep -v Warning | tail -30 ;;
check18)
  # 18th session (~7 min): bounded replay's decoder pass in CUDA graphs (models/ced/pass_graphs.py).
  timeout -s INT 200 python3 -m pytest -n 4 -q -p no:cacheprovider -rfE tests/test_pass_graphs.py \
    tests/test_ced_decode_path.py tests/test_ced_verify_graphs.py tests/test_ced_prefill_step.py \
    tests/test_triton_ced_launch.py tests/test_triton_moe_pairs.py --junitxml="$OUT/check18_tests.xml" 2>&1 | tee "$OUT/check18_tests.log" | tail -6
  timeout 100 python3 benchmarks/profile_cold_prefill.py --tokens 4096 --modes bounded exact --repeats 5 \
    --out "$OUT/profile_cold_prefill_4k" > "$OUT/profile_cold_prefill_4k.log" 2>&1
  grep -v Warning "$OUT/profile_cold_prefill_4k.log" | grep "^== " | cut -c 1-200
  prefill_ratios "${1:-?}" ;;
check18b)
  timeout -s INT 120 python3 -m pytest -n 4 -q -p no:cacheprovider -rfE tests/test_triton_ced_fused.py \
    tests/test_pass_graphs.py --junitxml="$OUT/check18b_tests.xml" 2>&1 | tail -3
  prefill_ratios "${1:-?}" "" --ced-repeats 5
  prefill_ratios "${1:-?}" _gc_freeze --ced-repeats 5 --gc-freeze ;;
s21)
  # 21st session (~8 min): every GPU test file but kv_sizing; then the decode profile at 1 / 16 / 64 of this tree
  # and of a baseline tree (carry .baseline/, holding base.tgz = git archive of the baseline commit), one after
  # the other on this GPU, so the step times compare as a ratio.
  gpu_files_but_kv_sizing
  timeout 200 python3 benchmarks/profile_decode.py --shape ced-bench --batches 1 16 64 --steps 16 \
    --out "$OUT/profile_ced_new.jsonl" 2>&1 | grep "== batch" | cut -c 1-150
  if [ -f .baseline/base.tgz ]; then
    rm -rf /tmp/base && mkdir -p /tmp/base && tar xzf .baseline/base.tgz -C /tmp/base
    (cd /tmp/base && PYTHONPATH=/tmp/base:/tmp/site timeout 200 python3 benchmarks/profile_decode.py \
      --shape ced-bench --batches 1 16 64 --steps 16 --out "$OUT/profile_ced_base.jsonl" 2>&1 \
      | grep "== batch" | cut -c 1-150)
  fi ;;
s21b)
  decode_ab "${1:-?}" ;;
final18)
  gpu_files_but_kv_sizing
  timeout -s INT 100 python3 -m pytest -q -p no:cacheprovider -rfE tests/test_kv_sizing.py 2>&1 | tail -3
  timeout 100 python3 benchmarks/profile_decode.py --shape ced-bench --batches 1 16 64 --steps 16 \
    --out "$OUT/profile_ced.jsonl" 2>&1 | grep "== batch" | cut -c 1-150 ;;
diag19)
  # 19th session (~4 min): the landing's pass-graph tests, then which torch ops launch the 16K prefill's library
  # kernels (elementwise, copies, reductions), and every kernel of a decode step with PDL off (no waits counted).
  timeout -s INT 120 python3 -m pytest -n 4 -q -p no:cacheprovider -rfE tests/test_pass_graphs.py 2>&1 | tail -3
  timeout 150 python3 benchmarks/profile_cold_prefill.py --tokens 16384 --modes bounded --repeats 2 --ops --top 40 \
    --out "$OUT/profile_cold_prefill_16k" > "$OUT/profile_cold_prefill_16k.log" 2>&1
  grep -v Warning "$OUT/profile_cold_prefill_16k.log" | grep -A42 "^torch op" | cut -c 1-160
  DEEPINFER_PDL=0 timeout 120 python3 benchmarks/profile_decode.py --shape ced-bench --batches 1 16 64 --steps 16 \
    --top 45 --out "$OUT/profile_ced_pdl0.jsonl" 2>&1 | grep "== batch" | cut -c 1-150 ;;
check19)
  # 19th session (~4 min): triton_splitk against float64 and in graphs, then its knobs against cuBLAS at the
  # CED bench projections (the GEMV kernels at their shipped knobs only).
  timeout -s INT 150 python3 -m pytest -n 4 -q -p no:cacheprovider -rfE tests/test_triton_gemv.py 2>&1 | tail -4
  timeout 330 python3 benchmarks/gemv_bench.py --rows 4 8 16 32 64 --tiles 8192 --per-sm 4 --warps 8 \
    --out "$OUT/gemv_splitk.jsonl" 2>&1 | grep -v "done$" | grep -v Warning | tail -32 ;;
moe19)
  # 19th session (~3 min): fused_experts' GEMM knobs at decode token counts (the CED bench MoE shape).
  timeout 400 python3 benchmarks/moe_launch_sweep.py --out "$OUT/moe_launch.jsonl" 2>&1 | grep -v Warning | tail -60 ;;
moe19b)
  # 19th session (~4 min): the MoE and decode-path GPU tests, the sweep again (launch_config's new row), then the
  # decode profile (the step's figures against the last run's).
  timeout -s INT 150 python3 -m pytest -n 4 -q -p no:cacheprovider -rfE tests/test_triton_moe.py \
    tests/test_triton_moe_pairs.py tests/test_ced_decode_path.py 2>&1 | tail -3
  timeout 200 python3 benchmarks/moe_launch_sweep.py --tokens 16 64 --also '{"BN1": 32, "stages2": 4}' \
    --out "$OUT/moe_launch.jsonl" 2>&1 | grep "^T=\|launch_config\|given"
  timeout 100 python3 benchmarks/profile_decode.py --shape ced-bench --batches 1 16 64 --steps 16 \
    --out "$OUT/profile_ced.jsonl" 2>&1 | grep "== batch" | cut -c 1-150 ;;
diag20)
  # 20th session (~5 min): the 4K bounded / exact prefill under three engine shapes, gpu_bench's timed prefill in
  # each (5 alternating repeats): 4K alone (max_model_len ~4K, 4 sequences), 4K beside 16K (max_model_len ~16K),
  # 4K with decode batches 1 / 16 / 64 (64 sequences): which setting costs the 4K prefill its time.
  for spec in "4096|" "4096 16384|" "4096|1 16 64"; do
    L=${spec%|*}; B=${spec#*|}; tag=$(echo "L${L}_B${B}" | tr ' ' '-')
    timeout 190 python3 benchmarks/gpu_bench.py --out "$OUT/diag20_$tag.jsonl" --commit "${1:-?}" \
      --phases roofline,ced --ced-prefill-tokens $L --ced-batches $B --ced-repeats 5 --budget-s 170 2>&1 \
      | grep "exact / bounded\|prefill (" | sed "s/^/$tag /" | cut -c 1-170
  done ;;
diag20b)
  # 20th session (~3 min): a bounded 4K prefill in gpu_bench's ced-phase engine shape (max_model_len 16K, 64
  # sequences, 16K batched tokens) and in profile_cold_prefill's own (4K, 4): wall, busy, idle spans, host top.
  for shape in "--max-len 16392 --max-seqs 64 --batched 16384|big" "|small"; do
    timeout 130 python3 benchmarks/profile_cold_prefill.py --tokens 4096 --modes bounded --repeats 5 --host \
      ${shape%|*} --out "$OUT/profile_cold_prefill_4k_${shape#*|}" > "$OUT/pcp_${shape#*|}.log" 2>&1
    grep -v Warning "$OUT/pcp_${shape#*|}.log" | grep -A12 "^== \|idle spans" | cut -c 1-180 | head -40
  done ;;
s22a)
  # 22nd session (~7 min): the CED kernel tests (the pipelined entry loop among them), then the attention's
  # launch knobs with the entry loop pipelined or not at decode 1 / 16 / 64 and a 2048-query prefill chunk.
  timeout -s INT 200 python3 -m pytest -n 4 -q -p no:cacheprovider -rfE tests/test_triton_ced.py 2>&1 | tail -3
  timeout 360 python3 benchmarks/ced_attn_sweep.py --batches 1 16 64 --prefill-chunk 2048 --block-n 16 32 \
    --warps 4 8 --stages 1 --split-scale 0 0.5 1 2 --prefetch 0 1 --reps 20 --out "$OUT/ced_attn_sweep.jsonl" 2>&1 \
    | grep -v Warning | tail -8 ;;
s22b)
  # 22nd session (~5 min, at 219a8d9 only: the prefetch was taken out after it): the GEMV tests (their weights
  # prefetched into L2 before the PDL wait), then the CED decode profile at 1 / 16 / 64 with the prefetch off and
  # on (DEEPINFER_L2_PREFETCH), alternating twice on this GPU.
  timeout -s INT 150 python3 -m pytest -n 4 -q -p no:cacheprovider -rfE tests/test_triton_gemv.py 2>&1 | tail -3
  for r in 1 2; do
    for pf in 0 1; do
      DEEPINFER_L2_PREFETCH=$pf timeout 150 python3 benchmarks/profile_decode.py --shape ced-bench --batches 1 16 64 \
        --steps 16 --top 30 --out "$OUT/profile_ced_l2pf$pf.jsonl" 2>&1 | grep "== batch" | sed "s/^/l2pf=$pf $r /" \
        | cut -c 1-120
    done
  done ;;
s22c)
  # 22nd session (~7 min, carry .whl312): every GPU test file but kv_sizing, then kv_sizing alone.
  gpu_files_but_kv_sizing
  timeout -s INT 100 python3 -m pytest -q -p no:cacheprovider -rfE tests/test_kv_sizing.py 2>&1 | tail -3 ;;
s23a)
  # 23rd session (~8 min, carry .baseline): the tails' GPU tests, then s21b (base / this tree's decode profiles
  # alternating twice; gpu_bench's roofline, CED decode at 1 / 16 / 64 and the 4K prefill ratio).
  timeout -s INT 90 python3 -m pytest -q -p no:cacheprovider -rfE tests/test_gemv_add_rms.py tests/test_route_tail.py \
    2>&1 | tail -3
  decode_ab "${1:-?}" ;;
s23b)
  # 23rd session (~4 min; not yet run): the decode profile as shipped (the GEMV epilogues and the norm prologue
  # off), then with each turned on in turn (profile_decode --knob).
  for k in "" "CED_ROUTE_TAIL=1" "CED_QUERY_ROPE_GEMV=1" "CED_OUT_ADD_RMS_GEMV=1" "CED_QUERY_NORM_GEMV=1"; do
    args=""; for a in $k; do args="$args --knob $a"; done
    timeout 110 python3 benchmarks/profile_decode.py --shape ced-bench --batches 1 16 64 --steps 16 $args \
      --out "$OUT/profile_ced_knobs.jsonl" 2>&1 | grep "== batch" | sed "s/^/[${k:-as shipped}] /" | cut -c 1-120
  done ;;
s24a)
  # 24th session (~3 min): the prologue's tests again (a float32 bound), then the decode profile with its timeline
  # (what each kernel adds to the device span under PDL) as shipped at 1 / 16 / 64, and with the prologue at 1.
  timeout -s INT 90 python3 -m pytest -q -p no:cacheprovider -rfE tests/test_gemv_norm_in.py 2>&1 | tail -3
  timeout 150 python3 benchmarks/profile_decode.py --shape ced-bench --batches 1 16 64 --steps 16 --top 30 \
    --out "$OUT/profile_ced_timeline.jsonl" 2>&1 | grep -v Warning | grep -A32 "== batch\|^timeline" | cut -c 1-120
  timeout 90 python3 benchmarks/profile_decode.py --shape ced-bench --batches 1 --steps 16 --top 30 \
    --knob CED_QUERY_NORM_GEMV=1 --out "$OUT/profile_ced_timeline_normin.jsonl" 2>&1 | grep "== batch\|span" ;;
s26a)
  # 26th session (~6 min): A/B in the decode step, twice each way: the tensor-core GEMV variant (up to 64 rows now)
  # at 16 / 64 rows against cuBLAS (GEMV_DOT_MAX_ROWS=16 / 64: it keeps the PDL overlap cuBLAS's kernels break);
  # pending token ids resolved inside the decode graphs (RESOLVE_IN_GRAPH) at 1 / 16 / 64; then the GPU tests of
  # the graph inputs with it on (test_overlap's GPU test runs both ways).
  for rep in 1 2; do
    for k in "" "GEMV_DOT_MAX_ROWS=16" "GEMV_DOT_MAX_ROWS=64" "backends.cuda_graph.RESOLVE_IN_GRAPH=1"; do
      args=""; for a in $k; do args="$args --knob $a"; done
      case "$k" in ""|backends*) b="1 16 64" ;; *) b="16 64" ;; esac
      timeout 100 python3 benchmarks/profile_decode.py --shape ced-bench --batches $b --steps 16 $args \
        --out "$OUT/profile_ced_s26.jsonl" 2>&1 | grep "== batch" | sed "s/^/[${k:-as shipped} $rep] /" | cut -c 1-140
    done
  done
  timeout -s INT 100 python3 -m pytest -n 4 -q -p no:cacheprovider -rfE tests/test_overlap.py \
    tests/test_cuda_graphs.py tests/test_verify_graphs.py 2>&1 | tail -3 ;;
s26b)
  # 26th session (~3 min): gemv_bench's dot rows against cuBLAS at 8 / 16 / 32 / 64 rows; CED attention at a short
  # context (the decode profile's ~200 tokens): how its time scales with splits and tiles.
  timeout 150 python3 benchmarks/gemv_bench.py --rows 8 16 32 64 --tiles 8192 16384 --per-sm 4 --warps 8 \
    --out "$OUT/gemv_dot.jsonl" 2>&1 | grep -v "done$" | grep -v Warning | tail -14
  timeout 100 python3 benchmarks/ced_attn_sweep.py --batches 16 64 --context 256 --block-n 16 32 --warps 4 \
    --stages 1 --split-scale 0 0.5 1 --prefetch 0 1 --out "$OUT/ced_attn_short.jsonl" 2>&1 | grep -v Warning \
    | tail -4
  raw_entry_sweep ;;
s26t)
  # 26th session (~5 min): the GPU test files of what changed since the last full run (the decode graphs' [3, B]
  # inputs, EARLY_W, the raw bf16 entries and the entry table), then raw_entry_sweep.
  timeout -s INT 220 python3 -m pytest -n 8 --dist loadfile -p no:cacheprovider -q -rfE tests/test_overlap.py \
    tests/test_cuda_graphs.py tests/test_verify_graphs.py tests/test_ced_verify_graphs.py tests/test_pass_graphs.py \
    tests/test_triton_ced.py tests/test_triton_gemv.py tests/test_gpu_parity.py tests/test_ced_decode_path.py \
    2>&1 | tee "$OUT/gpu_tests_s26t.log" | tail -6
  raw_entry_sweep ;;
s26raw)
  # 26th session, the last ~3 min of budget: raw_entry_sweep, then the decode graphs' [3, B] inputs on the GPU.
  raw_entry_sweep
  timeout -s INT 60 python3 -m pytest -n 8 -p no:cacheprovider -q -rfE tests/test_overlap.py tests/test_cuda_graphs.py \
    2>&1 | tail -4 ;;
s26min)
  # 26th session, the little budget the failed starts left (~5 min): the decode graphs' [3, B] inputs and the raw
  # entries on the GPU, raw_entry_sweep, then the 16K prefill's entry table off / on (what the budget cuts is last).
  timeout -s INT 110 python3 -m pytest -n 8 --dist loadfile -p no:cacheprovider -q -rfE tests/test_overlap.py \
    tests/test_cuda_graphs.py tests/test_triton_ced.py -k "not compile" 2>&1 | tail -4
  raw_entry_sweep
  table_prefill_ab 85 2 8 ;;
s26all)
  # 26th session, one call under 600 s (the device came rarely): the graph-input GPU tests, raw_entry_sweep, the
  # 16K prefill's entry table off / on, the decode profile at 16 / 64 as shipped and with the tensor-core GEMV up to
  # 64 rows (in that order: what the budget cuts is last).
  timeout -s INT 120 python3 -m pytest -n 8 --dist loadfile -p no:cacheprovider -q -rfE tests/test_overlap.py \
    tests/test_cuda_graphs.py tests/test_verify_graphs.py tests/test_ced_decode_path.py 2>&1 | tail -4
  raw_entry_sweep
  table_prefill_ab 85 2 8
  dot_rows_profiles 80 s26 ;;
s27)
  # 27th session, one call under 600 s (carry .whl312; starts failed for two sessions): every GPU test file but
  # kv_sizing (EARLY_W, the decode graphs' [3, B] inputs, the raw entries, the interpreter's row folding of the
  # (de)quantisation kernels: none ran on a GPU yet), the 16K prefill's entry table off / on, then the decode
  # profile at 16 / 64 with the tensor-core GEMV up to 64 rows (what the budget cuts is last).
  gpu_files_but_kv_sizing
  table_prefill_ab 80 2 8
  dot_rows_profiles 60 s27 ;;
s27t)
  # 27th session, a short call (~4 min): the GPU test files of what no GPU ran yet (the decode graphs' [3, B]
  # inputs, EARLY_W, the raw entries and the entry table, the (de)quantisation kernels' ROWS), then the 16K
  # prefill's entry table off / on as far as the call's limit lets it.
  timeout -s INT 220 python3 -m pytest -n 8 --dist loadfile -p no:cacheprovider -q -rfE tests/test_overlap.py \
    tests/test_cuda_graphs.py tests/test_verify_graphs.py tests/test_ced_verify_graphs.py tests/test_pass_graphs.py \
    tests/test_triton_ced.py tests/test_triton_gemv.py tests/test_gpu_parity.py tests/test_ced_decode_path.py \
    tests/test_nvidia_kernels.py 2>&1 | tee "$OUT/gpu_tests_s27t.log" | tail -6
  table_prefill_ab 80 2 8 ;;
s27m)
  # 27th session, the least budget (~2 min): the GPU tests of what is on by default and no GPU ran yet: EARLY_W
  # (test_triton_gemv), the decode graphs' [3, B] inputs (test_overlap, test_cuda_graphs), the (de)quantisation
  # kernels' ROWS (their bit-exact tests).
  timeout -s INT 120 python3 -m pytest -n 8 --dist loadfile -p no:cacheprovider -q -rfE tests/test_triton_gemv.py \
    tests/test_overlap.py tests/test_cuda_graphs.py tests/test_nvidia_kernels.py tests/test_triton_ced.py \
    -k "not compile and (gemv or graph or overlap or quant or fp4 or fp8 or every or early or pending or resolve)" \
    2>&1 | tee "$OUT/gpu_tests_s27m.log" | tail -6 ;;
s29c)
  # 29th session, one call when the device is scarce (~9 min): every GPU test file but kv_sizing (after the top-K
  # search's tile helper), then s29a's raw-entry launch sweep narrowed to BLOCK_N 32 / 64 (its 16K prefill A/B
  # waits for the next call: s29d with the best setting's knobs).
  gpu_files_but_kv_sizing
  timeout 200 python3 benchmarks/ced_attn_sweep.py --batches --prefill-chunk 2048 --context 16384 \
    --block-n 32 64 --warps 4 8 --stages 1 2 3 --split-scale 0 --prefetch 0 --raw 1 \
    --out "$OUT/ced_attn_raw_stages.jsonl" 2>&1 | grep -v Warning | tail -3
  python3 - "$OUT/ced_attn_raw_stages.jsonl" <<'PY2'
import json, sys
rows = [r for r in map(json.loads, open(sys.argv[1])) if r.get("ok") and r.get("chunk", 1) > 1 and "us" in r]
for r in sorted(rows, key=lambda r: r["us"]):
    print(f"{r['setting']:<28} {r['us']:9.1f} us")
PY2
  ;;
s29d)
  # 29th session (~3 min, after s29c): the 16K bounded prefill as shipped and with RAW_* knobs "$@" (e.g.
  # triton_ced_attention.RAW_STAGES=2), alternating, three repeats each.
  prefill_ab 60 4 raw "" "$*" ;;
s30a)
  # 30th session (~3 min; Firecracker machines have ncu): Nsight Compute on one launch of the 16K prefill chunk's
  # CED attention on raw bf16 entries (the shipped launch): occupancy, warp stall reasons, L2 and memory throughput,
  # to tell load latency from MMA or softmax time before another entry layout is built.
  command -v ncu >/dev/null || { echo "no ncu on this machine"; exit 0; }
  timeout 300 ncu --clock-control none --kernel-name regex:_ced_attn_kernel --launch-skip 3 --launch-count 1 \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    --section MemoryWorkloadAnalysis python3 benchmarks/ced_attn_sweep.py --batches --prefill-chunk 2048 \
    --context 16384 --block-n 32 --warps 4 --stages 1 --split-scale 0 --prefetch 0 --raw 1 \
    --out /tmp/ncu_sweep.jsonl > "$OUT/ncu_ced_attn_raw.txt" 2>&1
  grep -v Warning "$OUT/ncu_ced_attn_raw.txt" | grep -E "^ +[A-Z]|Stall|stall|Occupancy|Throughput|Registers" \
    | head -90 ;;
s30d)
  # 30th session's first call (~7 min): s30a's Nsight Compute run on the prefill chunk's CED attention, then the
  # files the MoE launch choice touches (moe-graphs' list): the first GPU run of the wide tiles' shared-memory guard.
  bash "$0" s30a
  bash "$0" moe-graphs ;;
s31a)
  # 31st session (~6 min): the transposed products (launch key trans: keys / latent on the MMA's M side; warp-group
  # MMAs from 64 keys on 4 warps) first through the CED GPU tests that draw them, then swept on a 2048-query prefill
  # chunk at 16K on raw entries (64 keys: 4 / 8 warps x 1-3 stages; 32 / 128 keys: 4 / 8 warps x 1 / 2 stages); then
  # the 16K bounded prefill as shipped / with the chunk's fastest launch, alternating.
  timeout -s INT 150 python3 -m pytest -p no:cacheprovider -q -rfE tests/test_triton_ced.py \
    -k "gpu_sparse_attention and (transposed or bench_shapes)" 2>&1 | tail -3
  raw_sweeps "150 64 4_8 1_2_3 1 0" "120 32_128 4_8 1_2 1 0"
  raw_ab 4 ;;
s31b)
  # 31st session, s31a at a budget's end (~3 min): its tests, the 64-key sweep alone, one A/B run each.
  timeout -s INT 100 python3 -m pytest -p no:cacheprovider -q -rfE tests/test_triton_ced.py \
    -k "gpu_sparse_attention and transposed" 2>&1 | tail -3
  raw_sweeps "100 64 4_8 1_2 1 0"
  raw_ab 2 ;;
s31c)
  # 31st session (~9 min): with the transposed raw launch on by default (RAW_TRANS), the CED kernel GPU tests; the
  # decode launches (FP4 entries, 16 / 64 queries at 16K) with trans; gpu_bench's 16K prefill; then Nsight Compute
  # on the prefill chunk's (now transposed) launch.
  timeout -s INT 150 python3 -m pytest -p no:cacheprovider -q -rfE -x tests/test_triton_ced.py \
    tests/test_triton_ced_launch.py 2>&1 | tail -15
  timeout 120 python3 benchmarks/ced_attn_sweep.py --batches 16 64 --context 16384 --block-n 32 64 --warps 4 8 \
    --stages 1 2 --split-scale 1 --prefetch 0 --trans 1 --out "$OUT/ced_attn_trans_decode.jsonl" 2>&1 \
    | grep -v Warning | tail -2
  REPEATS=2 bash "$0" ced-prefill "${1:-?}"
  command -v ncu >/dev/null || exit 0
  timeout 150 ncu --clock-control none --kernel-name regex:_ced_attn_kernel --launch-skip 3 --launch-count 1 \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    --section MemoryWorkloadAnalysis python3 benchmarks/ced_attn_sweep.py --batches --prefill-chunk 2048 \
    --context 16384 --block-n 32 --warps 4 --stages 2 --split-scale 0 --prefetch 0 --raw 1 --trans 1 \
    --out /tmp/ncu_sweep.jsonl > "$OUT/ncu_ced_attn_trans.txt" 2>&1
  grep -v Warning "$OUT/ncu_ced_attn_trans.txt" | grep -E "^ +[A-Z]|Stall|stall|Occupancy|Throughput|Registers" \
    | head -60 ;;
s31f)
  # 31st session's last call (~4 min): the CED kernel files and GPU parity at the landed commit, on 8 workers.
  timeout -s INT 240 python3 -m pytest -n 8 -p no:cacheprovider -q -rfE tests/test_triton_ced.py \
    tests/test_triton_ced_launch.py tests/test_gpu_parity.py tests/test_triton_ced_fused.py 2>&1 | tail -6 ;;
s31g)
  # 31st session's last seconds (~4 min): Nsight Compute's stall reasons and hot instructions on the prefill chunk's
  # transposed launch (the shipped one), then the chunk at 16 / 32 keys on 2 / 3 stages.
  command -v ncu >/dev/null || { echo "no ncu on this machine"; exit 0; }
  timeout 150 ncu --clock-control none --kernel-name regex:_ced_attn_kernel --launch-skip 3 --launch-count 1 \
    --section WarpStateStats --section SchedulerStats --section InstructionStats --section ComputeWorkloadAnalysis \
    --section SourceCounters python3 benchmarks/ced_attn_sweep.py --batches --prefill-chunk 2048 --context 16384 \
    --block-n 32 --warps 4 --stages 2 --split-scale 0 --prefetch 0 --raw 1 --trans 1 --out /tmp/ncu_sweep.jsonl \
    > "$OUT/ncu_ced_attn_trans_stalls.txt" 2>&1
  grep -v Warning "$OUT/ncu_ced_attn_trans_stalls.txt" | grep -E "Stall|stall|Issue|Eligible|Active Warps|Pipe|Executed Ipc" \
    | head -40
  raw_sweeps "60 16_32 4 2_3 1 0"
  raw_best > /dev/null ;;
s33a)
  # For the 33rd session (~8 min, carry .whl312): the router logits kernel's GPU tests and every GPU file that runs
  # the MoE at prefill sizes since 2e9672a's tiles (model parity, graphs, CED decode, speculation), then the 16K
  # bounded prefill with the tiled router logits off / on, alternating (ops.CED_ROUTE_LOGITS_TILED).
  timeout -s INT 200 python3 -m pytest -n 8 --dist loadfile -p no:cacheprovider -q -rfE tests/test_router_logits.py \
    tests/test_triton_gemv.py tests/test_gpu_parity.py tests/test_cuda_graphs.py tests/test_ced_decode_path.py \
    tests/test_speculative.py tests/test_route_tail.py 2>&1 | tail -6
  prefill_ab 50 6 router "" "CED_ROUTE_LOGITS_TILED=1" ;;
s33d)
  # 33rd session (~7 min; ran at dba18fd on the H100): the router logits kernel's and the key table's tests, the
  # indexer / top-K chunk sweeps (then with a byte-a-pass top-K, since removed), then the 16K bounded prefill as
  # shipped, with the tiled router logits, with the key table (one run each; the first, compiling, outran its 50 s).
  timeout -s INT 100 python3 -m pytest -n 8 -p no:cacheprovider -q -rfE tests/test_router_logits.py \
    tests/test_ced_score_table.py 2>&1 | tail -4
  timeout -s INT 90 python3 -m pytest -n 8 -p no:cacheprovider -q -rfE tests/test_triton_ced.py \
    -k "indexer or topk or compile" 2>&1 | tail -4
  timeout 150 python3 benchmarks/ced_prefill_kernels.py --kernels indexer topk --out "$OUT/ced_prefill_indexer.jsonl" \
    2>&1 | grep -v Warning | tail -22
  prefill_ab 50 8 three "" "CED_ROUTE_LOGITS_TILED=1" 2
  prefill_ab 50 8 three_table "triton_ced_scores.TABLE=1" "" 1 ;;
s34a)
  # 34th session (~2-5 min; ran at 8bccf3f and e273c0e): the index-list copy's host time (a fresh pinned tensor
  # against staging.Staging's reused ones), then the 16K bounded prefill with staging off / on alternating (two runs
  # each; the first compiles on a fresh machine), the first pair with host / device times at the layer boundaries
  # (--marks), then (FOUR_K=1) the 4K prefill's marks as shipped.
  timeout 90 python3 benchmarks/pinned_upload.py --out "$OUT/pinned_upload.jsonl" 2>&1 | grep -v Warning | tail -24
  n=0
  for k in "staging.ON=0" "" "staging.ON=0" ""; do
    n=$((n + 1)); m=""; [ $n -le 2 ] && m="--marks"
    timeout $([ $n -eq 1 ] && echo 170 || echo 80) python3 benchmarks/profile_cold_prefill.py --tokens 16384 \
      --modes bounded --repeats 3 --top 6 $m \
      ${k:+--knob $k} --out "$OUT/cold_prefill_16k_staging$n" > "$OUT/cold_prefill_16k_staging$n.log" 2>&1
    grep "^== \|^marks\|^  layer\|^  _\|^  forward\|^  compress" "$OUT/cold_prefill_16k_staging$n.log" \
      | sed "s/^/[${k:-as shipped}] /" | cut -c 1-200 | head -48
  done
  [ -n "${FOUR_K:-}" ] && timeout 80 python3 benchmarks/profile_cold_prefill.py --tokens 4096 --modes bounded --repeats 3 \
    --top 6 --marks --out "$OUT/cold_prefill_4k_marks" > "$OUT/cold_prefill_4k_marks.log" 2>&1 \
    && grep "^== \|^marks\|^  layer\|^  _\|^  forward\|^  compress" "$OUT/cold_prefill_4k_marks.log" | cut -c 1-200
  (cd "$OUT" && tar czf s34a_logs.tgz ./*.log ./*.txt && rm -f ./*.log ./*.txt)  # (few files come back a call)
  true ;;
s35a)
  # For the 35th session (~5 min; built in the 34th, not yet run on a GPU): the router kernel with several tokens a
  # program (triton_ced_route.ROWS_FROM) and the router logits on 128-deep K steps (the s33b sweep's fastest): their
  # GPU tests (the logits' at BLOCK_K 128 too), then the 16K bounded prefill as shipped / with both, alternating (two
  # runs each; the first compiles); the rows' kernel table gives each one's share (_route_kernel, _logits_kernel).
  timeout -s INT 150 python3 -m pytest -n 4 -p no:cacheprovider -q -rfE tests/test_triton_ced_glue.py \
    tests/test_route_tail.py tests/test_router_logits.py 2>&1 | tail -3
  timeout -s INT 60 python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from profile_decode import set_knobs; \
set_knobs(['triton_router_logits.BLOCK_K=128']); import pytest; sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', \
'tests/test_router_logits.py']))" 2>&1 | tail -2
  PREFILL_EXTRA=--marks prefill_ab 90 16 route_rows "" \
    "triton_ced_route.ROWS_FROM=2048 triton_router_logits.BLOCK_K=128"
  (cd "$OUT" && tar czf s35a_txt.tgz ./*.txt && rm -f ./*.txt) ;;  # (few files come back a call)
s36a)
  # 36th session (~6 min): the top-K's threshold search a radix digit at a time (a histogram of the next 4 / 8 bits
  # a pass, triton_ced_indexer digit 4 / 8; the shipped search settles one bit a count) and the MoE's k-sum in the
  # next add + RMSNorm (ops.MOE_KSUM_IN_NORM, on): their GPU tests and the top-K sm_90 compile test,
  # ced_prefill_kernels' top-K variants (a 2048-query chunk over 8K entries), then the 16K bounded prefill with the
  # k-sum apart / as shipped (--marks: the host's share on this machine), then with TOPK_DIGIT=8 (one run each).
  timeout -s INT 200 python3 -m pytest -p no:cacheprovider -q -rfE tests/test_triton_ced.py -k "topk or compile" \
    2>&1 | tail -3
  timeout -s INT 120 python3 -m pytest -p no:cacheprovider -q -rfE tests/test_triton_ced_glue.py \
    tests/test_triton_moe.py -k "pair or k_sum or pdl_chain or add_rms" 2>&1 | tail -3
  timeout 150 python3 benchmarks/ced_prefill_kernels.py --kernels topk --out "$OUT/ced_topk_s36a.jsonl" 2>&1 \
    | grep -v Warning | tail -14
  PREFILL_EXTRA=--marks prefill_ab 90 14 ksum "MOE_KSUM_IN_NORM=0" "" 2
  prefill_ab 90 14 topk "triton_ced_indexer.TOPK_DIGIT=8" "" 1
  (cd "$OUT" && tar czf s36a_txt.tgz ./*.txt 2>/dev/null && rm -f ./*.txt) ;;
s37a)
  # For the 37th session (~6 min; built in the 36th after the device budget ran out, off): the top-K's interpolation
  # search (triton_ced_indexer.TOPK_SEARCH 1) and lazy ties (TOPK_LAZY_TIES): their GPU tests and the sm_90 compile
  # test, ced_prefill_kernels' top-K variants, then the 16K bounded prefill as shipped / with both (one run each).
  timeout -s INT 200 python3 -m pytest -p no:cacheprovider -q -rfE tests/test_triton_ced.py -k "topk or compile" \
    2>&1 | tail -3
  timeout 150 python3 benchmarks/ced_prefill_kernels.py --kernels topk --out "$OUT/ced_topk_s37a.jsonl" 2>&1 \
    | grep -v Warning | tail -12
  prefill_ab 90 14 topk "" "triton_ced_indexer.TOPK_SEARCH=1 triton_ced_indexer.TOPK_LAZY_TIES=1" 2
  (cd "$OUT" && tar czf s37a_txt.tgz ./*.txt 2>/dev/null && rm -f ./*.txt) ;;
s38a)
  # For the 38th session (~8 min): the 37th's changes, built after its device budget ran out. The top-K tests at
  # its new defaults (4 warps), the add_moe / prefill-step / glue tests, the sm_90 compile test; the 16K bounded
  # prefill with PLAN_AFTER_SWA off / on (alternating, --marks); the decode profile at 1 / 16 / 64 with finish's
  # one launch (FINISH_ONE_LAUNCH) off / on.
  timeout -s INT 240 python3 -m pytest -p no:cacheprovider -q -rfE tests/test_triton_ced.py tests/test_triton_ced_glue.py \
    -k "topk or compile or add_moe or pair_sum or add_rms" 2>&1 | tail -3
  PREFILL_EXTRA=--marks prefill_ab 75 8 plan "models.ced.engine_path.PLAN_AFTER_SWA=0" "" 4
  for k in "models.ced.engine_path.FINISH_ONE_LAUNCH=0" ""; do
    timeout 100 python3 benchmarks/profile_decode.py --shape ced-bench --batches 1 16 64 --steps 16 \
      ${k:+--knob $k} --out "$OUT/profile_ced_finish.jsonl" 2>&1 | grep "== batch" | sed "s/^/[${k:-as shipped}] /" \
      | cut -c 1-140
  done
  (cd "$OUT" && tar czf s38a_txt.tgz ./*.txt 2>/dev/null && rm -f ./*.txt) ;;
s35b)
  # 35th session (~2 min): the CED attention's prefill chunk (2048 queries at 16K) on FP4 entries decoded in
  # registers with the transposed products (launch key trans on FP4 entries: a quarter of the bf16 table's bytes a
  # key, which the L2-bound gathers pay for) beside the shipped raw-table launch. At b1f4139 (H200) FP4 lost, 813 us
  # at best against 437: the decode is ALU-bound where the table's rows are not; the knobs that would have switched
  # it (FP4_TRANS) were removed after.
  timeout 60 python3 benchmarks/ced_attn_sweep.py --batches --prefill-chunk 2048 --context 16384 --block-n 32 \
    --warps 4 --stages 2 --split-scale 0 --prefetch 0 --raw 1 --trans 1 --maxnreg 168 --reps 20 \
    --out "$OUT/ced_attn_s35b_raw.jsonl" 2>&1 | grep -v Warning | tail -1
  timeout 150 python3 benchmarks/ced_attn_sweep.py --batches --prefill-chunk 2048 --context 16384 --block-n 32 \
    --warps 4 8 --stages 1 2 --split-scale 0 --prefetch 0 --raw 0 --trans 1 --maxnreg 0 168 --reps 20 \
    --out "$OUT/ced_attn_s35b_fp4.jsonl" 2>&1 | grep -v Warning | tail -1 ;;
s33b)
  # 33rd session (~3 min): where the host leaves the device idle in a cold bounded prefill (16K: ~4.3 ms in its
  # first 7 ms; 4K: a wall twice its GPU busy), with the Python frames recorded (--stack) so each idle span names
  # the function the host was in, and a cProfile of one more pass (--host; in the .txt under $OUT).
  for t in 16384 4096; do
    timeout 150 python3 benchmarks/profile_cold_prefill.py --tokens $t --modes bounded --repeats 2 --top 8 --stack \
      --host --out "$OUT/cold_prefill_stack_$((t / 1024))k" > "$OUT/cold_prefill_stack_$((t / 1024))k.log" 2>&1
    grep "^== \|idle\|  at " "$OUT/cold_prefill_stack_$((t / 1024))k.log" | cut -c 1-300 | head -24
  done
  # Then the router logits kernel's launch (~83 us a 16K call: a third of the copy rate) over its knobs.
  timeout 150 python3 benchmarks/router_logits_sweep.py --out "$OUT/router_logits_sweep.jsonl" 2>&1 \
    | grep -v Warning | grep "^|" | sort -t"|" -k2,2n -k4,4n | head -24 ;;
s32a)
  # For the 32nd session (~7 min): the transposed prefill chunk launch with its registers capped (maxnreg 168: three
  # 4-warp blocks an SM instead of two; ptxas: 14 spill stores with the ring decoded beforehand, 725 without; 128:
  # four), the ring decoded in the kernel / beforehand, against the shipped one; then the 16K bounded prefill as
  # shipped / with the fastest, alternating (two runs each).
  raw_sweeps "150 32 4 2 1 0_168_128"  # (at a4b7116: x ring copy off / on)
  raw_ab 4 ;;
s32b)
  # 32nd session (~9 min): the CED kernel files and GPU parity with the transposed chunk's registers capped at 168
  # (the new default), the capped launch's neighbours (16 / 32 / 64 keys x 1-3 stages; 8 warps capped at 128: two
  # blocks an SM), then the 16K bounded prefill as shipped / with the fastest (as shipped twice where it wins).
  timeout -s INT 220 python3 -m pytest -n 8 -p no:cacheprovider -q -rfE tests/test_triton_ced.py \
    tests/test_triton_ced_launch.py tests/test_gpu_parity.py tests/test_triton_ced_fused.py 2>&1 | tail -6
  raw_sweeps "80 16_32_64 4 1_2_3 1 168" "50 32_64 8 1_2 1 128"
  raw_ab 4 2 ;;
s32c)
  # 32nd session (~4 min): the MoE GPU tests with the prefill tiles of s30b / s30c's sweeps (bf16 at 64-row M-blocks:
  # the wide GEMM-1 tile and three GEMM-2 stages; FP8 at 128-row blocks: FP8_PREFILL_TILES), then both sweeps again
  # with the earlier tiles timed beside the new default ("given" rows).
  timeout -s INT 150 python3 -m pytest -n 4 --dist loadfile -p no:cacheprovider -q -rfE tests/test_triton_moe.py \
    tests/test_moe_fp8.py tests/test_triton_moe_pairs.py 2>&1 | tee "$OUT/gpu_tests_moe.log" | tail -4
  timeout 150 python3 benchmarks/moe_launch_sweep.py --prefill --tokens 2048 4096 \
    --also '{"BN1": 64, "stages2": 4}' --out "$OUT/moe_launch_prefill_bm64.jsonl" 2>&1 | grep -v Warning | tail -7
  timeout 150 python3 benchmarks/moe_launch_sweep.py --prefill --fp8 --also '{"BK1": 64, "BN2": 128, "warps2": 8}' \
    --out "$OUT/moe_launch_prefill_fp8.jsonl" 2>&1 | grep -v Warning | tail -4
  TOKENS=4096 prefill_ab 40 4 moe "" triton_moe.WIDE_PREFILL_TILES=0 ;;  # a 4K prefill: 64-row blocks
s30b)
  # 30th session (~3 min): moe_launch_sweep's large-M grid at 64-row M-blocks (2K and 4K-token prefill chunks of the
  # CED bench MoE: 256 and 512 pairs an expert), which kept the old tiles when WIDE_PREFILL_TILES came in.
  timeout 280 python3 benchmarks/moe_launch_sweep.py --prefill --tokens 2048 4096 \
    --out "$OUT/moe_launch_prefill_bm64.jsonl" 2>&1 | grep -v Warning | tail -8 ;;
s30c)
  # 30th session (~2 min): the same large-M grid with block-scaled FP8 expert weights at a 16K prefill layer (FP8
  # kept the old tiles when WIDE_PREFILL_TILES came in: never swept at prefill sizes).
  timeout 280 python3 benchmarks/moe_launch_sweep.py --prefill --fp8 \
    --out "$OUT/moe_launch_prefill_fp8.jsonl" 2>&1 | grep -v Warning | tail -8 ;;
s29e)
  # 29th session (~6 min; the last of its budget): the MoE GPU tests with the wide large-M tiles (WIDE_PREFILL_TILES,
  # from s29b's sweep), then the 16K bounded prefill with them off / on, alternating, twice.
  timeout -s INT 120 python3 -m pytest -n 4 --dist loadfile -p no:cacheprovider -q -rfE tests/test_triton_moe.py \
    tests/test_moe_fp8.py tests/test_triton_moe_pairs.py 2>&1 | tee "$OUT/gpu_tests_moe.log" | tail -4
  prefill_ab 55 8 moe triton_moe.WIDE_PREFILL_TILES=0 triton_moe.WIDE_PREFILL_TILES=1 ;;
s29a)
  # 29th session (~5 min): the launch on raw bf16 entries (the prefill's entry table, on since e67d1af): BLOCK_N 16 /
  # 32 / 64 x 4 / 8 warps x 1 / 2 / 3 stages on a 2048-query chunk at 16K; then the 16K bounded prefill as shipped
  # and with the chunk's fastest launch (the RAW_* knobs of triton_ced_attention).
  timeout 240 python3 benchmarks/ced_attn_sweep.py --batches --prefill-chunk 2048 --context 16384 \
    --block-n 16 32 64 --warps 4 8 --stages 1 2 3 --split-scale 0 --prefetch 0 --raw 1 \
    --out "$OUT/ced_attn_raw_stages.jsonl" 2>&1 | grep -v Warning | tail -3
  knobs=$(python3 - "$OUT/ced_attn_raw_stages.jsonl" <<'PY'
import json, re, sys
rows = [r for r in map(json.loads, open(sys.argv[1])) if r.get("ok") and r.get("chunk", 1) > 1 and "us" in r]
for r in sorted(rows, key=lambda r: r["us"])[:6]:
    print(f"{r['setting']:<28} {r['us']:9.1f} us", file=sys.stderr)
m = re.match(r"bn(\d+) w(\d+) s(\d+)", min(rows, key=lambda r: r["us"])["setting"]) if rows else None
if m:
    print(" ".join(f"--knob triton_ced_attention.{k}={v}"
                   for k, v in zip(("RAW_BLOCK_N", "RAW_WARPS", "RAW_STAGES"), m.groups())))
PY
)
  for k in "" "$knobs"; do
    timeout 60 python3 benchmarks/profile_cold_prefill.py --tokens 16384 --modes bounded --repeats 3 --top 4 $k \
      --out "$OUT/cold_prefill_16k_raw${k:+_best}" 2>&1 | grep -v Warning | grep -A5 "^== " | cut -c 1-150
  done ;;
s29b)
  # 29th session (~4 min): the MoE's two grouped GEMMs at a 16K prefill layer's shape (65,536 pairs over 32 experts):
  # tiles, K steps, warps, stages and 64-row M-blocks against launch_config's large-M choice (~46% of the matmul
  # rate in the 16K prefill); the last lines give the best of each GEMM.
  timeout 300 python3 benchmarks/moe_launch_sweep.py --prefill --out "$OUT/moe_launch_prefill.jsonl" 2>&1 \
    | grep -v Warning | tail -40 ;;
s28a)
  # 28th session (~8 min, ENTRY_TABLE on): the 16K bounded / exact prefill ratio (gpu_bench, 2 repeats; $1 commit),
  # then the decode profile at 1 / 16 / 64 with the pending token ids resolved outside / inside the decode graphs.
  timeout 300 python3 benchmarks/gpu_bench.py --out "$OUT/gpu_bench_ced_prefill.jsonl" --commit "${1:-?}" \
    --phases roofline,ced --ced-prefill-tokens 16384 --ced-batches --ced-repeats 2 --budget-s 270 2>&1 \
    | tee "$OUT/gpu_bench_ced_prefill.log" | grep -v Warning | tail -12
  for k in "" "backends.cuda_graph.RESOLVE_IN_GRAPH=1"; do
    timeout 90 python3 benchmarks/profile_decode.py --shape ced-bench --batches 1 16 64 --steps 16 ${k:+--knob $k} \
      --out "$OUT/profile_ced_s28.jsonl" 2>&1 | grep "== batch" | sed "s/^/[${k:-as shipped}] /" | cut -c 1-140
  done ;;
s28b)
  # 28th session (~5 min): the 16K bounded prefill with its entries read in place (FP4), then from the bf16 table
  # (the default since e67d1af), four repeats each; then CED attention at the decode profile's short context: how
  # its time scales with splits and tiles at 16 / 64 rows.
  for k in "ENTRY_TABLE=0" "ENTRY_TABLE=1"; do
    timeout 75 python3 benchmarks/profile_cold_prefill.py --tokens 16384 --modes bounded --repeats 4 --top 10 \
      --knob $k --out "$OUT/cold_prefill_16k_${k#ENTRY_TABLE=}" 2>&1 | grep -v Warning | grep -A12 "^== \|idle spans" | cut -c 1-150
  done
  timeout 100 python3 benchmarks/ced_attn_sweep.py --batches 16 64 --context 256 --block-n 16 32 --warps 4 \
    --stages 1 --split-scale 0 0.5 1 --prefetch 0 1 --out "$OUT/ced_attn_short.jsonl" 2>&1 | grep -v Warning \
    | tail -6 ;;
s28c)
  # 28th session (~8 min): top-K's threshold search one / two bits a pass, with / without the early stop, against
  # the shipped search on a 16K prefill chunk's scores; the CED GPU files spread test by test (the search
  # variants' bits, the entry table on by default); the 16K bounded prefill with the search as shipped and with
  # two bits a pass and the early stop.
  timeout 120 python3 benchmarks/ced_prefill_kernels.py --kernels topk --out "$OUT/ced_topk.jsonl" 2>&1 \
    | grep -v Warning | tail -8
  timeout -s INT 180 python3 -m pytest -n 12 --dist load -p no:cacheprovider -q -rfE \
    --junitxml="$OUT/gpu_tests_ced.xml" tests/test_triton_ced.py tests/test_gpu_parity.py \
    tests/test_ced_decode_path.py tests/test_ced_verify_graphs.py tests/test_triton_ced_glue.py \
    tests/test_triton_ced_fused.py tests/test_ced_index_plans.py tests/test_pass_graphs.py \
    tests/test_triton_ced_launch.py tests/test_swa_pool.py 2>&1 | tee "$OUT/gpu_tests_ced.log" | tail -6
  for k in "" "triton_ced_indexer.TOPK_DIGIT=2 triton_ced_indexer.TOPK_EARLY=1"; do
    args=""; for a in $k; do args="$args --knob $a"; done
    timeout 60 python3 benchmarks/profile_cold_prefill.py --tokens 16384 --modes bounded --repeats 3 --top 6 \
      $args --out "$OUT/cold_prefill_16k_topk${k:+_knobs}" 2>&1 | grep -v Warning | grep -A7 "^== " | cut -c 1-150
  done ;;
s26c)
  # 26th session (~5 min): a cold 16K bounded prefill with its entries read in place (FP4) and from a bf16 table
  # decoded once per full layer (ENTRY_TABLE=1), one after the other: wall, share of the matmul rate, kernels.
  table_prefill_ab 200 3 12 ;;
s25a)
  # 25th session (~6 min): s24b's decode profiles and gemv_bench (its tests run in s22c), and fused_experts as a PDL
  # chain (triton_moe.PDL_CHAIN) at 16 / 64.
  knob_profiles "" "triton_moe.PDL_CHAIN=1" "triton_ced_attention.DYNAMIC_ENTRIES=1" "triton_gemv.EARLY_W=1" \
    "SPLITK_MAX_ROWS=64 SPLITK_SWAP=1" "SPLITK_MAX_ROWS=64"
  splitk_swap_bench ;;
s25b)
  # 25th session (~7 min, EARLY_W and PDL_CHAIN on): the GEMV / PDL / CED decode GPU tests, then s21b COMMIT.
  timeout -s INT 150 python3 -m pytest -n 4 -q -p no:cacheprovider -rfE tests/test_gemv_norm_in.py \
    tests/test_triton_gemv.py tests/test_triton_pdl.py tests/test_ced_decode_path.py 2>&1 | tail -3
  decode_ab "${1:-?}" ;;
s24b)
  # 24th session (~8 min; not yet run: the budget ran out; the decode profiles come first): the decode profile as
  # shipped at 1 / 16 / 64; with the CED attention's entry loop bounded on the device at 1 / 16 / 64; with
  # triton_gemv's early weight tile at 1 (the only batch on the CUDA-core GEMV); with split-K swapped for 5-64 rows
  # at 16 / 64, and unswapped; then the GEMV, split-K, prologue and CED kernel tests; then gemv_bench's split-K
  # knobs with and without swap against cuBLAS at 16 / 64 rows.
  knob_profiles "" "triton_ced_attention.DYNAMIC_ENTRIES=1" "triton_gemv.EARLY_W=1" \
    "SPLITK_MAX_ROWS=64 SPLITK_SWAP=1" "SPLITK_MAX_ROWS=64"
  timeout -s INT 150 python3 -m pytest -n 4 -q -p no:cacheprovider -rfE tests/test_gemv_norm_in.py \
    tests/test_triton_gemv.py tests/test_triton_ced.py 2>&1 | tail -3
  splitk_swap_bench ;;
s22e)
  # 22nd session (carry .whl312 and .baseline): every GPU test file but kv_sizing, kv_sizing alone, the decode
  # profile of the baseline tree (.baseline/base.tgz) then this one, gpu_bench's roofline, CED decode at 1 / 16 /
  # 64 and the 4K prefill ratio. Over 8 min at c427fbb (the GPU files took 247 s): gpu_bench was cut off by the
  # call's limit, so run s22c and s21b COMMIT as two calls instead.
  gpu_files_but_kv_sizing
  timeout -s INT 100 python3 -m pytest -q -p no:cacheprovider -rfE tests/test_kv_sizing.py 2>&1 | tail -3
  rm -rf /tmp/base && mkdir -p /tmp/base && tar xzf .baseline/base.tgz -C /tmp/base
  (cd /tmp/base && PYTHONPATH=/tmp/base:/tmp/base/plugins/deepinfer-ngram:/tmp/ngram_ep:/tmp/site timeout 100 \
    python3 benchmarks/profile_decode.py --shape ced-bench --batches 1 16 64 --steps 16 \
    --out "$OUT/profile_ced_base.jsonl" 2>&1 | grep "== batch" | sed "s/^/base /" | cut -c 1-110)
  timeout 100 python3 benchmarks/profile_decode.py --shape ced-bench --batches 1 16 64 --steps 16 --top 30 \
    --out "$OUT/profile_ced_new.jsonl" 2>&1 | grep "== batch" | sed "s/^/new  /" | cut -c 1-110
  timeout 120 python3 benchmarks/gpu_bench.py --out "$OUT/gpu_bench_ced.jsonl" --commit "${1:-?}" \
    --phases roofline,ced --ced-prefill-tokens 4096 --ced-batches 1 16 64 --ced-repeats 2 --budget-s 110 2>&1 \
    | tee "$OUT/gpu_bench_ced.log" | grep -v Warning | grep "^row phase=ced" | cut -c 1-200 ;;
*)
  echo "usage: bash scripts/device_issue12.sh tests K | suite | suite-short | moe-graphs | smoke | ced-bench COMMIT | ced-prefill COMMIT | moe-pairs | next COMMIT | sweep | sweep2 | check | next13 | prefill-attn | final COMMIT | final2 | mla" >&2; exit 2 ;;
esac

#!/usr/bin/env bash
# Issue 15 (speculative decoding) on the GPU machine (the device tool), from the repo root there, one call:
#   bash scripts/device_issue15.sh all   # the example n-gram plugin installed (--target, no deps), the
#                                        # speculative GPU tests, then benchmarks/spec_bench.py on the demo model
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD:$PWD/plugins/deepinfer-ngram${PYTHONPATH:+:$PYTHONPATH}
case "${1:-}" in
all)
  # The plugin registers through its entry point: give Python one without installing (a dist-info on the path).
  mkdir -p /tmp/ngram_ep/deepinfer_ngram-0.1.0.dist-info
  printf 'Metadata-Version: 2.1\nName: deepinfer-ngram\nVersion: 0.1.0\n' > /tmp/ngram_ep/deepinfer_ngram-0.1.0.dist-info/METADATA
  printf '[deepinfer]\nngram = deepinfer_ngram\n' > /tmp/ngram_ep/deepinfer_ngram-0.1.0.dist-info/entry_points.txt
  export PYTHONPATH=/tmp/ngram_ep:$PYTHONPATH
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_speculative.py 2>&1 | tail -4
  timeout 200 python3 benchmarks/spec_bench.py --device cuda --rounds 3 --out "$OUT/spec_gpu.jsonl" 2>&1 \
    | grep -v Warn | tail -5 ;;
*)
  echo "usage: bash scripts/device_issue15.sh all" >&2; exit 2 ;;
esac

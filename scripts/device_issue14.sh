#!/usr/bin/env bash
# Issue 14 (structured outputs) on the GPU machine (the device tool), from the repo root there. xgrammar and
# apache-tvm-ffi travel as wheels in .whl/ (gitignored; pass carry=[".whl"]):
#   pip download xgrammar==0.2.9 apache-tvm-ffi==0.1.12 --no-deps -d .whl
#   bash scripts/device_issue14.sh tests   # the bitmask kernel at real vocabularies, structured outputs on CUDA
#   bash scripts/device_issue14.sh bench   # step time with/without constraints at batch 1, 16, 64 on the
#                                          # Llama-3.1-8B shape (demo tokenizer, grammars at 128256), rows in $OUT
# xgrammar imports transformers and pydantic; the GPU machine's Python has them (the HF parity tests use them).
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi -L
python3 -c "import torch, triton, xgrammar; print('torch', torch.__version__, 'triton', triton.__version__, 'xgrammar ok')"
case "${1:-tests}" in
tests)
  timeout 500 python3 -m pytest -q -p no:cacheprovider -rfE tests/test_structured_bitmask.py \
    tests/test_structured_matcher.py tests/test_structured_outputs.py -k "not cli" 2>&1 | tee "$OUT/tests.log" | tail -30 ;;
bench)
  timeout 560 python3 benchmarks/structured_bench.py --llama8b-dummy --batches 1 16 64 --steps 32 --repeats 3 \
    --jump-batch 16 --out "$OUT/structured_h200.jsonl" 2>&1 | grep -v Warning | tail -12 ;;
esac

#!/usr/bin/env bash
# Set up (CPU torch from the local wheel cache when present, the package with its test extra,
# the example plugins) and run the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q "torch==2.13.0" 2>/dev/null || python -m pip install -q torch
python -m pip install -q -e ".[test]"
for p in plugins/*/; do [ -f "$p/pyproject.toml" ] && python -m pip install -q -e "$p"; done
python -m pytest -q -x --durations=10 "$@"

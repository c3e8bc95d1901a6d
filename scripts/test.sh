#!/usr/bin/env bash
# Set up (CPU torch from the local wheel cache when present, the package with its test extra,
# the example plugins) and run the test suite. With no arguments (the whole suite, as CI runs it), first
# check the quickstart in a fresh venv holding only what the README's first command installs.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -eq 0 ]; then bash scripts/check_plain_install.sh; fi
pkgs=(-e ".[test]")
for p in plugins/*/; do [ -f "$p/pyproject.toml" ] && pkgs+=(-e "$p"); done
# One pip call resolves everything once, and without build isolation pip does not set up a fresh setuptools per
# editable package (about 50 of the 65 s the separate isolated installs took); where that fails (setuptools
# missing or older than the projects ask), isolated builds, then any torch.
python -m pip install -q --no-build-isolation "torch==2.13.0" "${pkgs[@]}" 2>/dev/null \
  || python -m pip install -q "torch==2.13.0" "${pkgs[@]}" 2>/dev/null || python -m pip install -q torch "${pkgs[@]}"
# Two worker processes, a test file per worker at a time (module fixtures stay shared): 8 minutes instead of 13
# on the 2-core CI machine; the suite passed twice that way before it was adopted.
python -m pytest -q -x --durations=10 -n 2 --dist loadfile "$@"
# The whole suite also runs the example plugins that carry their own pytest configuration (deepinfer-ring-example:
# the equivalence kit's pytest plugin against its ring; seconds).
if [ $# -eq 0 ]; then
  for p in plugins/*/; do
    if grep -q '^\[tool\.pytest' "$p/pyproject.toml" 2>/dev/null; then python -m pytest -q -x "$p"; fi
  done
fi

#!/usr/bin/env bash
# The README's first quickstart command in a fresh venv that holds only what it installs (no test extra,
# no system site packages): the bundled demo generates, init-model writes a checkpoint, and that checkpoint
# generates. Fails when a command fails or prints torch's "Failed to initialize NumPy" warning (a dependency
# pyproject.toml does not declare). Run by scripts/test.sh (so by CI) before the test suite; about a minute.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python -m venv "$work/venv"
if ! "$work/venv/bin/python" -m pip install -q "torch==2.13.0" -e "$repo" >"$work/pip.log" 2>&1; then
    cat "$work/pip.log"
    echo "check_plain_install: pip install torch==2.13.0 -e . failed" >&2
    exit 1
fi
cd "$work"  # away from the checkout: only the installed package is importable

run() {
    echo "+ deepinfer$(printf ' %q' "$@")"
    if ! "$work/venv/bin/deepinfer" "$@" >"$work/stdout" 2>"$work/stderr"; then
        cat "$work/stdout" "$work/stderr"
        echo "check_plain_install: 'deepinfer $*' failed in a plain install" >&2
        exit 1
    fi
    if grep -q "Failed to initialize NumPy" "$work/stderr"; then
        cat "$work/stderr"
        echo "check_plain_install: 'deepinfer $*' warns that NumPy is missing in a plain install" >&2
        exit 1
    fi
    sed 's/^/  /' "$work/stdout"
}

run generate --max-tokens 8 "def f():"
run init-model --arch llama --out "$work/ckpt"
run generate --model "$work/ckpt" --max-tokens 8 "def f():"
echo "check_plain_install: ok"

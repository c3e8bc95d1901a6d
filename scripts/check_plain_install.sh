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
# deepinfer serve works from the plain install: start it on a free port, ask /health and a chat completion.
"$work/venv/bin/deepinfer" serve --port 0 --threads 1 >"$work/serve.out" 2>"$work/serve.err" &
serve_pid=$!
url=""
for _ in $(seq 1 120); do
    url=$(sed -n 's/.* on \(http:[^ ]*\) (ready)$/\1/p' "$work/serve.err")
    [ -n "$url" ] && break
    kill -0 "$serve_pid" 2>/dev/null || break
    sleep 0.5
done
echo "+ deepinfer serve --port 0 (${url:-not ready})"
if [ -z "$url" ] || ! "$work/venv/bin/python" - "$url" <<'PY'
import json, sys, urllib.request
url = sys.argv[1]
assert json.load(urllib.request.urlopen(url + "/health"))["status"] == "ok"
body = json.dumps({"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}).encode()
req = urllib.request.Request(url + "/v1/chat/completions", body, {"content-type": "application/json"})
out = json.load(urllib.request.urlopen(req))
assert out["usage"]["completion_tokens"] == 4, out
print("  chat completion:", repr(out["choices"][0]["message"]["content"]))
PY
then
    kill "$serve_pid" 2>/dev/null
    cat "$work/serve.err"
    echo "check_plain_install: 'deepinfer serve' failed in a plain install" >&2
    exit 1
fi
kill "$serve_pid"
wait "$serve_pid" 2>/dev/null || true
echo "check_plain_install: ok"

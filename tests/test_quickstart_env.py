"""The quickstart's commands work with only the declared dependencies (what `pip install -e .` installs).

The test environment holds more (the test extra pulls numpy in through transformers), which is how a
missing dependency hid from CI: `init-model` crashed on a plain install because safetensors' save_file needs
numpy. Here a subprocess hides every installed distribution outside the closure of pyproject.toml's
dependencies, then runs init-model and generates from its checkpoint. scripts/check_plain_install.sh does
the same in a real fresh venv (CI runs it).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# Runs in the subprocess: argv[1] = comma-separated importable top-level modules to hide, argv[2:] = the CLI.
HIDE_AND_RUN = """
import sys
for name in sys.argv[1].split(","):
    sys.modules[name] = None  # `import name` raises ModuleNotFoundError; importlib.util.find_spec gives None
from deepinfer.cli import main
sys.exit(main(sys.argv[2:]))
"""

def declared_closure() -> set:
    """Normalised names of pyproject.toml's dependencies and, recursively, theirs (no extras)."""
    tomllib = pytest.importorskip("tomllib")
    from importlib import metadata

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    todo = list(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"])
    seen: set = set()
    while todo:
        req = Requirement(todo.pop())
        name = canonicalize_name(req.name)
        if name in seen or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
            continue
        seen.add(name)
        try:
            todo += metadata.requires(req.name) or []
        except metadata.PackageNotFoundError:
            pass  # declared but not installed here: nothing to hide, nothing it pulls in
    return seen


def undeclared_modules() -> list:
    """Top-level modules installed here that belong only to distributions outside the declared closure."""
    from importlib import metadata

    from packaging.utils import canonicalize_name

    allowed = declared_closure() | {"deepinfer"}
    return sorted(mod for mod, dists in metadata.packages_distributions().items()
                  if mod.isidentifier() and not any(canonicalize_name(d) in allowed for d in dists))


def run_plain(*argv, timeout=300):
    hidden = ",".join(undeclared_modules())
    return subprocess.run([sys.executable, "-c", HIDE_AND_RUN, hidden, *map(str, argv)], capture_output=True,
                          text=True, timeout=timeout, cwd=REPO)


def test_the_closure_hides_the_test_extra():
    hidden = undeclared_modules()
    if not hidden:
        pytest.skip("nothing beyond the declared dependencies is installed")
    assert "torch" not in hidden and "safetensors" not in hidden and "tokenizers" not in hidden
    for extra_only in ("pytest", "hypothesis"):
        assert extra_only in hidden


def test_init_model_and_generate_with_only_the_declared_dependencies(tmp_path):
    ckpt = tmp_path / "ckpt"
    p = run_plain("init-model", "--arch", "llama", "--out", ckpt, "--vocab-size", 300)
    assert p.returncode == 0, p.stderr
    assert "Failed to initialize NumPy" not in p.stderr and "Traceback" not in p.stderr
    assert (ckpt / "model.safetensors").exists()
    p = run_plain("generate", "--model", ckpt, "--max-model-len", 32, "--max-tokens", 3, "--temperature", 0,
                  "--ignore-eos", "--threads", 1, "def f():")
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() and "Failed to initialize NumPy" not in p.stderr

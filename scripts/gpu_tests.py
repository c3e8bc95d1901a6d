"""The GPU test suite in groups that each fit one device call.

    python scripts/gpu_tests.py --list            # the groups, their units and expected seconds
    python scripts/gpu_tests.py --group K         # run group K (0-based) with pytest
    python scripts/gpu_tests.py --update-durations a.xml b.xml   # fold measured junit times into the JSON

The GPU test files are every tests/test_*.py with a CUDA-only test, found by its skip marker (GPU_MARKERS, the one
place that decides; the whole file runs on the GPU, its CPU-side tests then on compiled kernels). Their expected
seconds come from docs/results/gpu_test_durations.json: {"files": {path: s}, "tests": {node id: s}}, measured on
the H200 (a file not in it counts DEFAULT_FILE_S). A file over the budget is split into its test functions
(node ids ``path::name`` or ``path::Class::name``, read from the file's AST, so every machine makes the same
split; a function's parametrisations stay together), each costed from "tests" or, where unmeasured, by an equal
share of what the file's measured functions leave. The units are packed into the fewest groups found by
first-fit decreasing, then balanced by longest-first onto the lightest group when that also fits; each group's
expected time plus OVERHEAD_S (start-up, imports, collection) stays within the budget (default 480 s, under the
device's 600 s per call), except a single unit that alone exceeds it, which gets a group of its own.

A group runs ``pytest -p no:cacheprovider -q -rfE --durations=25`` over its units, with a junit xml and the log
under $OUT when OUT is set (gpu_tests_group{K}.xml / .log). ``--update-durations`` reads such junit files and
rewrites the measured files' and functions' seconds (others keep theirs), so the next split uses real figures.

Standard library only: it runs on the device machine before anything is installed.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DURATIONS = ROOT / "docs" / "results" / "gpu_test_durations.json"
BUDGET_S = 480.0
OVERHEAD_S = 30.0  # per group: interpreter start, torch/triton imports, collection
DEFAULT_FILE_S = 60.0  # a GPU test file the durations file does not know yet
# A test file is a GPU test file when one of these matches its text: the shared ``gpu`` marker of
# deepinfer.testing.kernels, a skipif on CUDA's absence alone (module-level pytestmark too), or a skip call under a
# no-CUDA branch (not one that also needs the interpreter to be off: such tests run on the CPU too).
_NO_CUDA = r"not\s+(?:torch\.cuda\.is_available\(\)|HAS_CUDA(?!\w))"
GPU_MARKERS = (
    re.compile(r"^@gpu\b", re.M),
    re.compile(r"skipif\(\s*" + _NO_CUDA + r"\s*,"),
    re.compile(r"^\s*if\s+" + _NO_CUDA + r"\s*:\s*\n\s*pytest\.skip\(", re.M),
)


def gpu_test_files(tests_dir: Path = ROOT / "tests") -> list[str]:
    """Paths (relative to the tests folder's parent, '/'-separated) of the test files with a CUDA-only test."""
    found = []
    for p in sorted(tests_dir.glob("test_*.py")):
        text = p.read_text(encoding="utf-8")
        if any(m.search(text) for m in GPU_MARKERS):
            found.append(p.relative_to(tests_dir.parent).as_posix())
    return found


def test_functions(path: Path, rel: str) -> list[str]:
    """Node ids of the test functions of one file, in file order: rel::test_x and rel::TestY::test_z."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    ids = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
            ids.append(f"{rel}::{node.name}")
        elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            ids += [f"{rel}::{node.name}::{m.name}" for m in node.body
                    if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef)) and m.name.startswith("test")]
    return ids


@dataclass(frozen=True)
class Durations:
    """Measured seconds: per file and per test function (node id without parametrisation)."""

    files: dict = field(default_factory=dict)
    tests: dict = field(default_factory=dict)

    @classmethod
    def load(cls, path: Path = DURATIONS) -> "Durations":
        if not path.exists():
            return cls()
        raw = json.loads(path.read_text(encoding="utf-8"))
        return cls(dict(raw.get("files", {})), dict(raw.get("tests", {})))

    def file_s(self, rel: str) -> float:
        return float(self.files.get(rel, DEFAULT_FILE_S))


@dataclass(frozen=True)
class Unit:
    """What one pytest argument runs: a whole file or one test function; ``seconds`` is its expected time."""

    node: str
    seconds: float


def split_file(rel: str, ids: list[str], durations: Durations) -> list[Unit]:
    """A file's test functions as units: measured ones at their seconds, the rest sharing what is left of the
    file's seconds equally (at least 1 s each)."""
    if not ids:
        return [Unit(rel, durations.file_s(rel))]
    known = {i: float(durations.tests[i]) for i in ids if i in durations.tests}
    rest = [i for i in ids if i not in known]
    share = max(1.0, (durations.file_s(rel) - sum(known.values())) / len(rest)) if rest else 0.0
    return [Unit(i, known.get(i, share)) for i in ids]


def _first_fit_decreasing(units: list[Unit], cap: float) -> list[list[Unit]]:
    groups: list[list[Unit]] = []
    for u in sorted(units, key=lambda u: (-u.seconds, u.node)):
        for g in groups:
            if sum(x.seconds for x in g) + u.seconds <= cap:
                g.append(u)
                break
        else:
            groups.append([u])
    return groups


def _balanced(units: list[Unit], n: int) -> list[list[Unit]]:
    """Longest first, each onto the lightest of n groups (ties: the lower index)."""
    groups: list[list[Unit]] = [[] for _ in range(n)]
    for u in sorted(units, key=lambda u: (-u.seconds, u.node)):
        min(groups, key=lambda g: sum(x.seconds for x in g)).append(u)
    return groups


def plan(files: list[str], durations: Durations, budget: float = BUDGET_S, overhead: float = OVERHEAD_S,
         root: Path = ROOT) -> list[list[Unit]]:
    """Groups of units, each group's seconds + overhead <= budget where possible; every test of every file runs
    in exactly one group. Units within a group keep the order of ``files`` (then file order)."""
    cap = budget - overhead
    if cap <= 0:
        raise ValueError(f"budget={budget} must exceed the per-group overhead={overhead}")
    units: list[Unit] = []
    for rel in files:
        if durations.file_s(rel) <= cap:
            units.append(Unit(rel, durations.file_s(rel)))
        else:
            units += split_file(rel, test_functions(root / rel, rel), durations)
    if not units:
        return []
    groups = _first_fit_decreasing(units, cap)
    balanced = _balanced(units, len(groups))
    if all(sum(u.seconds for u in g) <= cap for g in balanced if len(g) > 1):
        groups = [g for g in balanced if g]
    order = {u.node: i for i, u in enumerate(units)}
    return [sorted(g, key=lambda u: order[u.node]) for g in groups]


def group_seconds(group: list[Unit]) -> float:
    return sum(u.seconds for u in group)


def describe(groups: list[list[Unit]], overhead: float = OVERHEAD_S) -> str:
    lines = []
    for k, g in enumerate(groups):
        lines.append(f"group {k}: {group_seconds(g) + overhead:.0f} s expected ({len(g)} units, "
                     f"{overhead:.0f} s overhead)")
        lines += [f"  {u.seconds:7.1f}  {u.node}" for u in g]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------- measured times
def _node_of(classname: str, name: str, root: Path) -> tuple[str, str]:
    """junit (classname, name) -> (file path, test function node id without parametrisation)."""
    parts = classname.split(".")
    for cut in range(len(parts), 0, -1):
        rel = "/".join(parts[:cut]) + ".py"
        if (root / rel).exists():
            return rel, "::".join([rel, *parts[cut:], name.split("[", 1)[0]])
    rel = "/".join(parts) + ".py"
    return rel, f"{rel}::{name.split('[', 1)[0]}"


def measured(junit_paths: list[Path], root: Path = ROOT) -> Durations:
    """Seconds per file and per test function summed over the testcases of the given junit xml files."""
    files: dict = {}
    tests: dict = {}
    for p in junit_paths:
        for case in ET.parse(p).getroot().iter("testcase"):
            rel, node = _node_of(case.get("classname", ""), case.get("name", ""), root)
            t = float(case.get("time", 0.0))
            files[rel] = files.get(rel, 0.0) + t
            tests[node] = tests.get(node, 0.0) + t
    return Durations(files, tests)


def update_durations(junit_paths: list[Path], path: Path = DURATIONS, root: Path = ROOT) -> Durations:
    """Fold measured times into the durations file: each measured function's seconds are replaced, and a measured
    file's seconds become the sum over its functions' (those measured now and, for a file split across groups
    and calls, those measured before); functions no longer in their file are dropped."""
    old, new = Durations.load(path), measured(junit_paths, root)
    tests = {**old.tests, **new.tests}
    alive = {rel: set(test_functions(root / rel, rel)) for rel in {n.split("::", 1)[0] for n in tests}
             if (root / rel).exists()}
    tests = {n: round(s, 1) for n, s in tests.items() if n in alive.get(n.split("::", 1)[0], ())}
    files = dict(old.files)
    for rel in new.files:
        files[rel] = round(sum(s for n, s in tests.items() if n.split("::", 1)[0] == rel), 1)
    raw = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
    raw.update(files=dict(sorted(files.items())), tests=dict(sorted(tests.items())))
    path.write_text(json.dumps(raw, indent=1) + "\n", encoding="utf-8")
    return Durations(files, tests)


# ------------------------------------------------------------------------------------------- running
def run_group(groups: list[list[Unit]], k: int, extra: list[str], out: str | None) -> int:
    if not 0 <= k < len(groups):
        raise SystemExit(f"--group {k}: there are {len(groups)} groups (0..{len(groups) - 1})")
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rfE", "--durations=25"]
    log = None
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        cmd.append(f"--junitxml={Path(out) / f'gpu_tests_group{k}.xml'}")
        log = open(Path(out) / f"gpu_tests_group{k}.log", "w", encoding="utf-8")
    cmd += [u.node for u in groups[k]] + extra
    print(f"group {k} of {len(groups)}, {group_seconds(groups[k]):.0f} s expected: {' '.join(cmd[1:])}", flush=True)
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        sys.stdout.write(line)
        if log:
            log.write(line)
    if log:
        log.close()
    return proc.wait()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    what = ap.add_mutually_exclusive_group(required=True)
    what.add_argument("--list", action="store_true", help="print the groups")
    what.add_argument("--group", type=int, help="run group K (0-based)")
    what.add_argument("--update-durations", nargs="+", type=Path, metavar="JUNIT_XML",
                      help="fold these junit files' times into the durations file")
    ap.add_argument("--budget", type=float, default=BUDGET_S, help="seconds one group may take (default 480)")
    ap.add_argument("--durations-file", type=Path, default=DURATIONS)
    ap.add_argument("pytest_args", nargs="*", help="after --: passed on to pytest")
    a = ap.parse_args(argv)
    if a.update_durations:
        d = update_durations(a.update_durations, a.durations_file)
        print(f"{a.durations_file}: {len(d.files)} files, {len(d.tests)} test functions")
        return 0
    groups = plan(gpu_test_files(), Durations.load(a.durations_file), a.budget)
    if a.list:
        print(describe(groups))
        return 0
    return run_group(groups, a.group, a.pytest_args, os.environ.get("OUT"))


if __name__ == "__main__":
    sys.exit(main())

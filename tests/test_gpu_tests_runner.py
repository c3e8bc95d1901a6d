"""scripts/gpu_tests.py on the CPU: which files are GPU test files, and how they are split into device calls
(every test in exactly one group, each group within the budget where possible, an oversized file split by test
function), the measured-times update, and the command line."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("gpu_tests", ROOT / "scripts" / "gpu_tests.py")
gpu_tests = sys.modules.setdefault("gpu_tests", importlib.util.module_from_spec(_spec))  # dataclasses look it up
_spec.loader.exec_module(gpu_tests)
Durations, Unit, plan = gpu_tests.Durations, gpu_tests.Unit, gpu_tests.plan


def write_tests(tmp_path: Path, files: dict) -> Path:
    """files: name -> number of test functions (plus one class with two tests when the count is negative)."""
    d = tmp_path / "tests"
    d.mkdir()
    for name, n in files.items():
        body = "".join(f"def test_{i}():\n    pass\n\n" for i in range(abs(n)))
        if n < 0:
            body += "class TestPair:\n    def test_a(self):\n        pass\n\n    def test_b(self):\n        pass\n"
        (d / name).write_text("import pytest\n\n@gpu\n" + body + "\ndef helper():\n    pass\n")
    return d


def covered(groups, root: Path, files) -> list[str]:
    """Every test function of ``files`` once per unit that runs it (a whole-file unit runs all of its own)."""
    out = []
    for g in groups:
        for u in g:
            out += gpu_tests.test_functions(root / u.node, u.node) if "::" not in u.node else [u.node]
    return out


def test_the_gpu_test_files_are_found_by_their_skip_markers(tmp_path):
    found = gpu_tests.gpu_test_files()
    for f in ("tests/test_triton_ced.py", "tests/test_cuda_graphs.py", "tests/test_gpu_parity.py",
              "tests/test_nvidia_kernels.py", "tests/test_kv_sizing.py"):
        assert f in found
    for f in ("tests/test_lowbit.py", "tests/test_sampling.py", "tests/test_gpu_tests_runner.py"):
        assert f not in found  # no CUDA-only test (test_sampling's skip also needs the interpreter off)
    d = tmp_path / "tests"
    d.mkdir()
    texts = {
        "test_a.py": "@gpu\ndef test_x(): pass\n",
        # (split literals, so this file's own text holds no marker)
        "test_b.py": "pytestmark = pytest.mark.skip" "if(not torch.cuda.is_available(), reason='gpu')\n",
        "test_c.py": "@pytest.mark.skip" "if(not HAS_CUDA, reason='gpu')\ndef test_x(): pass\n",
        "test_d.py": "if not HAS_CUDA:\n    pytest.skip('gpu', allow_module_level=True)\n",
        "test_e.py": "if not HAS_CUDA and not INTERPRET:\n    pytest.skip('no kernels')\n",
        "test_f.py": "@pytest.mark.skip" "if(not HAS_CUDA_GRAPHS, reason='x')\ndef test_x(): pass\n",
        "test_g.py": "def test_x(): assert gpu\n",
    }
    for name, text in texts.items():
        (d / name).write_text(text)
    assert gpu_tests.gpu_test_files(d) == ["tests/test_a.py", "tests/test_b.py", "tests/test_c.py",
                                           "tests/test_d.py"]


def test_the_repo_plan_covers_every_gpu_file_once_within_the_budget():
    files = gpu_tests.gpu_test_files()
    groups = plan(files, Durations.load())  # a file the durations do not know yet counts DEFAULT_FILE_S
    assert len(groups) >= 2  # the suite takes longer than one call
    cap = gpu_tests.BUDGET_S - gpu_tests.OVERHEAD_S
    assert all(gpu_tests.group_seconds(g) <= cap for g in groups)
    everything = [t for f in files for t in gpu_tests.test_functions(ROOT / f, f)]
    assert sorted(covered(groups, ROOT, files)) == sorted(everything)


@pytest.mark.parametrize("budget", [100.0, 130.0, 200.0, 1000.0])
def test_split_covers_every_test_once_and_fits(tmp_path, budget):
    d = write_tests(tmp_path, {"test_big.py": -6, "test_mid.py": 3, "test_small.py": 2, "test_tiny.py": 1})
    root = d.parent
    files = gpu_tests.gpu_test_files(d)
    durations = Durations({"tests/test_big.py": 300.0, "tests/test_mid.py": 60.0, "tests/test_small.py": 40.0},
                          {"tests/test_big.py::test_0": 90.0, "tests/test_big.py::TestPair::test_b": 5.0})
    groups = plan(files, durations, budget=budget, overhead=10.0, root=root)
    everything = [t for f in files for t in gpu_tests.test_functions(root / f, f)]
    assert len(everything) == 6 + 2 + 3 + 2 + 1
    assert sorted(covered(groups, root, files)) == sorted(everything)  # each test function exactly once
    cap = budget - 10.0
    for g in groups:
        assert gpu_tests.group_seconds(g) <= cap or len(g) == 1  # only a lone unit may exceed
    units = {u.node: u.seconds for g in groups for u in g}
    if budget < 300 + 10:  # the big file is split: measured functions at their figures, the rest share the rest
        assert "tests/test_big.py" not in units
        assert units["tests/test_big.py::test_0"] == 90.0 and units["tests/test_big.py::TestPair::test_b"] == 5.0
        assert units["tests/test_big.py::test_1"] == pytest.approx((300 - 95) / 6)
    else:
        assert len(groups) == 1 and units["tests/test_big.py"] == 300.0
    assert units.get("tests/test_tiny.py", gpu_tests.DEFAULT_FILE_S) == gpu_tests.DEFAULT_FILE_S  # unknown file
    total = sum(units.values())
    if budget == 200.0:  # the fewest groups the sizes allow, and balanced
        assert len(groups) == -(-total // cap)
    assert plan(files, durations, budget=budget, overhead=10.0, root=root) == groups  # deterministic


def test_a_single_test_over_the_budget_gets_its_own_group(tmp_path):
    d = write_tests(tmp_path, {"test_big.py": 3, "test_small.py": 1})
    files = gpu_tests.gpu_test_files(d)
    durations = Durations({"tests/test_big.py": 700.0, "tests/test_small.py": 50.0},
                          {"tests/test_big.py::test_0": 600.0})
    groups = plan(files, durations, budget=480.0, overhead=30.0, root=d.parent)
    alone = [g for g in groups if any(u.node == "tests/test_big.py::test_0" for u in g)]
    assert len(alone) == 1 and len(alone[0]) == 1
    assert all(gpu_tests.group_seconds(g) <= 450 for g in groups if g is not alone[0])
    with pytest.raises(ValueError, match="budget=20"):
        plan(files, durations, budget=20.0, overhead=30.0, root=d.parent)


def test_update_durations_from_junit(tmp_path):
    d = write_tests(tmp_path, {"test_a.py": 2, "test_b.py": -1})
    root = d.parent
    path = tmp_path / "durations.json"
    path.write_text(json.dumps({"note": "kept", "files": {"tests/test_a.py": 99.0, "tests/test_c.py": 7.0},
                                "tests": {"tests/test_a.py::test_1": 4.0, "tests/test_a.py::test_gone": 3.0}}))
    junit = tmp_path / "g0.xml"
    junit.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.test_a" name="test_0[float32]" time="1.5"/>'
        '<testcase classname="tests.test_a" name="test_0[bf16]" time="2.0"/>'
        '<testcase classname="tests.test_b.TestPair" name="test_a" time="0.25"/>'
        '<testcase classname="tests.test_b" name="test_0" time="10"/>'
        '</testsuite></testsuites>')
    got = gpu_tests.update_durations([junit], path, root)
    raw = json.loads(path.read_text())
    assert raw["note"] == "kept" and raw["files"] == got.files and raw["tests"] == got.tests
    assert got.tests == {"tests/test_a.py::test_0": 3.5, "tests/test_a.py::test_1": 4.0,
                         "tests/test_b.py::TestPair::test_a": 0.2, "tests/test_b.py::test_0": 10.0}
    # test_a's total keeps test_1's earlier figure (run in another group); test_c was not measured now.
    assert got.files == {"tests/test_a.py": 7.5, "tests/test_b.py": 10.2, "tests/test_c.py": 7.0}


def test_command_line_list_and_group_range(capsys):
    assert gpu_tests.main(["--list"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("group 0:") and "tests/test_triton_ced.py" in out
    with pytest.raises(SystemExit, match="--group 99: there are"):
        gpu_tests.main(["--group", "99"])

"""The layers depend one way: core never imports stages; backends import neither core nor stages; the shared
layout module imports none of them. Read from the source (every import, at any depth, relative or absolute)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "deepinfer"
RULES = {"core": ("stages",), "backends": ("core", "stages"), "layout.py": ("core", "stages", "backends")}


def imported(path: Path) -> set:
    """Top-level deepinfer subpackages a module imports."""
    parts = path.relative_to(PKG.parent).with_suffix("").parts  # ("deepinfer", "core", "engine")
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(parts[:-node.level]) + (node.module.split(".") if node.module else [])
            else:
                base = (node.module or "").split(".")
            names = [base + [a.name] for a in node.names] if len(base) == 1 else [base]
        elif isinstance(node, ast.Import):
            names = [a.name.split(".") for a in node.names]
        else:
            continue
        for n in names:
            if n and n[0] == "deepinfer" and len(n) > 1:
                out.add(n[1])
    return out


@pytest.mark.parametrize("layer", sorted(RULES))
def test_layers_import_one_way(layer):
    files = [PKG / layer] if layer.endswith(".py") else sorted((PKG / layer).rglob("*.py"))
    assert files
    bad = {str(f.relative_to(PKG)): sorted(imported(f) & set(RULES[layer])) for f in files}
    assert not {f: b for f, b in bad.items() if b}, f"{layer} must not import {RULES[layer]}"


def test_the_reader_sees_imports():
    """The check can fail: a module of core that imports stages is caught."""
    assert "stages" in imported(PKG / "builtin.py")

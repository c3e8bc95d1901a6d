"""docs/plugins.md, the page on writing a stage: its examples run and produce what the page says, and its
tables (state fields, context objects, stage kinds) match the code, so the page cannot rot silently."""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path

import attrs
import pytest

from deepinfer import Pipeline
from deepinfer.core.plugins import STAGE_KINDS, get_registry, new_plugin_manager
from deepinfer.core.state import ADMIT_INPUTS, STEP_INPUTS, AdmitState, StepState

DOC = Path(__file__).resolve().parent.parent / "docs" / "plugins.md"
TEXT = DOC.read_text()
RUN = "<!-- run by tests/test_docs_plugins.py -->\n```python\n(.*?)\n```"


def _table(first_header: str) -> list:
    """The rows (lists of cells, backticks stripped) of the table whose first header cell is first_header."""
    lines = TEXT.splitlines()
    start = next(i for i, line in enumerate(lines) if re.match(rf"\|\s*{re.escape(first_header)}\s*\|", line))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip().strip("`") for c in line.strip().strip("|").split("|")])
    return rows


def _owners_in_comments(source: str, pattern: str) -> dict:
    """field -> the owner named at the start of its comment in state.py ('# prefill: ...')."""
    return {m.group(1): m.group(2) for m in re.finditer(pattern, source, re.M)}


def test_field_table_matches_the_state_classes():
    rows = _table("field")
    doc = {(phase, field): owner for field, phase, owner, _ in rows}
    assert len(doc) == len(rows), "a field is listed twice"
    step_fields = set(vars(StepState(None, None, None)))
    step_owners = _owners_in_comments(inspect.getsource(StepState.__init__), r"^\s+self\.(\w+)\b.*#\s*(\w+):")
    admit_owners = _owners_in_comments(inspect.getsource(AdmitState), r"^\s+(\w+): [^#\n]*#\s*(\w+)")
    assert set(step_owners) == step_fields, "every StepState field carries an '# owner: ...' comment"
    assert set(admit_owners) == {f.name for f in attrs.fields(AdmitState)}
    code = {**{("step", f): o for f, o in step_owners.items()}, **{("admit", f): o for f, o in admit_owners.items()}}
    missing = sorted(set(code) - set(doc))
    stale = sorted(set(doc) - set(code))
    assert not missing and not stale, (f"docs/plugins.md's field table is out of date: add {missing}, drop {stale} "
                                       "(the fields are in deepinfer/core/state.py)")
    assert doc == code, "the 'written by' column must name the owner given in state.py"
    # ... and the owners are true: the engine provides its inputs, and in the reference recipe each field a
    # built-in stage writes is owned by that stage's kind.
    for phase, inputs in (("admit", ADMIT_INPUTS), ("step", STEP_INPUTS)):
        assert all(doc[(phase, f)] == "engine" for f in inputs)
    pipe = Pipeline.from_recipe("reference", registry=get_registry(new_plugin_manager(load_entry_points=False)))
    for spec in pipe.specs:
        for f in spec.writes:
            if f not in spec.reads:  # a stage that reads and writes a field transforms it (grammar: logits)
                assert doc[(spec.phase, f)] == spec.kind, (spec.name, f)


def test_kinds_and_dotted_names_on_the_page_exist():
    (kind_row,) = [r for r in _table("attribute") if r[0] == "kind"]
    kinds = re.findall(r"`(\w+)`", TEXT.split("| `kind`", 1)[1].splitlines()[0])
    assert set(kinds) == set(STAGE_KINDS) and "a kind of your own" in kind_row[1]
    names = set(re.findall(r"`(deepinfer(?:\.\w+)+)`", TEXT))
    assert "deepinfer.core.state.StepState" in names
    for name in names:
        parts = name.split(".")
        for i in range(len(parts), 0, -1):  # the longest importable prefix, then attributes
            try:
                obj = importlib.import_module(".".join(parts[:i]))
                break
            except ModuleNotFoundError:
                continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)  # AttributeError: the page names something that is gone


def test_examples_run_and_do_what_the_page_says(capsys, monkeypatch):
    contexts = []
    build = Pipeline.build
    monkeypatch.setattr(Pipeline, "build", lambda self, context: contexts.append(set(context)) or build(self, context))
    example, process_wide = re.findall(RUN, TEXT, re.S)
    ns: dict = {"__name__": "docs_plugins_example"}
    exec(compile(example, f"{DOC}:example", "exec"), ns)
    out = capsys.readouterr().out
    # The describe() excerpt the page shows is in what the example printed, line for line.
    excerpt = TEXT.split(example, 1)[1].split("```text\n", 1)[1].split("\n```", 1)[0]
    assert excerpt in out, f"the page shows:\n{excerpt}\nthe example printed:\n{out}"
    # The token the page names is the demo model's first greedy token, and banning it changed the output.
    (named,) = {int(t) for t in re.findall(r"\((\d+)\) no longer appears", TEXT)}
    assert ns["first"] == named and f"token_ids=({named},)" in excerpt
    assert ns["first"] not in ns["banned_ids"] and ns["banned_ids"] != ns["plain_ids"]
    assert len(ns["banned_ids"]) == len(ns["plain_ids"]) == 8
    # The context objects the page lists are the ones the engine offers a stage's constructor.
    assert contexts and all(c == contexts[0] for c in contexts)
    assert {r[0] for r in _table("context name")} == contexts[0]
    # The stage's own validation names the field and the value.
    with pytest.raises(ValueError, match=r"token_ids \[5000\] are outside the vocabulary"):
        ns["BanTokens"](vocab_size=4096, token_ids=(5000,))

    from deepinfer.core.plugins import get_plugin_manager

    exec(compile(process_wide, f"{DOC}:process-wide", "exec"), ns)
    order = eval(capsys.readouterr().out)  # the printed stage_names()
    assert order.index("verify") < order.index("ban_tokens") < order.index("sampler")
    assert "ban_tokens" not in get_registry(get_plugin_manager()).names("stage")  # unregistered again

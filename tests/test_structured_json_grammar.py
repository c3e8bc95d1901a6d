"""Bounded JSON strings (minLength / maxLength) through their repaired grammar (structured/json_grammar.py).

xgrammar 0.2.9 alone lets a bounded string hold raw control characters and no escapes (the probe below); the
repaired grammar accepts exactly the JSON encodings of strings within the bounds, escapes counting as one
character. The oracle is Python's json module: the grammar accepts a text iff json.loads reads a string of
allowed length from it (for texts built from strings, and for raw texts with control characters and broken
escapes).
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

xgr = pytest.importorskip("xgrammar")

from deepinfer.structured.json_grammar import repaired_ebnf  # noqa: E402


def accepts(ebnf: str, text: str) -> bool:
    return xgr.testing._is_grammar_accept_string(xgr.Grammar.from_ebnf(ebnf), text)


def oracle(text: str, lo: int, hi) -> bool:
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return isinstance(value, str) and lo <= len(value) and (hi is None or len(value) <= hi)


def test_xgrammar_alone_admits_raw_control_characters():
    """The probe behind the repair: this grammar's raw tab is not JSON, and it refuses an escaped quote."""
    g = xgr.Grammar.from_json_schema(json.dumps({"type": "string", "maxLength": 5}), any_whitespace=False)
    assert xgr.testing._is_grammar_accept_string(g, '"a\tb"')
    assert not xgr.testing._is_grammar_accept_string(g, '"a\\"b"')


def test_an_unbounded_schema_is_left_to_xgrammar():
    assert repaired_ebnf(xgr, json.dumps({"type": "object", "properties": {"s": {"type": "string"}}}), False) is None


# BMP characters only: an astral character is one code point but two \u escapes (JSON Schema counts code points).
TEXT = st.text(alphabet=st.characters(max_codepoint=0xFFFF, exclude_categories=("Cs",)), max_size=9)


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(s=TEXT, lo=st.integers(0, 4), span=st.one_of(st.none(), st.integers(0, 5)), ascii_=st.booleans())
def test_a_bounded_string_accepts_exactly_json_strings_within_bounds(s, lo, span, ascii_):
    hi = None if span is None else lo + span
    schema = {"type": "string", "minLength": lo, **({} if hi is None else {"maxLength": hi})}
    text = json.dumps(schema)  # what the compiler compiles: the repaired grammar, or xgrammar's own (no bounds)
    ebnf = repaired_ebnf(xgr, text, False) or str(xgr.Grammar.from_json_schema(text, any_whitespace=False))
    text = json.dumps(s, ensure_ascii=ascii_)  # escapes (\n, \", \u00e9) or raw characters where JSON allows them
    assert accepts(ebnf, text) == oracle(text, lo, hi), (text, lo, hi)


@pytest.mark.parametrize("text", ['"a\tb"', '"\x00"', '"a\\qb"', '"a\\u12"', '"a"b"', '"ab\\"', '"\x1f"'])
def test_raw_controls_and_broken_escapes_are_refused(text):
    ebnf = repaired_ebnf(xgr, json.dumps({"type": "string", "maxLength": 8}), False)
    assert not oracle(text, 0, 8) and not accepts(ebnf, text)


def test_bounded_strings_inside_an_object_keep_the_rest_of_the_schema():
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 4},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 150}},
              "required": ["name", "age"]}
    ebnf = repaired_ebnf(xgr, json.dumps(schema), False)
    assert accepts(ebnf, '{"name": "a\\"\\\\b", "age": 3}')  # decoded: a"\b, four characters
    assert not accepts(ebnf, '{"name": "abcde", "age": 3}')
    assert not accepts(ebnf, '{"name": "ab", "age": 151}')
    assert not accepts(ebnf, '{"name": "a\tb", "age": 3}')

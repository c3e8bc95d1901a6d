"""StructuredOutputsParams and the JSON-schema checks: invalid values raise ValueError naming the field; the
features xgrammar would silently weaken are refused naming the keyword and where it is, and each refusal is
backed by a probe showing that xgrammar 0.2.9 indeed accepts output that violates the keyword."""

from __future__ import annotations

import json
import re

import pytest

import deepinfer
from deepinfer import SamplingParams, StructuredOutputsParams as SO
from deepinfer.core.config import EngineConfig
from deepinfer.structured import check_json_schema, unsupported_feature


def test_exported_and_carried_by_sampling_params():
    assert deepinfer.StructuredOutputsParams is SO and "StructuredOutputsParams" in deepinfer.__all__
    p = SamplingParams(structured_outputs={"regex": "a+"})  # a dict is read as the fields
    assert p.structured_outputs == SO(regex="a+") and p.structured_outputs.kind == "regex"
    hash(SamplingParams(structured_outputs=SO(json={"type": "object"})))  # a dict schema keeps params hashable
    assert SO(choice=["a", "b"]).choice == ("a", "b")


@pytest.mark.parametrize("kw, msg", [
    (dict(json=""), r"StructuredOutputsParams\.json='' is invalid"),
    (dict(json="  "), r"StructuredOutputsParams\.json='  ' is invalid"),
    (dict(json="{not json"), r"StructuredOutputsParams\.json='\{not json' is invalid: not JSON"),
    (dict(json="[1]"), r"StructuredOutputsParams\.json='\[1\]' is invalid: must be a JSON schema"),
    (dict(json=3), r"StructuredOutputsParams\.json=3 is invalid"),
    (dict(json={"enum": {1, 2}}), r"StructuredOutputsParams\.json=.* is invalid: not JSON data"),
    (dict(regex=""), r"StructuredOutputsParams\.regex='' is invalid: must be a non-empty string"),
    (dict(grammar=""), r"StructuredOutputsParams\.grammar='' is invalid"),
    (dict(choice="yes"), r"StructuredOutputsParams\.choice='yes' is invalid: must be a list of strings"),
    (dict(choice=[]), r"StructuredOutputsParams\.choice=\[\] is invalid: must be a non-empty list"),
    (dict(choice=["a", ""]), r"StructuredOutputsParams\.choice=\['a', ''\] is invalid: must hold non-empty strings"),
    (dict(choice=["a", 1]), r"StructuredOutputsParams\.choice=\['a', 1\] is invalid"),
    (dict(regex="a", choice=["a"]), r"exactly one of json, regex, choice, grammar or json_object=True: regex and "
                                    r"choice are both set"),
    (dict(json={}, regex="a", grammar="root ::= \"a\""), r"json and regex and grammar are all set"),
    (dict(), r"exactly one of .*: none is set"),
    (dict(json_object=False), r"none is set"),
    (dict(json_object="yes"), r"StructuredOutputsParams\.json_object='yes' is invalid"),
    (dict(regex="a", disable_any_whitespace=1), r"StructuredOutputsParams\.disable_any_whitespace=1 is invalid"),
    (dict(regex="a", jump_forward="no"), r"StructuredOutputsParams\.jump_forward='no' is invalid"),
])
def test_validation_names_the_field(kw, msg):
    with pytest.raises(ValueError, match=msg):
        SO(**kw)


def test_sampling_params_field_validation():
    with pytest.raises(ValueError, match=r"SamplingParams\.structured_outputs='a\+' is invalid"):
        SamplingParams(structured_outputs="a+")
    with pytest.raises(ValueError, match=r"SamplingParams\.structured_outputs=.*jump_forward=True cannot be combined "
                                         r"with logprobs"):
        SamplingParams(structured_outputs=SO(regex="a", jump_forward=True), logprobs=1)
    assert SamplingParams(structured_outputs=SO(regex="a", jump_forward=True)).needs_output_tokens


def test_the_time_limit_is_an_engine_setting():
    assert EngineConfig().structured_outputs_timeout_s == 10.0
    for bad in (0, -1, float("inf"), "10", True):
        with pytest.raises(ValueError, match=r"EngineConfig\.structured_outputs_timeout_s=.* is invalid"):
            EngineConfig(structured_outputs_timeout_s=bad)


def test_cache_key_keeps_property_order_and_ignores_spelling():
    a = SO(json='{"b": 1,   "a": 2}').key
    assert a == SO(json={"b": 1, "a": 2}).key != SO(json={"a": 2, "b": 1}).key
    assert SO(json={}, disable_any_whitespace=True).key != SO(json={}).key
    assert SO(regex="x", disable_any_whitespace=True).key == SO(regex="x").key


# keyword, schema, an instance that violates it (xgrammar 0.2.9 accepts it), where the check points
WEAKENED = [
    ("multipleOf", {"type": "number", "multipleOf": 0.5}, "0.3", "/"),
    ("uniqueItems", {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "[1, 1]", "/"),
    ("contains", {"type": "array", "items": {"type": "integer"}, "contains": {"const": 5}}, "[1]", "/"),
    ("format", {"type": "string", "format": "regex"}, '"("', "/"),
    ("format", {"type": "integer", "format": "int32"}, None, "/"),  # OpenAPI's; jsonschema has no checker
    ("dependentRequired", {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                           "dependentRequired": {"a": ["b"]}}, '{"a": 1}', "/"),
    ("not", {"not": {"type": "integer"}}, "1", "/"),
    ("if", {"if": {"type": "integer"}, "then": {"minimum": 5}}, "1", "/"),
    ("allOf", {"allOf": [{"type": "integer"}, {"minimum": 5}]}, "1", "/"),
    ("oneOf", {"oneOf": [{"type": "integer"}, {"type": "number"}]}, "1", "/"),
    ("required", {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "zz"]},
     '{"a": 1}', "/"),
    # Keywords xgrammar enforces alone, dropping what is beside them.
    ("enum", {"type": "integer", "enum": [1, 50], "maximum": 10}, "50", "/"),
    ("enum", {"type": "integer", "enum": [1, 2.5]}, "2.5", "/"),
    ("const", {"type": "integer", "const": "x"}, '"x"', "/"),
    ("anyOf", {"type": "string", "anyOf": [{"maxLength": 2}, {"pattern": "^a+$"}]}, "85", "/"),
    ("allOf", {"type": "integer", "maximum": 100, "allOf": [{"maximum": 5}]}, "85", "/"),
    ("$ref", {"$defs": {"s": {"type": "string"}}, "$ref": "#/$defs/s", "minLength": 5}, None, "/"),
    ("pattern", {"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}, '"abcdef"', "/"),
    ("format", {"type": "string", "format": "date-time", "maxLength": 10}, '"2024-01-01T00:00:00Z"', "/"),
    # Would produce no JSON at all, or JSON that does not parse (see test_xgrammar_writes_invalid_json_for_these).
    ("anyOf", {"anyOf": []}, None, "/"),
    ("oneOf", {"type": "object", "properties": {"a": {"oneOf": []}}}, None, "/properties/a"),
    ("pattern", {"type": "string", "pattern": '^a"b$'}, None, "/"),
    ("pattern", {"type": "string", "pattern": "^a\\\\b$"}, None, "/"),
    ("pattern", {"type": "string", "pattern": "^a[\t ]b$"}, None, "/"),
    ("$ref", {"$ref": "http://example.com/s.json"}, None, "/"),
]


@pytest.mark.parametrize("keyword, schema, violating, where", WEAKENED)
def test_weakened_features_are_refused_naming_the_keyword(keyword, schema, violating, where):
    with pytest.raises(ValueError, match=rf"structured_outputs\.json: '{re.escape(keyword)}' at {where} is not "
                                         "supported"):
        check_json_schema(schema)
    nested = {"type": "object", "properties": {"x/y": {"type": "array", "items": schema}}, "required": ["x/y"]}
    inner = "" if where == "/" else where
    assert unsupported_feature(nested)[:2] == (keyword, "/properties/x~1y/items" + inner)


@pytest.mark.parametrize("keyword, schema, violating, where", WEAKENED)
def test_xgrammar_really_weakens_each_refused_feature(keyword, schema, violating, where, xgr_compiler):
    """The probe behind each refusal: xgrammar compiles the schema and accepts an instance that violates it."""
    jsonschema = pytest.importorskip("jsonschema")
    import xgrammar as xgr

    if violating is None:
        pytest.skip("no validator checks this keyword")
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(json.loads(violating), schema, format_checker=jsonschema.FormatChecker())
    m = xgr.GrammarMatcher(xgr_compiler.compile_json_schema(json.dumps(schema), any_whitespace=False))
    assert m.accept_string(violating) and m.is_completed(), keyword


@pytest.fixture(scope="module")
def xgr_compiler():
    """xgrammar's own compiler for the demo tokenizer (the probes ask xgrammar itself, not our wrapper)."""
    xgr = pytest.importorskip("xgrammar")
    from deepinfer.models.loader import DEMO_DIR
    from deepinfer.structured.compiler import tokenizer_info
    from deepinfer.tokenizer import Tokenizer

    return xgr.GrammarCompiler(tokenizer_info(Tokenizer.from_dir(DEMO_DIR), 4096), max_threads=1)


@pytest.mark.parametrize("schema", [
    {"type": "integer", "multipleOf": 3},  # enforced by xgrammar: kept
    {"type": "array", "items": {"type": "integer"}, "uniqueItems": False},
    {"type": "string", "format": "date-time"},
    {"oneOf": [{"type": "integer"}, {"type": "string"}]},  # disjoint branches: exact
    {"allOf": [{"type": "integer"}]},
    {"type": "object", "properties": {"contains": {"type": "string", "title": "format"}}, "required": ["contains"]},
    {"type": "object", "properties": {"a": {"enum": [{"not": 1}]}}},  # data under enum is not a schema
    {"type": "string", "enum": ["a", "b"]}, {"type": ["string", "null"], "enum": ["a", None]},  # a type they all have
    {"type": "integer", "enum": [1, 2.0]}, {"const": 3, "title": "three"},
    {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None, "title": "X"},  # pydantic's Optional
    {"$defs": {"s": {"type": "string"}}, "$ref": "#/$defs/s", "description": "annotations beside a $ref"},
    {"allOf": [{"$ref": "#/$defs/a"}], "$defs": {"a": {"type": "integer"}}},
    {"type": "string", "pattern": "^[ -~]+$"}, {"type": "string", "pattern": '^[^"\\\\]+$'},  # classes are safe
    {"type": "string", "pattern": "^\\d{3}-.+$"}, {"type": "string", "minLength": 1, "maxLength": 5},
    {"type": "object", "properties": {"next": {"$ref": "#"}}},  # recursion
])
def test_supported_features_pass(schema):
    check_json_schema(schema)


def test_a_ref_target_is_checked_wherever_it_points():
    """xgrammar follows a $ref to any JSON pointer, not only into $defs: the target's keywords are checked."""
    schema = {"x": {"type": "array", "items": {"enum": [1, 2]}, "uniqueItems": True}, "$ref": "#/x"}
    assert unsupported_feature(schema) == ("uniqueItems", "/x", "xgrammar does not enforce it")
    assert unsupported_feature({"a~b": {"not": {}}, "$ref": "#/a~0b"})[:2] == ("not", "/a~0b")


@pytest.mark.parametrize("schema, raw", [
    ({"anyOf": []}, ""),
    ({"type": "object", "properties": {"a": {"anyOf": []}}, "required": ["a"]}, '{"a": }'),
    ({"type": "string", "pattern": '^a"b$'}, '"a"b"'),
    ({"type": "string", "pattern": "^a\\tb$"}, '"a\tb"'),
])
def test_xgrammar_writes_invalid_json_for_these(schema, raw, xgr_compiler):
    """The probe behind the refusals whose output would not even parse: xgrammar accepts this text."""
    import xgrammar as xgr

    with pytest.raises(ValueError):
        json.loads(raw)
    m = xgr.GrammarMatcher(xgr_compiler.compile_json_schema(json.dumps(schema), any_whitespace=False))
    assert m.accept_string(raw) and m.is_completed()
    with pytest.raises(ValueError, match="is not supported"):
        check_json_schema(schema)


def test_the_time_limit_counts_from_the_start_of_compilation():
    """A grammar queued behind others for a compile thread is not timed out by the queue: its limit starts when
    its compilation does (constrain._result); one that compiles past the limit still times out."""
    import concurrent.futures
    import threading
    import time

    from deepinfer.stages.constrain import _result

    queued = concurrent.futures.Future()

    def run_late():  # starts after the admission deadline below has passed, then finishes quickly
        time.sleep(0.3)
        queued.set_running_or_notify_cancel()
        queued.started_at = time.monotonic()
        queued.set_result("grammar")

    threading.Thread(target=run_late, daemon=True).start()
    assert _result(queued, deadline=time.monotonic() + 0.05, limit=30.0) == "grammar"
    slow = concurrent.futures.Future()
    slow.set_running_or_notify_cancel()
    slow.started_at = time.monotonic()
    with pytest.raises(concurrent.futures.TimeoutError):
        _result(slow, deadline=time.monotonic() + 0.05, limit=0.1)
    assert _result(_done("cached"), deadline=time.monotonic() - 1, limit=0.0) == "cached"  # done: no wait


def _done(value):
    import concurrent.futures

    f = concurrent.futures.Future()
    f.set_result(value)
    return f

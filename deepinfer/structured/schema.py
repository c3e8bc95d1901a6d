"""JSON-schema features that xgrammar 0.2.9 would silently weaken, found before compiling.

xgrammar compiles most of JSON Schema into a grammar, but a few keywords it accepts and then ignores (or
enforces only in part): a request whose schema uses one would get output that parses but need not validate.
Such a schema is refused up front with a message naming the keyword and where it is (a JSON pointer), as
vLLM refuses them. Each entry below was checked against xgrammar 0.2.9 (tests/test_structured_schema.py
holds the probes: for every keyword refused here, xgrammar accepts an instance that violates it).
"""

from __future__ import annotations

from typing import Any, Iterator

# String formats xgrammar 0.2.9 enforces; any other `format` value is ignored by it.
SUPPORTED_FORMATS = frozenset({"date", "time", "date-time", "duration", "email", "hostname", "ipv4", "ipv6",
                               "uuid", "uri", "uri-reference", "uri-template", "json-pointer",
                               "relative-json-pointer"})

# Keyword -> why it is refused. (multipleOf, allOf, oneOf, required and uniqueItems are refused only in some
# forms: see _problem.)
_IGNORED = {
    "contains": "xgrammar does not enforce it",
    "minContains": "xgrammar does not enforce it",
    "maxContains": "xgrammar does not enforce it",
    "patternProperties": "xgrammar does not support it (it rejects even matching objects)",
    "dependentRequired": "xgrammar does not enforce it",
    "dependentSchemas": "xgrammar does not enforce it",
    "dependencies": "xgrammar does not enforce it",
    "not": "xgrammar does not enforce it",
    "if": "xgrammar does not enforce if/then/else",
    "then": "xgrammar does not enforce if/then/else",
    "else": "xgrammar does not enforce if/then/else",
}

# Keywords whose value is one subschema, a list of them, or a map of names to them.
_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
        "unevaluatedItems", "unevaluatedProperties", "additionalItems")
_LIST = ("allOf", "anyOf", "oneOf", "prefixItems")
_MAP = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")


def _escape(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


def _subschemas(schema: dict, where: str) -> Iterator[tuple]:
    for k in _ONE:
        if isinstance(schema.get(k), dict):
            yield schema[k], f"{where}/{k}"
    for k in _LIST:
        if isinstance(schema.get(k), list):
            for i, sub in enumerate(schema[k]):
                if isinstance(sub, dict):
                    yield sub, f"{where}/{k}/{i}"
    for k in _MAP:
        if isinstance(schema.get(k), dict):
            for name, sub in schema[k].items():
                if isinstance(sub, dict):
                    yield sub, f"{where}/{k}/{_escape(str(name))}"


def _single_type(schema: Any):
    t = schema.get("type") if isinstance(schema, dict) else None
    return t if isinstance(t, str) else None


def _problem(schema: dict) -> tuple:
    """(keyword, why) of the first feature of this schema object (not its subschemas) xgrammar would weaken."""
    for k, why in _IGNORED.items():
        if k in schema:
            return k, why
    if "multipleOf" in schema:
        m = schema["multipleOf"]
        if not (schema.get("type") == "integer" and isinstance(m, int) and not isinstance(m, bool)):
            return "multipleOf", ("xgrammar enforces it only on {\"type\": \"integer\"} with an integer multipleOf; "
                                  "it would ignore this one")
    if schema.get("uniqueItems") is True:
        return "uniqueItems", "xgrammar does not enforce it"
    fmt = schema.get("format")
    if fmt is not None and not (schema.get("type") in (None, "string") and fmt in SUPPORTED_FORMATS):
        return "format", (f"xgrammar does not enforce format {fmt!r}"
                          + ("" if schema.get("type") in (None, "string") else f" on type {schema.get('type')!r}")
                          + f" (it enforces these string formats: {', '.join(sorted(SUPPORTED_FORMATS))})")
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        return "allOf", "xgrammar does not intersect several subschemas (it would enforce them only in part)"
    one_of = schema.get("oneOf")
    if isinstance(one_of, list) and len(one_of) > 1:
        types = [_single_type(s) for s in one_of]
        if None in types or len(set(types)) < len(types) or {"integer", "number"} <= set(types):
            return "oneOf", ("xgrammar cannot make sure that exactly one branch matches when the branches may "
                             "overlap (it would allow several, as anyOf does); give each branch a distinct "
                             "\"type\", or use anyOf")
    req, props = schema.get("required"), schema.get("properties")
    if isinstance(req, list) and req:
        known = props if isinstance(props, dict) else {}
        missing = [r for r in req if r not in known]
        if missing:
            return "required", (f"names {missing[0]!r}, which is not in properties; xgrammar would not require "
                                "it (list every required key under properties)")
    return None


def unsupported_feature(schema: Any):
    """(keyword, JSON pointer, why) of the first feature xgrammar would silently weaken, or None."""
    stack = [(schema, "")]
    while stack:
        node, where = stack.pop()
        if not isinstance(node, dict):
            continue
        found = _problem(node)
        if found is not None:
            return found[0], where or "/", found[1]
        stack.extend(reversed(list(_subschemas(node, where))))
    return None


def check_json_schema(schema: Any) -> None:
    """Raise ValueError naming the first keyword xgrammar would silently weaken (and where it is)."""
    found = unsupported_feature(schema)
    if found is not None:
        keyword, where, why = found
        raise ValueError(f"structured_outputs.json: {keyword!r} at {where} is not supported: {why}")

"""JSON-schema features that xgrammar 0.2.9 would silently weaken, found before compiling.

xgrammar compiles most of JSON Schema into a grammar, but a few keywords it accepts and then ignores (or
enforces only in part, or next to which it drops the others, or turns into invalid JSON): a request whose schema
uses one would get output that parses but need not validate, or does not parse.
Such a schema is refused up front with a message naming the keyword and where it is (a JSON pointer), as
vLLM refuses them. Each entry below was checked against xgrammar 0.2.9 (tests/test_structured_schema.py
holds the probes: for every keyword refused here, xgrammar accepts an instance that violates it).
"""

from __future__ import annotations

import re._parser as _sre  # (Python's own regex parser: to find what a pattern spells literally)
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


# Keywords that constrain an instance (the rest are annotations: title, description, default, $defs, ...).
_CONSTRAINTS = frozenset({
    "type", "enum", "const", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
    "minLength", "maxLength", "pattern", "format", "items", "prefixItems", "additionalItems", "minItems",
    "maxItems", "uniqueItems", "contains", "minContains", "maxContains", "properties", "required",
    "additionalProperties", "patternProperties", "propertyNames", "minProperties", "maxProperties",
    "dependentRequired", "dependentSchemas", "dependencies", "anyOf", "oneOf", "allOf", "not", "if", "then", "else",
    "$ref", "unevaluatedItems", "unevaluatedProperties"})
# Keywords xgrammar enforces alone: next to one of them it drops every other constraint.
_ALONE = ("enum", "const", "anyOf", "oneOf", "allOf", "$ref")
_PY_TYPES = {"string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,), "null": (type(None),),
             "object": (dict,), "array": (list,)}


def _is_type(value, name: str) -> bool:
    if isinstance(value, bool) and name != "boolean":
        return False
    if name == "integer" and isinstance(value, float):
        return value.is_integer()
    return isinstance(value, _PY_TYPES.get(name, ()))


def _alone_problem(schema: dict):
    """(keyword, why) where an enum / const / anyOf / oneOf / allOf / $ref has sibling constraints xgrammar would
    drop (a "type" every enum or const value has is kept: it says nothing more)."""
    for k in _ALONE:
        if k not in schema:
            continue
        others = sorted(c for c in schema if c in _CONSTRAINTS and c != k)
        if k in ("enum", "const") and others == ["type"]:
            values = schema[k] if k == "enum" and isinstance(schema[k], list) else [schema.get(k)]
            types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
            bad = [v for v in values if not any(_is_type(v, t) for t in types if isinstance(t, str))]
            if not bad:
                continue
            return k, f"value {bad[0]!r} is not of type {schema['type']!r} (xgrammar would allow it)"
        if others:
            return k, (f"xgrammar enforces {k!r} alone and would ignore the keywords beside it ({', '.join(others)}); "
                       "move them inside, or fold them into it")
    for k in ("anyOf", "oneOf", "allOf"):
        if isinstance(schema.get(k), list) and not schema[k]:
            return k, "is an empty list (JSON Schema needs at least one subschema; xgrammar would allow no value)"
    ref = schema.get("$ref")
    if ref is not None and not (isinstance(ref, str) and (ref == "#" or ref.startswith("#/"))):
        return "$ref", f"{ref!r} is not a reference inside this schema ('#' or '#/...'); remote ones are not fetched"
    return None


_UNSAFE = frozenset(range(0x20)) | {ord('"'), ord("\\")}


def _pattern_problem(pattern) -> Any:
    """Why xgrammar would write invalid JSON for this string pattern, or None: it emits a character the pattern
    names literally (a quote, a backslash, a control character) raw inside the string, unescaped. (Classes,
    ranges and '.' are safe: it leaves those characters out of them.)"""
    if not isinstance(pattern, str):
        return None
    try:
        tree = _sre.parse(pattern)
    except Exception:  # noqa: BLE001 - not Python's syntax: xgrammar reports its own errors
        return None
    stack = [tree]
    while stack:
        items = stack.pop()
        for op, arg in items:
            name = str(op)
            if name == "LITERAL" and arg in _UNSAFE:
                return f"names {chr(arg)!r} literally, which xgrammar writes into the string unescaped"
            if name == "IN":
                if any(str(o) == "NEGATE" for o, _ in arg):
                    continue
                for o, a in arg:
                    ends = [a] if str(o) == "LITERAL" else list(a) if str(o) == "RANGE" else []
                    bad = [c for c in ends if c in _UNSAFE]
                    if bad:
                        return f"names {chr(bad[0])!r} literally, which xgrammar writes into the string unescaped"
            elif name == "SUBPATTERN":
                stack.append(arg[-1])
            elif name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"):
                stack.append(arg[-1])
            elif name == "BRANCH":
                stack.extend(arg[1])
            elif name in ("ASSERT", "ASSERT_NOT"):
                stack.append(arg[1])
    return None


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
    alone = _alone_problem(schema)
    if alone is not None:
        return alone
    bounded = [k for k in ("minLength", "maxLength") if k in schema]
    for k in ("pattern", "format"):
        if k in schema and bounded:
            return k, f"xgrammar ignores {bounded[0]!r} beside {k!r} (it would allow any length)"
    why = _pattern_problem(schema.get("pattern"))
    if why is not None:
        return "pattern", why
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


def _resolve(root: Any, ref: str):
    """The subschema a local $ref ('#' or '#/a/b', JSON-pointer escapes) points to, or None."""
    node = root
    for part in ref[2:].split("/") if ref != "#" else ():
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def unsupported_feature(schema: Any):
    """(keyword, JSON pointer, why) of the first feature xgrammar would silently weaken, or None. A local $ref's
    target is checked too, wherever it points (xgrammar follows any JSON pointer)."""
    stack, seen = [(schema, "")], set()
    while stack:
        node, where = stack.pop()
        if not isinstance(node, dict) or id(node) in seen:
            continue
        seen.add(id(node))
        found = _problem(node)
        if found is not None:
            return found[0], where or "/", found[1]
        subs = list(_subschemas(node, where))
        ref = node.get("$ref")
        if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
            target = _resolve(schema, ref)
            if target is not None:
                subs.append((target, ref[1:] or "/"))
        stack.extend(reversed(subs))
    return None


def check_json_schema(schema: Any) -> None:
    """Raise ValueError naming the first keyword xgrammar would silently weaken (and where it is)."""
    found = unsupported_feature(schema)
    if found is not None:
        keyword, where, why = found
        raise ValueError(f"structured_outputs.json: {keyword!r} at {where} is not supported: {why}")

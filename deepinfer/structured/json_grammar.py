r"""A JSON schema's grammar with xgrammar 0.2.9's bounded strings repaired.

xgrammar writes a string with ``minLength`` / ``maxLength`` as a repetition of one character rule,
``[^"\\\r\n]``, which admits raw control characters (U+0000-U+001F but CR and LF: invalid inside a JSON string)
and no escape sequence (mlc-ai/xgrammar#800, open). Such a schema is compiled from xgrammar's own grammar text
with that rule replaced by JSON's string character (any character but ``"``, ``\\`` and the controls, or an
escape, each counting as one character of the length, as a decoded string counts it). A schema without bounded
strings compiles as before, through xgrammar's JSON-schema entry point.
"""

from __future__ import annotations

from typing import Optional

# The character rule of a bounded string, as xgrammar 0.2.9 prints it, and JSON's (an escape is one character).
BOUNDED_CHAR = r'(([^\"\\\r\n]))'
JSON_CHAR = r'(([^\0-\x1f\"\\]) | ("\\" deepinfer_json_escape))'
ESCAPE_RULE = r'deepinfer_json_escape ::= (([\"\\/bfnrt]) | ("u" [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9]))'


def repaired_ebnf(xgr, schema_text: str, any_whitespace: bool) -> Optional[str]:
    """The schema's grammar (xgrammar's EBNF text) with every bounded string's character rule made JSON's; None
    when the schema has no bounded string (compile it as it is)."""
    ebnf = str(xgr.Grammar.from_json_schema(schema_text, any_whitespace=any_whitespace))
    lines = ebnf.splitlines()
    fixed = [ln.replace(BOUNDED_CHAR, JSON_CHAR) if _is_bounded_char_rule(ln) else ln for ln in lines]
    if fixed == lines:
        return None
    return "\n".join(fixed + [ESCAPE_RULE]) + "\n"


def _is_bounded_char_rule(line: str) -> bool:
    name, sep, body = line.partition(" ::= ")
    return bool(sep) and name.endswith("_characters") and body == BOUNDED_CHAR

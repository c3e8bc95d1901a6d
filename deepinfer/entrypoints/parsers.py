"""Output parsers: split a completion's text into reasoning, content and tool calls, whole or while it streams.

A parser is a pure function of the text so far: ``parse(text, final)`` returns what can be said of it now.
While streaming (``final=False``) it withholds a tail that may be the start of a tag and reports a tool
call's arguments as the raw JSON text read so far, so every later parse extends the earlier one (content,
reasoning and each call's arguments only grow at their ends). ``StreamDiffer`` turns successive parses into
deltas, which is how each protocol streams tool calls incrementally.

Formats (the tags each model family writes):

- ``qwen3`` / ``hermes`` / ``demo``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, reasoning in
  ``<think>...</think>``. The demo model speaks this format through the server's default chat template
  (chat_template.py), which renders tools and tool calls this way.
- ``deepseek_v3``: ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```
  <｜tool▁call▁end｜>...<｜tool▁calls▁end｜>`` (V3.1's ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}`` is read too);
  its reasoning (R1) is ``<think>...</think>``, the opening tag often written by the template.
- ``llama3_json``: the whole output is ``{"name": ..., "parameters": {...}}`` (``;``-separated for several),
  optionally after ``<|python_tag|>``.
- ``forced``: the JSON the constrain stage forces for tool_choice "required" (``[{"name", "parameters"}...]``).

Parsers are registered through the ``deepinfer_register_parsers`` hook (core/hookspecs.py):
``register.parser(kind="tool" | "reasoning", name=..., factory=...)``; the factory takes no argument.
"""

from __future__ import annotations

import json
import re
from typing import Optional

import attrs

from ..outputs import partial_prefix_len


@attrs.frozen
class ParsedCall:
    name: Optional[str]  # None while the name has not been read yet
    arguments: str  # raw JSON text read so far ("" when none yet)
    complete: bool


@attrs.frozen
class Parsed:
    content: str = ""
    reasoning: str = ""
    calls: tuple = ()


def scan_value(s: str, i: int) -> Optional[int]:
    """End (exclusive) of the JSON value that starts at s[i], or None if the text ends inside it."""
    n = len(s)
    if i >= n:
        return None
    c = s[i]
    if c == '"':
        j = i + 1
        while j < n:
            if s[j] == "\\":
                j += 2
                continue
            if s[j] == '"':
                return j + 1
            j += 1
        return None
    if c in "{[":
        depth, j, in_str = 0, i, False
        while j < n:
            ch = s[j]
            if in_str:
                if ch == "\\":
                    j += 1
                elif ch == '"':
                    in_str = False
            elif ch == '"':
                in_str = True
            elif ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    m = re.compile(r"[^,}\]\s]*").match(s, i)
    return m.end() if m.end() < n else None


_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')


def parse_call_object(obj: str, args_keys=("arguments", "parameters")) -> ParsedCall:
    """A (possibly partial) ``{"name": ..., "arguments": {...}}`` object: its name once read, its raw arguments."""
    m = _NAME.search(obj)
    name = json.loads(f'"{m.group(1)}"') if m else None
    args, complete_args = "", False
    km = re.search(r'"(?:' + "|".join(args_keys) + r')"\s*:\s*', obj)
    if km:
        start = km.end()
        end = scan_value(obj, start)
        if end is None:
            raw = obj[start:]
            args = "" if raw.startswith('"') else raw  # a string-valued argument is reported once complete
        else:
            raw = obj[start:end]
            if raw.startswith('"'):  # some models write the arguments as a JSON string
                raw = json.loads(raw)
            args, complete_args = raw, True
    complete = scan_value(obj, 0) is not None if obj.startswith("{") else False
    if complete and not km:
        args, complete_args = "{}", True
    return ParsedCall(name, args, complete and complete_args and name is not None)


def parse_json_calls(text: str, separators: str = ",;") -> tuple:
    """Calls from a sequence of JSON call objects, optionally inside ``[...]``, separated by ``separators``;
    returns (calls, rest): rest is text after the sequence that is not a call (None if there is none)."""
    calls, i, n = [], 0, len(text)
    while i < n and (text[i].isspace() or text[i] in "[" + separators):
        i += 1
    while i < n and text[i] == "{":
        end = scan_value(text, i)
        calls.append(parse_call_object(text[i:] if end is None else text[i:end]))
        if end is None:
            return tuple(calls), None
        i = end
        while i < n and (text[i].isspace() or text[i] in "]" + separators):
            i += 1
    return tuple(calls), (text[i:] if i < n else None)


# --- tool parsers --------------------------------------------------------------------------------------------

@attrs.define(eq=False)
class TagToolParser:
    """Tool calls as JSON objects between a start and an end tag (Qwen3, Hermes, the demo model)."""

    name: str = "qwen3"
    start: str = "<tool_call>"
    end: str = "</tool_call>"
    needs_special_tokens: bool = False

    def parse(self, text: str, final: bool) -> Parsed:
        content, calls, pos = [], [], 0
        while True:
            k = text.find(self.start, pos)
            if k < 0:
                tail = text[pos:]
                if not final:
                    tail = tail[:len(tail) - partial_prefix_len(tail, (self.start,))]
                content.append(tail)
                break
            content.append(text[pos:k])
            body_start = k + len(self.start)
            e = text.find(self.end, body_start)
            body = text[body_start:] if e < 0 else text[body_start:e]
            call = parse_call_object(body.strip())
            if e < 0 and final:
                call = attrs.evolve(call, complete=call.complete)
            calls.append(call)
            if e < 0:
                break
            pos = e + len(self.end)
        return Parsed(content="".join(content), calls=tuple(calls))


@attrs.define(eq=False)
class DeepSeekV3ToolParser:
    name: str = "deepseek_v3"
    needs_special_tokens: bool = True
    calls_begin = "<｜tool▁calls▁begin｜>"
    calls_end = "<｜tool▁calls▁end｜>"
    call_begin = "<｜tool▁call▁begin｜>"
    call_end = "<｜tool▁call▁end｜>"
    sep = "<｜tool▁sep｜>"

    def parse(self, text: str, final: bool) -> Parsed:
        k = text.find(self.calls_begin)
        if k < 0:
            k2 = text.find(self.call_begin)  # some V3.1 outputs skip the outer tag
            k = k2
        if k < 0:
            content = text if final else text[:len(text) - partial_prefix_len(text, (self.calls_begin, self.call_begin))]
            return Parsed(content=content)
        content, calls = text[:k], []
        for chunk in text[k:].split(self.call_begin)[1:]:
            head, sep, rest = chunk.partition(self.sep)
            if not sep:
                calls.append(ParsedCall(None, "", False))
                continue
            done = self.call_end in rest
            rest = rest.split(self.call_end)[0]
            if head.strip() == "function" or head.strip() == "":  # V3: name on the line after the separator
                name, nl, body = rest.partition("\n")
                if not nl:
                    calls.append(ParsedCall(None, "", False))
                    continue
                fence = body.find("```json")
                body = body[fence + len("```json"):] if fence >= 0 else body
            else:  # V3.1: name before the separator
                name, body = head, rest
            body = body.lstrip()
            end = scan_value(body, 0) if body.startswith("{") else None
            args = body[:end] if end is not None else (body if body.startswith("{") else "")
            calls.append(ParsedCall(name.strip(), args, end is not None and (done or final)))
        return Parsed(content=content, calls=tuple(calls))


@attrs.define(eq=False)
class JsonToolParser:
    """The whole output is a sequence of JSON call objects (Llama 3.1's JSON tool calling; the forced
    tool_choice="required" array). Text that does not start as a call is plain content."""

    name: str = "llama3_json"
    prefix: str = "<|python_tag|>"
    separators: str = ";"
    needs_special_tokens: bool = True

    def parse(self, text: str, final: bool) -> Parsed:
        body = text.lstrip()
        if self.prefix and body.startswith(self.prefix):
            body = body[len(self.prefix):].lstrip()
        elif self.prefix and not final and self.prefix.startswith(body):
            return Parsed()  # may still become the tag
        if not body:
            return Parsed(content="" if not final else text)
        if body[0] not in "{[":
            return Parsed(content=text)
        calls, rest = parse_json_calls(body, self.separators)
        if not calls:
            return Parsed(content=text if final else "")
        if final and any(c.name is None for c in calls):
            return Parsed(content=text)  # not a call after all
        return Parsed(content=(rest or "") if final else "", calls=calls)


# --- reasoning parsers -----------------------------------------------------------------------------------------

@attrs.define(eq=False)
class ThinkReasoningParser:
    """Reasoning between ``<think>`` and ``</think>``; a ``</think>`` with no opening tag closes reasoning that
    the chat template opened (DeepSeek-R1, Qwen3 with thinking forced)."""

    name: str = "qwen3"
    start: str = "<think>"
    end: str = "</think>"

    def split(self, text: str, final: bool) -> tuple:
        """(reasoning, rest) of the text so far."""
        body = text.lstrip()
        if body.startswith(self.start):
            inner = body[len(self.start):]
            r, sep, rest = inner.partition(self.end)
            if not sep and not final:
                r = r[:len(r) - partial_prefix_len(r, (self.end,))]
            return r, rest.lstrip("\n") if sep else ""
        if not final and self.start.startswith(body):
            return "", ""  # may still become the tag
        r, sep, rest = text.partition(self.end)
        if sep:
            return r, rest.lstrip("\n")
        return "", text


def parse_output(text: str, tool_parser=None, reasoning_parser=None, final: bool = True) -> Parsed:
    """Reasoning first, then tool calls in what follows it."""
    reasoning, rest = reasoning_parser.split(text, final) if reasoning_parser is not None else ("", text)
    if reasoning_parser is not None and not final and not rest and reasoning == "" and text.strip():
        return Parsed()
    parsed = tool_parser.parse(rest, final) if tool_parser is not None else Parsed(content=rest)
    return attrs.evolve(parsed, reasoning=reasoning)


class StreamDiffer:
    """Successive parses of one growing text -> deltas: ("reasoning", text), ("content", text),
    ("tool_start", index, name), ("tool_args", index, text), ("tool_end", index). A call starts once its name
    is known; its arguments stream as they are read."""

    def __init__(self, tool_parser=None, reasoning_parser=None):
        self.tool_parser, self.reasoning_parser = tool_parser, reasoning_parser
        self.prev = Parsed()
        self.started: list = []  # per call: arguments sent so far (None: not started)
        self.ended: set = set()

    def update(self, text: str, final: bool = False) -> list:
        cur = parse_output(text, self.tool_parser, self.reasoning_parser, final)
        events = []
        for field in ("reasoning", "content"):
            old, new = getattr(self.prev, field), getattr(cur, field)
            if len(new) > len(old) and new.startswith(old):
                events.append((field, new[len(old):]))
            elif new != old and not new.startswith(old):  # a parse that took text back: keep what was sent
                cur = attrs.evolve(cur, **{field: old})
        for i, call in enumerate(cur.calls):
            if i >= len(self.started):
                self.started.append(None)
            if self.started[i] is None:
                if call.name is None:
                    break  # calls start in order
                events.append(("tool_start", i, call.name))
                self.started[i] = ""
            sent = self.started[i]
            if len(call.arguments) > len(sent) and call.arguments.startswith(sent):
                events.append(("tool_args", i, call.arguments[len(sent):]))
                self.started[i] = call.arguments
            if (call.complete or final) and i not in self.ended:
                self.ended.add(i)
                events.append(("tool_end", i))
        self.prev = cur
        return events


# --- the registry -----------------------------------------------------------------------------------------------

def builtin_parsers() -> dict:
    """{(kind, name): factory} of the built-in parsers (registered by deepinfer.builtin)."""
    return {
        ("tool", "qwen3"): lambda: TagToolParser(name="qwen3"),
        ("tool", "hermes"): lambda: TagToolParser(name="hermes"),
        ("tool", "demo"): lambda: TagToolParser(name="demo"),
        ("tool", "deepseek_v3"): DeepSeekV3ToolParser,
        ("tool", "llama3_json"): JsonToolParser,
        ("reasoning", "qwen3"): lambda: ThinkReasoningParser(name="qwen3"),
        ("reasoning", "deepseek_r1"): lambda: ThinkReasoningParser(name="deepseek_r1"),
        ("reasoning", "deepseek_v3"): lambda: ThinkReasoningParser(name="deepseek_v3"),
        ("reasoning", "demo"): lambda: ThinkReasoningParser(name="demo"),
    }


# config.json model_type -> the parser names a checkpoint of that family writes.
FAMILY_PARSERS = {
    "qwen3": ("qwen3", "qwen3"), "qwen3_moe": ("qwen3", "qwen3"), "qwen2": ("hermes", None),
    "deepseek_v3": ("deepseek_v3", "deepseek_r1"), "deepseek_v32": ("deepseek_v3", "deepseek_r1"),
    "llama": ("llama3_json", None), "ced": ("demo", "demo"),
}


def choose_parser(registry, kind: str, name: Optional[str], model_type: Optional[str]):
    """The parser named (``"none"``: no parser), else the model family's default, else None."""
    if name is None:
        family = FAMILY_PARSERS.get(model_type or "")
        name = family[0 if kind == "tool" else 1] if family else None
    if name is None or name == "none":
        return None
    return registry.get(f"{kind}_parser", name).obj()

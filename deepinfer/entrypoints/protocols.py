"""Request bodies of the three protocols -> (Conversation, SamplingParams, tool plan), and the mapping decisions.

Sampling fields map to SamplingParams by vLLM's names; the vLLM extras (top_k, min_p, repetition_penalty,
min_tokens, ignore_eos, stop_token_ids, skip_special_tokens, include_stop_str_in_output, structured_outputs) are
read from the body too (the openai client's ``extra_body``). Defaults not in the request come from the
checkpoint's generation_config.json (as vLLM), else SamplingParams'. max_tokens: the request's (at most the
server's --max-tokens-limit), else 16 for /v1/completions (OpenAI's) and the rest of the context (capped by the
limit) for the chat protocols; a prompt plus max_tokens beyond the context is refused.

tool_choice: "auto" lets the model decide and the tool parser reads its calls; "none" renders the tools but
reads no calls; "required" (Anthropic: "any") and a named function are enforced by structured outputs (the
constrain stage): the output is forced to ``[{"name": ..., "parameters": {...}}, ...]`` over the tools'
schemas, or to the named function's arguments, so every call is valid JSON for its schema.
"""

from __future__ import annotations

import json
import re
from typing import Optional

import attrs

from ..core.params import SamplingParams, StructuredOutputsParams
from .conversation import Conversation, ConversionError, Message, Tool, ToolCall, check_tool, new_call_id, text_of
from .parsers import JsonToolParser, ParsedCall


@attrs.define
class ToolPlan:
    """How tool calls are read from this request's output."""

    mode: str = "none"  # none | auto | required | named
    named: Optional[str] = None
    parser: object = None  # the tool parser that reads the output (None: no calls are read)

    def calls_of(self, parsed_calls) -> list:
        return [c for c in parsed_calls if c.name is not None]


class NamedCallParser:
    """tool_choice naming one function: the whole output is its arguments."""

    needs_special_tokens = False

    def __init__(self, name: str):
        self.name = name

    def parse(self, text: str, final: bool):
        from .parsers import Parsed, scan_value

        body = text.lstrip()
        done = body.startswith("{") and scan_value(body, 0) is not None
        return Parsed(calls=(ParsedCall(self.name, body, done),))


def _type_check(body: dict, name: str, types, what: str, path: Optional[str] = None):
    """body[name] (None when absent or null); a 400 naming the field (``path``: where body sits, for a nested one)
    unless it is of ``types`` (a bool only where bool is one of them)."""
    v = body.get(name)
    if v is not None and (not isinstance(v, types) or (isinstance(v, bool) and bool not in _as_tuple(types))):
        path = path or name
        raise ConversionError(f"{path}={v!r} is invalid: must be {what}", path)
    return v


def bool_field(body: dict, key: str, default: bool = False, path: Optional[str] = None) -> bool:
    """A boolean field of a request body (absent or null: the default); anything but a bool is a 400."""
    v = _type_check(body, key, bool, "true or false", path)
    return default if v is None else v


def stream_flags(body: dict) -> tuple:
    """(stream, include_usage) of a request; stream_options must be an object when given."""
    stream, opts = bool_field(body, "stream"), _type_check(body, "stream_options", dict, "an object")
    return stream, stream and bool_field(opts or {}, "include_usage", path="stream_options.include_usage")


def _as_tuple(t):
    return t if isinstance(t, tuple) else (t,)


NUM = (int, float)


@attrs.define
class Limits:
    max_model_len: int
    max_tokens_limit: int
    defaults: dict = attrs.field(factory=dict)  # the checkpoint's sampling defaults


def sampling_params(body: dict, prompt_len: int, limits: Limits, *, max_tokens_keys=("max_tokens",),
                    default_max_tokens: Optional[int] = None, stop_key: str = "stop", logprobs=None,
                    structured=None, skip_special_tokens: Optional[bool] = None,
                    max_temperature: float = 2.0) -> SamplingParams:
    """SamplingParams of one request; ConversionError / ValueError name the field that is wrong. temperature is
    held to the protocol's range (OpenAI's [0, 2], Anthropic's [0, 1])."""
    kw = dict(limits.defaults)
    for name, types, what in (("temperature", NUM, "a number"), ("top_p", NUM, "a number"), ("min_p", NUM, "a number"),
                              ("presence_penalty", NUM, "a number"), ("frequency_penalty", NUM, "a number"),
                              ("repetition_penalty", NUM, "a number"), ("top_k", int, "an integer"),
                              ("seed", int, "an integer"), ("n", int, "an integer"), ("min_tokens", int, "an integer"),
                              ("ignore_eos", bool, "a boolean"), ("skip_special_tokens", bool, "a boolean"),
                              ("include_stop_str_in_output", bool, "a boolean")):
        v = _type_check(body, name, types, what)
        if v is not None:
            kw[name] = v
    t = body.get("temperature")
    if t is not None and not 0 <= t <= max_temperature:
        raise ConversionError(f"temperature={t!r} is invalid: must be in [0, {max_temperature:g}]", "temperature")
    max_tokens = None
    for key in max_tokens_keys:
        v = _type_check(body, key, int, "an integer >= 1")
        if v is not None:
            if v < 1:
                raise ConversionError(f"{key}={v} is invalid: must be >= 1", key)
            if v > limits.max_tokens_limit:
                raise ConversionError(f"{key}={v} is more than this server allows (--max-tokens-limit "
                                      f"{limits.max_tokens_limit})", key)
            max_tokens = v
            break
    room = limits.max_model_len - prompt_len
    if max_tokens is None:
        max_tokens = default_max_tokens if default_max_tokens is not None else min(room, limits.max_tokens_limit)
        max_tokens = max(1, min(max_tokens, room))
    elif max_tokens > room:
        raise ConversionError(f"this model's context is {limits.max_model_len} tokens; the prompt has {prompt_len} "
                              f"and {max_tokens_keys[0]}={max_tokens} asks for {max_tokens} more. Lower "
                              f"{max_tokens_keys[0]} or shorten the prompt", max_tokens_keys[0])
    kw["max_tokens"] = max_tokens
    stop = body.get(stop_key)
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise ConversionError(f"{stop_key} must be a string or a list of strings", stop_key)
        kw["stop"] = [s for s in stop if s]
    ids = body.get("stop_token_ids")
    if ids is not None:
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ConversionError("stop_token_ids must be a list of integers", "stop_token_ids")
        kw["stop_token_ids"] = ids
    bias = body.get("logit_bias")
    if bias:
        if not isinstance(bias, dict):
            raise ConversionError("logit_bias must be an object {token id: bias}", "logit_bias")
        try:
            kw["logit_bias"] = {int(k): float(v) for k, v in bias.items()}
        except (TypeError, ValueError):
            raise ConversionError("logit_bias keys must be token ids and values numbers", "logit_bias") from None
    if logprobs is not None:
        kw["logprobs"] = logprobs
    if skip_special_tokens is not None and "skip_special_tokens" not in body:
        kw["skip_special_tokens"] = skip_special_tokens
    so = body.get("structured_outputs")
    if so is not None:
        if structured is not None:
            raise ConversionError("give one of structured_outputs, response_format and a forced tool_choice",
                                  "structured_outputs")
        if not isinstance(so, dict):
            raise ConversionError("structured_outputs must be an object (vLLM's StructuredOutputsParams)",
                                  "structured_outputs")
        known = {f.name for f in attrs.fields(StructuredOutputsParams)}
        unknown = set(so) - known
        if unknown:
            raise ConversionError(f"structured_outputs has unknown field(s) {sorted(unknown)}; known: "
                                  f"{sorted(known)}", "structured_outputs")
        structured = StructuredOutputsParams(**so)
    if structured is not None:
        kw["structured_outputs"] = structured
    return SamplingParams(**kw)


def response_format(fmt, param: str = "response_format", compact: bool = False) -> Optional[StructuredOutputsParams]:
    """OpenAI's response_format (Chat Completions) or text.format (Responses) as structured outputs."""
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise ConversionError(f"{param} must be an object with a type", param)
    kind = fmt["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True, disable_any_whitespace=compact)
    if kind == "json_schema":
        spec = fmt.get("json_schema", fmt)  # Chat nests it; Responses puts schema beside type
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise ConversionError(f"{param}.json_schema.schema must be a JSON schema object", f"{param}.json_schema")
        return StructuredOutputsParams(json=schema, disable_any_whitespace=compact)
    raise ConversionError(f"{param}.type={kind!r} is invalid: expected text, json_object or json_schema",
                          f"{param}.type")


def tool_plan(tools: list, choice, tool_parser, param: str = "tool_choice") -> tuple:
    """(ToolPlan, forced StructuredOutputsParams or None) from the tools and the (normalised) tool choice:
    None/"auto", "none", "required", or a function name."""
    if not tools:
        if choice not in (None, "auto", "none"):
            raise ConversionError(f"{param} asks for a tool call but the request has no tools", param)
        return ToolPlan(), None
    if choice in (None, "auto"):
        return ToolPlan("auto", parser=tool_parser), None
    if choice == "none":
        return ToolPlan(), None
    by_name = {t.name: t for t in tools}
    if choice == "required":
        items = [{"type": "object", "properties": {"name": {"const": t.name}, "parameters": t.parameters},
                  "required": ["name", "parameters"]} for t in tools]
        schema = {"type": "array", "minItems": 1, "items": items[0] if len(items) == 1 else {"anyOf": items}}
        parser = JsonToolParser(name="forced", prefix="", separators=",", needs_special_tokens=False)
        return ToolPlan("required", parser=parser), StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    if choice not in by_name:
        raise ConversionError(f"{param} names function {choice!r}, which is not among the tools "
                              f"({', '.join(sorted(by_name))})", param)
    return (ToolPlan("named", named=choice, parser=NamedCallParser(choice)),
            StructuredOutputsParams(json=by_name[choice].parameters, disable_any_whitespace=True))


# --- OpenAI Chat Completions ---------------------------------------------------------------------------------

def openai_tools(tools, param: str = "tools", flat: bool = False) -> list:
    """Chat's [{type: function, function: {name, description, parameters}}]; Responses' flat variant."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ConversionError(f"{param} must be a list", param)
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            raise ConversionError(f"{param}[{i}] must be a tool of type 'function'", f"{param}[{i}]")
        fn = t if flat else t.get("function")
        if not isinstance(fn, dict):
            raise ConversionError(f"{param}[{i}].function must be an object", f"{param}[{i}].function")
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        check_tool(fn.get("name"), params, f"{param}[{i}]")
        out.append(Tool(fn["name"], fn.get("description") or "", params))
    return out


def openai_tool_choice(choice, param: str = "tool_choice"):
    if choice is None or choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict):
        fn = choice.get("function") if "function" in choice else choice  # Chat nests; Responses is flat
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            return fn["name"]
    raise ConversionError(f"{param}={choice!r} is invalid: expected 'auto', 'none', 'required' or "
                          "{type: function, function: {name}}", param)


def chat_conversation(body: dict) -> Conversation:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise ConversionError("messages must be a non-empty list", "messages")
    conv = Conversation(tools=openai_tools(body.get("tools")))
    for i, m in enumerate(msgs):
        p = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ConversionError(f"{p} must be an object", p)
        role = m.get("role")
        if role == "developer":
            role = "system"
        if role not in ("system", "user", "assistant", "tool"):
            raise ConversionError(f"{p}.role={role!r} is invalid: expected system, developer, user, assistant or tool",
                                  f"{p}.role")
        msg = Message(role, text_of(m.get("content"), f"{p}.content"))
        if role == "assistant":
            msg.reasoning = m.get("reasoning_content") or m.get("reasoning")
            if msg.reasoning is not None and not isinstance(msg.reasoning, str):
                raise ConversionError(f"{p}.reasoning_content={msg.reasoning!r} is invalid: must be a string",
                                      f"{p}.reasoning_content")
            for j, tc in enumerate(_type_check(m, "tool_calls", list, "a list", f"{p}.tool_calls") or []):
                fn = tc.get("function") if isinstance(tc, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise ConversionError(f"{p}.tool_calls[{j}] needs function.name", f"{p}.tool_calls[{j}]")
                args = fn.get("arguments", "{}")
                msg.tool_calls.append(ToolCall(tc.get("id") or new_call_id(), fn["name"],
                                               args if isinstance(args, str) else json.dumps(args)))
        if role == "tool":
            msg.tool_call_id = m.get("tool_call_id")
            if not isinstance(msg.tool_call_id, str):
                raise ConversionError(f"{p}.tool_call_id must be a string", f"{p}.tool_call_id")
        conv.messages.append(msg)
    conv.name_tool_results()
    return conv


# --- OpenAI Responses ----------------------------------------------------------------------------------------

def responses_conversation(body: dict) -> Conversation:
    conv = Conversation(tools=openai_tools(body.get("tools"), flat=True))
    if body.get("instructions"):
        if not isinstance(body["instructions"], str):
            raise ConversionError("instructions must be a string", "instructions")
        conv.messages.append(Message("system", body["instructions"]))
    inp = body.get("input")
    if isinstance(inp, str):
        conv.messages.append(Message("user", inp))
        return conv
    if not isinstance(inp, list) or not inp:
        raise ConversionError("input must be a string or a non-empty list of items", "input")
    for i, item in enumerate(inp):
        p = f"input[{i}]"
        if not isinstance(item, dict):
            raise ConversionError(f"{p} must be an object", p)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            role = "system" if role == "developer" else role
            if role not in ("system", "user", "assistant"):
                raise ConversionError(f"{p}.role={role!r} is invalid", f"{p}.role")
            conv.messages.append(Message(role, text_of(item.get("content"), f"{p}.content")))
        elif kind == "function_call":
            call = ToolCall(item.get("call_id") or new_call_id(), item.get("name"), item.get("arguments") or "{}")
            if not isinstance(call.name, str):
                raise ConversionError(f"{p}.name must be a string", f"{p}.name")
            last = conv.messages[-1] if conv.messages else None
            if last is None or last.role != "assistant" or (last.content and last.tool_calls is None):
                last = Message("assistant", "")
                conv.messages.append(last)
            last.tool_calls.append(call)
        elif kind == "function_call_output":
            out = item.get("output")
            conv.messages.append(Message("tool", out if isinstance(out, str) else text_of(out, f"{p}.output"),
                                         tool_call_id=item.get("call_id")))
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            if not isinstance(parts, list) or not all(isinstance(c, dict) and isinstance(c.get("text", ""), str)
                                                      for c in parts):
                raise ConversionError(f"{p}.content must be a list of {{\"text\": string}} parts", f"{p}.content")
            text = "".join(c.get("text", "") for c in parts)
            conv.messages.append(Message("assistant", "", reasoning=text))
        else:
            raise ConversionError(f"{p}.type={kind!r} is not supported: message, function_call, "
                                  "function_call_output or reasoning", f"{p}.type")
    _merge_assistant(conv)
    conv.name_tool_results()
    return conv


def _merge_assistant(conv: Conversation) -> None:
    """Consecutive assistant items (reasoning, text, calls) are one assistant turn."""
    out = []
    for m in conv.messages:
        prev = out[-1] if out else None
        if prev is not None and prev.role == "assistant" and m.role == "assistant" and not prev.tool_calls:
            prev.content = prev.content + m.content
            prev.reasoning = prev.reasoning or m.reasoning
            prev.tool_calls.extend(m.tool_calls)
        else:
            out.append(m)
    conv.messages = out


# --- Anthropic Messages --------------------------------------------------------------------------------------

def anthropic_tools(tools) -> list:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ConversionError("tools must be a list", "tools")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict):
            raise ConversionError(f"tools[{i}] must be an object", f"tools[{i}]")
        schema = t.get("input_schema") or {"type": "object", "properties": {}}
        check_tool(t.get("name"), schema, f"tools[{i}]")
        out.append(Tool(t["name"], t.get("description") or "", schema))
    return out


def anthropic_tool_choice(choice):
    if choice is None:
        return None
    if not isinstance(choice, dict) or choice.get("type") not in ("auto", "any", "tool", "none"):
        raise ConversionError(f"tool_choice={choice!r} is invalid: expected {{type: auto | any | tool | none}}",
                              "tool_choice")
    kind = choice["type"]
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise ConversionError("tool_choice of type 'tool' needs a name", "tool_choice.name")
        return choice["name"]
    return {"any": "required"}.get(kind, kind)


def anthropic_conversation(body: dict) -> Conversation:
    conv = Conversation(tools=anthropic_tools(body.get("tools")))
    system = body.get("system")
    if system:
        conv.messages.append(Message("system", text_of(system, "system")))
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise ConversionError("messages must be a non-empty list", "messages")
    for i, m in enumerate(msgs):
        p = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise ConversionError(f"{p}.role must be 'user' or 'assistant'", f"{p}.role")
        content = m.get("content")
        if isinstance(content, str):
            conv.messages.append(Message(m["role"], content))
            continue
        if not isinstance(content, list):
            raise ConversionError(f"{p}.content must be a string or a list of blocks", f"{p}.content")
        msg = Message(m["role"], "")
        texts = []
        for j, block in enumerate(content):
            q = f"{p}.content[{j}]"
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text":
                texts.append(_type_check(block, "text", str, "a string", f"{q}.text") or "")
            elif kind == "thinking" and m["role"] == "assistant":
                msg.reasoning = (msg.reasoning or "") + (_type_check(block, "thinking", str, "a string",
                                                                     f"{q}.thinking") or "")
            elif kind == "redacted_thinking":
                continue
            elif kind == "tool_use" and m["role"] == "assistant":
                if not isinstance(block.get("name"), str):
                    raise ConversionError(f"{q}.name must be a string", f"{q}.name")
                msg.tool_calls.append(ToolCall(block.get("id") or new_call_id("toolu_"), block["name"],
                                               json.dumps(block.get("input") or {})))
            elif kind == "tool_result" and m["role"] == "user":
                result = block.get("content")
                text = result if isinstance(result, str) else text_of(result, f"{q}.content")
                if texts or msg.content:
                    conv.messages.append(Message("user", "\n".join(texts)))
                    texts = []
                conv.messages.append(Message("tool", text, tool_call_id=block.get("tool_use_id")))
            else:
                raise ConversionError(f"{q}.type={kind!r} is not supported in a {m['role']} message (text, "
                                      "thinking, tool_use, tool_result)", f"{q}.type")
        msg.content = "\n".join(texts)
        if msg.content or msg.tool_calls or msg.reasoning or not any(x.role == "tool" for x in conv.messages[-1:]):
            if msg.role == "user" and not msg.content and conv.messages and conv.messages[-1].role == "tool":
                continue
            conv.messages.append(msg)
    conv.name_tool_results()
    return conv


# --- errors ----------------------------------------------------------------------------------------------------

_FIELD = re.compile(r"^(?:\w+Error: )?(?:SamplingParams|StructuredOutputsParams)\.(\w+)")


def param_of(message: str) -> Optional[str]:
    """The field a SamplingParams / StructuredOutputsParams error names."""
    m = _FIELD.match(message)
    return m.group(1) if m else None


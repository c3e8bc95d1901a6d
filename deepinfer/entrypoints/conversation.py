"""The one conversation format that Chat Completions, Responses and Anthropic Messages convert into and back.

A Conversation is a list of Messages (system, user, assistant, tool) and the tool definitions. Multi-part
content is joined to text (text parts only: an image part is refused with a 400 naming it); an assistant
message may carry reasoning and tool calls; a tool message carries the id of the call it answers. Tool-call
arguments are kept as JSON text, as the protocols send them.

Prompts are rendered by the checkpoint's chat template (jinja2, from tokenizer_config.json or
chat_template.jinja). ``DEFAULT_TEMPLATE`` (ChatML with Qwen3-style tools, ``<tool_call>`` and ``<think>``) is
used when the checkpoint has none, and when its template cannot express tools (it never mentions them) while
the request has tools or tool calls: the bundled demo model's ChatML template is such a one. For a plain
conversation DEFAULT_TEMPLATE renders what that ChatML template renders, and the ``demo`` parsers read the
format it asks for.

A final assistant message is a prefill (Anthropic's convention; Chat Completions' ``continue_final_message``):
the conversation before it is rendered with the generation prompt and its text is appended.
"""

from __future__ import annotations

import json
import uuid
from typing import Optional

import attrs


class ConversionError(ValueError):
    """A request that does not convert: names the field (``param``) and what is wrong."""

    def __init__(self, message: str, param: Optional[str] = None):
        super().__init__(message)
        self.param = param


def new_call_id(prefix: str = "call_") -> str:
    return prefix + uuid.uuid4().hex[:24]


@attrs.frozen
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of the arguments object


@attrs.frozen
class Tool:
    name: str
    description: str = ""
    parameters: dict = attrs.field(factory=lambda: {"type": "object", "properties": {}})

    def to_template(self) -> dict:
        """The OpenAI-style function entry chat templates iterate over (``tools``)."""
        fn = {"name": self.name, "description": self.description, "parameters": self.parameters}
        return {"type": "function", "function": fn}


@attrs.define
class Message:
    role: str  # system | user | assistant | tool
    content: str = ""
    reasoning: Optional[str] = None
    tool_calls: list = attrs.field(factory=list)  # [ToolCall], assistant only
    tool_call_id: Optional[str] = None  # tool only
    name: Optional[str] = None  # tool: the function answered

    def to_template(self) -> dict:
        d: dict = {"role": self.role, "content": self.content}
        if self.reasoning:
            d["reasoning_content"] = self.reasoning
        if self.tool_calls:
            d["tool_calls"] = [{"id": c.id, "type": "function",
                                "function": {"name": c.name, "arguments": _args_value(c.arguments)}}
                               for c in self.tool_calls]
        if self.tool_call_id is not None:
            d["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            d["name"] = self.name
        return d


def _args_value(text: str):
    """Arguments as templates expect them: the parsed object (templates apply tojson), else the text."""
    try:
        v = json.loads(text)
    except (TypeError, ValueError):
        return text
    return v if isinstance(v, dict) else text


@attrs.define
class Conversation:
    messages: list = attrs.field(factory=list)
    tools: list = attrs.field(factory=list)  # [Tool]

    @property
    def uses_tools(self) -> bool:
        return bool(self.tools) or any(m.tool_calls or m.role == "tool" for m in self.messages)

    def name_tool_results(self) -> None:
        """Give each tool message the name of the function whose call it answers (Anthropic's tool_result and
        Responses' function_call_output carry only the call's id; templates may print the name)."""
        names = {c.id: c.name for m in self.messages for c in m.tool_calls}
        for m in self.messages:
            if m.role == "tool" and m.name is None:
                m.name = names.get(m.tool_call_id)


def text_of(content, param: str, text_types=("text", "input_text", "output_text")) -> str:
    """Content as text: a string, or a list of parts whose text parts are joined (newline between parts)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ConversionError(f"{param} must be a string or a list of content parts, got {type(content).__name__}",
                              param)
    out = []
    for i, part in enumerate(content):
        if isinstance(part, str):
            out.append(part)
            continue
        if not isinstance(part, dict):
            raise ConversionError(f"{param}[{i}] must be a content part object", f"{param}[{i}]")
        kind = part.get("type")
        if kind in text_types:
            if not isinstance(part.get("text"), str):
                raise ConversionError(f"{param}[{i}].text must be a string", f"{param}[{i}].text")
            out.append(part["text"])
        else:
            raise ConversionError(f"{param}[{i}] has type {kind!r}; this server reads text content only "
                                  f"({', '.join(text_types)})", f"{param}[{i}].type")
    return "\n".join(out)


def check_tool(name, parameters, param: str) -> None:
    if not isinstance(name, str) or not name:
        raise ConversionError(f"{param}: a tool needs a non-empty string name", param)
    if not isinstance(parameters, dict):
        raise ConversionError(f"{param}: tool {name!r} parameters must be a JSON schema object", param)


# --- rendering --------------------------------------------------------------------------------------------------

DEFAULT_TEMPLATE = (
    "{{ bos_token if bos_token is defined else '' }}"
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages and messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n'"
    " + 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments '"
    " + 'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, '"
    " + '\"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' %}"
    "{%- if not (tools and loop.first) %}{{- '<|im_start|>system\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if message.reasoning_content %}{{- '<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' }}{%- endif %}"
    "{{- message.content }}"
    "{%- for tc in message.tool_calls or [] %}"
    "{%- if message.content or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + tc.function.name + '\", \"arguments\": ' }}"
    "{%- if tc.function.arguments is string %}{{- tc.function.arguments }}"
    "{%- else %}{{- tc.function.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def template_for(tokenizer, conv: Conversation, override: Optional[str] = None) -> Optional[str]:
    """The template source to pass to apply_chat_template (None: the checkpoint's own)."""
    if override is not None:
        return override
    own = tokenizer.chat_template
    if own is None and not getattr(tokenizer, "_chat_templates", None):
        return DEFAULT_TEMPLATE
    if conv.uses_tools and own is not None and "tool" not in own:
        return DEFAULT_TEMPLATE  # the checkpoint's template would drop the tools and the calls
    return None


def render(tokenizer, conv: Conversation, override: Optional[str] = None, template_kwargs: Optional[dict] = None
           ) -> str:
    """The prompt text of a conversation, ready for the assistant's turn (or continuing a final assistant
    message)."""
    msgs = list(conv.messages)
    prefill = ""
    if msgs and msgs[-1].role == "assistant" and not msgs[-1].tool_calls:
        prefill = msgs.pop().content
    source = template_for(tokenizer, conv, override)
    kw = dict(template_kwargs or {})
    if source is not None:
        kw["chat_template"] = source
    tools = [t.to_template() for t in conv.tools] or None
    try:
        text = tokenizer.apply_chat_template([m.to_template() for m in msgs], tokenize=False,
                                             add_generation_prompt=True, tools=tools, **kw)
    except ValueError:
        raise
    except Exception as exc:  # a template's raise_exception, or a template bug: the request fails alone
        raise ConversionError(f"the chat template could not render this conversation: {type(exc).__name__}: "
                              f"{exc}", "messages") from None
    return text + prefill

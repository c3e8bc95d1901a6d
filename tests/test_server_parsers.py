"""Output parsers and the conversation format, without a server: a streamed parse, fed the text in any split,
adds up to the parse of the whole text (so every protocol's incremental tool calls assemble to the final ones),
and each protocol converts a conversation to the same rendered prompt."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer.entrypoints.conversation import DEFAULT_TEMPLATE, ConversionError, render
from deepinfer.entrypoints.parsers import (DeepSeekV3ToolParser, JsonToolParser, StreamDiffer, TagToolParser,
                                           ThinkReasoningParser, parse_output)
from deepinfer.entrypoints.protocols import (anthropic_conversation, chat_conversation, responses_conversation,
                                             tool_plan)

ARGS = st.dictionaries(st.sampled_from(["city", "n", "flag", "nested", "q"]),
                       st.one_of(st.integers(-5, 500), st.booleans(), st.text("ab\"{}\\ ,é", max_size=6),
                                 st.lists(st.integers(0, 3), max_size=3)), max_size=4)
CALLS = st.lists(st.tuples(st.sampled_from(["get_weather", "f", "lookup_x"]), ARGS), min_size=0, max_size=3)
TEXT = st.text("abc <>/{}\n", max_size=12)


def qwen_text(content, calls, reasoning):
    body = "".join(f'<tool_call>\n{{"name": "{n}", "arguments": {json.dumps(a)}}}\n</tool_call>' for n, a in calls)
    think = f"<think>{reasoning}</think>\n" if reasoning is not None else ""
    return think + content + body


def deepseek_text(content, calls, reasoning):
    if not calls:
        return content
    inner = "".join(f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{n}\n```json\n{json.dumps(a)}\n```<｜tool▁call▁end｜>"
                    for n, a in calls)
    return content + "<｜tool▁calls▁begin｜>" + inner + "<｜tool▁calls▁end｜>"


def llama_text(content, calls, reasoning):
    if not calls:
        return content.lstrip("{[ <") or "hello"
    return "<|python_tag|>" + "; ".join(json.dumps({"name": n, "parameters": a}) for n, a in calls)


FORMATS = {
    "qwen3": (lambda: TagToolParser(), lambda: ThinkReasoningParser(), qwen_text),
    "deepseek_v3": (DeepSeekV3ToolParser, lambda: None, deepseek_text),
    "llama3_json": (JsonToolParser, lambda: None, llama_text),
}


def stream_in_pieces(text, cuts, tool, reasoning):
    d = StreamDiffer(tool, reasoning)
    events, prev = [], 0
    for c in sorted(set(cuts)) + [len(text)]:
        if c <= prev and c != len(text):
            continue
        events += d.update(text[:c], final=c == len(text))
        prev = c
    return events


@settings(max_examples=60, deadline=None)
@given(fmt=st.sampled_from(sorted(FORMATS)), content=TEXT, calls=CALLS,
       reasoning=st.one_of(st.none(), st.text("xyz <>\n", max_size=8)), data=st.data())
def test_streamed_deltas_add_up_to_the_whole_parse(fmt, content, calls, reasoning, data):
    make_tool, make_reasoning, write = FORMATS[fmt]
    text = write(content, calls, reasoning)
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=8), label="cuts")
    tool, rp = make_tool(), make_reasoning()
    whole = parse_output(text, tool, rp, final=True)
    assert [(c.name, json.loads(c.arguments)) for c in whole.calls] == [(n, a) for n, a in calls]
    events = stream_in_pieces(text, cuts, tool, rp)
    got_content = "".join(e[1] for e in events if e[0] == "content")
    got_reasoning = "".join(e[1] for e in events if e[0] == "reasoning")
    assert got_content == whole.content and got_reasoning == whole.reasoning
    names = [e[2] for e in events if e[0] == "tool_start"]
    args = ["".join(e[2] for e in events if e[0] == "tool_args" and e[1] == i) for i in range(len(names))]
    assert names == [n for n, _ in calls]
    assert [json.loads(a) for a in args] == [a for _, a in calls]
    assert sorted(e[1] for e in events if e[0] == "tool_end") == list(range(len(calls)))


def test_qwen_content_around_calls_and_an_unfinished_tag():
    p = TagToolParser()
    assert parse_output("a <tool_ca", p, final=False).content == "a "  # may still become a tag: held back
    assert parse_output("a <tool_ca", p, final=True).content == "a <tool_ca"
    out = parse_output('x<tool_call>{"name": "f", "arguments": {}}</tool_call>y', p)
    assert out.content == "xy" and out.calls[0].name == "f" and out.calls[0].complete


def test_deepseek_v31_format_is_read():
    text = "hi<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get<｜tool▁sep｜>{\"a\": 1}<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
    out = parse_output(text, DeepSeekV3ToolParser())
    assert out.content == "hi" and [(c.name, c.arguments) for c in out.calls] == [("get", '{"a": 1}')]


def test_reasoning_opened_by_the_template_is_closed_by_the_model():
    out = parse_output("step 1</think>\n\nanswer", None, ThinkReasoningParser())
    assert (out.reasoning, out.content) == ("step 1", "answer")


def test_forced_required_plan_schema_and_parser():
    from deepinfer.entrypoints.conversation import Tool

    tools = [Tool("a", "", {"type": "object", "properties": {"x": {"type": "integer"}}}), Tool("b")]
    plan, so = tool_plan(tools, "required", None)
    schema = json.loads(so.key[1])
    assert schema["minItems"] == 1 and len(schema["items"]["anyOf"]) == 2
    out = parse_output('[{"name": "a", "parameters": {"x": 3}}, {"name": "b", "parameters": {}}]', plan.parser)
    assert [(c.name, c.arguments) for c in out.calls] == [("a", '{"x": 3}'), ("b", "{}")]
    with pytest.raises(ConversionError, match="not among the tools"):
        tool_plan(tools, "c", None)
    with pytest.raises(ConversionError, match="no tools"):
        tool_plan([], "required", None)


# One conversation in the three protocols: the same Conversation, so the same prompt.
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
ARGS_JSON = '{"city": "Paris"}'


def _three():
    chat = {"messages": [{"role": "system", "content": "be brief"},
                         {"role": "user", "content": [{"type": "text", "text": "weather"}, {"type": "text", "text": "now"}]},
                         {"role": "assistant", "content": None, "tool_calls": [
                             {"id": "c1", "type": "function", "function": {"name": "get", "arguments": ARGS_JSON}}]},
                         {"role": "tool", "tool_call_id": "c1", "content": "sunny"}],
            "tools": [{"type": "function", "function": {"name": "get", "description": "d", "parameters": SCHEMA}}]}
    responses = {"instructions": "be brief",
                 "input": [{"role": "user", "content": [{"type": "input_text", "text": "weather"},
                                                        {"type": "input_text", "text": "now"}]},
                           {"type": "function_call", "call_id": "c1", "name": "get", "arguments": ARGS_JSON},
                           {"type": "function_call_output", "call_id": "c1", "output": "sunny"}],
                 "tools": [{"type": "function", "name": "get", "description": "d", "parameters": SCHEMA}]}
    anthropic = {"system": "be brief",
                 "messages": [{"role": "user", "content": [{"type": "text", "text": "weather"},
                                                           {"type": "text", "text": "now"}]},
                              {"role": "assistant", "content": [{"type": "tool_use", "id": "c1", "name": "get",
                                                                 "input": {"city": "Paris"}}]},
                              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1",
                                                            "content": "sunny"}]}],
                 "tools": [{"name": "get", "description": "d", "input_schema": SCHEMA}]}
    return chat_conversation(chat), responses_conversation(responses), anthropic_conversation(anthropic)


def test_three_protocols_convert_to_one_conversation_and_one_prompt():
    from deepinfer.models.loader import resolve_model_path
    from deepinfer.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(resolve_model_path(None))
    convs = _three()
    assert convs[0] == convs[1] == convs[2]
    prompts = {render(tok, c) for c in convs}
    assert len(prompts) == 1
    (prompt,) = prompts
    # The demo's ChatML template knows no tools: the default template renders them, the call and its result.
    assert "<tools>" in prompt and '"name": "get", "arguments": {"city": "Paris"}' in prompt
    assert "<tool_response>\nsunny\n</tool_response>" in prompt and "weather\nnow" in prompt
    plain = chat_conversation({"messages": [{"role": "user", "content": "hi"}]})
    assert render(tok, plain) == tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                                         add_generation_prompt=True)
    assert render(tok, plain, DEFAULT_TEMPLATE) == render(tok, plain)


@pytest.mark.parametrize("body, match", [
    ({"messages": []}, "non-empty"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "role='wizard'"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "text content only"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "tool_call_id"),
])
def test_chat_conversion_errors_name_the_field(body, match):
    with pytest.raises(ConversionError, match=match) as info:
        chat_conversation(body)
    assert info.value.param and info.value.param.startswith("messages")


# Generated conversations, written in each protocol, convert to one Conversation.
WORDS = st.text("abc xyz\n", min_size=1, max_size=8)


@st.composite
def exchanges(draw):
    """(system or None, tools, rounds): a round is (user text parts, assistant text, [(call id, name, args)])."""
    names = draw(st.lists(st.sampled_from(["get", "put", "find"]), min_size=1, max_size=2, unique=True))
    rounds = []
    for r in range(draw(st.integers(1, 3))):
        parts = draw(st.lists(WORDS, min_size=1, max_size=2))
        calls = [(f"c{r}_{k}", draw(st.sampled_from(names)), draw(ARGS)) for k in range(draw(st.integers(0, 2)))]
        text = draw(WORDS) if not calls else draw(st.sampled_from(["", "let me check"]))
        rounds.append((parts, text, calls))
    return draw(st.one_of(st.none(), WORDS)), names, rounds


def as_chat(system, names, rounds):
    msgs = [{"role": "system", "content": system}] if system else []
    for parts, text, calls in rounds:
        msgs.append({"role": "user", "content": [{"type": "text", "text": p} for p in parts]})
        msgs.append({"role": "assistant", "content": text or None, "tool_calls": [
            {"id": i, "type": "function", "function": {"name": n, "arguments": json.dumps(a)}} for i, n, a in calls]})
        msgs += [{"role": "tool", "tool_call_id": i, "content": f"result {i}"} for i, _, _ in calls]
    msgs.append({"role": "user", "content": "next"})
    return {"messages": msgs, "tools": [{"type": "function", "function": {"name": n, "parameters": SCHEMA}}
                                        for n in names]}


def as_responses(system, names, rounds):
    items = []
    for parts, text, calls in rounds:
        items.append({"role": "user", "content": [{"type": "input_text", "text": p} for p in parts]})
        if text:
            items.append({"role": "assistant", "content": [{"type": "output_text", "text": text}]})
        items += [{"type": "function_call", "call_id": i, "name": n, "arguments": json.dumps(a)} for i, n, a in calls]
        items += [{"type": "function_call_output", "call_id": i, "output": f"result {i}"} for i, _, _ in calls]
    items.append({"role": "user", "content": "next"})
    body = {"input": items, "tools": [{"type": "function", "name": n, "parameters": SCHEMA} for n in names]}
    return {**body, "instructions": system} if system else body


def as_anthropic(system, names, rounds):
    msgs, results = [], []
    for parts, text, calls in rounds:
        msgs.append({"role": "user", "content": results + [{"type": "text", "text": p} for p in parts]})
        blocks = ([{"type": "text", "text": text}] if text else []) + [
            {"type": "tool_use", "id": i, "name": n, "input": a} for i, n, a in calls]
        msgs.append({"role": "assistant", "content": blocks})
        results = [{"type": "tool_result", "tool_use_id": i, "content": f"result {i}"} for i, _, _ in calls]
    msgs.append({"role": "user", "content": results + [{"type": "text", "text": "next"}]})
    body = {"messages": msgs, "tools": [{"name": n, "input_schema": SCHEMA} for n in names]}
    return {**body, "system": system} if system else body


@settings(max_examples=40, deadline=None)
@given(exchanges())
def test_generated_conversations_convert_alike_from_every_protocol(ex):
    chat, resp, ant = (chat_conversation(as_chat(*ex)), responses_conversation(as_responses(*ex)),
                       anthropic_conversation(as_anthropic(*ex)))
    assert chat == resp == ant
    system, _, rounds = ex
    assert len(chat.messages) == (system is not None) + sum(2 + len(c) for _, _, c in rounds) + 1
    assert [m.name for m in chat.messages if m.role == "tool"] == [n for _, _, c in rounds for _, n, _ in c]

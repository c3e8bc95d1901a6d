"""deepinfer serve, driven by the official openai and anthropic clients against a server in a subprocess (as
vLLM's tests do): every endpoint streaming and not, n > 1, logprobs, stop, seeds, structured outputs, tool calls
round-tripped through each protocol (forced by the constrain stage, so valid with the demo model), the bad
inputs, and a load test of 200 streams with a fifth of the clients leaving early. One server for the module."""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
httpx = pytest.importorskip("httpx")
jsonschema = pytest.importorskip("jsonschema")

KEY = "test-key"
MODEL = "demo"
REPO = Path(__file__).resolve().parents[1]


def start_server(*extra, timeout=120.0):
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "DEEPINFER_NUM_THREADS": "1"}
    # DEEPINFER_TEST_SERVE_FLAGS: more flags for every server here (e.g. "--engine-process on": the whole file
    # against the engine in its own process, which CI's CPU runs do not choose by default).
    cmd = [sys.executable, "-m", "deepinfer.cli", "serve", "--port", "0", "--api-key", KEY, "--max-tokens-limit",
           "3000", "--max-body-bytes", "200000", "--num-kv-blocks", "256", "--disable-any-whitespace", *extra,
           *os.environ.get("DEEPINFER_TEST_SERVE_FLAGS", "").split()]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, env=env, text=True)
    proc.log = []  # every stderr line, read by a thread so the pipe never fills and blocks the server
    threading.Thread(target=lambda: proc.log.extend(iter(proc.stderr.readline, "")), daemon=True).start()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = re.search(r"on (http://[\d.]+:\d+) \(ready\)", "".join(proc.log))
        if m:
            return proc, m.group(1)
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError("server did not start:\n" + "".join(proc.log))


SERVER: dict = {}  # the module's server process (the last test shuts it down)


@pytest.fixture(scope="module")
def server():
    proc, url = start_server("--timeout-graceful-shutdown", "2")
    SERVER["proc"] = proc
    yield url
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        assert proc.wait(30) in (0, -signal.SIGTERM)
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def ant(server):
    return anthropic.Anthropic(base_url=server, api_key=KEY, max_retries=0)


def metrics(server) -> dict:
    text = httpx.get(server + "/metrics").text
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def gauge(server, name):
    return metrics(server)[f'deepinfer_{name}{{model_name="{MODEL}"}}']


GREEDY = {"temperature": 0.0}
AGREEDY = {"extra_body": {"temperature": 0.0}}  # this anthropic client has no temperature argument
HI = [{"role": "user", "content": "def f():"}]


# --- utility routes ------------------------------------------------------------------------------------------

def test_models_health_version_tokenize(server, oai):
    assert [m.id for m in oai.models.list().data] == [MODEL]
    assert httpx.get(server + "/health").json() == {"status": "ok"}
    assert gauge(server, "spec_decode_acceptance_rate") == 0 and gauge(server, "kv_blocks_total") == 256
    assert httpx.get(server + "/version").json()["version"]
    h = {"Authorization": f"Bearer {KEY}"}
    tok = httpx.post(server + "/tokenize", json={"prompt": "def f():"}, headers=h).json()
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == 4096
    back = httpx.post(server + "/detokenize", json={"tokens": tok["tokens"]}, headers=h).json()
    assert back["prompt"].endswith("def f():")
    bad = httpx.post(server + "/detokenize", json={"tokens": [10**9]}, headers=h)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


# --- completions ---------------------------------------------------------------------------------------------

def test_completions_plain_stream_n_logprobs_stop(oai):
    r = oai.completions.create(model=MODEL, prompt="def f():", max_tokens=6, **GREEDY)
    text = r.choices[0].text
    assert r.usage.completion_tokens == 6 and r.choices[0].finish_reason == "length"
    chunks = list(oai.completions.create(model=MODEL, prompt="def f():", max_tokens=6, stream=True,
                                         stream_options={"include_usage": True}, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text  # greedy: the same tokens
    assert chunks[-1].usage.completion_tokens == 6
    r = oai.completions.create(model=MODEL, prompt=["a = 1", "import os"], n=2, max_tokens=3, logprobs=2, seed=5)
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3] and r.usage.completion_tokens == 12
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 3 and all(len(t) <= 2 for t in lp.top_logprobs)
    assert all(x <= 0 for x in lp.token_logprobs)
    stop = text[2:4]
    r = oai.completions.create(model=MODEL, prompt="def f():", max_tokens=6, stop=[stop], **GREEDY)
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == text[:text.index(stop)]


def test_seed_reproducibility(oai):
    kw = dict(model=MODEL, messages=HI, max_tokens=8, temperature=1.0)
    a = oai.chat.completions.create(seed=123, **kw).choices[0].message.content
    b = oai.chat.completions.create(seed=123, **kw).choices[0].message.content
    others = {oai.chat.completions.create(seed=s, **kw).choices[0].message.content for s in (1, 2, 3)}
    assert a == b and len(others | {a}) > 1


# --- chat completions ----------------------------------------------------------------------------------------

def test_chat_plain_stream_n_logprobs(oai):
    r = oai.chat.completions.create(model=MODEL, messages=HI, max_completion_tokens=6, **GREEDY)
    msg = r.choices[0].message
    assert msg.role == "assistant" and r.usage.completion_tokens == 6 and r.usage.prompt_tokens > 3
    chunks = list(oai.chat.completions.create(model=MODEL, messages=HI, max_tokens=6, stream=True,
                                              stream_options={"include_usage": True}, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == msg.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.total_tokens == r.usage.total_tokens
    r = oai.chat.completions.create(model=MODEL, messages=HI, n=3, max_tokens=4, logprobs=True, top_logprobs=3,
                                    seed=7)
    assert [c.index for c in r.choices] == [0, 1, 2] and r.usage.completion_tokens == 12
    for c in r.choices:
        assert len(c.logprobs.content) == 4
        for entry in c.logprobs.content:
            assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
            assert entry.top_logprobs[0].logprob >= entry.logprob - 1e-5
    streamed = list(oai.chat.completions.create(model=MODEL, messages=HI, n=2, max_tokens=3, stream=True, seed=7,
                                                logprobs=True))
    per = {0: 0, 1: 0}
    for c in streamed:
        for ch in c.choices:
            per[ch.index] += len(ch.logprobs.content) if ch.logprobs else 0
    assert per == {0: 3, 1: 3}


def test_chat_structured_outputs(oai):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                                 "maximum": 99}},
              "required": ["ok", "n"], "additionalProperties": False}
    r = oai.chat.completions.create(model=MODEL, messages=HI, max_tokens=40, **GREEDY,
                                    response_format={"type": "json_schema",
                                                     "json_schema": {"name": "x", "schema": schema}})
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    r = oai.chat.completions.create(model=MODEL, messages=HI, max_tokens=10,
                                    extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert r.choices[0].message.content in ("yes", "no")
    r = oai.completions.create(model=MODEL, prompt="x", max_tokens=10,
                               extra_body={"structured_outputs": {"regex": "[0-9]{3}"}})
    assert re.fullmatch("[0-9]{3}", r.choices[0].text)


# --- tools, through each protocol ----------------------------------------------------------------------------

PARAMS = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 7}},
          "required": ["city", "days"], "additionalProperties": False}
OAI_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather", "parameters": PARAMS}},
             {"type": "function", "function": {"name": "get_time", "description": "time",
                                               "parameters": {"type": "object", "properties": {}}}}]
ASK = "What is the weather in Paris?"


def test_chat_tool_calls_forced_streamed_and_round_tripped(oai, server):
    r = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": ASK}], tools=OAI_TOOLS,
                                    tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                    max_tokens=40, **GREEDY)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and r.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments), PARAMS)
    # Streaming: the deltas assemble to the same call (greedy).
    args, names = "", []
    for ch in oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": ASK}], tools=OAI_TOOLS,
                                          tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                          max_tokens=40, stream=True, **GREEDY):
        for tc in (ch.choices[0].delta.tool_calls or []) if ch.choices else []:
            names += [tc.function.name] if tc.function.name else []
            args += tc.function.arguments or ""
    assert names == ["get_weather"] and json.loads(args) == json.loads(call.function.arguments)
    r = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": ASK}], tools=OAI_TOOLS,
                                    tool_choice="required", max_tokens=60, **GREEDY)
    calls = r.choices[0].message.tool_calls
    assert calls and all(c.function.name in ("get_weather", "get_time") for c in calls)
    for c in calls:
        if c.function.name == "get_weather":
            jsonschema.validate(json.loads(c.function.arguments), PARAMS)
    # Round trip: the call and its result go back; the prompt holds both.
    history = [{"role": "user", "content": ASK},
               {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21C"}]
    r = oai.chat.completions.create(model=MODEL, messages=history, tools=OAI_TOOLS, max_tokens=4, **GREEDY)
    assert r.choices[0].message.content is not None
    tok = httpx.post(server + "/tokenize", json={"messages": history, "tools": OAI_TOOLS, "return_token_strs": True},
                     headers={"x-api-key": KEY}).json()
    prompt = "".join(tok["token_strs"])
    assert "sunny, 21C" in prompt and call.function.arguments in prompt and tok["count"] == r.usage.prompt_tokens


def test_anthropic_and_responses_round_trip_to_the_same_prompt(oai, ant):
    """The same exchange through each protocol: the forced call validates, and sending it back with its result
    renders the same prompt (equal prompt token counts) as Chat Completions does."""
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in OAI_TOOLS]
    m = ant.messages.create(model=MODEL, max_tokens=40, messages=[{"role": "user", "content": ASK}], tools=tools,
                            tool_choice={"type": "tool", "name": "get_weather"}, **AGREEDY)
    (use,) = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and use.name == "get_weather"
    jsonschema.validate(use.input, PARAMS)
    with ant.messages.stream(model=MODEL, max_tokens=40, messages=[{"role": "user", "content": ASK}], tools=tools,
                             tool_choice={"type": "any"}, **AGREEDY) as s:
        final = s.get_final_message()
    assert final.stop_reason == "tool_use" and all(b.type == "tool_use" for b in final.content)
    args = json.dumps(use.input)
    a_hist = [{"role": "user", "content": ASK},
              {"role": "assistant", "content": [{"type": "tool_use", "id": use.id, "name": use.name,
                                                 "input": use.input}]},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}]}]
    n_ant = ant.messages.count_tokens(model=MODEL, messages=a_hist, tools=tools).input_tokens
    m2 = ant.messages.create(model=MODEL, max_tokens=3, messages=a_hist, tools=tools, **AGREEDY)
    assert m2.usage.input_tokens + m2.usage.cache_read_input_tokens == n_ant
    c_hist = [{"role": "user", "content": ASK},
              {"role": "assistant", "content": None, "tool_calls": [
                  {"id": use.id, "type": "function", "function": {"name": use.name, "arguments": args}}]},
              {"role": "tool", "tool_call_id": use.id, "content": "sunny"}]
    r = oai.chat.completions.create(model=MODEL, messages=c_hist, tools=OAI_TOOLS, max_tokens=3, **GREEDY)
    flat = [{"type": "function", **t["function"]} for t in OAI_TOOLS]
    resp = oai.responses.create(model=MODEL, input=[{"role": "user", "content": ASK},
                                                    {"type": "function_call", "call_id": use.id, "name": use.name,
                                                     "arguments": args},
                                                    {"type": "function_call_output", "call_id": use.id,
                                                     "output": "sunny"}], tools=flat, max_output_tokens=3,
                                temperature=0.0)
    assert r.usage.prompt_tokens == n_ant == resp.usage.input_tokens
    forced = oai.responses.create(model=MODEL, input=ASK, tools=flat, max_output_tokens=40, temperature=0.0,
                                  tool_choice={"type": "function", "name": "get_weather"})
    (fc,) = [o for o in forced.output if o.type == "function_call"]
    jsonschema.validate(json.loads(fc.arguments), PARAMS)


# --- responses and messages, streaming and not ---------------------------------------------------------------

def test_responses_create_and_stream(oai):
    r = oai.responses.create(model=MODEL, input="def f():", instructions="code", max_output_tokens=6,
                             temperature=0.0)
    assert r.status == "incomplete" and r.usage.output_tokens == 6 and r.output_text
    types, text = [], ""
    with oai.responses.create(model=MODEL, input="def f():", instructions="code", max_output_tokens=6,
                              temperature=0.0, stream=True) as s:
        for ev in s:
            types.append(ev.type)
            if ev.type == "response.output_text.delta":
                text += ev.delta
            last = ev
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.incomplete"
    assert "response.output_item.added" in types and "response.output_text.done" in types
    assert text == r.output_text == last.response.output_text


def test_messages_create_stream_stop_sequences(ant):
    m = ant.messages.create(model=MODEL, max_tokens=6, system="code", messages=HI, **AGREEDY)
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 6 and m.content[0].type == "text"
    with ant.messages.stream(model=MODEL, max_tokens=6, system="code", messages=HI, **AGREEDY) as s:
        streamed = "".join(s.text_stream)
        final = s.get_final_message()
    assert streamed == m.content[0].text == final.content[0].text and final.usage.output_tokens == 6
    stop = m.content[0].text[1:3]
    m2 = ant.messages.create(model=MODEL, max_tokens=6, system="code", messages=HI, **AGREEDY,
                             stop_sequences=[stop])
    assert m2.stop_reason == "stop_sequence" and m2.stop_sequence == stop
    # A final assistant message is a prefill: the reply continues it.
    m3 = ant.messages.create(model=MODEL, max_tokens=3, messages=HI + [{"role": "assistant", "content": "    return"}],
                             **AGREEDY)
    assert m3.usage.input_tokens + m3.usage.cache_read_input_tokens > \
        ant.messages.count_tokens(model=MODEL, messages=HI).input_tokens


# --- bad inputs: 4xx in each protocol's shape, and the server keeps serving -----------------------------------

def _post(server, path, body, key=KEY, raw=None):
    headers = {"x-api-key": key} if key else {}
    if raw is not None:
        return httpx.post(server + path, content=raw, headers={**headers, "content-type": "application/json"})
    return httpx.post(server + path, json=body, headers=headers)


@pytest.mark.parametrize("path, body, status, param", [
    ("/v1/chat/completions", {"model": "nope", "messages": HI}, 404, "model"),
    ("/v1/chat/completions", {"model": MODEL, "messages": HI, "temperature": -1}, 400, "temperature"),
    ("/v1/chat/completions", {"model": MODEL, "messages": HI, "top_p": "high"}, 400, "top_p"),
    ("/v1/chat/completions", {"model": MODEL, "messages": HI, "max_tokens": 100000}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x " * 5000}, 400, "prompt"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x " * 5000}]}, 400,
     "messages"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 4,
                         "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "wat"}}}},
     400, None),
    ("/v1/chat/completions", {"model": MODEL, "messages": HI, "tool_choice": "required"}, 400, "tool_choice"),
    ("/v1/responses", {"model": MODEL, "input": 5}, 400, "input"),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 2, 10**6]}, 400, "prompt"),
    ("/v1/messages", {"model": MODEL, "max_tokens": 4, "messages": HI, "n": 2}, 400, None),
    # Wrong inner types are the request's fault (400 naming the field), not the server's (500).
    ("/v1/chat/completions", {"model": MODEL, "messages": HI + [{"role": "assistant", "content": "",
                                                                  "tool_calls": 5}] + HI}, 400,
     "messages[1].tool_calls"),
    ("/v1/responses", {"model": MODEL, "input": [{"type": "reasoning", "content": [{"text": 5}]},
                                                 {"role": "user", "content": "hi"}]}, 400, "input[0].content"),
    ("/v1/messages", {"model": MODEL, "max_tokens": 4, "messages": [
        {"role": "user", "content": [{"type": "text", "text": 5}]}]}, 400, "messages[0].content[0].text"),
    ("/v1/messages/count_tokens", {"model": MODEL, "messages": [
        {"role": "user", "content": [{"type": "text", "text": 5}]}]}, 400, "messages[0].content[0].text"),
    ("/v1/completions", {"model": MODEL, "prompt": ""}, 400, "prompt"),
    # A template is code the server runs: a request cannot bring its own.
    ("/v1/chat/completions", {"model": MODEL, "messages": HI,
                              "chat_template_kwargs": {"chat_template": "{{ 'x' * 9 }}"}}, 400,
     "chat_template_kwargs.chat_template"),
    ("/v1/chat/completions", {"model": MODEL, "messages": HI, "chat_template_kwargs": 5}, 400,
     "chat_template_kwargs"),
    ("/v1/chat/completions", {"model": MODEL, "messages": HI, "stream": "true"}, 400, "stream"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stream": True, "stream_options": 5}, 400,
     "stream_options"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stream": True,
                         "stream_options": {"include_usage": "yes"}}, 400, "stream_options.include_usage"),
    ("/tokenize", {"model": MODEL, "prompt": "x", "add_special_tokens": "no"}, 400, "add_special_tokens"),
    ("/v1/messages", {"model": MODEL, "max_tokens": 4, "messages": HI, "stop_sequences": 5}, 400,
     "stop_sequences"),
    ("/v1/chat/completions", {"model": MODEL, "messages": HI, "max_tokens": 4,
                              "structured_outputs": {"regex": "[^\\s\\S]"}}, 400, None),
])
def test_bad_requests_openai_shape(server, path, body, status, param):
    r = _post(server, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    if path.startswith("/v1/messages"):  # Anthropic's shape: no param field, the message names it
        assert r.json()["type"] == "error" and err["type"] and (param is None or param in err["message"])
    else:
        assert err["message"] and err["type"] and (param is None or err["param"] == param)


def test_bad_requests_anthropic_shape_and_auth(server, ant):
    for body, status, kind in [({"model": MODEL, "messages": HI}, 400, "invalid_request_error"),
                               ({"model": "nope", "max_tokens": 4, "messages": HI}, 404, "not_found_error"),
                               ({"model": MODEL, "max_tokens": 4, "messages": HI, "temperature": 9}, 400,
                                "invalid_request_error")]:
        r = _post(server, "/v1/messages", body)
        assert r.status_code == status and r.json()["type"] == "error" and r.json()["error"]["type"] == kind
    r = _post(server, "/v1/messages", None, raw=b"{not json")
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = _post(server, "/v1/chat/completions", None, raw=b"[1, 2")
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    # top_k past int64 keeps every token (it once overflowed the sampler's tensors and failed the whole step).
    r = _post(server, "/v1/chat/completions", {"model": MODEL, "messages": HI, "top_k": 2**63, "max_tokens": 4})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length", r.text
    r = _post(server, "/v1/chat/completions", None, raw=b"[" * 50000 + b"]" * 50000)
    assert r.status_code == 400 and "nested too deeply" in r.json()["error"]["message"]
    r = _post(server, "/v1/messages", {"model": MODEL, "max_tokens": 4, "messages": HI}, key="wrong")
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = _post(server, "/v1/chat/completions", {"model": MODEL, "messages": HI}, key=None)
    assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
    with pytest.raises(anthropic.NotFoundError):
        ant.messages.create(model="nope", max_tokens=4, messages=HI)
    r = _post(server, "/v1/completions", {"model": MODEL, "prompt": "x" * 300000})
    assert r.status_code == 413 and "200000" in r.json()["error"]["message"]
    assert httpx.get(server + "/health").status_code == 200  # still serving
    m = metrics(server)
    assert m[f'deepinfer_request_errors_total{{kind="unknown_model",model_name="{MODEL}"}}'] >= 1


def test_bad_requests_amid_good_ones_fail_alone(server):
    """Bad requests sent at the same time as good ones get their 4xx; every good one completes in full."""
    bad_bodies = [
        ("/v1/chat/completions", {"model": MODEL, "messages": HI, "max_tokens": 4,
                                  "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "x"}}}}),
        ("/v1/completions", {"model": MODEL, "prompt": "x " * 5000}),
        ("/v1/messages", {"model": "nope", "max_tokens": 4, "messages": HI}),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "stop": 5}),
    ]

    async def main():
        async with httpx.AsyncClient(base_url=server, timeout=120, headers={"x-api-key": KEY}) as c:
            good = [c.post("/v1/completions", json={"model": MODEL, "prompt": f"v{i} =", "max_tokens": 3 + i % 3,
                                                    "ignore_eos": True, "stream": i % 2 == 0})
                    for i in range(12)]
            bad = [c.post(path, json=body) for path, body in bad_bodies * 2]
            return await asyncio.gather(*good), await asyncio.gather(*bad)

    good, bad = asyncio.run(main())
    assert all(r.status_code in (400, 404) for r in bad)
    for i, r in enumerate(good):
        assert r.status_code == 200
        if i % 2:
            assert r.json()["usage"]["completion_tokens"] == 3 + i % 3
        else:
            assert r.text.rstrip().endswith("data: [DONE]") and '"finish_reason": "length"' in r.text


# --- load: 200 streams, a fifth of the clients leave early ----------------------------------------------------

def test_200_streams_with_disconnects_complete_and_free_every_block(server):
    rng = random.Random(0)
    n, leave = 200, set(random.Random(1).sample(range(200), 40))

    async def one(client, i):
        want = 3000 if i in leave else 3 + i % 4  # those that leave would run for a minute if not aborted
        body = {"model": MODEL, "prompt": f"x{i} = ", "max_tokens": want, "stream": True, "ignore_eos": True,
                "stream_options": {"include_usage": True}, "temperature": 0.5}
        got = 0
        async with client.stream("POST", "/v1/completions", json=body, headers={"x-api-key": KEY}) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if i in leave and rng.random() < 0.3:
                    return None  # disconnect mid-stream
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):
                        got = chunk["usage"]["completion_tokens"]
        return want, got

    async def main():
        limits = httpx.Limits(max_connections=250, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=server, limits=limits, timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(n)))

    results = asyncio.run(main())
    finished = [r for r in results if r is not None]
    assert len(finished) == n - len(leave) and all(results[i] is None for i in leave)
    assert all(want == got for want, got in finished)
    deadline = time.monotonic() + 10  # an aborted request leaves at the next step
    while time.monotonic() < deadline and (gauge(server, "num_requests_running") or gauge(server, "kv_blocks_free")
                                           != gauge(server, "kv_blocks_total")):
        time.sleep(0.2)
    assert gauge(server, "num_requests_running") == 0 and gauge(server, "num_requests_waiting") == 0
    assert gauge(server, "kv_blocks_free") == gauge(server, "kv_blocks_total") == 256
    m = metrics(server)
    assert m[f'deepinfer_time_to_first_token_seconds_count{{model_name="{MODEL}"}}'] >= len(finished)


def test_a_non_streaming_client_that_leaves_aborts_its_request(server):
    body = {"model": MODEL, "messages": HI, "max_tokens": 3000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server + "/v1/chat/completions", json=body, headers={"x-api-key": KEY}, timeout=1.5)
    deadline = time.monotonic() + 10  # 3000 tokens would take a minute: only the abort ends it this soon
    while time.monotonic() < deadline and gauge(server, "num_requests_running"):
        time.sleep(0.1)
    assert gauge(server, "num_requests_running") == 0
    assert gauge(server, "kv_blocks_free") == gauge(server, "kv_blocks_total")


# --- deepinfer bench serve, against this server ----------------------------------------------------------------

def test_bench_serve_replays_the_workload_and_reports_it(server, tmp_path):
    from deepinfer.bench_serving import draw_lengths
    from deepinfer.entrypoints.bench_client import bench_serve, cost_per_million

    out = tmp_path / "rows.jsonl"
    row = bench_serve(server + "/v1", None, num_prompts=6, request_rate=20.0, input_len_range=(4, 12),
                      output_len_range=(2, 5), seed=3, api_key=KEY, gpu_hour_cost=2.0, warmups=0, out=str(out),
                      echo=lambda *a: None)
    assert row["model"] == MODEL and row["completed"] == 6 and row["failed"] == 0
    assert row["output_tokens"] == sum(draw_lengths(6, 2, 5, 3, "output"))  # ignore_eos: exactly what was asked
    assert row["ttft_p50_s"] <= row["ttft_p95_s"] <= row["ttft_p99_s"] <= row["e2e_p99_s"]
    assert row["cost_per_million_output_tokens"] == pytest.approx(2.0 * 1e6 / (row["output_tok_s"] * 3600))
    assert json.loads(out.read_text().splitlines()[-1])["num_prompts"] == 6
    assert cost_per_million(3.0, 1000.0) == pytest.approx(3.0 * 1e6 / 3.6e6) and cost_per_million(None, 5) is None
    bad = bench_serve(server + "/v1", MODEL, num_prompts=2, input_len=4, output_len=2, api_key="wrong", warmups=0,
                      echo=lambda *a: None)
    assert bad["failed"] == 2 and "401" in bad["first_error"]


def test_serve_command_line_checks_its_flags_before_loading(capsys):
    from deepinfer.cli import main

    assert main(["serve", "--max-body-bytes", "0"]) == 2
    assert "--max-body-bytes=0 is invalid" in capsys.readouterr().err
    assert main(["serve", "a", "--model", "b"]) == 2
    assert "give the model once" in capsys.readouterr().err
    assert main(["bench", "serve", "--num-prompts", "0"]) == 2
    assert main(["serve", "--help"]) == 0
    helptext = capsys.readouterr().out
    for flag in ("--max-num-seqs", "--enable-prefix-caching", "--api-key", "--host", "--recipe", "--tool-call-parser"):
        assert flag in helptext


# --- reasoning and auto tool calls, read by the demo model's parsers ------------------------------------------

# The demo model never writes these tags by itself: a regex (the constrain stage) makes it write the demo format,
# so the parsers, streamed and not, run end to end through each protocol.
FORMAT = r'<think>[a-z]{1,6}</think>\nok<tool_call>\n\{"name": "get_time", "arguments": \{\}\}\n</tool_call>'
SO = {"structured_outputs": {"regex": FORMAT, "jump_forward": True}}  # the fixed text needs no model step


def test_reasoning_and_auto_tool_calls_parsed_in_every_protocol(oai, ant):
    msgs = [{"role": "user", "content": "time?"}]
    r = oai.chat.completions.create(model=MODEL, messages=msgs, tools=OAI_TOOLS, max_tokens=150, extra_body=SO,
                                    **GREEDY)
    m = r.choices[0].message
    thought = m.model_extra["reasoning_content"]
    assert re.fullmatch("[a-z]{1,6}", thought) and m.content == "ok" and r.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in m.tool_calls] == [("get_time", {})]
    parts = {"reasoning": "", "content": "", "args": "", "names": []}
    for ch in oai.chat.completions.create(model=MODEL, messages=msgs, tools=OAI_TOOLS, max_tokens=150, stream=True,
                                          extra_body=SO, **GREEDY):
        d = ch.choices[0].delta if ch.choices else None
        if d is None:
            continue
        parts["reasoning"] += (d.model_extra or {}).get("reasoning_content") or ""
        parts["content"] += d.content or ""
        for tc in d.tool_calls or []:
            parts["names"] += [tc.function.name] if tc.function.name else []
            parts["args"] += tc.function.arguments or ""
    assert (parts["reasoning"], parts["content"], parts["names"]) == (thought, "ok", ["get_time"])
    assert json.loads(parts["args"]) == {}
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in OAI_TOOLS]  # the same prompt as Chat's
    a = ant.messages.create(model=MODEL, max_tokens=150, messages=msgs, tools=tools, extra_body={**SO, "temperature": 0})
    assert [b.type for b in a.content] == ["thinking", "text", "tool_use"] and a.stop_reason == "tool_use"
    assert (a.content[0].thinking, a.content[1].text, a.content[2].name) == (thought, "ok", "get_time")
    with ant.messages.stream(model=MODEL, max_tokens=150, messages=msgs, tools=tools,
                             extra_body={**SO, "temperature": 0}) as s:
        final = s.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text", "tool_use"] and final.content[2].input == {}
    flat = [{"type": "function", **t["function"]} for t in OAI_TOOLS]
    resp = oai.responses.create(model=MODEL, input="time?", tools=flat, max_output_tokens=150, temperature=0.0,
                                extra_body=SO)
    assert [o.type for o in resp.output] == ["reasoning", "message", "function_call"]
    assert resp.output_text == "ok" and resp.output[2].name == "get_time"
    with oai.responses.create(model=MODEL, input="time?", tools=flat, max_output_tokens=150, temperature=0.0,
                              extra_body=SO, stream=True) as s:
        events = list(s)
    assert [e.item.type for e in events if e.type == "response.output_item.done"] == [
        "reasoning", "message", "function_call"]
    assert "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta") == "{}"


# --- last: shutting down with a stream in flight ---------------------------------------------------------------

def test_graceful_shutdown_ends_an_in_flight_stream(server):
    """SIGTERM while a long stream runs: uvicorn stops accepting, gives in-flight requests
    --timeout-graceful-shutdown (2 s here), cancels the rest (which aborts them in the engine), then the engine
    thread stops and the process exits with the signal."""
    proc = SERVER["proc"]
    body = {"model": MODEL, "prompt": "x", "max_tokens": 3000, "ignore_eos": True, "stream": True}
    got = []

    def stream():
        try:
            with httpx.stream("POST", server + "/v1/completions", json=body, headers={"x-api-key": KEY},
                              timeout=60) as r:
                for line in r.iter_lines():
                    got.append(line)
        except httpx.HTTPError as exc:  # the connection closed under the stream
            got.append(f"closed: {type(exc).__name__}")

    t = threading.Thread(target=stream)
    t.start()
    deadline = time.monotonic() + 20
    while len(got) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) in (0, -signal.SIGTERM)
    t.join(10)
    assert not t.is_alive() and time.monotonic() - t0 < 15  # 3000 tokens would take a minute
    assert len(got) >= 3 and "data: [DONE]" not in got  # cut short, not finished
    time.sleep(0.2)
    assert "deepinfer serve: stopped" in "".join(proc.log)

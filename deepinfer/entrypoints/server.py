"""The HTTP server: OpenAI Completions, Chat Completions and Responses, Anthropic Messages, and the utility
routes, over one AsyncLLM (``deepinfer serve``; ``build_app`` for use from Python).

Every request is converted into a Conversation (conversation.py) or a plain prompt, rendered by the chat
template, tokenized here (so its length is checked before it reaches the engine) and run by AsyncLLM. Errors
come back in the protocol's own shape: OpenAI's ``{"error": {message, type, param, code}}`` and Anthropic's
``{"type": "error", "error": {type, message}}``, as JSON or as an SSE event once a stream has started. A
request that fails never disturbs the others: the engine fails it alone.

Client disconnects abort the request (its KV blocks are freed): a streaming response is cancelled by
Starlette when the client goes away, and a non-streaming one races the generation against the disconnect.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
import uuid
from typing import Optional

import attrs
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from .. import __version__
from .async_llm import AsyncLLM
from .conversation import Conversation, ConversionError, new_call_id, render
from .metrics import RequestTimer, ServerMetrics
from .parsers import StreamDiffer, _partial_tag_len, choose_parser, parse_output
from .protocols import (Limits, ToolPlan, anthropic_conversation, anthropic_tool_choice, chat_conversation,
                        openai_tool_choice, param_of, response_format, responses_conversation, sampling_params,
                        tool_plan)

log = logging.getLogger(__name__)

ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 413: "request_too_large", 500: "api_error", 503: "overloaded_error"}
OPENAI_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                413: "invalid_request_error", 500: "server_error", 503: "server_error"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 kind: str = "bad_request"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind


@attrs.define
class ServerSettings:
    model_name: str
    api_key: Optional[str] = None
    max_body_bytes: int = 4 * 2**20
    max_tokens_limit: Optional[int] = None  # None: the context length
    tool_parser: Optional[str] = None  # None: the model family's; "none": no parser
    reasoning_parser: Optional[str] = None
    chat_template: Optional[str] = None  # a template source, overriding the checkpoint's
    model_aliases: tuple = ()
    json_compact: bool = False  # response_format JSON without free whitespace (--disable-any-whitespace)


def _openai_error(e: ApiError) -> dict:
    return {"error": {"message": e.message, "type": OPENAI_TYPES.get(e.status, "invalid_request_error"),
                      "param": e.param, "code": e.code or e.status}}


def _anthropic_error(e: ApiError) -> dict:
    return {"type": "error", "error": {"type": ANTHROPIC_TYPES.get(e.status, "api_error"), "message": e.message}}


def _is_anthropic(path: str) -> bool:
    return path.startswith("/v1/messages")


def sse(data, event: Optional[str] = None) -> str:
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return (f"event: {event}\n" if event else "") + f"data: {text}\n\n"


def _finish(c) -> str:
    return {"stop": "stop", "length": "length", "abort": "abort", "error": "error"}.get(c.finish_reason or "", "stop")


def _token_str(tokenizer, tid: int, lp) -> str:
    s = lp.decoded_token if lp is not None and lp.decoded_token is not None else None
    return s if s is not None else tokenizer.decode([tid], skip_special_tokens=False)


def _bytes(s: str) -> list:
    return list(s.encode("utf-8"))


def chat_logprobs(tokenizer, token_ids, entries, top: int) -> Optional[dict]:
    if entries is None:
        return None
    content = []
    for tid, d in zip(token_ids, entries):
        lp = d.get(tid)
        tok = _token_str(tokenizer, tid, lp)
        tops = sorted(d.items(), key=lambda kv: (kv[1].rank is None, kv[1].rank or 0))[:top]
        content.append({"token": tok, "logprob": lp.logprob if lp else None, "bytes": _bytes(tok),
                        "top_logprobs": [{"token": _token_str(tokenizer, t, v), "logprob": v.logprob,
                                          "bytes": _bytes(_token_str(tokenizer, t, v))} for t, v in tops]})
    return {"content": content}


def completion_logprobs(tokenizer, token_ids, entries, top: int, offset0: int = 0) -> Optional[dict]:
    if entries is None:
        return None
    tokens, lps, tops, offsets, off = [], [], [], [], offset0
    for tid, d in zip(token_ids, entries):
        lp = d.get(tid)
        tok = _token_str(tokenizer, tid, lp)
        tokens.append(tok)
        lps.append(lp.logprob if lp else None)
        best = sorted(d.items(), key=lambda kv: (kv[1].rank is None, kv[1].rank or 0))[:top]
        tops.append({_token_str(tokenizer, t, v): v.logprob for t, v in best})
        offsets.append(off)
        off += len(tok)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def _usage_openai(out_list) -> dict:
    prompt = sum(len(o.prompt_token_ids) for o in out_list)
    gen = sum(len(c.token_ids) for o in out_list for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in out_list)
    return {"prompt_tokens": prompt, "completion_tokens": gen, "total_tokens": prompt + gen,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _stop_hold(text: str, stops) -> str:
    """Text safe to send while streaming: a tail that may be the start of a stop string is held back."""
    if not stops:
        return text
    k = _partial_tag_len(text, stops)
    return text[:len(text) - k] if k else text


@attrs.define
class Prepared:
    prompt_ids: list
    prompt_text: Optional[str]
    params: object
    plan: ToolPlan
    reasoning: object


class Blocks:
    """Parse events of one choice -> output blocks in order (reasoning, text, tool calls), each opened, grown
    and closed: what Responses calls output items and Anthropic content blocks."""

    def __init__(self):
        self.index = -1
        self.open: Optional[str] = None  # kind of the open block
        self.call_block: dict = {}  # tool call index -> block index
        self.blocks: list = []  # [kind, meta, text]

    def feed(self, events) -> list:
        out = []
        for ev in events:
            kind = ev[0]
            if kind in ("reasoning", "content"):
                want = "reasoning" if kind == "reasoning" else "text"
                if self.open != want:
                    out += self._close()
                    out += self._open(want, {})
                self.blocks[self.index][2] += ev[1]
                out.append(("delta", self.index, want, ev[1]))
            elif kind == "tool_start":
                out += self._close()
                out += self._open("tool", {"name": ev[2], "id": new_call_id(), "call": ev[1]})
                self.call_block[ev[1]] = self.index
            elif kind == "tool_args":
                b = self.call_block[ev[1]]
                self.blocks[b][2] += ev[2]
                out.append(("delta", b, "tool", ev[2]))
            elif kind == "tool_end":
                if self.open == "tool" and self.call_block.get(ev[1]) == self.index:
                    out += self._close()
        return out

    def finish(self) -> list:
        return self._close()

    def _open(self, kind, meta) -> list:
        self.index += 1
        self.open = kind
        self.blocks.append([kind, meta, ""])
        return [("open", self.index, kind, meta)]

    def _close(self) -> list:
        if self.open is None:
            return []
        kind, self.open = self.open, None
        return [("close", self.index, kind)]


class Server:
    def __init__(self, engine: AsyncLLM, settings: ServerSettings, registry=None):
        from ..core.plugins import get_registry

        self.engine, self.settings = engine, settings
        self.tokenizer = engine.tokenizer
        registry = registry or get_registry()
        model_type = getattr(engine.llm, "hf_config", {}).get("model_type")
        self.tool_parser = choose_parser(registry, "tool", settings.tool_parser, model_type)
        self.reasoning_parser = choose_parser(registry, "reasoning", settings.reasoning_parser, model_type)
        self.limits = Limits(engine.max_model_len, settings.max_tokens_limit or engine.max_model_len,
                             dict(getattr(engine.llm, "generation_defaults", {})))
        self.metrics = ServerMetrics(engine, settings.model_name)
        self.created = int(time.time())
        self.draining = False

    # --- plumbing ------------------------------------------------------------------------------------------

    def error_response(self, path: str, e: ApiError) -> JSONResponse:
        self.metrics.error(e.kind)
        body = _anthropic_error(e) if _is_anthropic(path) else _openai_error(e)
        return JSONResponse(body, status_code=e.status)

    def check_auth(self, request: Request) -> None:
        key = self.settings.api_key
        if key is None:
            return
        got = request.headers.get("x-api-key")
        auth = request.headers.get("authorization", "")
        if auth.lower().startswith("bearer "):
            got = auth[7:].strip()
        if got is None or not secrets.compare_digest(got.encode(), key.encode()):
            raise ApiError(401, "invalid or missing API key (Authorization: Bearer KEY, or x-api-key: KEY)",
                           code="invalid_api_key", kind="auth")

    async def read_json(self, request: Request) -> dict:
        self.check_auth(request)
        limit = self.settings.max_body_bytes
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise ApiError(413, f"request body is {length} bytes; this server accepts at most {limit} "
                                f"(--max-body-bytes)", kind="too_large")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ApiError(413, f"request body is over {limit} bytes (--max-body-bytes)", kind="too_large")
            chunks.append(chunk)
        try:
            body = json.loads(b"".join(chunks) or b"null")
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ApiError(400, f"request body is not valid JSON: {exc}", kind="malformed") from None
        if not isinstance(body, dict):
            raise ApiError(400, "request body must be a JSON object", kind="malformed")
        return body

    def check_model(self, body: dict, required: bool = True) -> None:
        name = body.get("model")
        if name is None and not required:
            return
        if not isinstance(name, str):
            raise ApiError(400, "model is required: a string naming the served model "
                                f"({self.settings.model_name!r})", param="model", kind="bad_field")
        if name != self.settings.model_name and name not in self.settings.model_aliases:
            raise ApiError(404, f"the model {name!r} does not exist; this server serves {self.settings.model_name!r}",
                           param="model", code="model_not_found", kind="unknown_model")

    def encode_prompt(self, text: str, add_special_tokens: bool = True) -> list:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def check_prompt_len(self, n: int, param: str = "messages") -> None:
        if n + 1 > self.engine.max_model_len:
            raise ApiError(400, f"the prompt has {n} tokens; this model's context is {self.engine.max_model_len} "
                                f"tokens, which leaves no room for output (at most {self.engine.max_model_len - 1} "
                                "prompt tokens)", param=param, code="context_length_exceeded",
                           kind="prompt_too_long")

    def prepare_chat(self, conv: Conversation, body: dict, choice, structured, *, max_tokens_keys,
                     logprobs=None, max_temperature: float = 2.0) -> Prepared:
        plan, forced = tool_plan(conv.tools, choice, self.tool_parser)
        if forced is not None and structured is not None:
            raise ConversionError("a forced tool_choice cannot be combined with response_format", "tool_choice")
        kwargs = body.get("chat_template_kwargs") if isinstance(body.get("chat_template_kwargs"), dict) else None
        text = render(self.tokenizer, conv, self.settings.chat_template, kwargs)
        ids = self.encode_prompt(text, add_special_tokens=False)
        self.check_prompt_len(len(ids))
        special = False if plan.parser is not None and getattr(plan.parser, "needs_special_tokens", False) else None
        params = sampling_params(body, len(ids), self.limits, max_tokens_keys=max_tokens_keys, logprobs=logprobs,
                                 structured=structured if forced is None else forced, skip_special_tokens=special,
                                 max_temperature=max_temperature)
        return Prepared(ids, text, params, plan, self.reasoning_parser)

    async def run(self, request: Request, prep: Prepared, stream: bool):
        """Start the request; returns (first output, the iterator of the rest, timer). An error before any token
        (a bad schema, a failing admission) raises ApiError, so the client gets a 4xx instead of a stream."""
        agen = self.engine.generate({"prompt_token_ids": prep.prompt_ids, "prompt": prep.prompt_text}, prep.params,
                                    stream=stream)
        timer = RequestTimer(self.metrics)
        first = await _race_disconnect(request, agen.__anext__())
        timer.observe(first)
        if first.error and not any(c.token_ids for c in first.outputs):
            await agen.aclose()
            raise _engine_error(first.error)
        return first, agen, timer


def _engine_error(message: str) -> ApiError:
    """An engine failure as an HTTP error: a ValueError at admission is the request's fault (400)."""
    bad = message.startswith(("ValueError", "PluginError", "KeyError", "TypeError", "SchemaError")) \
        or "structured outputs: " in message  # a grammar that fails to compile (the constrain stage says so)
    return ApiError(400 if bad else 500, message, param=param_of(message),
                    kind="bad_request" if bad else "engine_error")


class _Disconnected(Exception):
    pass


async def _race_disconnect(request: Request, awaitable):
    """Await ``awaitable`` unless the client disconnects first (then cancel it, which aborts its request)."""
    task = asyncio.ensure_future(awaitable)

    async def watch():
        while True:
            msg = await request.receive()
            if msg["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watcher.cancel()
        raise
    if task in done:
        watcher.cancel()
        return task.result()
    task.cancel()
    try:
        await task
    except (asyncio.CancelledError, Exception):
        pass
    raise _Disconnected()


async def _drain(agen, first, timer, request=None):
    """The final output of a non-streaming request."""
    out = first
    if out.finished:
        return out

    async def rest():
        last = out
        async for o in agen:
            timer.observe(o)
            last = o
        return last

    return await (_race_disconnect(request, rest()) if request is not None else rest())


async def block_stream(first, agen, timer, prep: Prepared, endpoint: str):
    """One choice's outputs as block events: ("blocks", events, blocks), then ("done", out, blocks) or
    ("error", ApiError). Shared by the protocols that stream output items / content blocks."""
    blocks = Blocks()
    d = StreamDiffer(prep.plan.parser, prep.reasoning)
    stops = prep.params.stop
    out = first
    while True:
        if out.error:
            err = _engine_error(out.error)
            timer.m.error(err.kind)
            yield "error", err, blocks
            return
        c = out.outputs[0]
        final = bool(c.finish_reason)
        evs = blocks.feed(d.update(c.text if final else _stop_hold(c.text, stops), final=final))
        if final:
            evs += blocks.finish()
        if evs:
            yield "blocks", evs, blocks
        if out.finished:
            timer.finish(out, endpoint)
            yield "done", out, blocks
            return
        out = await agen.__anext__()
        timer.observe(out)


def build_app(engine: AsyncLLM, settings: ServerSettings, registry=None) -> FastAPI:
    srv = Server(engine, settings, registry)
    app = FastAPI(title="DeepInfer", version=__version__, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = srv

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        return srv.error_response(request.url.path, exc)

    @app.exception_handler(ConversionError)
    async def _conv_error(request: Request, exc: ConversionError):
        return srv.error_response(request.url.path, ApiError(400, str(exc), param=exc.param, kind="bad_field"))

    @app.exception_handler(ValueError)
    async def _value_error(request: Request, exc: ValueError):
        return srv.error_response(request.url.path, ApiError(400, str(exc), param=param_of(str(exc)),
                                                             kind="bad_field"))

    @app.exception_handler(_Disconnected)
    async def _gone(request: Request, exc):
        srv.metrics.error("client_disconnected")
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        log.exception("deepinfer: internal error serving %s", request.url.path)
        return srv.error_response(request.url.path, ApiError(500, f"internal error: {type(exc).__name__}: {exc}",
                                                             kind="internal"))

    # --- utility routes ----------------------------------------------------------------------------------

    @app.get("/health")
    async def health():
        if not engine.is_alive:
            return JSONResponse({"status": "engine not running"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics():
        return Response(srv.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models(request: Request):
        srv.check_auth(request)
        card = {"id": settings.model_name, "object": "model", "created": srv.created, "owned_by": "deepinfer",
                "root": str(getattr(engine.llm, "model_path", settings.model_name)),
                "max_model_len": engine.max_model_len}
        return {"object": "list", "data": [card]}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await srv.read_json(request)
        srv.check_model(body, required=False)
        if "messages" in body:
            conv = chat_conversation(body)
            text = render(srv.tokenizer, conv, settings.chat_template)
            ids = srv.encode_prompt(text, add_special_tokens=False)
        elif isinstance(body.get("prompt"), str):
            ids = srv.encode_prompt(body["prompt"], add_special_tokens=body.get("add_special_tokens", True) is True)
        else:
            raise ApiError(400, "tokenize needs prompt (a string) or messages", param="prompt", kind="bad_field")
        out = {"tokens": ids, "count": len(ids), "max_model_len": engine.max_model_len}
        if body.get("return_token_strs"):
            out["token_strs"] = [srv.tokenizer.decode([t], skip_special_tokens=False) for t in ids]
        return out

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = await srv.read_json(request)
        srv.check_model(body, required=False)
        toks = body.get("tokens")
        vocab = engine.engine.model.vocab_size
        if not isinstance(toks, list) or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab
                                                 for t in toks):
            raise ApiError(400, f"tokens must be a list of token ids in [0, {vocab})", param="tokens",
                           kind="bad_field")
        return {"prompt": srv.tokenizer.decode(toks, skip_special_tokens=False)}

    # --- /v1/completions -----------------------------------------------------------------------------------

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await srv.read_json(request)
        srv.check_model(body)
        for name in ("echo", "suffix"):
            if body.get(name):
                raise ApiError(400, f"{name} is not supported by this server", param=name, kind="bad_field")
        if body.get("best_of") not in (None, body.get("n", 1)):
            raise ApiError(400, "best_of other than n is not supported", param="best_of", kind="bad_field")
        prompts = body.get("prompt")
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(prompts, list) or not prompts:
            raise ApiError(400, "prompt must be a string, a list of strings, a list of token ids or a list of those",
                           param="prompt", kind="bad_field")
        lp = body.get("logprobs")
        if lp is not None and (not isinstance(lp, int) or isinstance(lp, bool) or lp < 0):
            raise ApiError(400, f"logprobs={lp!r} is invalid: must be an integer >= 0", param="logprobs",
                           kind="bad_field")
        structured = response_format(body.get("response_format"), compact=settings.json_compact)
        vocab = engine.engine.model.vocab_size
        preps = []
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                ids, text = srv.encode_prompt(p), p
            elif isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab
                                                   for t in p):
                ids, text = list(p), None
            else:
                raise ApiError(400, f"prompt[{i}] must be a string or a non-empty list of token ids in [0, {vocab})",
                               param="prompt", kind="bad_field")
            srv.check_prompt_len(len(ids), "prompt")
            params = sampling_params(body, len(ids), srv.limits, default_max_tokens=16, logprobs=lp,
                                     structured=structured)
            preps.append(Prepared(ids, text, params, ToolPlan(), None))
        stream = body.get("stream") is True
        include_usage = stream and isinstance(body.get("stream_options"), dict) and \
            body["stream_options"].get("include_usage") is True
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        started = [await srv.run(request, p, stream) for p in preps]
        n = preps[0].params.n

        def choice_index(i, c):
            return i * n + c.index

        if not stream:
            finals = [await _drain(agen, first, timer, request) for first, agen, timer in started]
            choices = []
            for i, out in enumerate(finals):
                if out.error:
                    raise _engine_error(out.error)
                started[i][2].finish(out, "completions")
                for c in out.outputs:
                    choices.append({"index": choice_index(i, c), "text": c.text, "finish_reason": _finish(c),
                                    "stop_reason": c.stop_reason if c.stop_reason is not None else None,
                                    "logprobs": completion_logprobs(srv.tokenizer, c.token_ids, c.logprobs, lp or 0)})
            return {"id": rid, "object": "text_completion", "created": created, "model": settings.model_name,
                    "choices": sorted(choices, key=lambda x: x["index"]), "usage": _usage_openai(finals)}

        stops = preps[0].params.stop

        async def events():
            sent: dict = {}
            finals: dict = {}
            try:
                async for i, out in _merge(started):
                    if out.error:
                        err = _engine_error(out.error)
                        srv.metrics.error(err.kind)
                        yield sse(_openai_error(err))
                        break
                    for c in out.outputs:
                        key = choice_index(i, c)
                        text, ntok = sent.get(key, ("", 0))
                        full = c.text if c.finish_reason else _stop_hold(c.text, stops)
                        delta = full[len(text):] if full.startswith(text) else ""
                        new_tok = c.token_ids[ntok:]
                        if not delta and not c.finish_reason and not new_tok:
                            continue
                        lps = completion_logprobs(srv.tokenizer, new_tok, (c.logprobs or [])[ntok:] if c.logprobs
                                                  else None, lp or 0, len(text))
                        sent[key] = (text + delta, len(c.token_ids))
                        yield sse({"id": rid, "object": "text_completion", "created": created,
                                   "model": settings.model_name,
                                   "choices": [{"index": key, "text": delta, "logprobs": lps,
                                                "finish_reason": _finish(c) if c.finish_reason else None}]})
                    if out.finished:
                        finals[i] = out
                        started[i][2].finish(out, "completions")
                if include_usage and len(finals) == len(started):
                    yield sse({"id": rid, "object": "text_completion", "created": created,
                               "model": settings.model_name, "choices": [],
                               "usage": _usage_openai(list(finals.values()))})
                yield sse("[DONE]")
            finally:
                for _, agen, _t in started:
                    await agen.aclose()

        return StreamingResponse(events(), media_type="text/event-stream")

    # --- /v1/chat/completions ------------------------------------------------------------------------------

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await srv.read_json(request)
        srv.check_model(body)
        conv = chat_conversation(body)
        lp = body.get("logprobs")
        top = body.get("top_logprobs")
        if lp is not None and not isinstance(lp, bool):
            raise ApiError(400, f"logprobs={lp!r} is invalid: must be a boolean", param="logprobs", kind="bad_field")
        if top is not None and (not isinstance(top, int) or isinstance(top, bool) or top < 0):
            raise ApiError(400, f"top_logprobs={top!r} is invalid: must be an integer >= 0", param="top_logprobs",
                           kind="bad_field")
        if top and not lp:
            raise ApiError(400, "top_logprobs needs logprobs=true", param="top_logprobs", kind="bad_field")
        structured = response_format(body.get("response_format"), compact=settings.json_compact)
        prep = srv.prepare_chat(conv, body, openai_tool_choice(body.get("tool_choice")), structured,
                                max_tokens_keys=("max_completion_tokens", "max_tokens"),
                                logprobs=(top or 0) if lp else None)
        stream = body.get("stream") is True
        include_usage = stream and isinstance(body.get("stream_options"), dict) and \
            body["stream_options"].get("include_usage") is True
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        first, agen, timer = await srv.run(request, prep, stream)
        top = top or 0

        if not stream:
            out = await _drain(agen, first, timer, request)
            if out.error:
                raise _engine_error(out.error)
            timer.finish(out, "chat")
            choices = []
            for c in out.outputs:
                parsed = parse_output(c.text, prep.plan.parser, prep.reasoning, final=True)
                calls = [k for k in parsed.calls if k.name is not None and (k.complete or prep.plan.mode == "auto")]
                msg = {"role": "assistant", "content": parsed.content if (parsed.content or not calls) else None}
                if parsed.reasoning:
                    msg["reasoning_content"] = parsed.reasoning
                if calls:
                    msg["tool_calls"] = [{"id": new_call_id(), "type": "function",
                                          "function": {"name": k.name, "arguments": k.arguments}} for k in calls]
                finish = "tool_calls" if calls and c.finish_reason == "stop" else _finish(c)
                choices.append({"index": c.index, "message": msg, "finish_reason": finish,
                                "stop_reason": c.stop_reason,
                                "logprobs": chat_logprobs(srv.tokenizer, c.token_ids, c.logprobs, top) if lp else None})
            return {"id": rid, "object": "chat.completion", "created": created, "model": settings.model_name,
                    "choices": choices, "usage": _usage_openai([out])}

        stops = prep.params.stop

        def chunk(choices, **extra):
            return sse({"id": rid, "object": "chat.completion.chunk", "created": created,
                        "model": settings.model_name, "choices": choices, **extra})

        async def events():
            differs = {}
            sent: dict = {}
            ids: dict = {}
            out = first
            try:
                for c in out.outputs:
                    yield chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                  "finish_reason": None}])
                while True:
                    if out.error:
                        err = _engine_error(out.error)
                        srv.metrics.error(err.kind)
                        yield chunk([], error=_openai_error(err)["error"])
                        break
                    for c in out.outputs:
                        d = differs.setdefault(c.index, StreamDiffer(prep.plan.parser, prep.reasoning))
                        text = c.text if c.finish_reason else _stop_hold(c.text, stops)
                        evs = d.update(text, final=bool(c.finish_reason))
                        ntok = sent.get(c.index, 0)
                        new_tok = c.token_ids[ntok:]
                        sent[c.index] = len(c.token_ids)
                        lps = chat_logprobs(srv.tokenizer, new_tok, (c.logprobs or [])[ntok:], top) \
                            if lp and c.logprobs else None
                        delta: dict = {}
                        for ev in evs:
                            if ev[0] == "content":
                                delta["content"] = delta.get("content", "") + ev[1]
                            elif ev[0] == "reasoning":
                                delta["reasoning_content"] = delta.get("reasoning_content", "") + ev[1]
                            elif ev[0] == "tool_start":
                                ids[(c.index, ev[1])] = new_call_id()
                                delta.setdefault("tool_calls", []).append(
                                    {"index": ev[1], "id": ids[(c.index, ev[1])], "type": "function",
                                     "function": {"name": ev[2], "arguments": ""}})
                            elif ev[0] == "tool_args":
                                delta.setdefault("tool_calls", []).append(
                                    {"index": ev[1], "function": {"arguments": ev[2]}})
                        if delta or lps:
                            yield chunk([{"index": c.index, "delta": delta, "logprobs": lps, "finish_reason": None}])
                        if c.finish_reason:
                            finish = "tool_calls" if d.started and c.finish_reason == "stop" else _finish(c)
                            yield chunk([{"index": c.index, "delta": {}, "logprobs": None, "finish_reason": finish,
                                          "stop_reason": c.stop_reason}])
                    if out.finished:
                        timer.finish(out, "chat")
                        if include_usage:
                            yield chunk([], usage=_usage_openai([out]))
                        break
                    out = await agen.__anext__()
                    timer.observe(out)
                yield sse("[DONE]")
            finally:
                await agen.aclose()

        return StreamingResponse(events(), media_type="text/event-stream")

    # --- /v1/responses -------------------------------------------------------------------------------------

    @app.post("/v1/responses")
    async def responses(request: Request):
        body = await srv.read_json(request)
        srv.check_model(body)
        if body.get("previous_response_id"):
            raise ApiError(400, "previous_response_id is not supported: this server stores no responses; send the "
                                "whole conversation in input", param="previous_response_id", kind="bad_field")
        conv = responses_conversation(body)
        text_cfg = body.get("text") if isinstance(body.get("text"), dict) else {}
        structured = response_format(text_cfg.get("format"), "text.format", compact=settings.json_compact)
        if body.get("n") not in (None, 1):
            raise ApiError(400, "n is not a Responses field", param="n", kind="bad_field")
        prep = srv.prepare_chat(conv, body, openai_tool_choice(body.get("tool_choice")), structured,
                                max_tokens_keys=("max_output_tokens",))
        stream = body.get("stream") is True
        rid, created = f"resp_{uuid.uuid4().hex}", int(time.time())
        first, agen, timer = await srv.run(request, prep, stream)

        def response_obj(status, output, out=None):
            usage = None
            if out is not None:
                u = _usage_openai([out])
                usage = {"input_tokens": u["prompt_tokens"], "output_tokens": u["completion_tokens"],
                         "total_tokens": u["total_tokens"],
                         "input_tokens_details": {"cached_tokens": u["prompt_tokens_details"]["cached_tokens"]},
                         "output_tokens_details": {"reasoning_tokens": 0}}
            c = out.outputs[0] if out is not None else None
            incomplete = {"reason": "max_output_tokens"} if c is not None and c.finish_reason == "length" else None
            return {"id": rid, "object": "response", "created_at": created, "model": settings.model_name,
                    "status": "incomplete" if incomplete else status, "incomplete_details": incomplete,
                    "output": output, "usage": usage, "error": None, "instructions": body.get("instructions"),
                    "metadata": body.get("metadata") or {}, "parallel_tool_calls": True,
                    "temperature": prep.params.temperature, "top_p": prep.params.top_p,
                    "max_output_tokens": body.get("max_output_tokens"),
                    "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools") or [],
                    "text": {"format": text_cfg.get("format") or {"type": "text"}}}

        def item_of(kind, meta, text, idx, done=True):
            status = "completed" if done else "in_progress"
            if kind == "reasoning":
                return {"type": "reasoning", "id": f"rs_{rid}_{idx}", "summary": [],
                        "content": [{"type": "reasoning_text", "text": text}], "status": status}
            if kind == "text":
                return {"type": "message", "id": f"msg_{rid}_{idx}", "role": "assistant", "status": status,
                        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
                        if done else []}
            return {"type": "function_call", "id": f"fc_{rid}_{idx}", "call_id": meta["id"], "name": meta["name"],
                    "arguments": text, "status": status}

        if not stream:
            out = await _drain(agen, first, timer, request)
            if out.error:
                raise _engine_error(out.error)
            timer.finish(out, "responses")
            c = out.outputs[0]
            blocks = Blocks()
            d = StreamDiffer(prep.plan.parser, prep.reasoning)
            blocks.feed(d.update(c.text, final=True))
            blocks.finish()
            return response_obj("completed", [item_of(k, m, t, i) for i, (k, m, t) in enumerate(blocks.blocks)], out)

        async def events():
            seq = 0

            def ev(kind, **data):
                nonlocal seq
                seq += 1
                return sse({"type": kind, "sequence_number": seq - 1, **data}, event=kind)

            try:
                yield ev("response.created", response=response_obj("in_progress", []))
                yield ev("response.in_progress", response=response_obj("in_progress", []))
                async for what, x, blocks in block_stream(first, agen, timer, prep, "responses"):
                    if what == "error":
                        yield ev("error", code=str(x.status), message=x.message, param=x.param)
                    elif what == "done":
                        items = [item_of(k, m, t, i) for i, (k, m, t) in enumerate(blocks.blocks)]
                        resp = response_obj("completed", items, x)
                        yield ev("response.incomplete" if resp["status"] == "incomplete" else "response.completed",
                                 response=resp)
                    for e in x if what == "blocks" else ():
                        i = e[1]
                        kind, meta, text = blocks.blocks[i]
                        item_id = item_of(kind, meta, "", i)["id"]
                        if e[0] == "open":
                            yield ev("response.output_item.added", output_index=i,
                                     item=item_of(kind, meta, "", i, done=False))
                            if kind == "text":
                                yield ev("response.content_part.added", item_id=item_id, output_index=i,
                                         content_index=0, part={"type": "output_text", "text": "", "annotations": []})
                        elif e[0] == "delta":
                            name = {"text": "response.output_text.delta", "reasoning": "response.reasoning_text.delta",
                                    "tool": "response.function_call_arguments.delta"}[kind]
                            extra = {"content_index": 0, "logprobs": []} if kind == "text" else \
                                {"content_index": 0} if kind == "reasoning" else {}
                            yield ev(name, item_id=item_id, output_index=i, delta=e[3], **extra)
                        else:
                            if kind == "text":
                                yield ev("response.output_text.done", item_id=item_id, output_index=i, content_index=0,
                                         text=text, logprobs=[])
                                yield ev("response.content_part.done", item_id=item_id, output_index=i,
                                         content_index=0, part={"type": "output_text", "text": text,
                                                                "annotations": []})
                            elif kind == "reasoning":
                                yield ev("response.reasoning_text.done", item_id=item_id, output_index=i,
                                         content_index=0, text=text)
                            else:
                                yield ev("response.function_call_arguments.done", item_id=item_id, output_index=i,
                                         arguments=text, name=meta["name"])
                            yield ev("response.output_item.done", output_index=i, item=item_of(kind, meta, text, i))
            finally:
                await agen.aclose()

        return StreamingResponse(events(), media_type="text/event-stream")

    # --- /v1/messages (Anthropic) --------------------------------------------------------------------------

    def anthropic_prep(body: dict) -> Prepared:
        if not isinstance(body.get("max_tokens"), int) or isinstance(body.get("max_tokens"), bool):
            raise ApiError(400, "max_tokens: a required integer field", param="max_tokens", kind="bad_field")
        if body.get("n") not in (None, 1):
            raise ApiError(400, "n is not a Messages field (one completion per request)", param="n", kind="bad_field")
        conv = anthropic_conversation(body)
        return srv.prepare_chat(conv, {**body, "stop": body.get("stop_sequences")},
                                anthropic_tool_choice(body.get("tool_choice")), None, max_tokens_keys=("max_tokens",),
                                max_temperature=1.0)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request):
        body = await srv.read_json(request)
        srv.check_model(body)
        conv = anthropic_conversation(body)
        text = render(srv.tokenizer, conv, settings.chat_template)
        return {"input_tokens": len(srv.encode_prompt(text, add_special_tokens=False))}

    @app.post("/v1/messages")
    async def messages(request: Request):
        body = await srv.read_json(request)
        srv.check_model(body)
        prep = anthropic_prep(body)
        stream = body.get("stream") is True
        mid = f"msg_{uuid.uuid4().hex[:24]}"
        first, agen, timer = await srv.run(request, prep, stream)

        def stop_reason(c, has_calls):
            if has_calls and c.finish_reason == "stop":
                return "tool_use", None
            if c.finish_reason == "length":
                return "max_tokens", None
            if isinstance(c.stop_reason, str):
                return "stop_sequence", c.stop_reason
            return "end_turn", None

        def usage(out, final=True):
            return {"input_tokens": len(out.prompt_token_ids),
                    "output_tokens": sum(len(c.token_ids) for c in out.outputs) if final else 0,
                    "cache_read_input_tokens": out.num_cached_tokens, "cache_creation_input_tokens": 0}

        def block_of(kind, meta, text):
            if kind == "reasoning":
                return {"type": "thinking", "thinking": text, "signature": ""}
            if kind == "text":
                return {"type": "text", "text": text}
            try:
                args = json.loads(text) if text else {}
            except json.JSONDecodeError:
                args = {}
            return {"type": "tool_use", "id": "toolu_" + meta["id"].removeprefix("call_"), "name": meta["name"],
                    "input": args}

        if not stream:
            out = await _drain(agen, first, timer, request)
            if out.error:
                raise _engine_error(out.error)
            timer.finish(out, "messages")
            c = out.outputs[0]
            blocks = Blocks()
            blocks.feed(StreamDiffer(prep.plan.parser, prep.reasoning).update(c.text, final=True))
            content = [block_of(k, m, t) for k, m, t in blocks.blocks]
            reason, seq = stop_reason(c, any(b["type"] == "tool_use" for b in content))
            return {"id": mid, "type": "message", "role": "assistant", "model": settings.model_name,
                    "content": content, "stop_reason": reason, "stop_sequence": seq, "usage": usage(out)}

        async def events():
            try:
                yield sse({"type": "message_start", "message": {
                    "id": mid, "type": "message", "role": "assistant", "model": settings.model_name, "content": [],
                    "stop_reason": None, "stop_sequence": None, "usage": usage(first, final=False)}}, "message_start")
                async for what, x, blocks in block_stream(first, agen, timer, prep, "messages"):
                    if what == "error":
                        yield sse(_anthropic_error(x), "error")
                    elif what == "done":
                        c = x.outputs[0]
                        reason, seq = stop_reason(c, any(b[0] == "tool" for b in blocks.blocks))
                        yield sse({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": seq},
                                   "usage": {"output_tokens": len(c.token_ids)}}, "message_delta")
                        yield sse({"type": "message_stop"}, "message_stop")
                    for e in x if what == "blocks" else ():
                        i = e[1]
                        kind, meta, _ = blocks.blocks[i]
                        if e[0] == "open":
                            start = block_of(kind, meta, "")
                            yield sse({"type": "content_block_start", "index": i, "content_block": start},
                                      "content_block_start")
                        elif e[0] == "delta":
                            delta = {"text": {"type": "text_delta", "text": e[3]},
                                     "reasoning": {"type": "thinking_delta", "thinking": e[3]},
                                     "tool": {"type": "input_json_delta", "partial_json": e[3]}}[kind]
                            yield sse({"type": "content_block_delta", "index": i, "delta": delta},
                                      "content_block_delta")
                        else:
                            yield sse({"type": "content_block_stop", "index": i}, "content_block_stop")
            finally:
                await agen.aclose()

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


async def _merge(started):
    """(prompt index, output) from several requests' iterators as they arrive, until each has finished."""
    q: asyncio.Queue = asyncio.Queue()
    for i, (first, _, _) in enumerate(started):
        q.put_nowait((i, first))

    async def pump(i, agen, timer, first):
        if first.finished:
            return
        async for o in agen:
            timer.observe(o)
            await q.put((i, o))

    tasks = [asyncio.ensure_future(pump(i, agen, timer, first)) for i, (first, agen, timer) in enumerate(started)]
    finished = 0
    try:
        while finished < len(started):
            i, out = await q.get()
            finished += bool(out.finished)
            yield i, out
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

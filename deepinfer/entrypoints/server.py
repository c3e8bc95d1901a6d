"""The HTTP server over one AsyncLLM (``deepinfer serve``; ``build_app`` for use from Python): the plumbing every
route shares (errors in each protocol's shape, the API key, body limits, the model check, turning a request
into a started generation) and the utility routes. The protocols' routes are in openai_routes.py (Completions,
Chat Completions, Responses) and anthropic_routes.py (Messages); streaming.py turns outputs into stream events.

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
from typing import Optional

import attrs
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from .. import __version__
from .async_llm import AsyncLLM
from .conversation import Conversation, ConversionError, render
from .metrics import RequestTimer, ServerMetrics
from .parsers import choose_parser
from .protocols import Limits, ToolPlan, bool_field, chat_conversation, param_of, sampling_params, tool_plan

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


def openai_error(e: ApiError) -> dict:
    return {"error": {"message": e.message, "type": OPENAI_TYPES.get(e.status, "invalid_request_error"),
                      "param": e.param, "code": e.code or e.status}}


def anthropic_error(e: ApiError) -> dict:
    return {"type": "error", "error": {"type": ANTHROPIC_TYPES.get(e.status, "api_error"), "message": e.message}}


def _is_anthropic(path: str) -> bool:
    return path.startswith("/v1/messages")

@attrs.define
class Prepared:
    prompt_ids: list
    prompt_text: Optional[str]
    params: object
    plan: ToolPlan
    reasoning: object

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
        body = anthropic_error(e) if _is_anthropic(path) else openai_error(e)
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
        except RecursionError:
            raise ApiError(400, "request body is nested too deeply to parse", kind="malformed") from None
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
        kwargs = body.get("chat_template_kwargs")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise ConversionError("chat_template_kwargs must be an object", "chat_template_kwargs")
        if kwargs and "chat_template" in kwargs:  # a template is code the server runs: its operator picks it
            raise ConversionError("chat_template_kwargs.chat_template: a request cannot supply its own chat template "
                                  "(the server's is the checkpoint's, or --chat-template)",
                                  "chat_template_kwargs.chat_template")
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
        first = await race_disconnect(request, agen.__anext__())
        timer.observe(first)
        if first.error and not any(c.token_ids for c in first.outputs):
            await agen.aclose()
            raise engine_error(first.error)
        return first, agen, timer

    async def run_all(self, request: Request, preps: list, stream: bool) -> list:
        """``run`` for several prompts at once (they are batched together); if one fails before its first
        token, the others are aborted and its error is raised."""
        results = await asyncio.gather(*(self.run(request, p, stream) for p in preps), return_exceptions=True)
        failed = next((r for r in results if isinstance(r, BaseException)), None)
        if failed is not None:
            for r in results:
                if not isinstance(r, BaseException):
                    await r[1].aclose()  # aborts it
            raise failed
        return results


def engine_error(message: str) -> ApiError:
    """An engine failure as an HTTP error: a ValueError at admission is the request's fault (400)."""
    bad = message.startswith(("ValueError", "PluginError", "KeyError", "TypeError", "SchemaError")) \
        or "structured outputs: " in message  # a grammar that fails to compile (the constrain stage says so)
    return ApiError(400 if bad else 500, message, param=param_of(message),
                    kind="bad_request" if bad else "engine_error")


class _Disconnected(Exception):
    pass


async def race_disconnect(request: Request, awaitable):
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


async def drain(agen, first, timer, request=None):
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

    return await (race_disconnect(request, rest()) if request is not None else rest())

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
            ids = srv.encode_prompt(body["prompt"], add_special_tokens=bool_field(body, "add_special_tokens", True))
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
    from . import anthropic_routes, openai_routes

    openai_routes.add_routes(app, srv)
    anthropic_routes.add_routes(app, srv)
    return app



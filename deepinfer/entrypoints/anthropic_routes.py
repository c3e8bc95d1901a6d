"""Anthropic's routes: /v1/messages (with its streaming events) and /v1/messages/count_tokens."""

from __future__ import annotations

import json
import uuid

from fastapi import Request
from fastapi.responses import StreamingResponse

from .conversation import render
from .protocols import anthropic_conversation, anthropic_tool_choice, bool_field
from .server import ApiError, Prepared, anthropic_error
from .streaming import block_stream, final_blocks, sse


def add_routes(app, srv) -> None:
    settings = srv.settings

    # --- /v1/messages (Anthropic) --------------------------------------------------------------------------

    def anthropic_prep(body: dict) -> Prepared:
        if not isinstance(body.get("max_tokens"), int) or isinstance(body.get("max_tokens"), bool):
            raise ApiError(400, "max_tokens: a required integer field", param="max_tokens", kind="bad_field")
        if body.get("n") not in (None, 1):
            raise ApiError(400, "n is not a Messages field (one completion per request)", param="n", kind="bad_field")
        stops = body.get("stop_sequences")
        if stops is not None and not (isinstance(stops, list) and all(isinstance(x, str) and x for x in stops)):
            raise ApiError(400, "stop_sequences must be a list of non-empty strings", param="stop_sequences",
                           kind="bad_field")
        conv = anthropic_conversation(body)
        return srv.prepare_chat(conv, {**body, "stop": stops},
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
        stream = bool_field(body, "stream")
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

        def usage(out, final=True):  # as Anthropic counts: input_tokens leaves out the tokens read from the cache
            return {"input_tokens": len(out.prompt_token_ids) - out.num_cached_tokens,
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
            out, blocks = await final_blocks(first, agen, timer, request, prep, "messages")
            c = out.outputs[0]
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
                        yield sse(anthropic_error(x), "error")
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

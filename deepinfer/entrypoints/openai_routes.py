"""OpenAI's routes: /v1/completions, /v1/chat/completions and /v1/responses (create and stream), each request
converted (protocols.py), run (server.Server.run) and written back in the protocol's own shape."""

from __future__ import annotations

import time
import uuid
from typing import Optional

from fastapi import Request
from fastapi.responses import StreamingResponse

from .conversation import new_call_id
from .parsers import StreamDiffer, parse_output
from .protocols import (ToolPlan, bool_field, chat_conversation, openai_tool_choice, response_format,
                        responses_conversation, sampling_params, stream_flags)
from .server import ApiError, Prepared, drain, engine_error, openai_error
from .streaming import block_stream, final_blocks, merge_outputs, sse, stop_hold


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


def usage_openai(out_list) -> dict:
    prompt = sum(len(o.prompt_token_ids) for o in out_list)
    gen = sum(len(c.token_ids) for o in out_list for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in out_list)
    return {"prompt_tokens": prompt, "completion_tokens": gen, "total_tokens": prompt + gen,
            "prompt_tokens_details": {"cached_tokens": cached}}


def add_routes(app, srv) -> None:
    settings, engine = srv.settings, srv.engine

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
            if isinstance(p, str) and p:  # (an empty prompt is refused, as LLM.generate refuses it)
                ids, text = srv.encode_prompt(p), p
            elif isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab
                                                   for t in p):
                ids, text = list(p), None
            else:
                raise ApiError(400, f"prompt[{i}] must be a non-empty string or a non-empty list of token ids in "
                                    f"[0, {vocab})",
                               param="prompt", kind="bad_field")
            srv.check_prompt_len(len(ids), "prompt")
            params = sampling_params(body, len(ids), srv.limits, default_max_tokens=16, logprobs=lp,
                                     structured=structured)
            preps.append(Prepared(ids, text, params, ToolPlan(), None))
        stream, include_usage = stream_flags(body)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        started = await srv.run_all(request, preps, stream)  # all submitted at once: the engine batches them
        n = preps[0].params.n

        def choice_index(i, c):
            return i * n + c.index

        if not stream:
            finals = [await drain(agen, first, timer, request) for first, agen, timer in started]
            choices = []
            for i, out in enumerate(finals):
                if out.error:
                    raise engine_error(out.error)
                started[i][2].finish(out, "completions")
                for c in out.outputs:
                    choices.append({"index": choice_index(i, c), "text": c.text, "finish_reason": _finish(c),
                                    "stop_reason": c.stop_reason if c.stop_reason is not None else None,
                                    "logprobs": completion_logprobs(srv.tokenizer, c.token_ids, c.logprobs, lp or 0)})
            return {"id": rid, "object": "text_completion", "created": created, "model": settings.model_name,
                    "choices": sorted(choices, key=lambda x: x["index"]), "usage": usage_openai(finals)}

        stops = preps[0].params.stop

        async def events():
            sent: dict = {}
            finals: dict = {}
            try:
                async for i, out in merge_outputs(started):
                    if out.error:
                        err = engine_error(out.error)
                        srv.metrics.error(err.kind)
                        yield sse(openai_error(err))
                        break
                    for c in out.outputs:
                        key = choice_index(i, c)
                        text, ntok = sent.get(key, ("", 0))
                        full = c.text if c.finish_reason else stop_hold(c.text, stops)
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
                               "usage": usage_openai(list(finals.values()))})
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
        stream, include_usage = stream_flags(body)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        first, agen, timer = await srv.run(request, prep, stream)
        top = top or 0

        if not stream:
            out = await drain(agen, first, timer, request)
            if out.error:
                raise engine_error(out.error)
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
                    "choices": choices, "usage": usage_openai([out])}

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
                        err = engine_error(out.error)
                        srv.metrics.error(err.kind)
                        yield chunk([], error=openai_error(err)["error"])
                        break
                    for c in out.outputs:
                        d = differs.setdefault(c.index, StreamDiffer(prep.plan.parser, prep.reasoning))
                        text = c.text if c.finish_reason else stop_hold(c.text, stops)
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
                            yield chunk([], usage=usage_openai([out]))
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
        stream = bool_field(body, "stream")
        rid, created = f"resp_{uuid.uuid4().hex}", int(time.time())
        first, agen, timer = await srv.run(request, prep, stream)

        def response_obj(status, output, out=None):
            usage = None
            if out is not None:
                u = usage_openai([out])
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
            out, blocks = await final_blocks(first, agen, timer, request, prep, "responses")
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

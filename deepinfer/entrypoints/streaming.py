"""Outputs as stream events: SSE framing, the stop-string hold-back, output blocks (reasoning, text, tool
calls) opened, grown and closed in order, and the merge of several requests' outputs."""

from __future__ import annotations

import asyncio
import json
from typing import Optional

from .conversation import new_call_id
from ..outputs import partial_prefix_len
from .parsers import StreamDiffer
from .server import Prepared, drain, engine_error


def sse(data, event: Optional[str] = None) -> str:
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return (f"event: {event}\n" if event else "") + f"data: {text}\n\n"

def stop_hold(text: str, stops) -> str:
    """Text safe to send while streaming: a tail that may be the start of a stop string is held back."""
    if not stops:
        return text
    k = partial_prefix_len(text, stops)
    return text[:len(text) - k] if k else text

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


async def final_blocks(first, agen, timer, request, prep: Prepared, endpoint: str):
    """A non-streamed choice: its final output (an engine error raised as ApiError) and its whole text parsed
    into closed blocks; block_stream's twin for the protocols that answer with output items / content blocks."""
    out = await drain(agen, first, timer, request)
    if out.error:
        raise engine_error(out.error)
    timer.finish(out, endpoint)
    blocks = Blocks()
    blocks.feed(StreamDiffer(prep.plan.parser, prep.reasoning).update(out.outputs[0].text, final=True))
    blocks.finish()
    return out, blocks


async def block_stream(first, agen, timer, prep: Prepared, endpoint: str):
    """One choice's outputs as block events: ("blocks", events, blocks), then ("done", out, blocks) or
    ("error", ApiError). Shared by the protocols that stream output items / content blocks."""
    blocks = Blocks()
    d = StreamDiffer(prep.plan.parser, prep.reasoning)
    stops = prep.params.stop
    out = first
    while True:
        if out.error:
            err = engine_error(out.error)
            timer.m.error(err.kind)
            yield "error", err, blocks
            return
        c = out.outputs[0]
        final = bool(c.finish_reason)
        evs = blocks.feed(d.update(c.text if final else stop_hold(c.text, stops), final=final))
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

async def merge_outputs(started):
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


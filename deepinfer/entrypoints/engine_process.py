"""The engine in a process of its own, for AsyncLLM(engine_process=True) and ``deepinfer serve --engine-process``.

Why: the engine's step loop is Python, and so is the server's HTTP, SSE and JSON work. In one process they take
turns on the GIL, and every turn the event loop takes while a step's results wait to be read is a gap in the
GPU's work (the H200 at concurrency 64: the in-thread server 15% behind the offline engine). In its own process
the engine keeps its GIL to itself, as vLLM's engine core does.

The wire: a Unix socket pair, frames of a 4-byte big-endian length and UTF-8 JSON (no pickle: only data crosses).
The child (``python -m deepinfer.entrypoints.engine_process FD``) reads one ``start`` frame (LLM's keyword
arguments, or a ``factory`` "module:function" called with them that returns an LLM), builds the LLM, answers
``ready`` with what the front end needs (context length, vocabulary size, tokenizer directory, config), then
loops: it applies ``add`` / ``abort`` / ``stop`` frames between steps, steps while anything is unfinished, and
after every step sends one ``outputs`` frame: each request's news as a delta (new token ids, new text, new
logprobs; the prompt once) and a stats snapshot. :class:`RemoteEngine` is the front end's stand-in for the
Engine (the part of its interface AsyncLLM's thread uses); it rebuilds cumulative RequestOutputs from the deltas.

What cannot cross: ``logits_processors`` (Python callables) are refused for that request with a clear error.
"""

from __future__ import annotations

import importlib
import json
import logging
import select
import socket
import struct
import subprocess
import sys
import time
from types import SimpleNamespace
from typing import Optional

import attrs

from ..core.params import SamplingParams
from ..outputs import CompletionOutput, Logprob, RequestOutput
from .async_llm import EngineDeadError, engine_snapshot

_HEADER = struct.Struct(">I")
log = logging.getLogger(__name__)


def wanted(mode: str, device) -> bool:
    """Whether ``--engine-process MODE`` (auto | on | off) runs the engine in its own process on ``device``
    (None: the one LLM would pick): auto is on for CUDA, off on the CPU (docs/decisions.md)."""
    if mode != "auto":
        return mode == "on"
    import torch

    return (device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")


# --- framing ---------------------------------------------------------------------------------------------------

def send(sock: socket.socket, obj) -> None:
    # default=str: a value JSON has no type for (a config's dtype object, say) crosses as its text, never a crash
    data = json.dumps(obj, separators=(",", ":"), default=str).encode()
    sock.sendall(_HEADER.pack(len(data)) + data)


class Reader:
    """Frames from a socket; ``poll(timeout)`` returns the frames complete within timeout seconds ([] if none);
    EOF raises EngineDeadError."""

    def __init__(self, sock: socket.socket, what: str):
        self.sock, self.what, self.buf = sock, what, bytearray()

    def poll(self, timeout: Optional[float]) -> list:
        frames = self._frames()
        if frames:
            return frames
        ready, _, _ = select.select([self.sock], [], [], timeout)
        while ready:
            chunk = self.sock.recv(1 << 20)
            if not chunk:
                raise EngineDeadError(f"{self.what} closed the connection")
            self.buf += chunk
            ready, _, _ = select.select([self.sock], [], [], 0)
        return self._frames()

    def _frames(self) -> list:
        out = []
        while len(self.buf) >= 4:
            (n,) = _HEADER.unpack_from(self.buf)
            if len(self.buf) < 4 + n:
                break
            out.append(json.loads(bytes(self.buf[4:4 + n])))
            del self.buf[:4 + n]
        return out


# --- what crosses ----------------------------------------------------------------------------------------------

def params_to_wire(p: SamplingParams) -> dict:
    if p.logits_processors:
        raise ValueError("SamplingParams.logits_processors cannot be used with the engine in its own process "
                         "(Python callables do not cross it): serve with --engine-process off")
    d = {f.name: getattr(p, f.name) for f in attrs.fields(SamplingParams)
         if not f.name.startswith("_") and f.name != "logits_processors"}
    so = d.get("structured_outputs")
    if so is not None:
        d["structured_outputs"] = attrs.asdict(so, recurse=False)
    if d.get("logit_bias") is not None:
        d["logit_bias"] = [[int(k), v] for k, v in d["logit_bias"].items()]  # JSON keys would be strings
    return d


def params_from_wire(d: dict) -> SamplingParams:
    if d.get("logit_bias") is not None:
        d["logit_bias"] = {int(k): v for k, v in d["logit_bias"]}
    return SamplingParams(**d)


def _lps(entries) -> Optional[list]:
    if entries is None:
        return None
    return [None if e is None else [[t, v.logprob, v.rank, v.decoded_token] for t, v in e.items()] for e in entries]


def _lps_back(rows) -> Optional[list]:
    if rows is None:
        return None
    return [None if e is None else {t: Logprob(lp, rank, tok) for t, lp, rank, tok in e} for e in rows]


class DeltaWriter:
    """The child's side: what each request's front end has been told, and the news since."""

    def __init__(self):
        self.told: dict = {}  # request id -> {index: (tokens told, text told, logprobs told)}

    def delta(self, out: RequestOutput) -> dict:
        first = out.request_id not in self.told
        told = self.told.setdefault(out.request_id, {})
        comps = []
        for c in out.outputs:
            nt, text, nl = told.get(c.index, (0, "", 0))
            item = {"i": c.index, "ids": c.token_ids[nt:], "cum": c.cumulative_logprob, "fin": c.finish_reason,
                    "stop": c.stop_reason if isinstance(c.stop_reason, (str, int, type(None))) else str(c.stop_reason),
                    "err": c.error}
            if len(c.token_ids) < nt:  # never expected (outputs only grow); resend whole if it happens
                item["ids"], item["reset_ids"] = list(c.token_ids), True
            if c.text.startswith(text):
                item["text"] = c.text[len(text):]
            else:  # the text changed behind what was told (a stop string trimmed at the end)
                item["text"], item["reset_text"] = c.text, True
            if c.logprobs is not None:
                item["lps"] = _lps(c.logprobs[nl:] if len(c.logprobs) >= nl else c.logprobs)
                item["reset_lps"] = len(c.logprobs) < nl
            told[c.index] = (len(c.token_ids), c.text, len(c.logprobs or ()))
            comps.append(item)
        d = {"rid": out.request_id, "fin": out.finished, "err": out.error, "metrics": out.metrics,
             "cached": out.num_cached_tokens, "comps": comps}
        if first or out.finished:
            d["prompt"], d["prompt_ids"] = out.prompt, list(out.prompt_token_ids)
            d["prompt_lps"] = _lps(out.prompt_logprobs)
        if out.finished:
            self.told.pop(out.request_id, None)
        return d


class DeltaReader:
    """The front end's side: cumulative RequestOutputs rebuilt from deltas. A request's lists are replaced on
    each delta, never grown in place, so an output a consumer keeps does not change under it."""

    def __init__(self):
        self.state: dict = {}  # request id -> {"prompt":..., "comps": {index: [ids, text, lps, ...]}}

    def apply(self, d: dict) -> RequestOutput:
        st = self.state.setdefault(d["rid"], {"prompt": None, "prompt_ids": [], "prompt_lps": None, "comps": {}})
        for k in ("prompt", "prompt_ids", "prompt_lps"):
            if k in d:
                st[k] = d[k] if k != "prompt_lps" else _lps_back(d[k])
        outs = []
        for c in d["comps"]:
            ids, text, lps = st["comps"].get(c["i"], ([], "", None))
            ids = c["ids"] if c.get("reset_ids") else ids + c["ids"]
            text = c["text"] if c.get("reset_text") else text + c["text"]
            if "lps" in c:
                new = _lps_back(c["lps"])
                lps = new if c.get("reset_lps") or lps is None else lps + new
            st["comps"][c["i"]] = (ids, text, lps)
            outs.append(CompletionOutput(index=c["i"], text=text, token_ids=ids, cumulative_logprob=c["cum"],
                                         logprobs=lps, finish_reason=c["fin"], stop_reason=c["stop"],
                                         error=c["err"]))
        if d["fin"]:
            self.state.pop(d["rid"], None)
        return RequestOutput(d["rid"], st["prompt"], st["prompt_ids"], outs, d["fin"],
                             prompt_logprobs=st["prompt_lps"], error=d["err"], metrics=d["metrics"] or {},
                             num_cached_tokens=d["cached"])


# --- the front end's stand-in for the Engine -------------------------------------------------------------------

class RemoteEngine:
    """Starts the engine process and speaks to it; has the Engine methods AsyncLLM's thread calls (add_request,
    abort, requests, has_unfinished, step, sync) plus ``snapshot()`` and ``close()``. One thread uses it."""

    POLL_S = 0.01  # step() waits this long for news, then returns [] so the caller can check its inbox

    def __init__(self, llm_kwargs: dict, factory: Optional[str] = None, start_timeout: float = 900.0):
        parent, child = socket.socketpair()
        self.proc = subprocess.Popen([sys.executable, "-m", "deepinfer.entrypoints.engine_process",
                                      str(child.fileno())], pass_fds=(child.fileno(),))
        child.close()
        self.sock, self.reader = parent, Reader(parent, "the engine process")
        self.requests: set = set()  # ids sent, not finished: what AsyncLLM reads of Engine.requests
        self.deltas = DeltaReader()
        try:
            send(parent, {"type": "start", "kwargs": llm_kwargs, "factory": factory})
        except OSError as exc:
            raise EngineDeadError(f"the engine process did not start: {exc}") from None
        deadline = time.monotonic() + start_timeout
        while True:
            try:
                frames = self.reader.poll(1.0)
            except EngineDeadError:
                self.proc.wait(10)
                raise EngineDeadError(f"the engine process exited while starting (exit code {self.proc.returncode}"
                                      "; its error is on stderr above)") from None
            msg = next((f for f in frames if f["type"] in ("ready", "failed")), None)
            if msg is not None:
                break
            if time.monotonic() > deadline:
                self.close()
                raise EngineDeadError(f"the engine process did not start within {start_timeout:.0f} s")
        if msg["type"] == "failed":
            self.close()
            raise ValueError(f"the engine process could not build the LLM: {msg['error']}")
        self.info = info = msg["info"]
        self.max_model_len = info["max_model_len"]
        self.model = SimpleNamespace(vocab_size=info["vocab_size"])
        self._snapshot = info["stats"]

    def add_request(self, rid, prompt, params, stream=True, priority=0) -> None:
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, not {type(params).__name__}")
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        wire = params_to_wire(params)  # raises for what cannot cross, before anything is sent
        send(self.sock, {"type": "add", "rid": rid, "prompt": prompt, "params": wire, "stream": stream,
                         "priority": priority})
        self.requests.add(rid)

    def abort(self, rid) -> None:
        if rid in self.requests:
            send(self.sock, {"type": "abort", "rid": rid})

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def step(self) -> list:
        outs = []
        for f in self.reader.poll(self.POLL_S):
            if f["type"] == "outputs":
                self._snapshot = f["stats"]
                for d in f["outs"]:
                    out = self.deltas.apply(d)
                    if out.finished:
                        self.requests.discard(out.request_id)
                    outs.append(out)
            elif f["type"] == "error":  # a step raised in the child: it has failed everything in flight
                self.requests.clear()
                self.deltas.state.clear()
                raise RuntimeError(f["message"])
        return outs

    def sync(self) -> None:
        return None

    def snapshot(self) -> dict:
        return self._snapshot

    def close(self, timeout: float = 30.0) -> None:
        try:
            send(self.sock, {"type": "stop"})
        except OSError:
            pass
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self.sock.close()


# --- the child -------------------------------------------------------------------------------------------------

def _build(start: dict):
    kwargs = start.get("kwargs") or {}
    if start.get("factory"):
        mod, _, fn = start["factory"].partition(":")
        return getattr(importlib.import_module(mod), fn)(**kwargs)
    from ..core.llm import LLM

    return LLM(**kwargs)


def _error_delta(rid: str, message: str) -> dict:
    return {"rid": rid, "fin": True, "err": message, "metrics": {}, "cached": 0, "prompt": None, "prompt_ids": [],
            "prompt_lps": None, "comps": [{"i": 0, "ids": [], "text": "", "cum": None, "fin": "error", "stop": None,
                                           "err": message}]}


def serve_child(sock: socket.socket) -> int:
    try:
        return _serve(sock)
    except (BrokenPipeError, ConnectionResetError, EngineDeadError):  # the front end is gone: nobody to serve
        return 0


def _serve(sock: socket.socket) -> int:
    reader = Reader(sock, "the front end")
    start = next(f for f in reader.poll(None) if f["type"] == "start")
    try:
        llm = _build(start)
    except Exception as exc:
        send(sock, {"type": "failed", "error": f"{type(exc).__name__}: {exc}"})
        return 1
    eng = llm.engine
    tok_dir = (start.get("kwargs") or {}).get("tokenizer") or llm.model_path  # as LLM loads it
    send(sock, {"type": "ready", "info": {
        "max_model_len": eng.max_model_len, "vocab_size": eng.model.vocab_size, "tokenizer_dir": str(tok_dir),
        "model_path": str(llm.model_path), "hf_config": llm.hf_config,
        "generation_defaults": dict(getattr(llm, "generation_defaults", {}) or {}), "stats": engine_snapshot(eng)}})
    writer = DeltaWriter()
    running = True
    while running or eng.has_unfinished():
        news = []
        if not eng.has_unfinished():  # going idle: the front end's stats show the freed blocks
            send(sock, {"type": "outputs", "outs": [], "stats": engine_snapshot(eng)})
        for f in reader.poll(None if not eng.has_unfinished() and running else 0):
            kind = f["type"]
            if kind == "add":
                try:
                    eng.add_request(f["rid"], f["prompt"], params_from_wire(f["params"]), stream=f["stream"],
                                    priority=f["priority"])
                except Exception as exc:  # this request only (a bad prompt, a bad value)
                    news.append(_error_delta(f["rid"], f"{type(exc).__name__}: {exc}"))
            elif kind == "abort":
                if f["rid"] in eng.requests:
                    eng.abort(f["rid"])
            elif kind == "stop":
                running = False
                for rid in list(eng.requests):
                    eng.abort(rid)
        if eng.has_unfinished():
            try:
                news += [writer.delta(o) for o in eng.step()]
            except Exception as exc:  # a bug the engine did not contain: fail what is in flight, keep serving
                log.exception("deepinfer: engine step raised; failing the requests in flight")
                for rid in list(eng.requests):
                    eng.abort(rid)
                try:
                    eng.step()
                    eng.sync()
                except Exception:
                    pass
                send(sock, {"type": "error", "message": f"engine step failed: {type(exc).__name__}: {exc}"})
                continue
        if news:
            send(sock, {"type": "outputs", "outs": news, "stats": engine_snapshot(eng)})
    return 0


def main(argv=None) -> int:
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the front end stops us cleanly
    fd = int((argv or sys.argv[1:])[0])
    sock = socket.socket(fileno=fd)
    try:
        return serve_child(sock)
    finally:
        sock.close()


if __name__ == "__main__":
    raise SystemExit(main())

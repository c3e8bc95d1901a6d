"""AsyncLLM: the engine loop in its own thread; requests are added, streamed and aborted from asyncio.

The Engine is not thread-safe, so only the engine thread touches it. Callers post commands (add, abort) to an
inbox; the thread applies them between steps, steps while any request is unfinished, and hands each
RequestOutput to its request's asyncio queue (``loop.call_soon_threadsafe``). When idle it blocks on the
inbox, so an idle server costs no CPU.

Leaving ``generate``'s iterator early (a client that disconnects cancels the task that iterates it) aborts
the request: the engine finishes its sequences and their KV blocks go back to the pool at once.

The engine thread and the caller's event loop share the GIL. With Python's default switch interval (5 ms) a
busy event loop (streaming to many clients) could keep the engine thread waiting up to 5 ms for the GIL each
time a CUDA sync returns it to Python, a gap in the GPU's work every step (the H200 at concurrency 64: the
server 8% behind the offline engine). AsyncLLM lowers the process's switch interval to ``gil_switch_interval``
(0.5 ms) so that wait is short; ``None`` leaves the interpreter's setting alone.

``stats()`` is a snapshot taken by the engine thread after every step (running and waiting sequences, KV
blocks, prefix-cache hit rate), so readers on other threads never walk the engine's structures.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import sys
import threading
import time
from types import SimpleNamespace
from typing import AsyncIterator, Optional

from ..core.params import SamplingParams
from ..outputs import CompletionOutput, RequestOutput

log = logging.getLogger(__name__)
GIL_SWITCH_INTERVAL_S = 0.0005  # see the module docstring


class EngineDeadError(RuntimeError):
    """The engine thread has stopped (shut down, or crashed); no request can be served."""


class AsyncLLM:
    """An asynchronous front end over one LLM. ``AsyncLLM(model=...)`` takes LLM's arguments;
    ``AsyncLLM(llm=existing)`` wraps an LLM already built. Use ``async with`` or call ``shutdown()``."""

    def __init__(self, llm=None, stream_interval: int = 1, gil_switch_interval=GIL_SWITCH_INTERVAL_S,
                 engine_process: bool = False, engine_factory: Optional[str] = None, **llm_kwargs):
        """stream_interval: a streamed request hears of its progress every this many new tokens (its first token
        and its end always at once); larger values cost the event loop less per token (SGLang's
        --stream-interval). gil_switch_interval: seconds; the process's switch interval is lowered to it (never
        raised; process-wide, see the module docstring); None leaves it. engine_process: build and run the engine
        in a process of its own (entrypoints/engine_process.py; LLM's arguments must then be JSON data, and
        ``engine_factory`` "module:function" may build the LLM from them instead of LLM(**kwargs))."""
        if not isinstance(stream_interval, int) or isinstance(stream_interval, bool) or stream_interval < 1:
            raise ValueError(f"AsyncLLM stream_interval={stream_interval!r} is invalid: must be an int >= 1")
        if gil_switch_interval is not None:
            lower_switch_interval(gil_switch_interval)
        if llm is not None and (llm_kwargs or engine_process):
            raise TypeError("AsyncLLM: pass llm=... or LLM's arguments (with engine_process), not both")
        if engine_process:
            from ..tokenizer import Tokenizer
            from .engine_process import RemoteEngine

            remote = RemoteEngine(llm_kwargs, engine_factory)
            info = remote.info
            # What the server reads of an LLM, without one in this process.
            llm = SimpleNamespace(engine=remote, tokenizer=Tokenizer.from_dir(info["tokenizer_dir"]),
                                  model_path=info["model_path"], hf_config=info["hf_config"],
                                  generation_defaults=info["generation_defaults"])
        elif llm is None:
            from ..core.llm import LLM

            llm = LLM(**llm_kwargs)
        self.stream_interval = stream_interval
        self.remote = engine_process
        self._sent: dict = {}  # request id -> tokens it has been told of (stream_interval > 1 only)
        self.llm, self.engine, self.tokenizer = llm, llm.engine, llm.tokenizer
        self.max_model_len = self.engine.max_model_len
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._queues: dict = {}  # request id -> (loop, asyncio.Queue); owned by the engine thread once added
        self._ids = itertools.count()
        self._stopping = threading.Event()
        self._dead: Optional[str] = None
        self._stats = self._snapshot()
        self._thread = threading.Thread(target=self._run, name="deepinfer-engine", daemon=True)
        self._thread.start()

    # --- the caller's side (any thread; generate from an event loop) ---------------------------------------

    def new_request_id(self, prefix: str = "req") -> str:
        return f"{prefix}-{next(self._ids)}"

    async def generate(self, prompt, params: SamplingParams, request_id: Optional[str] = None,
                       stream: bool = True, priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Yield cumulative RequestOutputs of one request (``stream=False``: only the final one). A request that
        fails (bad prompt, bad schema, a failing step) ends with an output whose ``error`` is set. Closing the
        iterator before the end (or cancelling the task) aborts the request and frees its KV blocks."""
        self._check_alive()
        rid = request_id or self.new_request_id()
        q: asyncio.Queue = asyncio.Queue()
        self._inbox.put(("add", rid, prompt, params, stream, priority, (asyncio.get_running_loop(), q)))
        finished = False
        try:
            while True:
                out = await q.get()
                if isinstance(out, BaseException):
                    raise out
                while not q.empty() and not out.finished:  # a slow consumer skips to the latest (cumulative)
                    nxt = q.get_nowait()
                    if isinstance(nxt, BaseException):
                        raise nxt
                    out = nxt
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            if not finished:
                self.abort(rid)

    def abort(self, request_id: str) -> None:
        """Stop a request (no effect when it has finished); its blocks are freed before the next step."""
        self._inbox.put(("abort", request_id))

    def stats(self) -> dict:
        """The engine's state after its latest step: running/waiting sequences, KV blocks, prefix-cache totals."""
        return self._stats

    @property
    def is_alive(self) -> bool:
        alive = self._dead is None and self._thread.is_alive()
        return alive and (not self.remote or self.engine.proc.poll() is None)  # an idle engine process may die

    def _check_alive(self) -> None:
        if not self.is_alive:
            raise EngineDeadError(f"the engine is not running ({self._dead or 'its thread ended'})")

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort what is in flight (each stream ends with finish_reason "abort") and stop the engine thread (and
        the engine's process, with engine_process)."""
        if self._thread.is_alive():
            self._inbox.put(("stop",))
            self._thread.join(timeout)
        if self.remote and self.engine.proc.poll() is None:
            self.engine.close()
        self._dead = self._dead or "shut down"

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await asyncio.get_running_loop().run_in_executor(None, self.shutdown)

    # --- the engine thread ---------------------------------------------------------------------------------

    def _deliver(self, rid: str, item) -> None:
        self._deliver_all([(rid, item)])

    def _deliver_all(self, items) -> None:
        """Hand outputs to their requests' queues: one wake-up of each caller's event loop per step."""
        by_loop: dict = {}
        k = self.stream_interval
        for rid, item in items:
            entry = self._queues.get(rid)
            if entry is None:
                continue
            if isinstance(item, BaseException) or item.finished:
                self._queues.pop(rid, None)
                self._sent.pop(rid, None)
            elif k > 1:
                n = sum(len(c.token_ids) for c in item.outputs)
                told = self._sent.get(rid, 0)
                if told and n - told < k:
                    continue  # not enough new tokens yet; the next step's output carries these too
                self._sent[rid] = n
            by_loop.setdefault(entry[0], []).append((entry[1], item))
        for loop, puts in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, puts)
            except RuntimeError:  # the caller's loop is closed: nobody listens any more
                for q, _ in puts:
                    for rid in [r for r, e in self._queues.items() if e[1] is q]:
                        self._queues.pop(rid, None)

    def _apply(self, cmd) -> bool:
        """Apply one inbox command; False on stop."""
        kind = cmd[0]
        if kind == "add":
            _, rid, prompt, params, stream, priority, target = cmd
            self._queues[rid] = target
            try:
                self.engine.add_request(rid, prompt, params, stream=stream, priority=priority)
            except Exception as exc:  # a bad argument (duplicate id, not SamplingParams): this request only
                self._deliver(rid, _error_output(rid, f"{type(exc).__name__}: {exc}"))
        elif kind == "abort":
            if cmd[1] in self.engine.requests:
                self.engine.abort(cmd[1])
        elif kind == "stop":
            return False
        return True

    def _run(self) -> None:
        try:
            running = True
            while running:
                # Block while idle; otherwise take what arrived since the last step without waiting.
                block = not self.engine.has_unfinished()
                while running:
                    try:
                        cmd = self._inbox.get(block=block, timeout=0.5 if block else None)
                    except queue.Empty:
                        if block:
                            self._stats = self._snapshot()
                            continue
                        break
                    running = self._apply(cmd)
                    block = False
                if not running:
                    break
                if not self.engine.has_unfinished():
                    continue
                try:
                    outs = self.engine.step()
                except EngineDeadError:  # the engine's process died: nothing more can be served
                    raise
                except Exception as exc:  # a bug the engine did not contain: fail what is in flight, keep going
                    log.exception("deepinfer: engine step raised; failing the requests in flight")
                    self._fail_all(f"engine step failed: {type(exc).__name__}: {exc}")
                    continue
                self._deliver_all([(out.request_id, out) for out in outs])
                self._stats = self._snapshot()
            self._fail_all("the server is shutting down", reason="abort")
        except BaseException as exc:  # pragma: no cover - the thread itself broke
            self._dead = f"engine thread crashed: {type(exc).__name__}: {exc}"
            log.exception("deepinfer: %s", self._dead)
            for rid in list(self._queues):
                self._deliver(rid, EngineDeadError(self._dead))
        finally:
            self._stats = self._snapshot()
            if self._dead is None:
                self._dead = "shut down"

    def _fail_all(self, message: str, reason: str = "error") -> None:
        for rid in list(self.engine.requests):
            self.engine.abort(rid)
        try:
            self.engine.step()  # reports (and frees) the aborted requests
            self.engine.sync()
        except Exception:  # pragma: no cover
            log.exception("deepinfer: could not step the engine while failing its requests")
        for rid in list(self._queues):
            self._deliver(rid, _error_output(rid, message) if reason == "error" else _abort_output(rid))

    def _snapshot(self) -> dict:
        return self.engine.snapshot() if self.remote else engine_snapshot(self.engine)


def engine_snapshot(eng) -> dict:
    """An Engine's state for stats(): running/waiting sequences, KV blocks, prefix-cache and speculation totals."""
    sched, pool = eng.scheduler, eng.pool
    cache = eng.prefix_cache
    summary = cache.summary() if cache is not None else {}
    return {"running": len(sched.running), "waiting": len(sched.waiting), "requests": len(eng.requests),
            "kv_blocks_total": pool.num_blocks, "kv_blocks_free": pool.num_free,
            "kv_usage": 1.0 - pool.num_free / pool.num_blocks,
            "prefix_cache_queries": summary.get("query_tokens", 0), "prefix_cache_hits": summary.get("hit_tokens", 0),
            "prefix_cache_hit_rate": summary.get("hit_rate", 0.0), "steps": eng.stats["steps"],
            **_spec(getattr(eng, "spec_stats", None)), "time": time.time()}


def lower_switch_interval(seconds) -> None:
    """Lower the process's GIL switch interval to ``seconds`` (never raise it)."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds <= 1:
        raise ValueError(f"AsyncLLM gil_switch_interval={seconds!r} is invalid: must be seconds in (0, 1], or None")
    if sys.getswitchinterval() > seconds:
        sys.setswitchinterval(seconds)


def _spec(stats) -> dict:
    """Speculative decoding's totals (core/speculative.py SpecStats); zeros without speculation."""
    if stats is None:
        return {"spec_draft_tokens": 0, "spec_accepted_tokens": 0, "spec_acceptance_rate": 0.0}
    drafted, accepted = stats.draft_tokens, stats.accepted_tokens
    return {"spec_draft_tokens": drafted, "spec_accepted_tokens": accepted,
            "spec_acceptance_rate": accepted / drafted if drafted else 0.0}


def _put_all(puts) -> None:
    for q, item in puts:
        q.put_nowait(item)


def _error_output(rid: str, message: str) -> RequestOutput:
    comp = CompletionOutput(index=0, text="", token_ids=[], finish_reason="error", error=message)
    return RequestOutput(rid, None, [], [comp], True, error=message)


def _abort_output(rid: str) -> RequestOutput:
    return RequestOutput(rid, None, [], [CompletionOutput(index=0, text="", token_ids=[], finish_reason="abort")],
                         True)

"""Grammar compilation for structured outputs, on xgrammar.

- ``import_xgrammar()``: the library, or an error that names the install command (it is an optional
  dependency: ``pip install 'deepinfer[structured]'``).
- ``tokenizer_info()``: xgrammar's TokenizerInfo built from the checkpoint's tokenizer.json (its vocabulary,
  decoder type and prefix-space handling) with the model's vocabulary size, which may be padded beyond the
  tokenizer's: ids past the tokenizer are never allowed.
- ``GrammarCompilers.get(tokenizer, vocab_size)``: one ``Compiler`` per (tokenizer.json, vocabulary size),
  shared by every engine of the process. A Compiler compiles on its own daemon threads (so a request's
  compilation overlaps its prefill and a pathological grammar still running at exit does not hold the
  process) and caches the result, a compiled grammar or the compiler's error, by grammar: a grammar is
  compiled once per tokenizer, and concurrent requests for it share one compilation.

Waiting, and the time limit, belong to the caller (the constrain stage): ``Future.result(timeout)``.
"""

from __future__ import annotations

import collections
import concurrent.futures
import hashlib
import json
import os
import queue
import re
import threading
import time
from typing import Any, Optional

from .json_grammar import repaired_ebnf

INSTALL = "pip install 'deepinfer[structured]'"
CACHE_SIZE = 512  # compiled grammars kept per tokenizer


class StructuredOutputsUnavailable(RuntimeError):
    """xgrammar is not installed: structured outputs cannot run."""


def import_xgrammar():
    try:
        import xgrammar
    except ImportError as exc:
        raise StructuredOutputsUnavailable(
            f"structured outputs need the xgrammar package, which is not installed ({exc}); install it with: "
            f"{INSTALL}") from None
    return xgrammar


_LOG_PREFIX = re.compile(r"^\[[\d:]+\]\s+\S+?:\d+:\s*")


def compiler_message(exc: BaseException) -> str:
    """xgrammar's error text without its log prefix ("[12:00:00] /project/cpp/file.cc:123: ")."""
    text = str(exc).strip()
    return _LOG_PREFIX.sub("", text) or type(exc).__name__


def tokenizer_info(tokenizer, vocab_size: int):
    """xgrammar's TokenizerInfo for a deepinfer Tokenizer (its tokenizer.json) and the model's vocab size."""
    xgr = import_xgrammar()
    backend = _backend(tokenizer)
    vocab = backend.get_vocab(with_added_tokens=True)
    encoded = [""] * vocab_size
    for token, i in vocab.items():
        if i < vocab_size:
            encoded[i] = token
    meta = xgr.TokenizerInfo._detect_metadata_from_hf(backend.to_str())
    stops = [i for i in tokenizer.eos_token_ids if i < vocab_size] or None  # None: xgrammar finds them
    return xgr.TokenizerInfo(encoded, meta["vocab_type"], vocab_size=vocab_size, stop_token_ids=stops,
                             add_prefix_space=meta["add_prefix_space"])


def _backend(tokenizer):
    """The tokenizers.Tokenizer (tokenizer.json) behind a deepinfer Tokenizer."""
    return getattr(tokenizer, "_tok", tokenizer)


def choice_grammar(choices) -> str:
    """An EBNF grammar whose language is exactly the given strings."""
    def lit(s: str) -> str:
        out = []
        for ch in s:
            if ch in '"\\':
                out.append("\\" + ch)
            elif ch == "\n":
                out.append("\\n")
            elif ch == "\r":
                out.append("\\r")
            elif ch == "\t":
                out.append("\\t")
            elif ord(ch) < 0x20:
                out.append(f"\\x{ord(ch):02x}")
            else:
                out.append(ch)
        return '"' + "".join(out) + '"'

    return "root ::= " + " | ".join(lit(c) for c in choices)


JSON_OBJECT_SCHEMA = '{"type": "object", "additionalProperties": true}'


class _Workers:
    """A few daemon threads that run submitted calls into concurrent.futures.Future objects."""

    def __init__(self, n: int, name: str):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        for i in range(n):
            threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True).start()

    def submit(self, fn, *args) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put((fut, fn, args))
        return fut

    def _run(self) -> None:
        while True:
            fut, fn, args = self._jobs.get()
            if not fut.set_running_or_notify_cancel():
                continue
            fut.started_at = time.monotonic()  # (a time limit counts from here, not from the queue: constrain.py)
            try:
                fut.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - the compiler's error belongs to its request
                fut.set_exception(exc)


class Compiler:
    """Compiles StructuredOutputsParams for one tokenizer; cached by grammar (see the module docstring)."""

    def __init__(self, tokenizer, vocab_size: int, workers: int = 2):
        self._xgr = import_xgrammar()
        self.info = tokenizer_info(tokenizer, vocab_size)
        self.vocab_size = vocab_size
        self.stop_token_ids = list(self.info.stop_token_ids)
        cores = os.cpu_count() or 1
        self._compiler = self._xgr.GrammarCompiler(self.info, max_threads=max(1, min(8, cores)))
        self._batcher = self._xgr.BatchGrammarMatcher(max_threads=max(1, cores // 2))
        self._workers = _Workers(workers, "deepinfer-grammar")
        self._cache: collections.OrderedDict = collections.OrderedDict()  # grammar key -> Future
        self._lock = threading.Lock()
        self._decoded: Optional[list] = None  # bytes of every token (jump-forward), built on first use
        self._prefixes: Optional[frozenset] = None

    def submit(self, spec) -> concurrent.futures.Future:
        """A future of the compiled grammar of ``spec`` (StructuredOutputsParams); the cached one if any. The
        cache keeps the CACHE_SIZE grammars used last (a compiled grammar holds per-token masks)."""
        key = spec.key
        with self._lock:
            fut = self._cache.get(key)
            if fut is None:
                fut = self._cache[key] = self._workers.submit(self._compile, key)
                while len(self._cache) > CACHE_SIZE:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(key)
            return fut

    def _compile(self, key: tuple):
        kind, text, compact = key
        c = self._compiler
        if kind == "json":  # (bounded strings through their repaired grammar: json_grammar.py)
            ebnf = repaired_ebnf(self._xgr, text, any_whitespace=not compact)
            return c.compile_json_schema(text, any_whitespace=not compact) if ebnf is None else c.compile_grammar(ebnf)
        if kind == "json_object":
            return c.compile_json_schema(JSON_OBJECT_SCHEMA, any_whitespace=not compact)
        if kind == "regex":
            return c.compile_regex(text)
        if kind == "choice":
            return c.compile_grammar(choice_grammar(json.loads(text)))
        return c.compile_grammar(text)

    def matcher(self, compiled):
        return self._xgr.GrammarMatcher(compiled)

    def allocate_bitmask(self, rows: int):
        """[rows, ceil(V / 32)] int32 on the host, every bit set (every token allowed)."""
        return self._xgr.allocate_token_bitmask(rows, self.vocab_size)

    def batch_fill(self, matchers: list, bitmask, indices: list) -> None:
        """Fill bitmask row indices[i] with matchers[i]'s next-token mask (xgrammar's threads, no GIL)."""
        self._batcher.batch_fill_next_token_bitmask(matchers, bitmask, indices)

    def token_bytes(self, token_id: int) -> bytes:
        if self._decoded is None:
            self._decoded = self.info.decoded_vocab
        return self._decoded[token_id]

    def is_strict_prefix(self, token_id: int) -> bool:
        """Whether another token's bytes extend this token's (a jump must not end on it: see matcher.py)."""
        if self._prefixes is None:
            self.token_bytes(0)
            self._prefixes = frozenset(b[:i] for b in self._decoded for i in range(1, len(b)))
        return self.token_bytes(token_id) in self._prefixes


class GrammarCompilers:
    """The process's Compilers, one per (tokenizer.json text, model vocabulary size)."""

    _lock = threading.Lock()
    _by_key: dict = {}

    @classmethod
    def get(cls, tokenizer, vocab_size: int) -> Compiler:
        import_xgrammar()
        digest = hashlib.sha256(_backend(tokenizer).to_str().encode()).hexdigest()
        key = (digest, tuple(tokenizer.eos_token_ids), vocab_size)
        with cls._lock:
            comp = cls._by_key.get(key)
            if comp is None:
                comp = cls._by_key[key] = Compiler(tokenizer, vocab_size)
            return comp


def describe(spec: Any) -> str:
    """How a spec is named in messages: "the JSON schema", "the regex", ..."""
    return {"json": "the JSON schema", "json_object": "the JSON-object grammar", "regex": "the regex",
            "choice": "the choice list", "grammar": "the EBNF grammar"}[spec.kind]

"""Streaming token ids -> text, and deciding when a sequence has finished.

IncrementalDetokenizer decodes only a small window of recent tokens per step and holds
back text while the last token ends in the middle of a UTF-8 character (byte-level BPE
splits multi-byte characters across tokens; decoding such a prefix gives U+FFFD).
StopChecker applies EOS / stop_token_ids / stop strings / min_tokens / max_tokens with
the meanings vLLM gives them.
"""

from __future__ import annotations

from typing import Sequence

from deepinfer.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"
# Prompt tokens decoded as left context, so the first output token decodes as it would
# mid-stream (e.g. keeps its leading space under SentencePiece-style decoders).
_PROMPT_CONTEXT = 5


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text deltas.

    The window ids[prefix:read] is text already emitted; ids[prefix:] decoded minus that
    prefix's decode is the new text. Both offsets advance once a step's text is complete,
    so each step decodes only the tokens since the last emitted character plus a little context.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        fast = getattr(tokenizer, "decode_ids", None)
        # With Tokenizer.decode_ids the window holds no special id where they are skipped (dropped on the way
        # in, once per token), and decodes without decode()'s per-call checks; any other tokenizer: decode().
        self._drop = frozenset(getattr(tokenizer, "all_special_ids", ())) if fast and skip_special_tokens \
            else frozenset()
        self._decode = (lambda ids: fast(ids, skip_special_tokens)) if fast \
            else (lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))
        # The working window: recent prompt context, then output ids; trimmed as text is emitted.
        self._ids: list[int] = self._kept(prompt_token_ids[-_PROMPT_CONTEXT:])
        self._prefix = 0
        self._read = len(self._ids)
        self.token_ids: list[int] = []
        self.text: str = ""

    def step(self, new_token_ids: Sequence[int]) -> str:
        """Appends tokens; returns the text they complete (possibly "" while a character is partial)."""
        if not new_token_ids:
            return ""
        self.token_ids.extend(new_token_ids)
        kept = self._kept(new_token_ids)
        if not kept:  # only special tokens, skipped: nothing to show
            return ""
        self._ids.extend(kept)
        decode = self._decode
        prefix_text = decode(self._ids[self._prefix:self._read])
        full_text = decode(self._ids[self._prefix:])
        if len(full_text) <= len(prefix_text) or full_text.endswith(_REPLACEMENT):
            # Nothing visible yet (special token skipped) or a character is still incomplete.
            return ""
        delta = full_text[len(prefix_text):]
        # Tokens before the old read offset are no longer needed as context.
        del self._ids[:self._read]
        self._prefix, self._read = 0, len(self._ids)
        self.text += delta
        return delta

    def _kept(self, ids) -> list:
        drop = self._drop
        return [int(i) for i in ids if i not in drop] if drop else [int(i) for i in ids]

    def flush(self) -> str:
        """Emits whatever is held back (a trailing partial character decodes as U+FFFD).

        Call once when the sequence finishes so a held-back tail is not lost.
        """
        prefix_text = self._decode(self._ids[self._prefix:self._read])
        full_text = self._decode(self._ids[self._prefix:])
        delta = full_text[len(prefix_text):] if full_text.startswith(prefix_text) else ""
        del self._ids[:self._read]
        self._prefix, self._read = 0, len(self._ids)
        self.text += delta
        return delta


def decode_token(tokenizer: Tokenizer, token_id: int) -> str:
    """Text shown for one token in logprobs output: its own decode, special tokens included.

    Ids past the tokenizer's vocabulary (models often pad the embedding) show as "".
    """
    if not 0 <= token_id < tokenizer.vocab_size:
        return ""
    return tokenizer.decode([token_id], skip_special_tokens=False)


def _check_ids(name: str, ids: Sequence[int]) -> tuple[int, ...]:
    for i in ids:
        if not isinstance(i, int) or isinstance(i, bool) or i < 0:
            raise ValueError(f"StopChecker.{name} must hold non-negative ints, got {i!r}")
    return tuple(ids)


class StopChecker:
    """Decides after each output token whether the sequence is finished.

    Precedence follows vLLM: EOS, then stop_token_ids, then stop strings, then max_tokens
    (a stop string completed by the last allowed token reports "stop", not "length").
    min_tokens: no stop of any kind until min_tokens tokens precede the current one, i.e.
    a stop can fire from output token min_tokens + 1 on (the sampler masks EOS before that).
    """

    def __init__(
        self,
        stop: Sequence[str],
        stop_token_ids: Sequence[int],
        eos_token_ids: Sequence[int],
        ignore_eos: bool,
        min_tokens: int,
        max_tokens: int | None,
        include_stop_str_in_output: bool = False,
    ):
        if isinstance(stop, str):
            stop = [stop]
        for s in stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"StopChecker.stop must hold non-empty strings, got {s!r}")
        if not isinstance(min_tokens, int) or min_tokens < 0:
            raise ValueError(f"StopChecker.min_tokens={min_tokens!r} must be an int >= 0")
        if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
            raise ValueError(f"StopChecker.max_tokens={max_tokens!r} must be None or an int >= 1")
        self.stop = tuple(stop)
        self.stop_token_ids = frozenset(_check_ids("stop_token_ids", stop_token_ids))
        self.eos_token_ids = frozenset(_check_ids("eos_token_ids", eos_token_ids))
        self.ignore_eos = bool(ignore_eos)
        self.min_tokens = min_tokens
        self.max_tokens = max_tokens
        self.include_stop_str_in_output = include_stop_str_in_output
        self._max_stop_len = max((len(s) for s in self.stop), default=0)

    def check(
        self, text: str, new_text_len: int, token_id: int, num_output_tokens: int
    ) -> tuple[str | None, int | None, str | int | None]:
        """Returns (finish_reason, truncate_text_to, stop_reason); (None, None, None) to continue.

        text is all output text so far, of which the last new_text_len characters came with
        this token. truncate_text_to, when not None, means the output text is text[:truncate_text_to].
        """
        if num_output_tokens > self.min_tokens:
            if token_id in self.eos_token_ids and not self.ignore_eos:
                return "stop", self._cut_stop_token(text, new_text_len), None
            if token_id in self.stop_token_ids:
                return "stop", self._cut_stop_token(text, new_text_len), token_id
            found = self._find_stop_string(text, new_text_len)
            if found is not None:
                return "stop", found[1], found[0]
        if self.max_tokens is not None and num_output_tokens >= self.max_tokens:
            return "length", None, None
        return None, None, None

    def _cut_stop_token(self, text: str, new_text_len: int) -> int | None:
        # Like vLLM, the text of the token that stopped the sequence is not part of the output.
        if self.include_stop_str_in_output or new_text_len <= 0:
            return None
        return len(text) - new_text_len

    def _find_stop_string(self, text: str, new_text_len: int) -> tuple[str, int] | None:
        if not self.stop or new_text_len <= 0:
            return None
        # Only a match that ends inside the new text is new; earlier text was checked before.
        tail_start = max(0, len(text) - new_text_len - self._max_stop_len + 1)
        best: tuple[int, str] | None = None
        for s in self.stop:
            idx = text.find(s, max(tail_start, len(text) - new_text_len - len(s) + 1))
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is None:
            return None
        idx, s = best
        return s, idx + len(s) if self.include_stop_str_in_output else idx

"""One sequence's grammar state: an xgrammar GrammarMatcher and how many of the sequence's output tokens it
has accepted. The constrain stage catches it up with the tokens the engine folded (``catch_up``), asks it
for the next-token mask, and rolls it back for speculative decoding (any number of tokens).

Jump-forward (``jump_forward``): when the grammar admits exactly one continuation, its text is encoded
with the model's tokenizer (the tokens the model would read), each token checked and accepted by the
matcher, so what is appended always matches the grammar. Boundaries: the token before the jump was
sampled and is in the KV cache already, so it stays; the jump's last token is held back when a longer
token of the vocabulary extends it (the model then chooses the token that spans the boundary, say ``"``
followed by the first letters of a string value); when the encoding does not spell the forced text
exactly (a tokenizer that adds a prefix space), xgrammar's own tokenization of it is used. When the
grammar is complete and admits nothing but a stop token, the jump ends with that token, so the request
finishes without another model step.
"""

from __future__ import annotations

import torch


class GrammarViolation(ValueError):
    """A token the grammar does not admit reached the matcher (a sampler or logits processor ignored the mask)."""


def stop_only_row(words: int, stop_token_ids) -> torch.Tensor:
    """A bitmask row [words] int32 that allows only the stop tokens."""
    vals = [0] * words
    for t in stop_token_ids:
        vals[t >> 5] |= 1 << (t & 31)
    return torch.tensor([v - (1 << 32) if v >= 1 << 31 else v for v in vals], dtype=torch.int32)


class SeqGrammar:
    def __init__(self, compiler, compiled):
        self.compiler = compiler
        self.matcher = compiler.matcher(compiled)
        self.num_accepted = 0  # output tokens accepted (after the grammar terminated: counted, not matched)

    @property
    def terminated(self) -> bool:
        """A stop token was accepted: nothing but stop tokens may follow."""
        return self.matcher.is_terminated()

    @property
    def completed(self) -> bool:
        """The output so far is a complete sentence of the grammar (it may still go on)."""
        return self.matcher.is_completed()

    def accept(self, tokens) -> None:
        for t in tokens:
            t = int(t)
            if not self.terminated and not self.matcher.accept_token(t):
                raise GrammarViolation(f"token {t} ({self.compiler.token_bytes(t)!r}) does not continue the grammar "
                                       f"after {self.num_accepted} accepted token(s); if the sampling parameters "
                                       "(min_tokens, allowed_token_ids, bad_words, a logits processor) remove every "
                                       "token the grammar allows there, the two ask for incompatible outputs")
            self.num_accepted += 1

    def catch_up(self, output_token_ids) -> None:
        """Accept the output tokens this matcher has not seen yet."""
        self.accept(output_token_ids[self.num_accepted:])

    def rollback(self, num_tokens: int) -> None:
        """Forget the last num_tokens accepted tokens (any number, up to all of them)."""
        if not 0 <= num_tokens <= self.num_accepted:
            raise ValueError(f"rollback({num_tokens}): the matcher has accepted {self.num_accepted} token(s)")
        if num_tokens:
            self.matcher.rollback(num_tokens)
            self.num_accepted -= num_tokens

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the next-token mask into bitmask[row] (a set bit: the token is allowed)."""
        if self.terminated:
            bitmask[row] = stop_only_row(bitmask.shape[1], self.compiler.stop_token_ids)
        else:
            self.matcher.fill_next_token_bitmask(bitmask, row)

    def only_stop_allowed(self) -> bool:
        mask = self.compiler.allocate_bitmask(1)
        self.fill(mask, 0)
        return bool(torch.equal(mask[0], stop_only_row(mask.shape[1], self.compiler.stop_token_ids)))

    def jump_forward(self, tokenizer) -> list:
        """The tokens the grammar forces now, accepted by the matcher (see the module docstring); [] if none."""
        m, comp = self.matcher, self.compiler
        if self.terminated:
            return []
        text = m.find_jump_forward_string()
        toks: list = []
        if text:
            toks = list(tokenizer.encode(text, add_special_tokens=False))
            if b"".join(comp.token_bytes(t) for t in toks) != text.encode():
                toks = list(m.find_jump_forward_tokens())
        taken: list = []
        for t in toks:
            if not m.accept_token(t):
                break
            taken.append(t)
        if taken and comp.is_strict_prefix(taken[-1]) and not self.only_stop_allowed():
            m.rollback(1)  # the model picks the token at the boundary
            taken.pop()
        if comp.stop_token_ids and self.completed and self.only_stop_allowed():
            stop = comp.stop_token_ids[0]
            m.accept_token(stop)
            taken.append(stop)
        self.num_accepted += len(taken)
        return taken

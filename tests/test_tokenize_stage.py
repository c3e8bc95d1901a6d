"""The tokenize stage's checks of token-id prompts: accepted exactly when every id is an int (not a bool) in
[0, vocab); otherwise an error naming the bad ids. The fast path (a C-level check of plain ints) and the
per-id loop must agree with this predicate on every mix."""

from __future__ import annotations

import types

import pytest
from hypothesis import given, settings, strategies as st

from deepinfer.stages.tokenize import TokenizeStage

V = 50


class MyInt(int):
    pass


ITEMS = st.one_of(st.integers(-3, V + 3), st.booleans(), st.floats(0, V, allow_nan=False),
                  st.integers(0, V - 1).map(MyInt), st.just("7"))


def ok(t) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and 0 <= t < V


@settings(max_examples=300, deadline=None)
@given(st.lists(ITEMS, min_size=1, max_size=12))
def test_token_id_prompts_are_accepted_exactly_when_valid(ids):
    stage = TokenizeStage(tokenizer=None, vocab_size=V)
    state = types.SimpleNamespace(prompt=list(ids))
    if all(ok(t) for t in ids):
        stage(state)
        assert state.prompt_token_ids == list(ids)
    else:
        with pytest.raises(ValueError, match="out of range") as err:
            stage(state)
        first_bad = next(t for t in ids if not ok(t))
        assert repr(first_bad) in str(err.value)


def test_empty_prompt_is_an_error():
    with pytest.raises(ValueError, match="prompt is empty"):
        TokenizeStage(tokenizer=None, vocab_size=V)(types.SimpleNamespace(prompt=[]))

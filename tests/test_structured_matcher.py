"""The grammar machinery under the constrain stage: TokenizerInfo from tokenizer.json with a padded vocabulary,
the compile cache, per-sequence matchers (rollback of any number of tokens, then re-accepting gives the same
bitmasks), and jump-forward (the tokens appended are the tokenizer's, accepted by the grammar)."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings, strategies as st

pytest.importorskip("xgrammar")

from deepinfer import StructuredOutputsParams as SO  # noqa: E402
from deepinfer.backends.reference.bitmask import allowed_mask  # noqa: E402
from deepinfer.models.loader import DEMO_DIR  # noqa: E402
from deepinfer.structured import GrammarCompilers, GrammarViolation, SeqGrammar  # noqa: E402
from deepinfer.tokenizer import Tokenizer  # noqa: E402

V = 4096
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["a", "bb", "ccc"]}, "maxItems": 3},
    "pos": {"type": "object", "properties": {"x": {"type": "number", "minimum": -1, "maximum": 1}}}},
    "required": ["name", "age", "tags"]}
SPECS = [SO(json=SCHEMA), SO(json=SCHEMA, disable_any_whitespace=True), SO(regex=r"(ab|c)*d{2,3}"),
         SO(grammar='root ::= "(" root ")" | "x"'), SO(choice=["alpha", "alps", "beta"])]


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_dir(DEMO_DIR)


@pytest.fixture(scope="module")
def comp(tok):
    return GrammarCompilers.get(tok, V)


def grammar(comp, spec) -> SeqGrammar:
    return SeqGrammar(comp, comp.submit(spec).result(timeout=60))


def mask_of(g: SeqGrammar) -> torch.Tensor:
    m = g.compiler.allocate_bitmask(1)
    g.fill(m, 0)
    return m[0].clone()


def walk(g: SeqGrammar, rng: random.Random, steps: int) -> tuple:
    """Accept up to `steps` random allowed tokens (stop tokens only when nothing else is allowed); returns the
    tokens and the mask seen before each of them."""
    toks, masks = [], []
    stops = set(g.compiler.stop_token_ids)
    for _ in range(steps):
        m = mask_of(g)
        allowed = allowed_mask(m[None], V)[0].nonzero().flatten().tolist()
        choices = [t for t in allowed if t not in stops] or allowed
        if not choices or g.terminated:
            break
        t = rng.choice(choices)
        masks.append(m)
        toks.append(t)
        g.accept([t])
    return toks, masks


def test_tokenizer_info_from_tokenizer_json_with_a_padded_vocabulary(tok):
    from deepinfer.structured.compiler import Compiler

    padded = Compiler(tok, V + 100)  # the model's lm_head padded past the tokenizer's 4096 ids
    assert padded.info.vocab_size == V + 100 and padded.stop_token_ids == list(tok.eos_token_ids)
    g = SeqGrammar(padded, padded.submit(SO(regex="[a-z]+")).result(timeout=60))
    m = padded.allocate_bitmask(1)
    assert m.shape == (1, (V + 100 + 31) // 32)
    g.fill(m, 0)
    allowed = allowed_mask(m, V + 100)[0]
    assert not allowed[V:].any() and allowed[:V].sum() > 10  # padded ids are never allowed
    assert all(tok.decode([t]).isalpha() for t in allowed.nonzero().flatten().tolist()[:50])


def test_compiles_are_cached_by_grammar_and_tokenizer(tok, comp):
    a = comp.submit(SO(json=SCHEMA))
    assert comp.submit(SO(json=dict(SCHEMA))) is a  # same grammar: same compilation
    assert comp.submit(SO(json=SCHEMA, disable_any_whitespace=True)) is not a
    assert GrammarCompilers.get(tok, V) is comp and GrammarCompilers.get(tok, V + 32) is not comp
    bad = comp.submit(SO(regex="(ab"))
    with pytest.raises(RuntimeError, match="parenthesis is not closed"):
        bad.result(timeout=60)
    assert comp.submit(SO(regex="(ab")) is bad  # a bad grammar's error is cached too


@given(spec=st.sampled_from(SPECS), seed=st.integers(0, 10**6), steps=st.integers(1, 40), data=st.data())
@settings(max_examples=40, deadline=None)
def test_rollback_then_reaccept_gives_the_same_bitmasks(comp, spec, seed, steps, data):
    g = grammar(comp, spec)
    toks, masks = walk(g, random.Random(seed), steps)
    final = mask_of(g)
    k = data.draw(st.integers(0, len(toks)), label="rollback")
    g.rollback(k)
    assert g.num_accepted == len(toks) - k
    for i in range(len(toks) - k, len(toks)):
        assert torch.equal(mask_of(g), masks[i]), f"mask {i} differs after rolling back {k}"
        g.accept([toks[i]])
    assert torch.equal(mask_of(g), final)
    with pytest.raises(ValueError, match="rollback"):
        g.rollback(len(toks) + 1)


def test_a_token_outside_the_grammar_is_refused(comp, tok):
    g = grammar(comp, SO(regex="[0-9]+"))
    with pytest.raises(GrammarViolation, match="does not continue the grammar"):
        g.accept(tok.encode("abc", add_special_tokens=False))


def test_catch_up_accepts_only_new_tokens(comp, tok):
    g = grammar(comp, SO(regex="[a-z]+!"))
    ids = tok.encode("hello", add_special_tokens=False)
    g.catch_up(ids[:1])
    g.catch_up(ids)
    assert g.num_accepted == len(ids) and not g.completed
    g.catch_up(ids + tok.encode("!", add_special_tokens=False))
    assert g.completed and g.only_stop_allowed()


def test_jump_forward_appends_the_tokenizers_encoding_of_the_forced_text(comp, tok):
    keys = ["alpha", "beta_value", "gamma_count"]
    schema = {"type": "object", "properties": {k: {"type": "integer", "minimum": 0, "maximum": 9} for k in keys},
              "required": keys}
    g = grammar(comp, SO(json=schema, disable_any_whitespace=True, jump_forward=True))
    text = ""
    jumped = 0
    for digit in "123":
        forced = g.matcher.find_jump_forward_string()
        toks = g.jump_forward(tok)
        jumped += len(toks)
        piece = tok.decode(toks)
        assert forced.startswith(piece) and toks == tok.encode(piece, add_special_tokens=False)
        text += piece
        g.matcher.find_jump_forward_string()
        rest = forced[len(piece):]  # held back at the boundary: the model writes it
        for t in tok.encode(rest + digit, add_special_tokens=False):
            g.accept([t])
        text += rest + digit
    tail = g.jump_forward(tok)
    assert tail[-1] in tok.eos_token_ids  # complete: the jump ends with the stop token
    text += tok.decode(tail)
    assert text == '{"alpha": 1, "beta_value": 2, "gamma_count": 3}'
    assert jumped >= 6  # the fixed keys were jumped, not sampled


def test_the_compile_cache_is_bounded(tok, comp, monkeypatch):
    from deepinfer.structured import compiler

    monkeypatch.setattr(compiler, "CACHE_SIZE", 2)
    first = comp.submit(SO(regex="q1"))
    comp.submit(SO(regex="q2"))
    assert comp.submit(SO(regex="q1")) is first  # a hit refreshes it
    comp.submit(SO(regex="q3"))  # evicts q2, the least recently used
    assert comp.submit(SO(regex="q1")) is first and len(comp._cache) == 2


def test_the_stage_rolls_a_sequence_back_for_speculative_decoding(tok):
    """Draft tokens accepted, then rejected: GrammarStage.rollback returns the matcher to the shorter sequence,
    and the next step's mask is the one before the drafts."""
    from types import SimpleNamespace

    from deepinfer import SamplingParams
    from deepinfer.backends.reference.ops import ReferenceOps
    from deepinfer.stages.constrain import GrammarStage

    stage = GrammarStage(tokenizer=tok, vocab_size=V, ops=ReferenceOps("cpu"))
    stage.admit_request("r", SamplingParams(structured_outputs=SO(json=SCHEMA, disable_any_whitespace=True)))
    out = list(tok.encode('{"name": "ab', add_special_tokens=False))
    seq = SimpleNamespace(request_id="r", seq_id=0, output_token_ids=out[:2], finished=False)
    g = stage.grammar(seq)
    g.catch_up(seq.output_token_ids)
    before = mask_of(g)
    seq.output_token_ids = out  # drafts accepted...
    g.catch_up(seq.output_token_ids)
    assert not torch.equal(mask_of(g), before)
    stage.rollback(seq, len(out) - 2)  # ...then rejected
    seq.output_token_ids = out[:2]
    assert g.num_accepted == 2 and torch.equal(mask_of(g), before)
    stage.release_request("r")

"""Structured outputs end to end on the demo model (LLM() with no model): regexes, choices, an EBNF arithmetic
grammar, JSON objects, mixed batches, failures that stay with their request (bad grammars, rejected schemas,
a compile past the time limit, no xgrammar), overlap scheduling, and the CLI flags."""

from __future__ import annotations

import concurrent.futures
import json
import re
import sys
import threading
from fractions import Fraction

import pytest

pytest.importorskip("xgrammar")

from deepinfer import LLM, Pipeline, SamplingParams, StructuredOutputsParams  # noqa: E402

SO = StructuredOutputsParams
PROMPTS = ["def f(x):", "The answer is ", "import os\n", "x = "]


@pytest.fixture(scope="module")
def llm():
    return LLM(max_model_len=256, threads=1)


def sp(so=None, temperature=0.0, max_tokens=48, **kw):
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, structured_outputs=so, **kw)


def texts(outs):
    return [o.outputs[0].text for o in outs]


REGEXES = [r"\d{3}-[a-z]{2,5}", r"(yes|no|maybe)!", r"[A-Z][a-z]{1,6}( [A-Z][a-z]{1,6}){0,2}\.",
           r"0x[0-9a-f]{4}", r"(ab|cd){1,4}e"]


def test_regex_outputs_fullmatch(llm):
    params = [sp(SO(regex=rx), temperature=t, seed=i) for i, rx in enumerate(REGEXES) for t in (0.0, 1.0)]
    outs = llm.generate([PROMPTS[i % 4] for i in range(len(params))], params, use_tqdm=False)
    for p, o in zip(params, outs):
        c = o.outputs[0]
        assert c.finish_reason == "stop" and re.fullmatch(p.structured_outputs.regex, c.text), (p, c)


def test_choices_are_exactly_one_of_the_list(llm):
    lists = [["yes", "no"], ["red", "green", "blue", "greenish"], ['say "hi"', "back\\slash", "naïve", "two\nlines"]]
    params = [sp(SO(choice=c), temperature=t, seed=7) for c in lists for t in (0.0, 1.5)]
    outs = llm.generate([PROMPTS[1]] * len(params), params, use_tqdm=False)
    for p, o in zip(params, outs):
        assert o.outputs[0].finish_reason == "stop" and o.outputs[0].text in p.structured_outputs.choice


ARITH = r"""
root ::= expr
expr ::= term | term addop term | term addop term addop term
term ::= factor | factor mulop factor
factor ::= num | "(" num addop num ")" | "(" num mulop num ")"
num ::= [1-9] | [1-9] [0-9]
addop ::= "+" | "-"
mulop ::= "*" | "/"
"""


def parse_arith(text: str) -> Fraction:
    """A recursive-descent parser of + - * / ( ) over positive integers; raises ValueError on bad input."""
    toks = re.findall(r"\d+|[-+*/()]|\S", text)
    pos = 0

    def peek():
        return toks[pos] if pos < len(toks) else None

    def take(what=None):
        nonlocal pos
        t = peek()
        if t is None or (what is not None and t != what):
            raise ValueError(f"expected {what or 'a token'} at {pos} in {text!r}")
        pos += 1
        return t

    def factor():
        if peek() == "(":
            take("(")
            v = expr()
            take(")")
            return v
        t = take()
        if not t.isdigit():
            raise ValueError(f"not a number: {t!r} in {text!r}")
        return Fraction(int(t))

    def term():
        v = factor()
        while peek() in ("*", "/"):
            v = v * factor() if take() == "*" else v / factor()
        return v

    def expr():
        v = term()
        while peek() in ("+", "-"):
            v = v + term() if take() == "+" else v - term()
        return v

    if " " in text:
        raise ValueError(f"the grammar has no spaces: {text!r}")
    v = expr()
    if pos != len(toks):
        raise ValueError(f"trailing input at {pos} in {text!r}")
    return v


def test_ebnf_arithmetic_grammar(llm):
    params = [sp(SO(grammar=ARITH), temperature=t, seed=s) for t in (0.0, 1.0) for s in range(4)]
    outs = llm.generate([PROMPTS[s % 4] for s in range(len(params))], params, use_tqdm=False)
    for o in outs:
        assert o.outputs[0].finish_reason == "stop"
        parse_arith(o.outputs[0].text)  # raises on a sentence outside the grammar
    with pytest.raises(ValueError):
        parse_arith("1+")  # the parser is a real check


def test_json_object_and_any_whitespace(llm):
    outs = llm.generate(["data = "] * 2, [sp(SO(json_object=True, disable_any_whitespace=True), max_tokens=120),
                                          sp(SO(json={"enum": ["on", "off"]}))], use_tqdm=False)
    c = outs[0].outputs[0]
    if c.finish_reason == "stop":  # an open-ended object may outrun max_tokens; when it ends, it is an object
        assert isinstance(json.loads(c.text), dict)
    else:
        assert c.text.startswith("{")
    assert json.loads(outs[1].outputs[0].text) in ("on", "off")  # any whitespace is allowed around it


def test_unconstrained_neighbours_are_unchanged(llm):
    plain = [sp(max_tokens=12), sp(max_tokens=12, temperature=0.9, seed=3)]
    alone = llm.generate(PROMPTS[:2], plain, use_tqdm=False)
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["a"]}
    mixed = llm.generate([PROMPTS[2], PROMPTS[0], PROMPTS[3], PROMPTS[1]],
                         [sp(SO(json=schema, disable_any_whitespace=True)), plain[0],
                          sp(SO(regex=r"[a-z]{3}", jump_forward=True)), plain[1]], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in (mixed[1], mixed[3])] == [o.outputs[0].token_ids for o in alone]
    assert json.loads(mixed[0].outputs[0].text)["a"] in range(100)
    assert re.fullmatch(r"[a-z]{3}", mixed[2].outputs[0].text)


def test_bad_grammars_fail_alone_among_good_ones(llm, caplog):
    words = [f"w{i:05d}_{'z' * 20}" for i in range(3000)]
    slow = LLM(max_model_len=256, threads=1, structured_outputs_timeout_s=0.02)
    cases = [
        (SO(regex="(ab"), "the regex does not compile: Regex parsing error at position 4"),
        (SO(grammar='root ::= "a" |'), "the EBNF grammar does not compile: EBNF parser error"),
        (SO(json={"type": "foo"}), 'the JSON schema does not compile: Unsupported type "foo"'),
        (SO(json={"type": "array", "items": {"type": "integer"}, "uniqueItems": True}),
         "'uniqueItems' at / is not supported"),
        (SO(json={"type": "object", "properties": {"n": {"type": "number", "multipleOf": 0.5}}}),
         "'multipleOf' at /properties/n is not supported"),
        (SO(json={"enum": words}), "did not compile within structured_outputs_timeout_s=0.02 s"),
        (None, None), (SO(regex="[0-9]{2}"), None), (SO(choice=["A", "B"]), None),
    ]
    # Every grammar but the slow one is compiled (or has failed) before the run, so on a busy machine only the
    # slow one can miss the 0.02 s limit; and the slow one's compilation is held until the run is over (else a
    # machine slow enough at prefill would have it done by its first sampling step, which then serves it).
    comp = next(st for st in slow.engine.stages["step"] if st.name == "grammar").compiler
    for so, err in cases:
        if so is not None and so.json != {"enum": words} and not (err and "not supported" in err):
            concurrent.futures.wait([comp.submit(so)], timeout=60)
    release, compile_ = threading.Event(), comp._compile

    def held(key):
        if key == SO(json={"enum": words}).key:
            release.wait(60)
        return compile_(key)

    comp._compile = held
    try:
        outs = slow.generate([PROMPTS[i % 4] for i in range(len(cases))], [sp(so) for so, _ in cases],
                             use_tqdm=False)
    finally:
        release.set()
    for (so, err), o in zip(cases, outs):
        c = o.outputs[0]
        if err is None:
            assert c.finish_reason in ("stop", "length") and c.error is None and c.text
        else:
            assert c.finish_reason == "error" and err in c.error, (so, c.error)
    assert re.fullmatch("[0-9]{2}", outs[7].outputs[0].text) and outs[8].outputs[0].text in ("A", "B")
    # The engine serves on: a bad regex again (now known bad: it fails at admission) and a good request.
    again = slow.generate(PROMPTS[:2], [sp(SO(regex="(ab")), sp(SO(regex="z+"), max_tokens=4)], use_tqdm=False)
    assert "Regex parsing error" in again[0].outputs[0].error and set(again[1].outputs[0].text) == {"z"}


def test_bounded_strings_stay_json_when_the_model_pushes_control_characters(llm):
    """The README's schema (a name of at most 20 characters) with the tab token pushed up: xgrammar's own bounded
    string would let raw tabs in (invalid JSON); the repaired grammar escapes or refuses them."""
    tab = llm.tokenizer.encode("\t", add_special_tokens=False)
    assert len(tab) == 1
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 150}},
              "required": ["name", "age"]}
    params = [sp(SO(json=schema, disable_any_whitespace=True), temperature=t, max_tokens=64, seed=i,
                 logit_bias={tab[0]: 20.0}) for i, t in enumerate((0.0, 1.0, 1.5))]
    for o in llm.generate(PROMPTS[:3], params, use_tqdm=False):
        c = o.outputs[0]
        assert c.finish_reason == "stop", c
        value = json.loads(c.text)
        assert len(value["name"]) <= 20 and 0 <= value["age"] <= 150


def test_an_unsatisfiable_grammar_fails_alone_naming_it(llm):
    """A regex no string matches leaves no token allowed: the request fails saying so (it was once reported as
    the model's non-finite logits), and its neighbour is untouched."""
    alone = llm.generate(PROMPTS[:1], [sp(max_tokens=6)], use_tqdm=False)[0].outputs[0].token_ids
    outs = llm.generate(PROMPTS[:2], [sp(max_tokens=6), sp(SO(regex="[^\\s\\S]"), max_tokens=6)], use_tqdm=False)
    assert outs[0].outputs[0].token_ids == alone and outs[0].error is None
    assert outs[1].outputs[0].finish_reason == "error" and "grammar admits no token" in outs[1].error


def test_grammar_completion_ends_the_request(llm):
    out = llm.generate([PROMPTS[0]], sp(SO(choice=["done"]), max_tokens=100), use_tqdm=False)[0].outputs[0]
    assert (out.text, out.finish_reason) == ("done", "stop")
    assert out.token_ids[-1] == llm.get_tokenizer().eos_token_id and len(out.token_ids) <= 5  # not 100 tokens


def test_n_and_seeds_each_follow_the_grammar(llm):
    outs = llm.generate([PROMPTS[3]], sp(SO(regex=r"[a-z]{2,4}=\d"), temperature=1.0, seed=5, n=3), use_tqdm=False)
    comps = outs[0].outputs
    assert len(comps) == 3 and all(re.fullmatch(r"[a-z]{2,4}=\d", c.text) for c in comps)


def test_overlap_scheduling_gives_the_same_outputs():
    """Greedy and seeded outputs are those without overlap; the engine collects the step in flight in the middle
    of the next launch when a row is constrained."""
    schema = {"type": "object", "properties": {"k": {"enum": ["a", "b"]}, "v": {"type": "integer", "minimum": 0,
                                                                              "maximum": 9}}, "required": ["k", "v"]}
    params = [sp(SO(json=schema, disable_any_whitespace=True)), sp(max_tokens=10), sp(SO(regex=r"[a-c]{4}")),
              sp(SO(choice=["x", "yy"]), temperature=1.0, seed=2)]
    ref = LLM(max_model_len=256, threads=1).generate(PROMPTS, params, use_tqdm=False)
    ov = LLM(max_model_len=256, threads=1, overlap_scheduling=True)
    eng, seen, where = ov.engine, [], {"launching": False}
    launch, collect = eng._launch, eng._collect_step

    def launching(*a):
        where["launching"] = True
        try:
            return launch(*a)
        finally:
            where["launching"] = False

    def collecting(*a):
        seen.append(where["launching"])
        return collect(*a)

    eng._launch, eng._collect_step = launching, collecting
    assert eng.overlap
    got = ov.generate(PROMPTS, params, use_tqdm=False)
    # The step in flight was collected inside the next launch (after its forward, before the grammar stage).
    assert any(seen) and not all(seen)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
    assert json.loads(got[0].outputs[0].text)["k"] in ("a", "b")


def test_without_xgrammar_a_constrained_request_fails_alone(monkeypatch):
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import xgrammar now raises ImportError
    llm = LLM(max_model_len=128, threads=1)
    outs = llm.generate(PROMPTS[:2], [sp(SO(regex="a+")), sp(max_tokens=4)], use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "error"
    assert "pip install 'deepinfer[structured]'" in outs[0].outputs[0].error
    assert outs[1].outputs[0].finish_reason == "length" and outs[1].outputs[0].error is None


def test_a_pipeline_without_the_constrain_stage_refuses_constrained_requests():
    llm = LLM(max_model_len=128, threads=1, pipeline=Pipeline.from_recipe("reference").remove("grammar"))
    outs = llm.generate(PROMPTS[:2], [sp(SO(regex="a+")), sp(max_tokens=3)], use_tqdm=False)
    assert "needs a constrain stage" in outs[0].outputs[0].error and outs[1].outputs[0].error is None


def test_cli_flags(tmp_path, capsys):
    from deepinfer.cli import main

    schema = tmp_path / "s.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}))
    grammar = tmp_path / "g.ebnf"
    grammar.write_text(ARITH)
    runs = [["--json-schema", str(schema), "--disable-any-whitespace", "--jump-forward"], ["--regex", "[a-z]{3}"],
            ["--choice", "left", "--choice", "right"], ["--grammar", str(grammar)]]
    for flags in runs:
        code = main(["generate", "--json", "--temperature", "0", "--max-tokens", "40", *flags, "x = "])
        out, err = capsys.readouterr()
        assert code == 0, err
        text = json.loads(out)["completions"][0]["text"]
        if flags[0] == "--json-schema":
            assert isinstance(json.loads(text)["ok"], bool)
        elif flags[0] == "--regex":
            assert re.fullmatch("[a-z]{3}", text)
        elif flags[0] == "--choice":
            assert text in ("left", "right")
        else:
            parse_arith(text)
    assert main(["generate", "--regex", "a", "--choice", "b", "x"]) == 2
    assert "give at most one of --regex, --choice" in capsys.readouterr().err
    assert main(["generate", "--json-schema", str(tmp_path / "missing.json"), "x"]) == 2
    assert "cannot read it" in capsys.readouterr().err
    assert main(["generate", "--jump-forward", "x"]) == 2

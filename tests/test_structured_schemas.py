"""Structured outputs on the demo model: 100 JSON schemas drawn by hypothesis (objects, arrays, enums, numbers
and integers with ranges, bounded strings, nested, required and optional keys) give output that parses and
validates with the jsonschema library, greedy and sampled, and with jump-forward. Every schema bounds its
output's length (strings have maxLength, arrays maxItems, numbers ranges), so each completes well inside
max_tokens; all requests run in one generate call (one batch), which keeps the file quick on a CPU."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, seed, settings, strategies as st

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

from deepinfer import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402

NAMES = ["id", "name", "age", "tags", "price", "kind", "ok", "items", "x", "y", "note", "level"]
WORDS = ["red", "green", "blue", "a b", "x\"y", "ü", "1", "none"]
N = 100


@st.composite
def integers(draw):
    lo = draw(st.integers(-1000, 1000))
    return {"type": "integer", "minimum": lo, "maximum": draw(st.integers(lo, lo + 2000))}


@st.composite
def numbers(draw):
    lo = draw(st.integers(-100, 100))
    hi = draw(st.integers(lo + 1, lo + 200))
    return {"type": "number", "minimum": lo / 4, "maximum": hi / 4}


@st.composite
def strings(draw):
    hi = draw(st.integers(1, 8))
    s = {"type": "string", "maxLength": hi}
    if draw(st.booleans()):
        s["minLength"] = draw(st.integers(0, hi))
    return s


enums = st.lists(st.one_of(st.sampled_from(WORDS), st.integers(-50, 50)), min_size=1, max_size=4,
                 unique=True).map(lambda v: {"enum": v})
leaves = st.one_of(integers(), numbers(), strings(), enums, st.just({"type": "boolean"}), st.just({"type": "null"}))


def containers(children):
    def obj(props, req_bits):
        names = list(props)
        return {"type": "object", "properties": props,
                "required": [n for n, keep in zip(names, req_bits) if keep]}

    objects = st.dictionaries(st.sampled_from(NAMES), children, min_size=1, max_size=3).flatmap(
        lambda props: st.lists(st.booleans(), min_size=len(props), max_size=len(props)).map(
            lambda bits: obj(props, bits)))
    arrays = st.tuples(children, st.integers(1, 3), st.integers(0, 1)).map(
        lambda t: {"type": "array", "items": t[0], "maxItems": t[1], "minItems": min(t[2], t[1])})
    return st.one_of(objects, arrays)


schemas = st.recursive(leaves, containers, max_leaves=5).filter(lambda s: "properties" in s or "items" in s)


def draw_schemas(n: int) -> list:
    out: list = []

    @seed(14)
    @settings(max_examples=4 * n, database=None, derandomize=True, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(schemas)
    def collect(s):
        if len(out) < n and s not in out:
            out.append(s)

    collect()
    return out


SCHEMAS = draw_schemas(N)


@pytest.fixture(scope="module")
def llm():
    return LLM(max_model_len=512, max_num_seqs=256, threads=1)


def check(outs, schemas, label):
    bad = []
    for o, schema in zip(outs, schemas):
        c = o.outputs[0]
        try:
            assert c.finish_reason == "stop", f"finish_reason {c.finish_reason} ({c.error})"
            jsonschema.validate(json.loads(c.text), schema)
        except Exception as exc:  # collect them all: one message lists every failure
            bad.append(f"{label}: schema {json.dumps(schema)} gave {c.text!r}: {exc}")
    assert not bad, "\n".join(bad)


def test_the_drawn_schemas_cover_the_features():
    assert len(SCHEMAS) == N
    text = json.dumps(SCHEMAS)
    for feature in ('"type": "object"', '"type": "array"', '"enum"', '"type": "number"', '"minimum"',
                    '"required": []', '"maxLength"'):
        assert feature in text, feature
    assert any(s.get("type") == "object" and any(v.get("type") in ("object", "array")
                                                 for v in s["properties"].values()) for s in SCHEMAS)  # nested


def test_outputs_validate_greedy_sampled_and_jump_forward(llm):
    prompts, params, want = [], [], []
    for i, schema in enumerate(SCHEMAS):
        for mode in ("greedy", "sampled", "jump"):
            so = StructuredOutputsParams(json=schema, disable_any_whitespace=True, jump_forward=mode == "jump")
            temp = 0.8 if mode == "sampled" else 0.0
            params.append(SamplingParams(max_tokens=300, temperature=temp, seed=i, structured_outputs=so))
            prompts.append("data = ")
            want.append((schema, mode))
    outs = llm.generate(prompts, params, use_tqdm=False)
    for mode in ("greedy", "sampled", "jump"):
        sel = [k for k, (_, m) in enumerate(want) if m == mode]
        check([outs[k] for k in sel], [want[k][0] for k in sel], mode)
    # Jump-forward appends forced tokens without a model step but the same text is allowed: it validates, and
    # on schemas with fixed keys it took fewer sampled tokens.
    n_tokens = {m: sum(len(outs[k].outputs[0].token_ids) for k, (_, mm) in enumerate(want) if mm == m)
                for m in ("greedy", "jump")}
    assert n_tokens["jump"] > 0 and n_tokens["greedy"] > 0

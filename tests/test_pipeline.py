"""Pipeline: validation errors that name the stage and the field, immutable edits, describe/to_dot, recipes."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer import Pipeline, PipelineError
from deepinfer.core.plugins import get_registry, new_plugin_manager

STEP = ["prefill", "forward", "verify", "grammar", "sampler", "detokenize"]


# Test stages: plain classes are enough, a factory only needs the contract's class attributes.
class WriteY:
    name, kind, reads, writes = "cyc_a", "test", ("x",), ("y",)


class WriteX:
    name, kind, reads, writes = "cyc_b", "test", ("y",), ("x",)


class SecondSampler:
    name, kind, reads, writes = "sampler2", "sample", ("logits", "sampling"), ("next_tokens",)


class Seven:
    """A sampler that declares it replaces the built-in one, so it may write next_tokens too."""

    name, kind, reads, writes, replaces = "seven", "sample", ("logits", "sampling"), ("next_tokens",), ("sampler",)

    def __init__(self, token: int = 7):
        self.token = token


class SevenByKind(Seven):
    name, replaces = "seven_by_kind", ("sample",)


class ScaleLogits:
    """A transformer: reads and writes logits, so it runs after verify and before every reader of logits."""

    name, kind, reads, writes = "scale", "constrain", ("logits",), ("logits",)


class WritesBatch:
    name, kind, reads, writes = "bad_writer", "test", (), ("batch",)


class NoTuple:
    name, kind, reads, writes = "no_tuple", "test", "logits", ("x",)


@pytest.fixture
def reg():
    r = get_registry(new_plugin_manager(load_entry_points=False))
    for cls in (WriteY, WriteX, SecondSampler, Seven, SevenByKind, ScaleLogits, WritesBatch, NoTuple):
        r.current_plugin = "tests.test_pipeline"
        r.stage(kind=cls.kind, name=cls.name, factory=cls)
    return r


@pytest.fixture
def ref(reg):
    return Pipeline.from_recipe("reference", registry=reg)


def _spec(pipe, name):
    (spec,) = [s for s in pipe.specs if s.name == name]
    return spec


def test_reference_recipe_order(ref):
    assert ref.stage_names("admit") == ["tokenize", "prefix_cache", "swa_replay"]
    assert ref.stage_names("step") == STEP
    assert ref.recipe == "reference" and ref.config == {"enforce_eager": True, "overlap_scheduling": False}
    assert ref.backend == "reference" and _spec(ref, "swa_replay").args == {"mode": "exact"}


def test_missing_producer_names_stage_and_field(ref):
    with pytest.raises(PipelineError, match=r"stage 'grammar' reads 'logits', which no step stage writes"):
        ref.remove("verify")


def test_missing_engine_output_names_field(ref):
    with pytest.raises(PipelineError, match=r"no step stage writes 'outputs'"):
        ref.remove("detokenize")


def test_two_writers_without_replaces(ref):
    with pytest.raises(PipelineError) as exc:
        ref.insert("sampler2", after="sampler")
    msg = str(exc.value)
    assert "'sampler'" in msg and "'sampler2'" in msg and "'next_tokens'" in msg and "replaces" in msg


def test_cycle_names_stages_and_fields(reg):
    with pytest.raises(PipelineError, match="cycle") as exc:
        Pipeline.from_stages(["tokenize", *STEP, "cyc_a", "cyc_b"], registry=reg)
    msg = str(exc.value)
    assert "'cyc_a'" in msg and "'cyc_b'" in msg
    assert "'x'" in msg and "'y'" in msg


def test_writing_an_engine_input_is_refused(ref):
    with pytest.raises(PipelineError, match=r"stage 'bad_writer' writes 'batch', which is an engine input"):
        ref.insert("bad_writer", before="prefill")


def test_reads_must_be_a_tuple(ref):
    with pytest.raises(PipelineError, match=r"stage 'no_tuple' .* does not declare reads"):
        ref.insert("no_tuple", after="verify")


def test_unknown_stage_lists_registered_names(ref, reg):
    with pytest.raises(PipelineError, match="unknown stage 'nope'") as exc:
        ref.replace("sample", "nope")
    for name in reg.names("stage"):
        assert name in str(exc.value)
    with pytest.raises(PipelineError, match="unknown stage 'nope'"):
        Pipeline.from_stages(["nope"], registry=reg)


def test_unknown_target_lists_the_pipeline(ref):
    with pytest.raises(PipelineError, match=r"no stage named or of kind 'draft'.*sampler \[sample\]"):
        ref.remove("draft")


def test_duplicate_stage_name(ref):
    with pytest.raises(PipelineError, match="used twice: sampler"):
        ref.insert("sampler", after="detokenize")


@pytest.mark.parametrize("target,old,name,kinds", [
    ("sampler", "sampler", "tokenize", ("sample", "tokenize")),  # was "stage name(s) used twice: tokenize"
    ("sample", "sampler", "detokenize", ("sample", "detokenize")),  # target by kind
    ("verify", "verify", "scale", ("verify", "constrain")),  # a constrain stage does not do verify's job
])
def test_replace_with_another_kind_names_both_kinds(ref, target, old, name, kinds):
    with pytest.raises(PipelineError) as exc:
        ref.replace(target, name)
    msg = str(exc.value)
    assert (f"cannot replace {old!r} (kind {kinds[0]!r}) with {name!r} (kind {kinds[1]!r}): the kinds differ"
            in msg)
    assert "used twice" not in msg and "insert()" in msg


def test_writer_names_the_stage_whose_value_the_engine_gets(ref):
    assert ref.writer("logprobs") == "sampler" and ref.writer("next_tokens") == "sampler"
    assert ref.writer("prompt_token_ids", phase="admit") == "tokenize" and ref.writer("prompt_token_ids") is None
    assert ref.writer("batch") is None  # an engine input, not a stage's
    seven = ref.replace("sample", "seven")
    assert seven.writer("logprobs") is None and seven.writer("next_tokens") == "seven"
    # A declared replacement runs after the stage it replaces, so its value is the one the engine gets.
    assert ref.insert("seven", before="sampler").writer("next_tokens") == "seven"
    assert ref.insert("scale", after="sampler").writer("logits") == "scale"  # the last transformer


def test_insert_needs_one_anchor(ref):
    with pytest.raises(PipelineError, match="exactly one of before= or after="):
        ref.insert("scale")
    with pytest.raises(PipelineError, match="exactly one of before= or after="):
        ref.insert("scale", before="sampler", after="verify")


def test_edits_return_new_pipelines_and_leave_the_original(ref):
    specs, names = list(ref.specs), ref.stage_names()
    replaced = ref.replace("sample", "seven", token=3)
    inserted = ref.insert("scale", after="verify")
    removed = inserted.remove("scale")
    with_args = replaced.with_args("seven", token=5)
    assert ref.specs == specs and ref.stage_names() == names, "an edit changed the original"
    assert replaced.stage_names() == [n.replace("sampler", "seven") for n in STEP]
    assert _spec(replaced, "seven").args == {"token": 3} and _spec(with_args, "seven").args == {"token": 5}
    assert inserted.stage_names() == [*STEP[:3], "scale", *STEP[3:]]
    assert removed.stage_names() == names and removed is not inserted
    assert all(p.recipe == "reference" and p.registry is ref.registry for p in (replaced, inserted, removed))
    # replace by name and by kind pick the same stage
    assert ref.replace("sampler", "seven").stage_names() == replaced.stage_names()


@pytest.mark.parametrize("stage", ["seven", "seven_by_kind"])
@pytest.mark.parametrize("where", ["before", "after"])
def test_declared_replacement_may_write_the_same_field(ref, stage, where):
    p = ref.insert(stage, **{where: "sampler"})
    order = p.stage_names()
    # The replacement runs after the stage it replaces (its value is the one detokenize reads), wherever listed.
    assert order.index("sampler") < order.index(stage) < order.index("detokenize")


def test_transformer_runs_between_producer_and_readers(ref):
    p = ref.insert("scale", before="prefill")  # listed first, but it reads logits
    assert p.stage_names() == [*STEP[:3], "scale", *STEP[3:]]


@settings(max_examples=30, deadline=None)
@given(st.permutations(["tokenize", *STEP, "scale"]))
def test_run_order_does_not_depend_on_list_order(perm):
    reg = get_registry(new_plugin_manager(load_entry_points=False))
    reg.stage(kind="constrain", name="scale", factory=ScaleLogits)
    p = Pipeline.from_stages(perm, registry=reg)
    assert p.stage_names("admit") == ["tokenize"]
    # Two stages transform logits (grammar and scale): both run between verify and the sampler, in list order.
    transformers = [n for n in perm if n in ("grammar", "scale")]
    assert p.stage_names("step") == [*STEP[:3], *transformers, *STEP[4:]]


def test_describe_lists_every_stage_with_reads_and_writes(ref):
    p = ref.insert("scale", after="verify")
    text = p.describe()
    lines = text.splitlines()
    assert lines[0] == "Pipeline reference"
    for spec in p.specs:
        (i,) = [k for k, line in enumerate(lines) if re.search(rf"\d+\. {spec.name} \[{spec.kind}\]", line)]
        assert f"from {spec.plugin}" in lines[i]
        assert lines[i + 1].split() == ["reads:", *(", ".join(spec.reads).split() or ["-"]),
                                        "writes:", *(", ".join(spec.writes).split() or ["-"])]
    assert "from tests.test_pipeline" in text  # provenance of the test stage
    assert "seven [sample] (token=3)" in ref.replace("sample", "seven", token=3).describe()


# A small parser for the DOT language subset: enough to reject malformed text and read nodes and edges.
_TOKEN = re.compile(r'\s*(?:(->|--)|([{}\[\];,=])|("(?:[^"\\]|\\.)*")|([A-Za-z_][A-Za-z_0-9.]*|-?\d+(?:\.\d+)?))')


def _tokens(text):
    pos, out = 0, []
    text = text.rstrip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if not m or m.end() == pos:
            raise ValueError(f"bad DOT at {pos}: {text[pos:pos + 20]!r}")
        out.append(next(g for g in m.groups() if g is not None))
        pos = m.end()
    return out


def parse_dot(text):
    """Returns (nodes, edges) of a digraph: node ids (unquoted) and (tail, head, attrs) triples."""
    toks, i = _tokens(text), 0
    nodes, edges = set(), []

    def peek():
        return toks[i] if i < len(toks) else None

    def take(expect=None):
        nonlocal i
        t = peek()
        if t is None or (expect is not None and t != expect):
            raise ValueError(f"expected {expect!r}, got {t!r}")
        i += 1
        return t

    def ident():
        t = take()
        if t in "{}[];,=" or t in ("->", "--"):
            raise ValueError(f"expected an id, got {t!r}")
        return t[1:-1] if t.startswith('"') else t

    def attrs():
        out = {}
        while peek() == "[":
            take("[")
            while peek() != "]":
                k = ident()
                take("=")
                out[k] = ident()
                if peek() in (",", ";"):
                    take()
            take("]")
        return out

    def stmts():
        while peek() not in ("}", None):
            if peek() == "subgraph":
                take()
                if peek() != "{":
                    ident()
                take("{")
                stmts()
                take("}")
            elif peek() in ("graph", "node", "edge"):
                take()
                attrs()
            else:
                first = ident()
                if peek() == "=":
                    take()
                    ident()
                else:
                    chain = [first]
                    while peek() == "->":
                        take()
                        chain.append(ident())
                    a = attrs()
                    nodes.update(chain)
                    edges.extend((t, h, a) for t, h in zip(chain, chain[1:]))
            if peek() == ";":
                take()

    take("digraph")
    if peek() != "{":
        ident()
    take("{")
    stmts()
    take("}")
    if peek() is not None:
        raise ValueError(f"text after the graph: {toks[i:]}")
    return nodes, edges


def test_dot_parser_rejects_broken_text():
    with pytest.raises(ValueError):
        parse_dot('digraph g { "a" -> ; }')
    with pytest.raises(ValueError):
        parse_dot('digraph g { "a" -> "b" [label="x"];')
    assert parse_dot('digraph { a -> b [label="x"]; }') == ({"a", "b"}, [("a", "b", {"label": "x"})])


def test_to_dot_is_valid_and_draws_every_stage(ref):
    p = ref.insert("scale", after="verify")
    nodes, edges = parse_dot(p.to_dot())
    for spec in p.specs:
        assert spec.name in nodes
    labelled = {(t, h, a.get("label")) for t, h, a in edges}
    assert ("verify", "scale", "logits") in labelled
    assert ("scale", "grammar", "logits") in labelled  # the transformed value flows on, through each transformer
    assert ("grammar", "sampler", "logits") in labelled
    assert ("sampler", "detokenize", "next_tokens") in labelled
    assert ("step:batch", "prefill", "batch") in labelled
    assert ("admit:prompt", "tokenize", "prompt") in labelled
    # every stage's reads arrive on an edge
    for spec in p.specs:
        assert {f for t, h, a in edges if h == spec.name for f in [a.get("label")]} == set(spec.reads)


def test_from_recipe_unknown_lists_recipes(reg):
    with pytest.raises(PipelineError, match="unknown recipe 'fastest'") as exc:
        Pipeline.from_recipe("fastest", registry=reg)
    for name in ("reference", "throughput"):
        assert name in str(exc.value)


def test_build_passes_args_and_named_context(ref):
    from deepinfer.core.graph import instantiate

    bad = ref.replace("sample", "seven", colour=1)
    with pytest.raises(PipelineError, match=r"stage 'seven' could not be built with args \{'colour': 1\}"):
        instantiate(_spec(bad, "seven"), {})
    seven = _spec(ref.replace("sample", "seven", token=9), "seven")
    assert instantiate(seven, {"ops": None}).token == 9
    # A context object reaches the factory only when its signature names it, and the stage's own args win.
    assert instantiate(_spec(ref.replace("sample", "seven"), "seven"), {"token": 4, "ops": None}).token == 4
    assert instantiate(seven, {"token": 4}).token == 9


# The throughput recipe's config overrides reach the engine.

@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from deepinfer.testing.models import build_tiny_hf_model

    path = tmp_path_factory.mktemp("tiny-llama-pipeline")
    build_tiny_hf_model(path, "llama")
    return path


def test_throughput_recipe_config_reaches_engine_config(tiny_llama):
    from deepinfer import LLM

    config = Pipeline.from_recipe("throughput").config
    assert config["max_num_seqs"] == 512 and config["max_num_batched_tokens"] == 8192
    llm = LLM(str(tiny_llama), recipe="throughput", num_kv_blocks=64)
    assert llm.config.max_num_seqs == 512 and llm.config.max_num_batched_tokens == 8192
    assert llm.engine.scheduler.max_num_seqs == 512 and llm.engine.scheduler.max_num_batched_tokens == 8192
    assert llm.pipeline.recipe == "throughput"
    # An explicit argument wins over the recipe; the default recipe keeps EngineConfig's defaults.
    llm = LLM(str(tiny_llama), recipe="throughput", num_kv_blocks=64, max_num_seqs=3)
    assert llm.config.max_num_seqs == 3 and llm.config.max_num_batched_tokens == 8192
    llm = LLM(str(tiny_llama), num_kv_blocks=64)
    assert llm.config.max_num_seqs == 256 and llm.config.max_num_batched_tokens == 4096
    # A pipeline passed in carries its recipe's config too.
    llm = LLM(str(tiny_llama), pipeline=Pipeline.from_recipe("throughput").replace("sample", "sampler"),
              num_kv_blocks=64)
    assert llm.config.max_num_seqs == 512

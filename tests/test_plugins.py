"""Plugins: the built-in registrations, in-process plugin objects, conflicts, the entry-point example package
(deepinfer-top-a, installed with ``pip install -e plugins/deepinfer-top-a``) and the env switches.

Every hookspec must be exercised here: tests say which hooks they exercise with @exercises, and a meta-test
checks that each hookspec has a docstring and at least one such test.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import json
from collections import Counter
from types import SimpleNamespace

import attrs
import pytest
import torch

from deepinfer import Pipeline, SamplingParams, Stage, hookimpl
from deepinfer.backends.reference.ops import ReferenceOps
from deepinfer.backends.reference.sampling import SamplingBatch
from deepinfer.core import hookspecs
from deepinfer.core.plugins import (BUILTIN, PluginError, get_plugin_manager, get_registry, new_plugin_manager,
                                    plugin_origin)

EXERCISED: dict = {}  # hookspec name -> tests that exercise it


def exercises(*hooks):
    def mark(fn):
        for h in hooks:
            EXERCISED.setdefault(h, []).append(fn.__name__)
        return fn
    return mark


BUILTIN_STAGES = {"tokenize": "tokenize", "prefill": "prefill", "forward": "forward", "verify": "verify",
                  "grammar": "constrain", "sampler": "sample", "detokenize": "detokenize"}
PROMPTS = ["The quick brown fox", "def add(a, b):", "Hello!"]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from deepinfer.testing.models import build_tiny_hf_model

    path = tmp_path_factory.mktemp("tiny-llama-plugins")
    build_tiny_hf_model(path, "llama")
    return str(path)


# A test plugin: an attrs class with eq=False, one hookimpl per hookspec.

@attrs.define(eq=False)
class ConstantSample(Stage):
    """Always picks the same token, so a pipeline that uses it is recognisable from its output."""

    name = "always_token"
    kind = "sample"
    reads = ("logits", "sampling")
    writes = ("next_tokens",)

    token: int = 7

    def __call__(self, state) -> None:
        state.next_tokens = torch.full((state.logits.shape[0],), self.token, dtype=torch.long,
                                       device=state.logits.device)


class CountingOps(ReferenceOps):
    """A backend that is the reference one plus a count of the ops called."""

    name = "counting"

    def __init__(self, device="cpu"):
        super().__init__(device)
        self.calls = Counter()

    def paged_attention(self, *args, **kwargs):
        self.calls["paged_attention"] += 1
        return super().paged_attention(*args, **kwargs)


@attrs.define(eq=False)
class TestPlugin:
    __test__ = False  # not a pytest class

    stage_name: str = "always_token"
    override_llama: bool = False
    built: list = attrs.field(factory=list)  # models the plugin's factory built

    @hookimpl
    def deepinfer_register_stages(self, register):
        register.stage(kind="sample", name=self.stage_name, factory=ConstantSample)

    @hookimpl
    def deepinfer_register_backends(self, register):
        register.backend(name="counting", factory=CountingOps, available=lambda: True)
        register.backend(name="never_here", factory=CountingOps, available=lambda: False)

    @hookimpl
    def deepinfer_register_models(self, register):
        from deepinfer.models import llama

        def make(hf_config, ops):
            self.built.append(hf_config["architectures"][0])
            return llama.factory("LlamaForCausalLM")(hf_config, ops)

        if self.override_llama:
            register.model(architecture="LlamaForCausalLM", factory=make, override=True)
        register.model(architecture="TestOnlyForCausalLM", factory=make)

    @hookimpl
    def deepinfer_register_parsers(self, register):
        from deepinfer.entrypoints.parsers import TagToolParser

        register.parser(kind="tool", name="test_tags", factory=lambda: TagToolParser(name="test_tags", start="<call>",
                                                                                       end="</call>"))

    @hookimpl
    def deepinfer_register_recipes(self, register):
        register.recipe(name="always7", spec={
            "description": "the reference stages with a sampler that always picks token 7",
            "stages": ["tokenize", "prefill", "forward", "verify", {"name": self.stage_name, "token": 7},
                       "detokenize"],
            "engine": {"max_num_seqs": 2},
        })


@pytest.fixture
def fresh_pm():
    return new_plugin_manager(load_entry_points=False)


@pytest.fixture
def test_plugin(fresh_pm):
    plugin = TestPlugin()
    fresh_pm.register(plugin, name="test-plugin")
    yield fresh_pm, plugin
    fresh_pm.unregister(plugin)
    assert "always_token" not in get_registry(fresh_pm).names("stage")


# Built-ins.

@exercises("deepinfer_register_stages", "deepinfer_register_backends", "deepinfer_register_models",
           "deepinfer_register_recipes")
def test_builtins_are_registered_by_the_builtin_plugin(fresh_pm):
    from deepinfer.models import llama

    reg = get_registry(fresh_pm)
    for name, kind in BUILTIN_STAGES.items():
        e = reg.get("stage", name)
        assert (e.plugin, e.kind) == (BUILTIN, kind)
        assert e.obj.name == name and e.obj.kind == kind
    assert reg.get("backend", "reference").plugin == BUILTIN
    assert reg.get("backend", "reference").available()
    for arch in llama.ARCHITECTURES:
        assert reg.get("model", arch).plugin == BUILTIN
    assert set(reg.names("recipe")) >= {"reference", "throughput"}
    assert {e.plugin for e in reg.entries.values()} == {BUILTIN}
    assert set(reg.by_plugin()) == {BUILTIN}
    assert plugin_origin(fresh_pm, BUILTIN).endswith("builtin.py")


def test_default_registry_has_builtins_and_installed_plugins():
    reg = get_registry()
    assert get_registry(get_plugin_manager()).names("stage") == reg.names("stage")
    for name in BUILTIN_STAGES:
        assert reg.get("stage", name).plugin == BUILTIN


def test_unknown_names_list_what_is_registered(fresh_pm):
    reg = get_registry(fresh_pm)
    with pytest.raises(PluginError, match=r"unknown backend 'tpu'; registered: nvidia, reference"):
        reg.get("backend", "tpu")


# In-process plugin objects.

@exercises("deepinfer_register_stages", "deepinfer_register_backends", "deepinfer_register_models",
           "deepinfer_register_recipes")
def test_in_process_plugin_registers_with_provenance(test_plugin):
    pm, _ = test_plugin
    reg = get_registry(pm)
    assert reg.get("stage", "always_token").plugin == "test-plugin"
    assert reg.get("stage", "always_token").kind == "sample"
    assert reg.get("backend", "counting").plugin == "test-plugin"
    assert not reg.get("backend", "never_here").available()
    assert reg.get("model", "TestOnlyForCausalLM").plugin == "test-plugin"
    assert reg.get("recipe", "always7").plugin == "test-plugin"
    assert reg.get("model", "LlamaForCausalLM").plugin == BUILTIN  # no override asked
    assert {e.name for e in reg.by_plugin()["test-plugin"]} == {"always_token", "counting", "never_here",
                                                                "TestOnlyForCausalLM", "always7", "test_tags"}
    assert plugin_origin(pm, "test-plugin") == f"in-process object ({__name__})"


@exercises("deepinfer_register_stages")
def test_swapped_in_sampler_changes_generation(test_plugin, tiny_llama):
    from deepinfer import LLM

    pm, _ = test_plugin
    reg = get_registry(pm)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    base = Pipeline.from_recipe("reference", registry=reg)
    plain = LLM(tiny_llama, pipeline=base, num_kv_blocks=64).generate(PROMPTS, params, use_tqdm=False)
    assert any(t != 7 for o in plain for t in o.outputs[0].token_ids)  # the model itself does not say 7s

    llm = LLM(tiny_llama, pipeline=base.replace("sample", "always_token"), num_kv_blocks=64)
    assert "always_token [sample]  from test-plugin" in llm.pipeline.describe()
    for o in llm.generate(PROMPTS, params, use_tqdm=False):
        assert o.outputs[0].token_ids == [7] * 6
    llm = LLM(tiny_llama, pipeline=base.replace("sample", "always_token", token=11), num_kv_blocks=64)
    assert llm.generate(PROMPTS[:1], params, use_tqdm=False)[0].outputs[0].token_ids == [11] * 6


def _no_logprobs_warnings(caplog) -> list:
    return [r.getMessage() for r in caplog.records if "no stage of the pipeline writes 'logprobs'" in r.getMessage()]


@exercises("deepinfer_register_stages")
def test_requested_logprobs_without_a_writer_warn_once_per_engine(test_plugin, tiny_llama, caplog):
    from deepinfer import LLM

    pm, _ = test_plugin
    base = Pipeline.from_recipe("reference", registry=get_registry(pm))
    asks = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, logprobs=2)
    out = LLM(tiny_llama, pipeline=base, num_kv_blocks=64).generate(PROMPTS[:1], asks, use_tqdm=False)
    assert len(out[0].outputs[0].logprobs) == 2 and _no_logprobs_warnings(caplog) == []  # the sampler writes them

    pipe = base.replace("sample", "always_token")
    assert (base.writer("logprobs"), pipe.writer("logprobs"), pipe.writer("next_tokens")) == (
        "sampler", None, "always_token")
    llm = LLM(tiny_llama, pipeline=pipe, num_kv_blocks=64)
    plain = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    llm.generate(PROMPTS[:1], plain, use_tqdm=False)
    assert _no_logprobs_warnings(caplog) == []  # nobody asked
    outs = llm.generate(PROMPTS, asks, use_tqdm=False)
    assert all(o.outputs[0].logprobs is None for o in outs)
    (msg,) = _no_logprobs_warnings(caplog)  # three requests asked; one warning
    assert "the sampler was replaced by 'always_token', which does not" in msg
    llm.generate(PROMPTS[:1], asks, use_tqdm=False)
    assert len(_no_logprobs_warnings(caplog)) == 1
    LLM(tiny_llama, pipeline=pipe, num_kv_blocks=64).generate(PROMPTS[:1], asks, use_tqdm=False)
    assert len(_no_logprobs_warnings(caplog)) == 2  # once per engine: a new engine says it again


@exercises("deepinfer_register_recipes", "deepinfer_register_stages")
def test_plugin_recipe_builds_and_configures(test_plugin, tiny_llama):
    from deepinfer import LLM

    pm, _ = test_plugin
    pipe = Pipeline.from_recipe("always7", registry=get_registry(pm))
    assert pipe.stage_names() == ["prefill", "forward", "verify", "always_token", "detokenize"]
    llm = LLM(tiny_llama, pipeline=pipe, num_kv_blocks=64)
    assert llm.config.max_num_seqs == 2  # the recipe's config reached the engine
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [[7, 7, 7]] * 3


@exercises("deepinfer_register_backends", "deepinfer_register_models")
def test_plugin_backend_and_model_are_used_by_llm(tiny_llama):
    """LLM reads the process-wide registry, so register on the default manager and unregister after."""
    from deepinfer import LLM

    pm = get_plugin_manager()
    plugin = TestPlugin(stage_name="always_token_global", override_llama=True)
    pm.register(plugin, name="test-plugin-global")
    try:
        reg = get_registry()
        assert reg.get("model", "LlamaForCausalLM").plugin == "test-plugin-global"  # override=True wins
        llm = LLM(tiny_llama, backend="counting", num_kv_blocks=64)
        assert llm.backend_name == "counting" and plugin.built == ["LlamaForCausalLM"]
        out = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                           use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4
        assert llm.engine.ops.calls["paged_attention"] > 0
    finally:
        pm.unregister(plugin)
    reg = get_registry()
    assert "counting" not in reg.names("backend")
    assert reg.get("model", "LlamaForCausalLM").plugin == BUILTIN


# Conflicts: two registrations of one name warn, keep one, and break nothing.

@attrs.define(eq=False)
class OtherConstantSample(ConstantSample):
    """A second factory, so a test can tell which registration of a name was kept."""


@attrs.define(eq=False)
class SameStagePlugin:
    name: str = "dup"
    override: bool = False
    factory: type = ConstantSample

    @hookimpl
    def deepinfer_register_stages(self, register):
        register.stage(kind="sample", name=self.name, factory=self.factory, override=self.override)


@pytest.fixture
def register_plugins():
    """register_plugins(pm, name=plugin, ...) registers in order; all are unregistered after the test."""
    done = []

    def register(pm, **plugins):
        for name, plugin in plugins.items():
            pm.register(plugin, name=name)
            done.append((pm, plugin))

    yield register
    for pm, plugin in done:
        pm.unregister(plugin)


def _clash_warnings(caplog) -> list:
    return [r.getMessage() for r in caplog.records if "is registered by both" in r.getMessage()]


@exercises("deepinfer_register_stages")
def test_two_plugins_same_stage_name_warn_and_keep_the_first_loaded(fresh_pm, register_plugins, caplog):
    register_plugins(fresh_pm, **{"plugin-one": SameStagePlugin(),
                                  "plugin-two": SameStagePlugin(factory=OtherConstantSample)})
    reg = get_registry(fresh_pm)  # does not raise: a clash must not take every command down
    kept = reg.get("stage", "dup")
    assert (kept.plugin, kept.obj) == ("plugin-one", ConstantSample)
    ((k, lost),) = reg.shadowed
    assert k is kept and (lost.plugin, lost.obj) == ("plugin-two", OtherConstantSample)
    (msg,) = _clash_warnings(caplog)
    assert "stage 'dup' is registered by both 'plugin-one' and 'plugin-two'" in msg
    assert "keeping 'plugin-one''s (loaded first), 'plugin-two''s is shadowed" in msg
    # A pipeline that uses the name builds with the kept factory; the clash is reported once per manager.
    caplog.clear()
    pipe = Pipeline.from_recipe("reference", registry=get_registry(fresh_pm)).replace("sample", "dup")
    assert "dup [sample]  from plugin-one" in pipe.describe()
    assert _clash_warnings(caplog) == []


@exercises("deepinfer_register_stages")
def test_a_clash_with_a_builtin_keeps_the_builtin_unless_override(fresh_pm, register_plugins, caplog):
    from deepinfer.stages.sample import SampleStage

    plugin = SameStagePlugin(name="sampler")
    register_plugins(fresh_pm, shadow=plugin)
    reg = get_registry(fresh_pm)
    assert reg.get("stage", "sampler").plugin == BUILTIN and reg.get("stage", "sampler").obj is SampleStage
    assert [(k.plugin, s.plugin) for k, s in reg.shadowed] == [(BUILTIN, "shadow")]
    (msg,) = _clash_warnings(caplog)
    assert "by both 'deepinfer.builtin' and 'shadow'; keeping 'deepinfer.builtin''s (the built-in)" in msg
    assert "override=True" in msg
    # override=True replaces the built-in on purpose: no warning, but the shadowed one is still recorded.
    caplog.clear()
    plugin.override = True
    reg = get_registry(fresh_pm)
    assert reg.get("stage", "sampler").plugin == "shadow" and reg.get("stage", "sampler").obj is ConstantSample
    assert [(k.plugin, s.plugin) for k, s in reg.shadowed] == [("shadow", BUILTIN)]
    assert _clash_warnings(caplog) == []


@exercises("deepinfer_register_stages")
def test_two_overrides_of_a_builtin_keep_the_first(fresh_pm, register_plugins, caplog):
    register_plugins(fresh_pm, **{"over-one": SameStagePlugin(name="sampler", override=True),
                                  "over-two": SameStagePlugin(name="sampler", override=True,
                                                              factory=OtherConstantSample)})
    reg = get_registry(fresh_pm)
    assert reg.get("stage", "sampler").plugin == "over-one"
    assert [(k.plugin, s.plugin) for k, s in reg.shadowed] == [("over-one", BUILTIN), ("over-one", "over-two")]
    (msg,) = _clash_warnings(caplog)
    assert "'over-one' and 'over-two'; keeping 'over-one''s (loaded first)" in msg


@exercises("deepinfer_register_stages")
def test_deepinfer_plugins_lists_both_sides_of_a_clash(register_plugins, capsys, caplog):
    """The command a user runs to diagnose a clash works through it and marks the kept and shadowed entries."""
    from deepinfer.cli import main

    register_plugins(get_plugin_manager(), **{"clash-one": SameStagePlugin(name="clash_stage"),
                                              "clash-two": SameStagePlugin(name="clash_stage"),
                                              "clash-builtin": SameStagePlugin(name="sampler")})
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()

    def stages_of(plugin):
        i = next(k for k, line in enumerate(lines) if line.startswith(f"{plugin}  ("))
        return next(line for line in lines[i + 1:] if line.strip().startswith("stages:"))

    assert "sample/clash_stage (kept, shadows clash-two)" in stages_of("clash-one")
    assert "sample/clash_stage (shadowed by clash-one)" in stages_of("clash-two")
    assert "sample/sampler (shadowed by deepinfer.builtin)" in stages_of("clash-builtin")
    assert "sample/sampler (kept, shadows clash-builtin)" in stages_of(BUILTIN)
    assert len(_clash_warnings(caplog)) == 2
    assert main(["plugins", "--json"]) == 0
    report = {p["name"]: p for p in json.loads(capsys.readouterr().out)}
    assert report["clash-two"]["stages"] == ["sample/clash_stage (shadowed by clash-one)"]
    assert main(["pipeline", "reference"]) == 0  # other commands keep working too
    assert "sampler [sample]  from deepinfer.builtin" in capsys.readouterr().out


def test_attrs_plugin_objects_do_not_compare_equal():
    pm = new_plugin_manager(load_entry_points=False)
    a, b = TestPlugin(), TestPlugin()
    pm.register(a, name="a")
    pm.register(b, name="b")  # with eq=True pluggy would refuse b as already registered
    assert pm.get_plugin("a") is a and pm.get_plugin("b") is b


@pytest.mark.parametrize("bad", [dict(name="", factory=ConstantSample), dict(name="x", factory=42)])
def test_register_stage_checks_its_arguments(fresh_pm, bad):
    reg = get_registry(fresh_pm)
    reg.current_plugin = "careless"
    with pytest.raises(PluginError, match="plugin 'careless'"):
        reg.stage(kind="sample", **bad)


def test_register_recipe_needs_stages(fresh_pm):
    reg = get_registry(fresh_pm)
    with pytest.raises(PluginError, match=r"recipe 'r' must be a dict with 'stages' or a pathlib.Path"):
        reg.recipe(name="r", spec={"config": {}})


# The installed example package: deepinfer-top-a, found through its entry point.

@pytest.fixture(scope="module")
def top_a_entry_point():
    eps = [ep for ep in importlib.metadata.entry_points(group="deepinfer") if ep.name == "top_a"]
    assert eps, "the example plugin is not installed: pip install -e plugins/deepinfer-top-a"
    return eps[0]


def _plugin_names(pm) -> set:
    return {pm.get_name(p) for p in pm.get_plugins()}


@exercises("deepinfer_register_stages")
def test_top_a_found_through_entry_point(top_a_entry_point, monkeypatch):
    monkeypatch.delenv("DEEPINFER_PLUGINS", raising=False)
    monkeypatch.delenv("DEEPINFER_DISABLE_PLUGINS", raising=False)
    assert top_a_entry_point.value == "deepinfer_top_a" and top_a_entry_point.dist.name == "deepinfer-top-a"
    pm = new_plugin_manager()
    assert {"top_a", BUILTIN} <= _plugin_names(pm)
    entry = get_registry(pm).get("stage", "top_a")
    import deepinfer_top_a

    assert (entry.plugin, entry.kind, entry.obj) == ("top_a", "sample", deepinfer_top_a.TopASample)
    assert plugin_origin(pm, "top_a") == "deepinfer-top-a 0.1.0 (entry point deepinfer_top_a)"
    assert "top_a" not in _plugin_names(new_plugin_manager(load_entry_points=False))


@pytest.mark.parametrize("allow,deny,loaded,unmatched", [
    ("", "", True, {}),
    ("top_a", "", True, {}),
    ("something_else", "", False, {"DEEPINFER_PLUGINS": ["something_else"]}),
    (" top_a , other ", "", True, {"DEEPINFER_PLUGINS": ["other"]}),
    ("", "top_a", False, {}),
    ("top_a", "top_a", False, {}),  # the deny list wins
    ("", "other,top_a", False, {"DEEPINFER_DISABLE_PLUGINS": ["other"]}),
    ("nope", "nada,zilch", False, {"DEEPINFER_PLUGINS": ["nope"], "DEEPINFER_DISABLE_PLUGINS": ["nada", "zilch"]}),
    ("deepinfer.builtin", "", False, {}),  # names the built-in: always loaded, so it matches something
])
def test_env_switches_for_entry_point_plugins(top_a_entry_point, monkeypatch, caplog, allow, deny, loaded,
                                              unmatched):
    monkeypatch.setenv("DEEPINFER_PLUGINS", allow)
    monkeypatch.setenv("DEEPINFER_DISABLE_PLUGINS", deny)
    pm = new_plugin_manager()
    assert ("top_a" in _plugin_names(pm)) is loaded
    reg = get_registry(pm)
    assert ("top_a" in reg.names("stage")) is loaded
    assert "sampler" in reg.names("stage")  # the built-ins are not entry points: the allow list keeps them
    # A name that matches no installed plugin is reported (a typo would otherwise silently load nothing).
    installed = sorted({ep.name for ep in importlib.metadata.entry_points(group="deepinfer")})
    warned = {r.getMessage().split()[1]: r.getMessage() for r in caplog.records
              if "matching no installed plugin" in r.getMessage()}
    assert set(warned) == set(unmatched)
    for var, names in unmatched.items():
        assert f"{var} names {', '.join(repr(n) for n in names)}, matching no installed plugin" in warned[var]
        assert warned[var].endswith(f"(installed entry points: {', '.join(installed)})") and "top_a" in installed


def test_disable_builtin(top_a_entry_point, monkeypatch):
    monkeypatch.delenv("DEEPINFER_PLUGINS", raising=False)
    monkeypatch.setenv("DEEPINFER_DISABLE_PLUGINS", BUILTIN)
    reg = get_registry(new_plugin_manager())
    assert "top_a" in reg.names("stage")
    assert not any(e.plugin == BUILTIN for e in reg.entries.values())
    assert not set(reg.names("stage")) & set(BUILTIN_STAGES) and "reference" not in reg.names("recipe")


def test_top_a_pipeline_generates(top_a_entry_point, tiny_llama):
    from deepinfer import LLM

    pipe = Pipeline.from_recipe("reference").replace("sample", "top_a", a=0.3)
    llm = LLM(tiny_llama, pipeline=pipe, num_kv_blocks=64)
    assert "top_a [sample] (a=0.3)  from top_a" in llm.pipeline.describe()
    (stage,) = [s for s in llm.engine.stages["step"] if s.name == "top_a"]
    assert stage.a == 0.3 and stage.generator is llm.engine.generator  # engine context reached the factory
    seeded = SamplingParams(max_tokens=8, temperature=1.0, seed=3, ignore_eos=True)
    a, b = (llm.generate(PROMPTS, seeded, use_tqdm=False) for _ in range(2))
    vocab = llm.engine.model.vocab_size
    for x, y in zip(a, b):
        assert len(x.outputs[0].token_ids) == 8 and all(0 <= t < vocab for t in x.outputs[0].token_ids)
        assert x.outputs[0].token_ids == y.outputs[0].token_ids  # seeded rows are reproducible
    # Greedy rows ignore the filter and equal the built-in sampler's greedy output.
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    ref = LLM(tiny_llama, num_kv_blocks=64).generate(PROMPTS, greedy, use_tqdm=False)
    got = llm.generate(PROMPTS, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]


# TopASample on hand-built batches.

def _state(logits, params, generators=None):
    S, V = logits.shape
    generators = generators or [None] * S
    batch = SamplingBatch.build(params, [[0]] * S, [[]] * S, generators, V, (1,), "cpu")
    return SimpleNamespace(logits=logits, sampling=batch, next_tokens=None)


def test_top_a_keeps_only_tokens_above_the_threshold(top_a_entry_point):
    from deepinfer_top_a import TopASample

    probs = torch.tensor([0.6, 0.25, 0.1, 0.05 - 1e-3, 1e-3])  # a=0.2: threshold 0.2 * 0.36 = 0.072
    logits = probs.log().repeat(4000, 1)
    st = _state(logits, [SamplingParams(temperature=1.0)] * 4000)
    TopASample(a=0.2, generator=torch.Generator().manual_seed(0))(st)
    freq = torch.bincount(st.next_tokens, minlength=5).float() / 4000
    assert freq[3] == 0 and freq[4] == 0
    kept = probs[:3] / probs[:3].sum()
    assert torch.allclose(freq[:3], kept, atol=0.03), (freq, kept)


def test_top_a_edge_values(top_a_entry_point):
    from deepinfer_top_a import TopASample

    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5]]).repeat(500, 1)
    rnd = [SamplingParams(temperature=1.0)] * 500
    st = _state(logits, rnd)
    TopASample(a=0.0, generator=torch.Generator().manual_seed(1))(st)
    assert set(st.next_tokens.tolist()) == {0, 1, 2, 3}  # a = 0 keeps every token
    st = _state(logits, rnd)
    TopASample(a=1000.0, generator=torch.Generator().manual_seed(1))(st)
    assert set(st.next_tokens.tolist()) == {0}  # the most likely token always stays
    for bad in (-0.1, float("nan"), float("inf"), "0.2", True):
        with pytest.raises(ValueError, match=r"top_a: a=.* is invalid"):
            TopASample(a=bad)


def test_top_a_mixed_batch_greedy_seeded_banned(top_a_entry_point):
    from deepinfer_top_a import TopASample

    # softmax: p1 = 0.466, p4 = 0.421, the rest <= 0.038 < a * p1**2 = 0.0434
    logits = torch.tensor([[0.0, 3.0, 0.0, 0.2, 2.9, 0.5]]).repeat(4, 1)
    params = [SamplingParams(temperature=0.0),  # greedy: argmax 1
              SamplingParams(temperature=1.0, seed=5),
              SamplingParams(temperature=1.0),
              SamplingParams(temperature=0.0, min_tokens=2)]  # greedy; eos (1) banned under min_tokens
    gens = lambda: [None, torch.Generator().manual_seed(5), None, None]  # noqa: E731
    outs = []
    for run in range(2):
        st = _state(logits, params, gens())
        TopASample(a=0.2, generator=torch.Generator().manual_seed(run))(st)
        outs.append(st.next_tokens.tolist())
        assert st.next_tokens.dtype == torch.int64 and st.next_tokens.shape == (4,)
    for toks in outs:
        assert toks[0] == 1 and toks[3] == 4
        assert toks[1] in (1, 4) and toks[2] in (1, 4)  # only tokens 1 and 4 clear a * max_p**2
    assert outs[0][1] == outs[1][1]  # the seeded row draws from its own generator
    # All-greedy batches take the fast path.
    st = _state(logits[:1], params[:1])
    TopASample()(st)
    assert st.next_tokens.tolist() == [1]


@exercises("deepinfer_register_parsers")
def test_parser_plugin_is_chosen_by_name_and_reads_its_format():
    from deepinfer.entrypoints.parsers import choose_parser, parse_output

    pm = new_plugin_manager(load_entry_points=False)
    pm.register(TestPlugin(), name="test-plugin")
    reg = get_registry(pm)
    assert reg.get("tool_parser", "test_tags").plugin == "test-plugin"
    assert reg.get("tool_parser", "qwen3").plugin == BUILTIN and reg.get("reasoning_parser", "qwen3").plugin == BUILTIN
    parser = choose_parser(reg, "tool", "test_tags", None)
    parsed = parse_output('hi <call>{"name": "f", "arguments": {"x": 1}}</call>', parser)
    assert parsed.content == "hi " and [(c.name, c.arguments) for c in parsed.calls] == [("f", '{"x": 1}')]
    assert choose_parser(reg, "tool", None, "ced").name == "demo"  # the family's default
    assert choose_parser(reg, "tool", "none", "ced") is None
    with pytest.raises(PluginError, match="unknown tool_parser 'nope'"):
        choose_parser(reg, "tool", "nope", None)
    with pytest.raises(PluginError, match="kind 'output'"):
        reg.parser(kind="output", name="x", factory=dict)


# The meta-test.

def test_every_hookspec_is_documented_and_exercised():
    from deepinfer.core import plugins

    specs = {name: fn for name, fn in vars(hookspecs).items()
             if callable(fn) and getattr(fn, "deepinfer_spec", None) is not None}
    assert specs, "no hookspecs found"
    assert all(name.startswith("deepinfer_") for name in specs)
    this = globals()
    for name, fn in specs.items():
        doc = inspect.getdoc(fn) or ""
        assert len(doc) > 40 and "Returns" in doc, f"hookspec {name} needs a docstring saying what it returns"
        assert list(inspect.signature(fn).parameters) == ["register"], f"{name}: registration hooks take register"
        assert f"register.{name.removeprefix('deepinfer_register_').rstrip('s')}(" in doc, name
        tests = EXERCISED.get(name, [])
        assert tests, f"hookspec {name} is exercised by no test in {__name__}"
        assert all(t.startswith("test_") and callable(this.get(t)) for t in tests)
        assert callable(getattr(TestPlugin, name, None)), f"the test plugin does not implement {name}"
        assert name in plugins._HOOKS, f"get_registry does not call {name}"
    assert set(plugins._HOOKS) == set(specs)

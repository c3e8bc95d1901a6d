"""Pipeline: a validated DAG of stages, built from a recipe and edited in Python.

A Pipeline is immutable: replace/insert/remove return a new one. It is checked
when built, never during a step: every read has a producer (or is an engine
input), no two stages write one field unless one declares it replaces the
other (or transforms it: reads and writes it), no cycles, every stage name is
registered. Errors name the stage and the field.
"""

from __future__ import annotations

import inspect
import textwrap
from typing import Any, Iterable, Optional

import attrs

from .plugins import PluginError, Registry, get_registry
from .state import ADMIT_INPUTS, ADMIT_OUTPUTS, STEP_INPUTS, STEP_OUTPUTS

PHASES = {"admit": (ADMIT_INPUTS, ADMIT_OUTPUTS), "step": (STEP_INPUTS, STEP_OUTPUTS)}


class PipelineError(ValueError):
    """The stage graph is invalid; the message names the stage and the field."""


@attrs.frozen
class StageSpec:
    """One node: a registered stage (by name) and its keyword arguments."""

    name: str
    kind: str
    factory: Any
    plugin: str
    args: dict = attrs.field(factory=dict)

    def attr(self, key: str, default=()):
        return tuple(getattr(self.factory, key, default))

    @property
    def phase(self) -> str:
        return getattr(self.factory, "phase", "step")

    @property
    def reads(self) -> tuple:
        return self.attr("reads")

    @property
    def writes(self) -> tuple:
        return self.attr("writes")

    @property
    def replaces(self) -> tuple:
        return self.attr("replaces")


def _spec(registry: Registry, name: str, args: dict) -> StageSpec:
    try:
        entry = registry.get("stage", name)
    except PluginError as exc:
        raise PipelineError(str(exc)) from None
    for key in ("reads", "writes"):
        if not isinstance(getattr(entry.obj, key, None), (tuple, list)):
            raise PipelineError(f"stage {name!r} (from {entry.plugin}) does not declare {key} as a tuple of field names")
    return StageSpec(name=name, kind=entry.kind, factory=entry.obj, plugin=entry.plugin, args=dict(args))


def _order(phase: str, specs: list) -> list:
    """Validate one phase and return its stages in run order (stable topological order)."""
    inputs, outputs = PHASES[phase]
    writers: dict = {}  # field -> producing spec (not a transformer)
    overrides: list = []  # (replacer, replaced, field): the replacer runs after, so its value is the one read
    for s in specs:
        for f in s.writes:
            if f in inputs:
                raise PipelineError(f"stage {s.name!r} writes {f!r}, which is an engine input of the {phase} phase")
            if f in s.reads:
                continue  # transforms a field another stage produced
            old = writers.get(f)
            if old is not None:
                if s.name in old.replaces or s.kind in old.replaces:
                    overrides.append((old.name, s.name, f))
                    continue  # old replaces s; keep old as producer
                if old.name in s.replaces or old.kind in s.replaces:
                    overrides.append((s.name, old.name, f))
                    writers[f] = s
                    continue
                raise PipelineError(f"stages {old.name!r} and {s.name!r} both write {f!r}; one must declare "
                                    f"replaces=({old.name!r},) or remove the other")
            writers[f] = s
    deps: dict = {s.name: set() for s in specs}
    why: dict = {}  # (stage, stage it runs after) -> the field that orders them, for error messages
    for new, old_name, f in overrides:
        deps[new].add(old_name)
        why.setdefault((new, old_name), f)
    last_touch: dict = {}  # field -> name of the last stage (producer or transformer) so far in list order
    for s in specs:
        for f in s.reads:
            if f in inputs:
                continue
            if f not in writers:
                raise PipelineError(f"stage {s.name!r} reads {f!r}, which no {phase} stage writes and the engine "
                                    f"does not provide (engine inputs: {', '.join(inputs)})")
            if writers[f] is not s:
                deps[s.name].add(writers[f].name)
                why.setdefault((s.name, writers[f].name), f)
                if f in s.writes and f in last_touch and last_touch[f] != s.name:
                    deps[s.name].add(last_touch[f])  # chain transformers in list order
                    why.setdefault((s.name, last_touch[f]), f)
        for f in s.writes:
            last_touch[f] = s.name
    # Readers of a transformed field run after every transformer of it.
    for s in specs:
        for f in s.reads:
            if f in s.writes or f in inputs:
                continue
            for t in specs:
                if t is not s and f in t.reads and f in t.writes:
                    deps[s.name].add(t.name)
                    why.setdefault((s.name, t.name), f)
    for f in outputs:
        if f not in writers:
            raise PipelineError(f"no {phase} stage writes {f!r}, which the engine needs")
    by_name = {s.name: s for s in specs}
    done, order, visiting = set(), [], []

    def visit(n: str) -> None:
        if n in done:
            return
        if n in visiting:
            cyc = visiting[visiting.index(n):] + [n]
            links = [f"{a!r} runs after {b!r} for {why.get((a, b), '?')!r}" for a, b in zip(cyc, cyc[1:])]
            raise PipelineError("cycle between stages: " + " -> ".join(cyc) + " (" + "; ".join(links) + ")")
        visiting.append(n)
        for d in sorted(deps[n], key=lambda x: [p.name for p in specs].index(x)):
            visit(d)
        visiting.pop()
        done.add(n)
        order.append(by_name[n])

    for s in specs:
        visit(s.name)
    return order


class Pipeline:
    """An ordered, validated graph of stages in two phases (admit, step)."""

    def __init__(self, specs: Iterable[StageSpec], recipe: Optional[str] = None, config: Optional[dict] = None,
                 registry: Optional[Registry] = None, backend: Optional[str] = None,
                 model_settings: Optional[dict] = None, description: str = ""):
        self.specs = list(specs)
        self.recipe = recipe
        self.config = dict(config or {})  # engine config overrides the recipe asks for
        self.registry = registry
        self.backend = backend  # the recipe's backend (None: detected); LLM(backend=...) wins
        self.model_settings = dict(model_settings or {})  # the recipe's [model]: slow twins, where the model has them
        self.description = description
        names = [s.name for s in self.specs]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise PipelineError(f"stage name(s) used twice: {', '.join(sorted(dup))}")
        for s in self.specs:
            if s.phase not in PHASES:
                raise PipelineError(f"stage {s.name!r} has unknown phase {s.phase!r}; expected one of {list(PHASES)}")
        self.order = {ph: _order(ph, [s for s in self.specs if s.phase == ph]) for ph in PHASES}
        # field -> the stage whose value of it the engine sees (the last writer in run order), per phase
        self._writers = {ph: {f: s.name for s in self.order[ph] for f in s.writes} for ph in PHASES}

    # Construction.
    @classmethod
    def from_stages(cls, stages: Iterable, registry: Optional[Registry] = None, **kw) -> "Pipeline":
        """stages: names or (name, args) pairs or {"name":..., "args":...} dicts."""
        registry = registry or get_registry()
        specs = []
        for st in stages:
            if isinstance(st, str):
                name, args = st, {}
            elif isinstance(st, dict):
                name, args = st["name"], st.get("args", {})
            else:
                name, args = st
            specs.append(_spec(registry, name, args))
        return cls(specs, registry=registry, **kw)

    @classmethod
    def from_recipe(cls, recipe, registry: Optional[Registry] = None) -> "Pipeline":
        """A registered recipe by name, or a recipe file by path (core/recipe.py), checked as it loads."""
        from .recipe import resolve

        registry = registry or get_registry()
        r = resolve(recipe, registry)
        return cls.from_stages(r.stages, registry=registry, recipe=r.name, config=r.engine, backend=r.backend,
                               model_settings=r.model, description=r.description)

    def _reg(self) -> Registry:
        return self.registry or get_registry()

    def _find(self, target: str) -> int:
        hits = [i for i, s in enumerate(self.specs) if s.name == target]
        if not hits:
            hits = [i for i, s in enumerate(self.specs) if s.kind == target]
        if len(hits) != 1:
            have = ", ".join(f"{s.name} [{s.kind}]" for s in self.specs)
            what = "no stage" if not hits else f"{len(hits)} stages"
            raise PipelineError(f"{what} named or of kind {target!r} in the pipeline (stages: {have})")
        return hits[0]

    def _with(self, specs: list) -> "Pipeline":
        return Pipeline(specs, recipe=self.recipe, config=self.config, registry=self.registry, backend=self.backend,
                        model_settings=self.model_settings, description=self.description)

    def replace(self, target: str, name: str, **args) -> "Pipeline":
        """Swap the stage named (or of kind) ``target`` for the registered stage ``name`` of the same kind."""
        i = self._find(target)
        specs = list(self.specs)
        old, specs[i] = specs[i], _spec(self._reg(), name, args)
        if specs[i].kind != old.kind:
            raise PipelineError(f"cannot replace {old.name!r} (kind {old.kind!r}) with {name!r} (kind "
                                f"{specs[i].kind!r}): the kinds differ. replace() swaps a stage for another of "
                                f"its kind; use insert()/remove() or Pipeline.from_stages() to change the graph")
        return self._with(specs)

    def insert(self, name: str, *, before: Optional[str] = None, after: Optional[str] = None, **args) -> "Pipeline":
        if (before is None) == (after is None):
            raise PipelineError("insert needs exactly one of before= or after=")
        i = self._find(before) if before is not None else self._find(after) + 1
        specs = list(self.specs)
        specs.insert(i, _spec(self._reg(), name, args))
        return self._with(specs)

    def remove(self, target: str) -> "Pipeline":
        specs = list(self.specs)
        del specs[self._find(target)]
        return self._with(specs)

    def with_args(self, target: str, **args) -> "Pipeline":
        i = self._find(target)
        specs = list(self.specs)
        specs[i] = attrs.evolve(specs[i], args={**specs[i].args, **args})
        return self._with(specs)

    # Inspection.
    def stage_names(self, phase: str = "step") -> list:
        return [s.name for s in self.order[phase]]

    def writer(self, field: str, phase: str = "step") -> Optional[str]:
        """The name of the stage whose value of ``field`` the engine gets, or None if no stage writes it.

        Computed when the pipeline is built, so it is cheap enough for request admission (the engine asks
        whether anything writes ``logprobs`` before it promises them to a request).
        """
        return self._writers[phase].get(field)

    def describe(self) -> str:
        lines = [f"Pipeline {self.recipe or '(custom)'}"]
        if self.description:
            lines += textwrap.wrap(self.description, 110, initial_indent="  ", subsequent_indent="  ")
        lines.append(f"  backend: {self.backend or '(detected: nvidia on a CUDA device, else reference)'}")
        lines.append("  engine: " + (", ".join(f"{k}={v!r}" for k, v in self.config.items()) + " (the rest: "
                                     "EngineConfig's defaults)" if self.config else "EngineConfig's defaults"))
        if self.model_settings:
            lines.append("  model (where the model has it): "
                         + ", ".join(f"{k}={v!r}" for k, v in self.model_settings.items()))
        for ph in PHASES:
            lines.append(f"  {ph} phase (engine provides: {', '.join(PHASES[ph][0])})")
            for i, s in enumerate(self.order[ph], 1):
                args = ", ".join(f"{k}={v!r}" for k, v in s.args.items())
                lines.append(f"    {i}. {s.name} [{s.kind}]{' (' + args + ')' if args else ''}  from {s.plugin}")
                lines.append(f"         reads: {', '.join(s.reads) or '-'}   writes: {', '.join(s.writes) or '-'}")
        return "\n".join(lines)

    def to_dot(self) -> str:
        out = ["digraph pipeline {", "  rankdir=LR;", "  node [shape=box];"]
        for ph in PHASES:
            inputs = PHASES[ph][0]
            out.append(f"  subgraph cluster_{ph} {{ label=\"{ph}\";")
            for f in inputs:
                out.append(f'    "{ph}:{f}" [shape=ellipse, label="{f}"];')
            producer = {f: f"{ph}:{f}" for f in inputs}
            for s in self.order[ph]:
                out.append(f'    "{s.name}" [label="{s.name}\\n[{s.kind}]"];')
                for f in s.reads:
                    if f in producer:
                        out.append(f'    "{producer[f]}" -> "{s.name}" [label="{f}"];')
                for f in s.writes:
                    producer[f] = s.name
            out.append("  }")
        out.append("}")
        return "\n".join(out)

    def __repr__(self) -> str:
        return f"Pipeline({self.recipe or 'custom'}: {' -> '.join(s.name for s in self.specs)})"

    # Binding to an engine.
    def build(self, context: dict) -> dict:
        """Instantiate every stage; returns {phase: [stage objects in run order]}."""
        return {ph: [instantiate(s, context) for s in self.order[ph]] for ph in PHASES}


def instantiate(spec: StageSpec, context: dict) -> Any:
    """Call the factory with the spec's args plus the context objects its signature names."""
    try:
        params = inspect.signature(spec.factory).parameters
    except (TypeError, ValueError):
        params = {}
    kwargs = {k: v for k, v in context.items() if k in params and k not in spec.args}
    try:
        return spec.factory(**kwargs, **spec.args)
    except TypeError as exc:
        raise PipelineError(f"stage {spec.name!r} could not be built with args {spec.args!r}: {exc}") from exc

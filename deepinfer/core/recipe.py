"""Recipes: named compositions of stages and settings, as data (TOML files, or dicts a plugin registers).

A recipe file (recipes/*.toml holds the built-in ones)::

    description = "what it is for"
    backend = "reference"            # optional: a registered backend; absent: detected
    [[stages]]                       # in order; a stage by its registered name, then its arguments
    name = "swa_replay"
    mode = "exact"
    [engine]                         # EngineConfig fields (max_num_seqs, enforce_eager, cuda_graph_sizes, ...)
    [cache]                          # the prefix-cache fields: enable_prefix_caching, host_cache_gb, cache_dir,
                                     # disk_cache_gb
    [model]                          # the model's own slow twins, applied where the model has them: pool_impl
    [speculative]                    # speculative_config: method (a draft stage), num_speculative_tokens, ...

Everything is checked when the recipe is loaded, never when it runs: an unknown key, an unknown stage (names
resolve through the plugin registry, so a plugin's stage may go anywhere), an argument its stage does not
take, or a value EngineConfig or the stage's own validators refuse fails with a RecipeError that names the
file, the key and what is accepted.
"""

from __future__ import annotations

import inspect
import json
import os
from pathlib import Path
from typing import Optional, Union

import attrs

from .graph import PipelineError
from .plugins import PluginError, Registry

TOP_KEYS = ("description", "backend", "stages", "engine", "cache", "model", "speculative")
CACHE_KEYS = ("enable_prefix_caching", "host_cache_gb", "cache_dir", "disk_cache_gb", "disk_write_through")
# [model]: the slow twins a model may have, each with the values it takes (read where the model has them).
MODEL_KEYS = {"pool_impl": ("gather", "mask")}


class RecipeError(PipelineError):
    """A recipe is invalid; the message names the file (or plugin), the key and what is accepted."""


@attrs.frozen
class Recipe:
    """A loaded, checked recipe. ``engine``: EngineConfig fields ([engine] and [cache] together)."""

    name: str  # the registered name, or the path as given
    source: str  # the file, or "plugin P" for a dict a plugin registered
    description: str = ""
    stages: tuple = ()  # ((registered name, {argument: value}), ...)
    backend: Optional[str] = None
    engine: dict = attrs.field(factory=dict)
    model: dict = attrs.field(factory=dict)


def _show(value) -> str:
    """A value as TOML would write it (strings quoted, true/false), for error messages."""
    try:
        return json.dumps(value)
    except TypeError:
        return repr(value)


def looks_like_path(recipe: Union[str, os.PathLike]) -> bool:
    return isinstance(recipe, os.PathLike) or recipe.endswith(".toml") or "/" in recipe or os.sep in recipe


def read_toml(path: Union[str, os.PathLike]) -> dict:
    import tomllib

    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise RecipeError(f"{path}: no such recipe file") from None
    except OSError as exc:
        raise RecipeError(f"{path}: cannot read it ({exc.strerror})") from None
    except tomllib.TOMLDecodeError as exc:
        raise RecipeError(f"{path}: not valid TOML: {exc}") from None


def resolve(recipe: Union[str, os.PathLike], registry: Registry) -> Recipe:
    """A registered recipe by name, or a recipe file by path, loaded and checked."""
    if not isinstance(recipe, (str, os.PathLike)):
        raise RecipeError(f"recipe={recipe!r} is invalid: give a registered name or a path to a .toml file")
    if not looks_like_path(recipe):
        try:
            entry = registry.get("recipe", recipe)
        except PluginError as exc:
            raise RecipeError(f"{exc}; or give a path to a .toml recipe file") from None
        if isinstance(entry.obj, dict):
            return parse(entry.obj, recipe, f"recipe {recipe!r} (plugin {entry.plugin})", registry)
        return parse(read_toml(entry.obj), recipe, str(entry.obj), registry)
    return parse(read_toml(recipe), str(recipe), str(recipe), registry)


def parse(data: dict, name: str, where: str, registry: Registry) -> Recipe:
    def fail(msg: str):
        raise RecipeError(f"{where}: {msg}")

    unknown = [k for k in data if k not in TOP_KEYS]
    if unknown:
        fail(f"unknown key {unknown[0]!r}; a recipe has: {', '.join(TOP_KEYS)}")
    for key in ("engine", "cache", "model", "speculative"):
        if not isinstance(data.get(key, {}), dict):
            fail(f"{key} = {_show(data[key])} is invalid: [{key}] must be a table")
    description = data.get("description", "")
    if not isinstance(description, str):
        fail(f"description = {_show(description)} is invalid: must be a string")
    speculative = data.get("speculative") or None
    if speculative is not None:
        from .config import _speculative

        try:
            _speculative(None, None, speculative)
        except ValueError as exc:
            fail(f"[speculative] is invalid: {exc}")
    backend = data.get("backend")
    if backend is not None and backend not in registry.names("backend"):
        fail(f"backend = {_show(backend)} is invalid: registered backends: {', '.join(registry.names('backend'))}")
    return Recipe(name=name, source=where, description=description.strip(),
                  stages=_stages(data.get("stages"), fail, registry), backend=backend,
                  engine={**_engine(data.get("engine", {}), data.get("cache", {}), fail),
                          **({"speculative_config": dict(speculative)} if speculative else {})},
                  model=_model(data.get("model", {}), fail))


def _stages(stages, fail, registry: Registry) -> tuple:
    if not isinstance(stages, list) or not stages:
        fail("stages is missing or empty: list the stages in order, one [[stages]] table each "
             "(name = a registered stage, then its arguments)")
    out = []
    for i, st in enumerate(stages, 1):
        if isinstance(st, str):
            st = {"name": st}
        if not isinstance(st, dict) or not isinstance(st.get("name"), str):
            fail(f"[[stages]] #{i} = {_show(st)} is invalid: each stage is a table with name = a registered stage")
        args = {k: v for k, v in st.items() if k != "name"}
        name = st["name"]
        try:
            entry = registry.get("stage", name)
        except PluginError:
            fail(f"[[stages]] #{i}: unknown stage {name!r}; registered stages: {', '.join(registry.names('stage'))}")
        _check_args(entry.obj, name, i, args, fail)
        out.append((name, args))
    return tuple(out)


def _check_args(factory, name: str, i: int, args: dict, fail) -> None:
    """Each argument is one the factory takes, and passes the attrs validator of its field, when it has one."""
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return
    for key, value in args.items():
        if key not in params:
            takes = ", ".join(p for p in params if p != "self") or "none"
            fail(f"[[stages]] #{i} ({name}): unknown argument {key!r}; {name} takes: {takes}")
    if not attrs.has(factory):
        return
    for field in attrs.fields(factory):
        if field.name in args and field.validator is not None:
            try:
                field.validator(None, field, args[field.name])
            except (ValueError, TypeError) as exc:
                why = str(exc)  # the stage's own message names the field, or say which
                if "invalid" not in why:
                    why = f"{field.name} = {_show(args[field.name])} is invalid: {why}"
                fail(f"[[stages]] #{i} ({name}): {why}")


def _reason(exc: Exception) -> str:
    """EngineConfig's message without its 'EngineConfig.field=value ' prefix (the recipe's own is used)."""
    msg = str(exc)
    if msg.startswith("EngineConfig.") and " is " in msg:
        return msg[msg.index(" is ") + 1:]
    return f"is invalid: {msg}"


def _engine(engine: dict, cache: dict, fail) -> dict:
    from .config import EngineConfig, config_fields

    fields = sorted(config_fields() - {"speculative_config"})
    for key in engine:
        if key not in fields:
            hint = " (use [speculative])" if key == "speculative_config" else ""
            fail(f"[engine] unknown key {key!r}{hint}; EngineConfig fields: {', '.join(fields)}")
    for key in cache:
        if key not in CACHE_KEYS:
            fail(f"[cache] unknown key {key!r}; accepted: {', '.join(CACHE_KEYS)}")
        if key in engine:
            fail(f"{key} is set in both [engine] and [cache]; set it once")
    for table, values in (("engine", engine), ("cache", cache)):
        for key, value in values.items():
            try:
                EngineConfig(**{key: value})  # EngineConfig's own validators decide
            except (ValueError, TypeError) as exc:
                fail(f"[{table}] {key} = {_show(value)} {_reason(exc)}")
    return {**engine, **cache}


def _model(model: dict, fail) -> dict:
    for key, value in model.items():
        if key not in MODEL_KEYS:
            fail(f"[model] unknown key {key!r}; accepted: {', '.join(MODEL_KEYS)}")
        if value not in MODEL_KEYS[key]:
            fail(f"[model] {key} = {_show(value)} is invalid: expected one of {', '.join(map(_show, MODEL_KEYS[key]))}")
    return dict(model)


def builtin_dir() -> Path:
    """The built-in recipes: deepinfer/recipes/ in an installed wheel, else the repository's top-level
    recipes/ (a source checkout or an editable install), which the wheel is built from (see setup.py)."""
    here = Path(__file__).resolve().parent.parent
    packaged = here / "recipes"
    return packaged if any(packaged.glob("*.toml")) else here.parent / "recipes"

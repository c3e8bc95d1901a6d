"""The plugin manager and the typed ``register`` object that hooks receive.

Built-ins register through the same hooks as third-party packages (found
through the entry-point group ``deepinfer``). ``DEEPINFER_PLUGINS`` is a
comma-separated allow list of entry-point names (empty = all);
``DEEPINFER_DISABLE_PLUGINS`` a deny list; a name in either that matches no
installed plugin is reported. Registration runs at build time, so a Registry
is computed on demand and never mutated during a step.

Two registrations of one name do not stop the engine: the core keeps one (the
built-in if either is, else the one loaded first) and logs a warning naming
both plugins; a registration with ``override=True`` replaces the other on
purpose, without a warning. Either way the pair is recorded in
``Registry.shadowed``, so ``deepinfer plugins`` shows both.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
from typing import Any, Callable, Optional

import attrs
import pluggy

from . import hookspecs
from .hookspecs import PROJECT

log = logging.getLogger(__name__)

BUILTIN = "deepinfer.builtin"
STAGE_KINDS = ("tokenize", "prefix_cache", "prefill", "swa_replay", "draft", "forward", "verify", "constrain",
               "sample", "detokenize")


PARSER_KINDS = ("tool", "reasoning")


class PluginError(ValueError):
    """A plugin registered something wrong (conflict, bad name) or a name is unknown."""


@attrs.frozen
class Entry:
    """One registered thing and the plugin that provided it."""

    category: str  # stage | backend | model | recipe | tool_parser | reasoning_parser
    name: str
    obj: Any
    plugin: str
    kind: Optional[str] = None  # stage kind
    available: Optional[Callable[[], bool]] = None
    override: bool = False  # registered with override=True: replaces an earlier registration of the name on purpose


@attrs.define(eq=False)
class Registry:
    """What the loaded plugins provide, keyed by category and name."""

    entries: dict = attrs.field(factory=dict)  # (category, name) -> Entry
    shadowed: list = attrs.field(factory=list)  # (kept Entry, shadowed Entry) for every name registered twice
    current_plugin: str = "?"
    reported: set = attrs.field(factory=set)  # clashes already warned about (shared per plugin manager)

    def _add(self, entry: Entry, override: bool) -> None:
        key = (entry.category, entry.name)
        old = self.entries.get(key)
        if old is None:
            self.entries[key] = entry
        elif override and not old.override:  # replaced on purpose: no warning, but `deepinfer plugins` shows both
            self.entries[key] = entry
            self.shadowed.append((entry, old))
        else:  # a clash: keep the first (built-ins register first), say so once per manager
            self.shadowed.append((old, entry))
            clash = (entry.category, entry.name, old.plugin, entry.plugin)
            if clash not in self.reported:
                self.reported.add(clash)
                why = "the built-in" if old.plugin == BUILTIN else "loaded first"
                log.warning("deepinfer: %s %r is registered by both %r and %r; keeping %r's (%s), %r's is shadowed. "
                            "Disable one (DEEPINFER_DISABLE_PLUGINS), rename it, or register it with override=True "
                            "to replace the other on purpose", entry.category, entry.name, old.plugin, entry.plugin,
                            old.plugin, why, entry.plugin)

    # The typed register API that hookimpls call.
    def stage(self, kind: str, name: str, factory: Callable, override: bool = False) -> None:
        if not isinstance(name, str) or not name:
            raise PluginError(f"plugin {self.current_plugin!r}: stage name must be a non-empty string, got {name!r}")
        if not callable(factory):
            raise PluginError(f"plugin {self.current_plugin!r}: stage {name!r} factory is not callable")
        self._add(Entry("stage", name, factory, self.current_plugin, kind=kind, override=override), override)

    def backend(self, name: str, factory: Callable, available: Callable[[], bool] = lambda: True,
                override: bool = False) -> None:
        self._add(Entry("backend", name, factory, self.current_plugin, available=available, override=override),
                  override)

    def model(self, architecture: str, factory: Callable, override: bool = False) -> None:
        self._add(Entry("model", architecture, factory, self.current_plugin, override=override), override)

    def recipe(self, name: str, spec, override: bool = False) -> None:
        """spec: a dict shaped like a recipe file (core/recipe.py), or the path of a .toml recipe file (read and
        checked when a pipeline is built from it)."""
        if not (isinstance(spec, os.PathLike) or (isinstance(spec, dict) and "stages" in spec)):
            raise PluginError(f"plugin {self.current_plugin!r}: recipe {name!r} must be a dict with 'stages' "
                              "or a pathlib.Path to a .toml recipe file")
        self._add(Entry("recipe", name, spec, self.current_plugin, override=override), override)

    def parser(self, kind: str, name: str, factory: Callable, override: bool = False) -> None:
        """An output parser of the server (entrypoints/parsers.py); kind: "tool" or "reasoning"."""
        if kind not in PARSER_KINDS:
            raise PluginError(f"plugin {self.current_plugin!r}: parser {name!r} has kind {kind!r}; expected one of "
                              f"{PARSER_KINDS}")
        if not callable(factory):
            raise PluginError(f"plugin {self.current_plugin!r}: parser {name!r} factory is not callable")
        self._add(Entry(f"{kind}_parser", name, factory, self.current_plugin, kind=kind, override=override), override)

    # Lookups.
    def names(self, category: str) -> list[str]:
        return sorted(n for c, n in self.entries if c == category)

    def get(self, category: str, name: str) -> Entry:
        try:
            return self.entries[(category, name)]
        except KeyError:
            known = ", ".join(self.names(category)) or "none"
            raise PluginError(f"unknown {category} {name!r}; registered: {known}") from None

    def by_plugin(self) -> dict:
        out: dict = {}
        for e in self.entries.values():
            out.setdefault(e.plugin, []).append(e)
        return out


def _csv_env(name: str) -> set:
    return {s.strip() for s in os.environ.get(name, "").split(",") if s.strip()}


def _warn_unmatched(var: str, names: set, installed: list) -> None:
    if names:
        log.warning("deepinfer: %s names %s, matching no installed plugin (installed entry points: %s)", var,
                    ", ".join(repr(n) for n in sorted(names)), ", ".join(installed) or "none")


def _load_entry_points(pm: pluggy.PluginManager) -> None:
    allow, deny = _csv_env("DEEPINFER_PLUGINS"), _csv_env("DEEPINFER_DISABLE_PLUGINS")
    eps = importlib.metadata.entry_points(group=PROJECT)
    installed = sorted({ep.name for ep in eps})
    _warn_unmatched("DEEPINFER_PLUGINS", allow - {*installed, BUILTIN}, installed)
    _warn_unmatched("DEEPINFER_DISABLE_PLUGINS", deny - {*installed, BUILTIN}, installed)
    for ep in eps:
        if (allow and ep.name not in allow) or ep.name in deny or pm.has_plugin(ep.name):
            continue
        try:
            pm.register(ep.load(), name=ep.name)
            try:
                pm.check_pending()  # a misspelled hook name would otherwise be ignored silently
            except pluggy.PluginValidationError as exc:
                pm.unregister(name=ep.name)
                raise RuntimeError(f"it implements an unknown hook: {exc}") from None
            origins(pm)[ep.name] = f"{ep.dist.name} {ep.dist.version} (entry point {ep.value})" if ep.dist else ep.value
        except Exception as exc:  # a broken plugin must not take the engine down
            log.warning("deepinfer: plugin %r (%s) failed to load: %s", ep.name, ep.value, exc)


def new_plugin_manager(load_entry_points: bool = True) -> pluggy.PluginManager:
    """A fresh manager with the built-ins and (optionally) the installed plugins."""
    from .. import builtin

    pm = pluggy.PluginManager(PROJECT)
    pm.add_hookspecs(hookspecs)
    if BUILTIN not in _csv_env("DEEPINFER_DISABLE_PLUGINS"):
        pm.register(builtin, name=BUILTIN)
    if load_entry_points:
        _load_entry_points(pm)
    return pm


_DEFAULT: list = []  # the process-wide manager, created on first use (like pytest's config.pluginmanager)


def get_plugin_manager() -> pluggy.PluginManager:
    if not _DEFAULT:
        _DEFAULT.append(new_plugin_manager())
    return _DEFAULT[0]


_HOOKS = {
    "deepinfer_register_stages": None,
    "deepinfer_register_backends": None,
    "deepinfer_register_models": None,
    "deepinfer_register_recipes": None,
    "deepinfer_register_parsers": None,
}


def get_registry(pm: Optional[pluggy.PluginManager] = None) -> Registry:
    """Run every registration hook and return what they registered, with provenance."""
    pm = pm or get_plugin_manager()
    reg = Registry(reported=_kept(pm, "deepinfer_reported", set))  # a clash is warned about once per manager
    for hook_name in _HOOKS:
        hook = getattr(pm.hook, hook_name)
        # Built-ins first (they win a clash; an override=True replaces them); then in load order. Impls are
        # called one by one to record who registered what.
        impls = sorted(hook.get_hookimpls(), key=lambda i: pm.get_name(i.plugin) != BUILTIN)
        for impl in impls:
            reg.current_plugin = pm.get_name(impl.plugin) or repr(impl.plugin)
            impl.function(register=reg)
    reg.current_plugin = "?"
    return reg


def _kept(pm: pluggy.PluginManager, attr: str, factory: Callable):
    """A record kept on the manager (it outlives every registry built from it)."""
    if not hasattr(pm, attr):
        setattr(pm, attr, factory())
    return getattr(pm, attr)


def origins(pm: pluggy.PluginManager) -> dict:
    """plugin name -> where it came from (distribution and entry point), kept on the manager."""
    return _kept(pm, "deepinfer_origins", dict)


def plugin_origin(pm: pluggy.PluginManager, name: str) -> str:
    """Where a plugin came from: its distribution, else its module file."""
    if name in origins(pm):
        return origins(pm)[name]
    plugin = pm.get_plugin(name)
    return getattr(plugin, "__file__", None) or f"in-process object ({type(plugin).__module__})"

"""Every pluggy hookspec of DeepInfer, each named deepinfer_*.

Registration hooks get a typed ``register`` object (see plugins.Registry): the
core owns naming and conflicts and records which plugin provided what. Hooks
run when a pipeline or engine is built, never per step.
"""

from __future__ import annotations

import pluggy

PROJECT = "deepinfer"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def deepinfer_register_stages(register) -> None:
    """Register stage factories: ``register.stage(kind=..., name=..., factory=...)``.

    Called every time a registry is built (``get_registry``: when an LLM or a
    pipeline from a recipe is built), never per step, so it must only
    register and have no other side effects. ``kind`` is one of the
    stage kinds (plugins.STAGE_KINDS: tokenize, prefix_cache, prefill,
    swa_replay, draft, forward, verify, constrain, sample, detokenize) or a
    new kind of the plugin's own. A name registered twice is kept once (the
    built-in, else the first loaded) with a warning, unless the later one
    passes ``override=True``. See docs/plugins.md for a worked example. The
    factory is called with the stage's keyword arguments plus whichever engine
    context objects (config, engine_config, model, ops, tokenizer, vocab_size,
    device, generator, decode_graphs) its signature names. The factory must carry the stage
    contract's class attributes (reads, writes, optional phase/replaces), so
    pass the stage class itself. Returns nothing.
    """


@hookspec
def deepinfer_register_backends(register) -> None:
    """Register backends: ``register.backend(name=..., factory=..., available=...)``.

    ``factory(device)`` returns an Ops object (backends/base.py); it is called
    only when the backend is chosen, so heavy imports belong inside it.
    ``available()`` says whether it can run here. Returns nothing.
    """


@hookspec
def deepinfer_register_models(register) -> None:
    """Register model architectures: ``register.model(architecture=..., factory=...)``.

    ``architecture`` is the name in config.json's ``architectures`` list.
    ``factory(hf_config: dict, ops)`` returns an unloaded model module
    (models/base.py contract); the loader calls it on the meta device, then
    moves it to the chosen device and dtype and loads the weights. Returns
    nothing.
    """


@hookspec
def deepinfer_register_recipes(register) -> None:
    """Register recipes: ``register.recipe(name=..., spec=...)``.

    A recipe is data: a ``pathlib.Path`` to a TOML recipe file, or a dict of
    the same shape (``stages``: stage names or {"name": ..., **args} tables;
    optional ``description``, ``backend``, ``engine``, ``cache``, ``model``,
    ``speculative``; see core/recipe.py). It is checked when a pipeline is
    built from it. Returns nothing.
    """


@hookspec
def deepinfer_register_parsers(register) -> None:
    """Register output parsers for the server: ``register.parser(kind=..., name=..., factory=...)``.

    ``kind`` is ``"tool"`` (tool calls in a model's output) or ``"reasoning"`` (its reasoning text);
    ``factory()`` takes no argument and returns a parser object (entrypoints/parsers.py: a tool parser has
    ``parse(text, final) -> Parsed`` and ``needs_special_tokens``, a reasoning parser ``split(text, final)
    -> (reasoning, rest)``). Called when a server is built (``deepinfer serve --tool-call-parser NAME``),
    never per request. Returns nothing.
    """

"""pytest plugin (entry point ``pytest11: deepinfer``): run the equivalence kit's suite against your own
compact implementations.

Name them in your pytest configuration, one ``KIND = MODULE:ATTR`` per line::

    [tool.pytest.ini_options]
    deepinfer_compact = ["ring = my_pkg.ring:CompactRing"]

or on the command line (``--deepinfer-compact ring=my_pkg.ring:CompactRing``, repeatable; it wins over the
ini line of the same kind). Kinds and what the object must be (deepinfer.testing.equivalence's contracts):

    ring   make(n_win, allowance, width) -> ring with append / rollback / window    (ring.py)
    paged  read(cache, block_tables, lengths, block_size) -> list of tensors        (paged.py)
    tier   make() -> an empty tier with put / get                                   (tiers.py)
    hash   hash_blocks(tokens, block_size, salt) -> list of block hashes            (hashing.py)
    batch  run(rows) -> list of per-row outputs (optional attribute vocab_size)     (batching.py)
    llm    make_llm(enable_prefix_caching) -> LLM (optional vocab_size, block_size) (prefix.py)

When anything is named, or ``deepinfer_kit`` lists kinds (``all`` for every one), pytest collects the suite
(deepinfer/testing/equivalence/suite.py) under the ini file's node, ``<inifile>::test_...``, whenever it
collects the directory holding that file; only the tests of the selected kinds (default: the named ones).
Each test gets its implementation from the fixture ``deepinfer_compact_<kind>``: by default the named object,
else ours (ring, paged, tier, hash; batch and llm have no default and skip). A conftest.py beside the ini
file may override the fixture instead of naming a module. ``deepinfer_kit_examples`` (default 50) sets the
hypothesis examples per test (a fifth for batch and llm, which run a model).

Without any of these options the plugin adds nothing to a test run.
"""

from __future__ import annotations

import importlib

import pytest

KINDS = ("ring", "paged", "tier", "hash", "batch", "llm")
SUITE = "deepinfer.testing.equivalence.suite"


def pytest_addoption(parser) -> None:
    parser.addini("deepinfer_compact", type="linelist", default=[],
                  help="deepinfer equivalence kit: KIND = MODULE:ATTR lines naming your implementations")
    parser.addini("deepinfer_kit", type="args", default=[],
                  help="deepinfer equivalence kit: kinds whose tests to run (all: every kind; default: the named)")
    parser.addini("deepinfer_kit_examples", default="50", help="deepinfer equivalence kit: examples per test")
    parser.getgroup("deepinfer").addoption(
        "--deepinfer-compact", action="append", default=[], metavar="KIND=MODULE:ATTR",
        help="run the deepinfer equivalence kit against this implementation (repeatable)")


def _parse(line: str, where: str) -> tuple:
    kind, sep, target = line.partition("=")
    kind, target = kind.strip(), target.strip()
    if not sep or kind not in KINDS or ":" not in target:
        raise pytest.UsageError(f"{where} {line!r}: expected KIND = MODULE:ATTR with KIND one of {', '.join(KINDS)}")
    return kind, target


def named(config) -> dict:
    """kind -> "module:attr", from the ini lines and then the command line."""
    out = dict(_parse(l, "deepinfer_compact") for l in config.getini("deepinfer_compact"))
    out.update(_parse(l, "--deepinfer-compact") for l in config.getoption("deepinfer_compact"))
    return out


def selected(config) -> set:
    kinds = config.getini("deepinfer_kit")
    if "all" in kinds:
        return set(KINDS)
    bad = sorted(set(kinds) - set(KINDS))
    if bad:
        raise pytest.UsageError(f"deepinfer_kit: unknown kind(s) {bad}; expected some of {', '.join(KINDS)} or all")
    return set(kinds) | set(named(config))


def resolve(target: str):
    """The object ``module:attr.sub`` names."""
    mod, _, attr = target.partition(":")
    obj = importlib.import_module(mod)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def pytest_configure(config) -> None:
    named(config), selected(config)  # a bad line fails at start-up, as a usage error


class KitSuite(pytest.Module):
    """The suite module, collected under the ini file's node so that its conftest.py fixtures apply."""

    def _getobj(self):
        return importlib.import_module(SUITE)

    def collect(self):
        kinds = selected(self.config)
        for item in super().collect():
            if any(item.name.startswith(f"test_{kind}_") for kind in kinds):
                yield item


def pytest_collect_file(file_path, parent):
    config = parent.config
    if config.inipath is not None and file_path == config.inipath and selected(config):
        return KitSuite.from_parent(parent, path=file_path)
    return None


def _ours(kind: str, tmp_path_factory):
    from .equivalence import hashing, paged, ring, tiers

    if kind == "ring":
        return ring.CEDRing
    if kind == "paged":
        return paged.engine_read
    if kind == "tier":
        return tiers.host_tier
    if kind == "hash":
        return hashing.prefix_cache_hasher()
    pytest.skip(f"deepinfer_compact names no {kind} implementation (kind {kind} has no default)")


def _fixture(kind: str):
    @pytest.fixture(scope="session", name=f"deepinfer_compact_{kind}")
    def impl(pytestconfig, tmp_path_factory):
        target = named(pytestconfig).get(kind)
        return resolve(target) if target else _ours(kind, tmp_path_factory)

    impl.__doc__ = f"The {kind} implementation the deepinfer equivalence kit checks (see the plugin's docstring)."
    return impl


deepinfer_compact_ring = _fixture("ring")
deepinfer_compact_paged = _fixture("paged")
deepinfer_compact_tier = _fixture("tier")
deepinfer_compact_hash = _fixture("hash")
deepinfer_compact_batch = _fixture("batch")
deepinfer_compact_llm = _fixture("llm")

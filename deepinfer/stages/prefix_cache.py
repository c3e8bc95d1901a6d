"""Admit stage: a request's prefix-cache key. The cache itself (block hashes, shared blocks, eviction) is the
engine's (core/prefix_cache.py); this stage decides, per request, under which key its blocks are found.

The key chains from the engine's identity (model, dtype, cache layout) and the request's ``cache_salt``
(``{"prompt_token_ids": [...], "cache_salt": "tenant-a"}``, as vLLM's prompt field): requests with different
salts never share a block. A request that scores its prompt (``prompt_logprobs``) neither looks up nor
registers blocks, since every prompt position must then be computed (vLLM does the same). With
``enable_prefix_caching=False`` no request does.
"""

from __future__ import annotations

import attrs

from ..core.prefix_cache import root_key
from ..core.stage import Stage


@attrs.define(eq=False)
class PrefixCacheStage(Stage):
    name = "prefix_cache"
    kind = "prefix_cache"
    phase = "admit"
    reads = ("prompt", "params")
    writes = ("cache_root",)

    engine_config: object
    cache_identity: str

    def __call__(self, st) -> None:
        salt = st.prompt.get("cache_salt") if isinstance(st.prompt, dict) else None
        if salt is not None and not isinstance(salt, str):
            raise ValueError(f"cache_salt must be a string, got {type(salt).__name__} {salt!r}")
        if not self.engine_config.enable_prefix_caching or st.params.prompt_logprobs is not None:
            st.cache_root = None
            return
        st.cache_root = root_key(self.cache_identity, salt)

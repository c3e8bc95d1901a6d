"""The offline API: LLM(model=...).generate(prompts, sampling_params), chat, stream."""

from __future__ import annotations

import itertools
import logging
import os
import weakref
from typing import Iterator, Optional

import torch

from ..models import loader
from ..models.quant import fp8_block_size
from .config import EngineConfig, config_fields
from .prefix_cache import checkpoint_identity
from .swa_pool import wanted as swa_pool_wanted
from .engine import Engine
from .graph import Pipeline
from ..outputs import held_for_stream
from .params import SamplingParams
from .plugins import get_registry
from .vllm_compat import drop_vllm_keywords

log = logging.getLogger(__name__)


def choose_backend(registry, backend: Optional[str], device: Optional[str]):
    """Backend by explicit name, DEEPINFER_ACCELERATOR (nvidia|ascend|cpu), or detection."""
    acc = os.environ.get("DEEPINFER_ACCELERATOR", "").strip().lower()
    if acc and acc not in ("nvidia", "ascend", "cpu"):
        raise ValueError(f"DEEPINFER_ACCELERATOR={acc!r} is invalid: expected nvidia, ascend or cpu")
    if device is None:
        if acc == "cpu":
            device = "cpu"
        elif acc == "nvidia" or (not acc and torch.cuda.is_available()):
            device = "cuda"
        elif acc == "ascend":
            device = "npu"
        else:
            device = "cpu"
    if backend is None:
        wanted = {"cuda": "nvidia", "npu": "ascend"}.get(torch.device(device).type, "reference")
        names = registry.names("backend")
        backend = wanted if wanted in names and registry.get("backend", wanted).available() else "reference"
    entry = registry.get("backend", backend)
    return entry.obj(device), backend


GENERATION_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def generation_defaults(model_path) -> dict:
    """The sampling defaults a checkpoint's generation_config.json recommends (only the keys vLLM reads);
    a value SamplingParams would reject is ignored with a warning rather than breaking every request."""
    import json
    from pathlib import Path

    f = Path(model_path) / "generation_config.json"
    if not f.exists():
        return {}
    try:
        cfg = json.loads(f.read_text())
    except json.JSONDecodeError as exc:
        log.warning("ignoring %s: %s", f, exc)
        return {}
    out = {k: cfg[k] for k in GENERATION_KEYS if cfg.get(k) is not None}
    try:
        SamplingParams(**out)
    except ValueError as exc:
        log.warning("ignoring the sampling defaults of %s: %s", f, exc)
        return {}
    return out


def set_threads(threads: Optional[int] = None) -> None:
    """torch's CPU thread count: ``threads`` when given, else ``DEEPINFER_NUM_THREADS`` when set, else torch's
    own default (one per core, slow on a machine whose cores are busy with other work)."""
    name = "threads"
    if threads is None:
        env = os.environ.get("DEEPINFER_NUM_THREADS", "").strip()
        if not env:
            return
        name, threads = "DEEPINFER_NUM_THREADS", int(env) if env.isdigit() else env
    if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
        raise ValueError(f"{name}={threads!r} is invalid: must be an int >= 1")
    torch.set_num_threads(threads)


class LLM:
    """Load a checkpoint and generate. ``model=None`` loads the bundled demo model."""

    def __init__(self, model: Optional[str] = None, recipe="default", pipeline: Optional[Pipeline] = None,
                 dtype: Optional[str] = None, max_model_len: Optional[int] = None, backend: Optional[str] = None,
                 device: Optional[str] = None, tokenizer: Optional[str] = None, registry=None,
                 hf_overrides: Optional[dict] = None, load_format: str = "auto", threads: Optional[int] = None,
                 **engine_kwargs):
        set_threads(threads)
        # One registry for stages, backends and models: the pipeline's when it brings one.
        registry = registry or (pipeline.registry if pipeline is not None and pipeline.registry else None) \
            or get_registry()
        if pipeline is None:
            pipeline = Pipeline.from_recipe(recipe, registry=registry)
        engine_kwargs = drop_vllm_keywords(engine_kwargs)
        unknown = set(engine_kwargs) - config_fields()
        if unknown:
            raise TypeError(f"LLM() got unknown argument(s) {sorted(unknown)}; engine settings: {sorted(config_fields())}")
        # What is passed here explicitly wins over the recipe's settings (None: not passed).
        explicit = {"dtype": dtype, "max_model_len": max_model_len, "device": device}
        cfg = {**pipeline.config, **engine_kwargs, **{k: v for k, v in explicit.items() if v is not None}}
        config = EngineConfig(**cfg)
        ops, self.backend_name = choose_backend(registry, backend or pipeline.backend, config.device)
        self.model_path = loader.resolve_model_path(model)
        hf_config = {**loader.load_config(self.model_path), **(hf_overrides or {})}
        if config.quantization == "fp8" and fp8_block_size(hf_config) is None:
            raise ValueError(f"EngineConfig.quantization='fp8' needs an FP8 checkpoint (config.json "
                             f"quantization_config.quant_method 'fp8'); {self.model_path} is not one, and online "
                             "quantization is not implemented")
        torch_dtype = loader.torch_dtype(config.dtype, hf_config, ops.device)
        if config.tensor_parallel_size * config.data_parallel_size > 1:  # rank 0 of parallel serving (parallel/)
            from ..parallel.workers import start_parallel

            net = start_parallel(config, self.model_path, hf_config, ops, self.backend_name, torch_dtype, load_format,
                                 registry, threads)
            weakref.finalize(self, net.shutdown)
        else:
            net = loader.build_model(self.model_path, hf_config, ops, torch_dtype, ops.device, registry, load_format,
                                     config.fp8_experts)
        net.requires_grad_(False)  # inference only: no op records an autograd graph
        for key, value in pipeline.model_settings.items():  # the recipe's slow twins, where the model has them
            if hasattr(net, key):
                setattr(net, key, value)
        if config.enable_eplb and getattr(net, "eplb", None) is None:  # one process; start_parallel set up the ranks'
            from ..parallel.placement import enable_eplb

            enable_eplb(net, config.eplb_config)
        from ..tokenizer import Tokenizer

        self.tokenizer = Tokenizer.from_dir(tokenizer or self.model_path)
        if self.tokenizer.vocab_size > net.vocab_size:
            log.warning("tokenizer has %d tokens but the model only %d logits", self.tokenizer.vocab_size,
                        net.vocab_size)
        max_len = loader.check_max_model_len(config.max_model_len, hf_config, net.max_position)
        if swa_pool_wanted(config, net):  # the cache then keeps each slot's recent encoder outputs (sized below)
            net.keep_encoder_outputs = True
        self.kv_plan = self._plan_kv(config, net, ops, torch_dtype, max_len)
        num_blocks, max_len = self.kv_plan.num_blocks, self.kv_plan.max_model_len
        self.engine = Engine(config, net, self.tokenizer, pipeline, ops, num_blocks, max_len,
                             identity=checkpoint_identity(self.model_path, hf_config, load_format),
                             model_path=self.model_path)
        self.generation_defaults = generation_defaults(self.model_path)
        self.config, self.hf_config = config, hf_config
        self._ids = itertools.count()
        self._streams: dict = {}  # request id -> its latest undelivered output (None: none yet)

    @staticmethod
    def _plan_kv(config, net, ops, dtype, max_len: int):
        """The KV pool: from num_kv_blocks, kv_cache_memory_gb, or (CUDA) a profile run (core/kv_sizing.py)."""
        from .kv_sizing import cache_layout, plan_kv, profile_memory

        per_block, fixed = cache_layout(net, dtype, config.block_size, config.max_num_seqs)
        profile = None
        if ops.device.type == "cuda" and config.num_kv_blocks is None and config.kv_cache_memory_gb is None:
            graph_batch = 0
            if not config.enforce_eager and getattr(net, "supports_cuda_graphs", False):
                from ..backends.cuda_graph import capture_sizes

                graph_batch = max(capture_sizes(config.cuda_graph_sizes, config.max_num_seqs))
            profile = profile_memory(net, ops, dtype, config, max_len, graph_batch)
        plan = plan_kv(config, per_block, fixed, max_len, config.max_model_len is not None, profile)
        log.info("%s", plan.describe())
        return plan

    def shutdown(self) -> None:
        """Stop the parallel workers (tensor_parallel_size > 1) and leave the process group; a no-op otherwise.
        Also runs when the LLM is garbage-collected or the interpreter exits."""
        stop = getattr(self.engine.model, "shutdown", None)
        if stop is not None:
            stop()

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams() with the checkpoint's generation_config.json sampling defaults (as vLLM does)."""
        return SamplingParams(**self.generation_defaults)

    @property
    def pipeline(self) -> Pipeline:
        return self.engine.pipeline

    def get_tokenizer(self):
        return self.tokenizer

    # Generation.
    def _add(self, prompts, sampling_params, stream: bool = False, priority: Optional[list] = None) -> list:
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise TypeError(f"prompts must be a str, a list of token ids, a dict or a list of those, "
                            f"got {type(prompts).__name__}")
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            if not isinstance(sampling_params, (list, tuple)) or not all(
                    isinstance(p, SamplingParams) for p in sampling_params):
                raise TypeError("sampling_params must be a SamplingParams or a list of them, one per prompt")
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts; pass one, or one per prompt")
        if priority is None:
            priority = [0] * len(prompts)
        elif not isinstance(priority, (list, tuple)) or len(priority) != len(prompts) \
                or not all(isinstance(p, int) and not isinstance(p, bool) for p in priority):
            raise ValueError(f"priority={priority!r} is invalid: pass one int per prompt ({len(prompts)})")
        ids = []
        for p, sp, prio in zip(prompts, params, priority):
            rid = str(next(self._ids))
            self.engine.add_request(rid, p, sp, stream=stream, priority=prio)
            ids.append(rid)
        return ids

    def generate(self, prompts, sampling_params=None, use_tqdm: bool = True, priority: Optional[list] = None) -> list:
        """One RequestOutput per prompt, in order. A prompt is a str, a list of token ids or {"prompt_token_ids": [...]}.
        ``priority``: one int per prompt, lower served first, ties by arrival (as vLLM's)."""
        ids = self._add(prompts, sampling_params, priority=priority)
        own = set(ids)
        done: dict = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="generate", unit="req", dynamic_ncols=True)
        try:
            while len(done) < len(ids):
                for out in self._step():
                    if out.finished and out.request_id in own:
                        done[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
            self._stash(self.engine.sync())  # a step may still be in flight (overlap scheduling): leave none behind
            drain = getattr(self.engine.prefix_cache, "drain", None)  # (None: no caching, or per-rank pools)
            if drain is not None and not self.engine.scheduler.has_unfinished():
                drain()  # the disk tier's background writes: a restarted engine finds what this computed
        finally:
            if bar is not None:
                bar.close()
            for rid in own - done.keys():  # interrupted (an exception, Ctrl-C): stop the rest
                self.engine.abort(rid)
        return [done[i] for i in ids]

    def stream(self, prompt, sampling_params: Optional[SamplingParams] = None) -> Iterator:
        """Yield the cumulative RequestOutput of one request after every step that changed it.

        Leaving the loop early (or dropping the iterator) aborts the request and frees its KV blocks. While
        the iterator is paused, other calls (generate, another stream) keep its request running; it resumes
        with the latest output.
        """
        (rid,) = self._add([prompt], sampling_params, stream=True)
        self._streams[rid] = None
        stops = (sampling_params or self.get_default_sampling_params()).stop
        try:
            while True:
                out = self._streams.get(rid)
                if out is None:
                    self._step()
                    continue
                self._streams[rid] = None
                yield held_for_stream(out, stops)  # (a tail that may begin a stop string waits)
                if out.finished:
                    return
        finally:
            self._streams.pop(rid, None)
            self.engine.abort(rid)

    def _step(self) -> list:
        """One engine step; outputs of live streams are kept for their iterators, the rest returned."""
        return self._stash(self.engine.step())

    def _stash(self, outs: list) -> list:
        rest = []
        for out in outs:
            if out.request_id in self._streams:
                self._streams[out.request_id] = out  # cumulative: the latest one is all a stream needs
            else:
                rest.append(out)
        return rest

    def chat(self, messages, sampling_params=None, use_tqdm: bool = True, chat_template: Optional[str] = None,
             add_generation_prompt: bool = True) -> list:
        """messages: one conversation (list of {role, content}) or a list of them."""
        if not isinstance(messages, (list, tuple)):
            raise TypeError(f"messages must be a list of {{role, content}} dicts (or a list of such lists), got "
                            f"{type(messages).__name__}")
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        kw = {"chat_template": chat_template} if chat_template else {}
        prompts = []
        for c, conv in enumerate(convs):
            conv = _chat_messages(conv, f"messages[{c}]" if len(convs) > 1 else "messages")
            text = self.tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                      **kw)
            prompts.append({"prompt_token_ids": self.tokenizer.encode(text), "prompt": text})  # prompt: for outputs
        outs = self.generate(prompts, sampling_params, use_tqdm=use_tqdm)
        return outs

    def cache_stats(self) -> dict:
        """Prefix-cache totals (core/prefix_cache.py ``summary``); {"enabled": False} when caching is off."""
        cache = self.engine.prefix_cache
        if cache is None:
            return {"enabled": False}
        pool = self.engine.swa_pool
        return {"enabled": True, **cache.summary(), **(pool.summary() if pool is not None else {})}

    def spec_stats(self) -> dict:
        """Speculative decoding's accounting since start-up (core/speculative.py): rows verified, draft tokens,
        accepted tokens, acceptance by draft position, tokens emitted per verified row; {"enabled": False}
        without speculative_config."""
        eng = self.engine
        if eng.spec is None:
            return {"enabled": False}
        gate = {} if eng.draft_gate is None else {"draft_gate_closed_steps": eng.draft_gate.closed}
        return {"enabled": True, "method": eng.spec.method, "num_speculative_tokens": eng.spec.num_speculative_tokens,
                **eng.spec_stats.summary(), **gate}

    def reset_prefix_cache(self) -> int:
        """Forget every cached device block no request holds (as vLLM's reset_prefix_cache); returns how many.
        The host and disk tiers keep their entries (a later lookup may still hit there)."""
        cache = self.engine.prefix_cache
        return 0 if cache is None else cache.reset()

    def expert_load(self) -> dict:
        """Tokens routed to each expert per MoE layer over the recent window of steps."""
        load = getattr(self.engine.model, "expert_load", None)
        if load is None:
            raise ValueError(f"{type(self.engine.model).__name__} has no experts; expert load needs an MoE model")
        return load.as_dict()

    def eplb_stats(self) -> dict:
        """Expert-parallel load balancing: the layout, rebalances so far (step, balancedness before and after,
        slots moved) and the balancedness over the current window under the placement in use and the default."""
        eplb = getattr(self.engine.model, "eplb", None)
        if eplb is None:
            raise ValueError("EPLB is off; pass LLM(..., enable_eplb=True) (an MoE model)")
        return eplb.stats()

    def dump_expert_load(self, path, **extra) -> None:
        """Append the expert load as JSONL rows (one per MoE layer) with the model path and any extra fields."""
        load = getattr(self.engine.model, "expert_load", None)
        if load is None:
            raise ValueError(f"{type(self.engine.model).__name__} has no experts; expert load needs an MoE model")
        load.dump_jsonl(path, {"model": str(self.model_path), **extra})


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def _chat_messages(conv, where: str) -> list:
    """A conversation checked for the chat template: dicts with a known role and a string content (a list of
    {"type": "text", "text": ...} parts is joined with newlines, as vLLM does); ValueError naming the message."""
    if not isinstance(conv, (list, tuple)) or not conv:
        raise ValueError(f"{where} must be a non-empty list of {{role, content}} dicts")
    out = []
    for i, m in enumerate(conv):
        at = f"{where}[{i}]"
        if not isinstance(m, dict):
            raise ValueError(f"{at} must be a dict with 'role' and 'content', got {type(m).__name__}")
        if m.get("role") not in CHAT_ROLES:
            raise ValueError(f"{at}.role={m.get('role')!r} is invalid: expected one of {', '.join(CHAT_ROLES)}")
        content = m.get("content")
        if isinstance(content, (list, tuple)):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise ValueError(f"{at}.content: only text parts ({{'type': 'text', 'text': str}}) are supported")
            m = {**m, "content": "\n".join(p["text"] for p in content)}
        elif content is None and not (m["role"] == "assistant" and m.get("tool_calls")):
            raise ValueError(f"{at} needs 'content' (a string)")
        elif content is not None and not isinstance(content, str):
            raise ValueError(f"{at}.content must be a string or a list of text parts, got {type(content).__name__}")
        out.append(m)
    return out

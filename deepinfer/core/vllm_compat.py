"""vLLM's LLM(...) keywords that DeepInfer does not take, and what to use instead.

The keywords whose meaning carries over are EngineConfig fields (gpu_memory_utilization, max_logprobs,
enable_prefix_caching, kv_cache_dtype, quantization, tensor_parallel_size, speculative_config, ...). The
ones here are refused with a ValueError that says what to do instead, unless their value asks for what
DeepInfer does anyway (``trust_remote_code=False``, ``pipeline_parallel_size=1``): those are accepted and
dropped. A keyword neither vLLM nor DeepInfer knows stays a TypeError (raised by LLM).
"""

from __future__ import annotations

_LOCAL = "DeepInfer loads a local directory or the local Hugging Face cache; fetch the revision with `hf download`"
_NO_LORA = "LoRA adapters are not supported; merge the adapter into the weights"
_TEXT_ONLY = "DeepInfer serves text-only causal LMs"

# keyword -> (values accepted as a no-op, what to use instead)
REFUSED: dict = {
    "trust_remote_code": ((False,), "DeepInfer never runs code shipped with a checkpoint; its architectures are "
                                    "built in or come from plugins (register.model)"),
    "tokenizer_mode": (("auto",), "DeepInfer reads the checkpoint's tokenizer.json (fast tokenizers only)"),
    "skip_tokenizer_init": ((False,), "the tokenizer is needed for stop strings and detokenization"),
    "revision": ((None,), _LOCAL), "tokenizer_revision": ((None,), _LOCAL), "code_revision": ((None,), _LOCAL),
    "download_dir": ((None,), _LOCAL + "; HF_HOME points at the cache"), "hf_token": ((None,), _LOCAL),
    "swap_space": ((0,), "preemption is by recompute, there is no CPU swap space"),
    "cpu_offload_gb": ((0,), "weights stay on the device; pick a smaller dtype or model"),
    "pipeline_parallel_size": ((1,), "pipeline parallelism is not implemented; use tensor_parallel_size"),
    "distributed_executor_backend": ((None, "mp"), "the engine spawns its workers (torch.multiprocessing); across "
                                                   "machines run the script under torchrun"),
    "disable_custom_all_reduce": ((False, True), ""),
    "enable_chunked_prefill": ((None, True), "chunked prefill is always on; max_num_batched_tokens sets the chunk "
                                             "(at least max_model_len prefills every prompt in one step)"),
    "max_num_partial_prefills": ((None, 1), "chunked prefill takes prompts in arrival order"),
    "long_prefill_token_threshold": ((None, 0), "chunked prefill takes prompts in arrival order"),
    "max_seq_len_to_capture": ((None,), "CUDA graphs cover every decode length; enforce_eager=True turns them off"),
    "compilation_config": ((None,), "CUDA graphs capture the decode step; enforce_eager=True turns them off"),
    "num_gpu_blocks_override": ((None,), "use num_kv_blocks"),
    "kv_cache_memory_bytes": ((None,), "use kv_cache_memory_gb"),
    "async_scheduling": ((None,), "use overlap_scheduling"),
    "disable_async_output_proc": ((None, False), "use overlap_scheduling=False"),
    "scheduling_policy": (("fcfs", "priority"), "requests are served by generate(priority=...), then arrival"),
    "enable_lora": ((False, None), _NO_LORA), "max_loras": ((None,), _NO_LORA), "max_lora_rank": ((None,), _NO_LORA),
    "max_cpu_loras": ((None,), _NO_LORA),
    "limit_mm_per_prompt": ((None,), _TEXT_ONLY), "mm_processor_kwargs": ((None,), _TEXT_ONLY),
    "allowed_local_media_path": ((None, ""), _TEXT_ONLY),
    "task": (("auto", "generate"), "DeepInfer generates text (no embedding, scoring or pooling)"),
    "runner": (("auto", "generate"), "DeepInfer generates text (no embedding, scoring or pooling)"),
    "override_pooler_config": ((None,), "DeepInfer generates text (no pooling)"),
    "generation_config": (("auto",), "sampling defaults come from the checkpoint's generation_config.json; pass "
                                     "SamplingParams to override them"),
    "override_generation_config": ((None,), "pass SamplingParams to override the checkpoint's defaults"),
    "guided_decoding_backend": ((None,), "structured output is not implemented yet"),
    "structured_outputs_config": ((None,), "structured output is not implemented yet"),
    "logits_processors": ((None,), "pass per-request callables in SamplingParams(logits_processors=[...])"),
    "served_model_name": ((None,), "a server setting; the offline LLM has no served name"),
    "disable_log_stats": ((True, False), ""),
    "enable_sleep_mode": ((False,), "sleep mode is not implemented"),
    "kv_transfer_config": ((None,), "KV transfer (disaggregated prefill) is not implemented"),
    "calculate_kv_scales": ((False,), "the KV cache is not quantized (kv_cache_dtype='auto')"),
    "worker_cls": (("auto",), "the engine runs in-process; swap stages or backends through plugins instead"),
    "reasoning_parser": ((None, ""), "a server setting"),
}


def _accepted(value, ok) -> bool:
    # True == 1 in Python: a bool only matches a bool, an int only an int.
    return any(value == v and isinstance(value, bool) == isinstance(v, bool) for v in ok)


def drop_vllm_keywords(kwargs: dict) -> dict:
    """kwargs without the vLLM keywords whose value asks for what DeepInfer does anyway; a vLLM keyword with
    any other value is a ValueError naming it and what to use instead."""
    out = {}
    for name, value in kwargs.items():
        if name not in REFUSED:
            out[name] = value
            continue
        ok, instead = REFUSED[name]
        if not _accepted(value, ok):
            accepted = " or ".join(repr(v) for v in ok)
            raise ValueError(f"LLM({name}={value!r}) is not supported (vLLM's keyword; accepted here: {accepted})"
                             + (f": {instead}" if instead else ""))
    return out

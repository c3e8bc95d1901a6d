"""EngineConfig: frozen, validated; derive variants with attrs.evolve."""

from __future__ import annotations

from typing import Optional

import attrs

DTYPES = ("auto", "float32", "bfloat16", "float16")


def _positive(name: str):
    def check(inst, attribute, value):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"EngineConfig.{name}={value!r} is invalid: must be an int >= 1")
    return check


def _non_negative(name: str):
    def check(inst, attribute, value):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"EngineConfig.{name}={value!r} is invalid: must be an int >= 0")
    return check


def _watermark(inst, attribute, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise ValueError(f"EngineConfig.watermark={value!r} is invalid: must be a fraction of the pool in [0, 1)")


def _fraction(inst, attribute, value):
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1):
        raise ValueError(f"EngineConfig.{attribute.name}={value!r} is invalid: must be a fraction in (0, 1]")


def _max_logprobs(inst, attribute, value):
    if not isinstance(value, int) or isinstance(value, bool) or value < -1:
        raise ValueError(f"EngineConfig.max_logprobs={value!r} is invalid: must be an int >= 0, or -1 (no limit)")


def _optional_bool(inst, attribute, value):
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"EngineConfig.{attribute.name}={value!r} is invalid: must be a bool")


def _speculative(inst, attribute, value):
    from .speculative import SpeculativeConfig

    SpeculativeConfig.parse(value)  # a drafter without confidences refuses dynamic=True when it is built


def _only(name: str, allowed, why: str):
    def check(inst, attribute, value):
        if value != allowed or isinstance(value, bool) != isinstance(allowed, bool):
            raise ValueError(f"EngineConfig.{name}={value!r} is not supported: only {allowed!r}; {why}")
    return check


def _one_of(name: str, allowed: tuple):
    def check(inst, attribute, value):
        if value not in allowed:
            raise ValueError(f"EngineConfig.{name}={value!r} is invalid: expected one of {allowed}")
    return check


def _quantization(inst, attribute, value):
    if value not in (None, "fp8"):
        raise ValueError(f"EngineConfig.quantization={value!r} is not supported: None (what the checkpoint "
                         "says) or 'fp8' (an FP8 block-quantized checkpoint); online quantization is not implemented")


def _sizes(inst, attribute, value):
    if value is not None and (not isinstance(value, (list, tuple)) or not value or any(
            not isinstance(v, int) or isinstance(v, bool) or v < 1 for v in value)):
        raise ValueError(f"EngineConfig.cuda_graph_sizes={value!r} is invalid: must be a non-empty list of ints >= 1")


def _positive_seconds(inst, attribute, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or value == float("inf"):
        raise ValueError(f"EngineConfig.{attribute.name}={value!r} is invalid: must be a finite number of seconds > 0")


def _gigabytes(inst, attribute, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
        raise ValueError(f"EngineConfig.{attribute.name}={value!r} is invalid: must be a finite number of GB >= 0")


def _optional_str(inst, attribute, value):
    if value is not None and not isinstance(value, str):
        raise ValueError(f"EngineConfig.{attribute.name}={value!r} is invalid: must be a path (str) or None")
    if value is not None and "\0" in value:
        raise ValueError(f"EngineConfig.{attribute.name}={value!r} is invalid: a path holds no NUL byte")


def _default_true(value):
    """None -> True: vLLM's ``enable_prefix_caching: Optional[bool] = None`` means "the default", which is on."""
    return True if value is None else value


def _eplb_config(inst, attribute, value):
    # Checked alone (a recipe checks each key by itself); inert unless enable_eplb, as in vLLM.
    if value is not None:
        from ..parallel.placement import EplbConfig  # parallel/ is imported only when EPLB is configured

        EplbConfig.from_dict(value)  # raises naming the key and the value


def _dtype(inst, attribute, value):
    if value not in DTYPES:
        raise ValueError(f"EngineConfig.dtype={value!r} is invalid: expected one of {DTYPES}")


@attrs.frozen
class EngineConfig:
    dtype: str = attrs.field(default="auto", validator=_dtype)  # auto: float32 on CPU, the checkpoint's dtype on GPU
    max_model_len: Optional[int] = attrs.field(default=None, validator=_positive("max_model_len"))  # None: from config
    block_size: int = attrs.field(default=16, validator=_positive("block_size"))
    num_kv_blocks: Optional[int] = attrs.field(default=None, validator=_positive("num_kv_blocks"))  # None: from memory
    kv_cache_memory_gb: Optional[float] = None  # KV budget when num_kv_blocks is None; None: 0.5 on CPU, a profile run on CUDA
    max_num_seqs: int = attrs.field(default=256, validator=_positive("max_num_seqs"))
    max_num_batched_tokens: int = attrs.field(default=4096, validator=_positive("max_num_batched_tokens"))
    # Admission keeps this fraction of the KV pool free (at least one block; 0: off) so a new sequence does not
    # force the preemption of a running one; running sequences' growth may use it (vLLM's watermark).
    watermark: float = attrs.field(default=0.01, validator=_watermark)
    # A waiting sequence that does not fit may be passed over by later ones that do, in at most this many steps;
    # then nothing behind it is admitted until it fits (0: strict head-of-line order). See core/scheduler.py.
    scheduling_aging_steps: int = attrs.field(default=32, validator=_non_negative("scheduling_aging_steps"))
    enforce_eager: bool = False  # True: never capture CUDA graphs (dense models' decode uses them on CUDA otherwise)
    # Decode batch sizes captured as CUDA graphs at start-up (capped at max_num_seqs); None: 1, 2, 4, 8, 16, 24,
    # 32, 48, ... 256. A decode step of n rows replays the smallest size >= n; larger ones run eagerly.
    cuda_graph_sizes: Optional[list] = attrs.field(default=None, validator=_sizes)
    # Overlap scheduling: launch step N+1 before collecting step N's tokens (decode inputs read them on the
    # device). None: on for CUDA devices, off elsewhere (nothing runs asynchronously there to overlap).
    overlap_scheduling: Optional[bool] = None
    seed: int = 0
    # Batch-invariant kernels (backends/batch_invariant.py): a request's tokens and logprobs do not depend on the
    # other requests of its steps (the deterministic recipe; README "Deterministic inference" says what holds).
    batch_invariant: bool = attrs.field(default=False, validator=_optional_bool)
    device: Optional[str] = None  # None: from the backend
    # vLLM's names, where the meaning carries over (see core/vllm_compat.py for the ones refused).
    # CUDA: the share of total device memory the engine may hold, weights, activations and CUDA graphs
    # included; the KV cache gets what is left after a profile run (core/kv_sizing.py). Ignored on the CPU and
    # when num_kv_blocks or kv_cache_memory_gb is set.
    gpu_memory_utilization: float = attrs.field(default=0.9, validator=_fraction)
    max_logprobs: int = attrs.field(default=20, validator=_max_logprobs)  # most logprobs a request may ask; -1: all
    # A structured-output request whose grammar has not compiled this long after admission fails alone.
    structured_outputs_timeout_s: float = attrs.field(default=10.0, validator=_positive_seconds)
    # Reuse the KV of full blocks whose prefix (tokens, cache_salt) another request computed (core/prefix_cache.py).
    enable_prefix_caching: bool = attrs.field(default=True, converter=_default_true, validator=_optional_bool)
    # Slower prefix-cache tiers (core/kv_tiers): blocks evicted from device memory go to a host-memory pool of
    # host_cache_gb (0: none) and to cache_dir (None: $DEEPINFER_CACHE_DIR, unset: none), capped at
    # disk_cache_gb, which survives restarts and may be shared by several engines.
    host_cache_gb: float = attrs.field(default=0.0, validator=_gigabytes)
    cache_dir: Optional[str] = attrs.field(default=None, validator=_optional_str)
    disk_cache_gb: float = attrs.field(default=16.0, validator=_gigabytes)
    # Every block the prefix cache registers also goes to the disk tier (once per block), not only evicted ones,
    # so a restart finds what a run without memory pressure computed; False: the disk gets evictions only.
    disk_write_through: bool = attrs.field(default=True, converter=_default_true, validator=_optional_bool)
    # CED's encoder SWA KV at block boundaries, in host memory for swa_cache_ttl_s after its last use, so a hit
    # needs no bounded replay (core/swa_pool.py). Needs a host tier; None: a quarter of host_cache_gb, 0: off.
    swa_cache_gb: Optional[float] = attrs.field(default=None, validator=attrs.validators.optional(_gigabytes))
    swa_cache_ttl_s: float = attrs.field(default=300.0, validator=_positive_seconds)
    kv_cache_dtype: str = attrs.field(default="auto", validator=_only("kv_cache_dtype", "auto", (
        "the KV cache takes the model's dtype (CED checkpoints keep their own FP8/FP4 formats)")))
    quantization: Optional[str] = attrs.field(default=None, validator=_quantization)  # the checkpoint's own
    # An FP8 block-scaled checkpoint's expert weights: "fp8" serves them as stored (float8_e4m3fn + block scales,
    # half the memory of bf16, through Ops.moe_experts); "dequantize" dequantizes them at load like the dense
    # weights (the oracle of the FP8 path). See models/quant.py for the layouts kept FP8.
    fp8_experts: str = attrs.field(default="fp8", validator=_one_of("fp8_experts", ("fp8", "dequantize")))
    # Parallel serving over torch.distributed (parallel/workers.py; README "Parallel serving"): one rank per
    # device, tensor_parallel_size x data_parallel_size of them; the Llama family's dense layers tensor-parallel,
    # MoE experts expert-parallel (enable_expert_parallel; exchanged by all-to-all, or one all-reduce). A
    # collective that waits longer than distributed_timeout_s fails its step (a peer died or hangs).
    tensor_parallel_size: int = attrs.field(default=1, validator=_positive("tensor_parallel_size"))
    data_parallel_size: int = attrs.field(default=1, validator=_positive("data_parallel_size"))
    enable_expert_parallel: bool = attrs.field(default=False, validator=_optional_bool)
    expert_parallel_comm: str = attrs.field(default="alltoall", validator=_one_of(
        "expert_parallel_comm", ("alltoall", "allreduce")))
    distributed_timeout_s: float = attrs.field(default=300.0, validator=_positive_seconds)
    # {"method": a registered draft stage (e.g. "ngram"), "num_speculative_tokens": k, ...the drafter's own
    # arguments}; None: no speculation (core/speculative.py).
    speculative_config: Optional[dict] = attrs.field(default=None, validator=_speculative)
    # Expert-parallel load balancing (parallel/placement.py), vLLM's names: eplb_config keys window_size,
    # step_interval, num_redundant_experts, log_balancedness, and num_ranks / num_nodes (simulated in one
    # process; over the parallel workers num_ranks is the world size).
    enable_eplb: bool = attrs.field(default=False, validator=_optional_bool)
    eplb_config: Optional[dict] = attrs.field(default=None, validator=_eplb_config)

    def __attrs_post_init__(self) -> None:
        if self.kv_cache_memory_gb is not None and not (isinstance(self.kv_cache_memory_gb, (int, float))
                                                        and self.kv_cache_memory_gb > 0):
            raise ValueError(f"EngineConfig.kv_cache_memory_gb={self.kv_cache_memory_gb!r} is invalid: must be > 0")
        if not isinstance(self.seed, int):
            raise ValueError(f"EngineConfig.seed={self.seed!r} is invalid: must be an int")


def config_fields() -> set:
    return {f.name for f in attrs.fields(EngineConfig)}

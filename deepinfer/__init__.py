"""DeepInfer: an LLM inference engine in which inference is a graph of swappable stages."""

from .core.graph import Pipeline, PipelineError
from .core.hookspecs import hookimpl, hookspec
from .core.params import SamplingParams, StructuredOutputsParams
from .core.stage import RowError, Stage
from .outputs import CompletionOutput, Logprob, RequestOutput

__version__ = "0.1.0"


def __getattr__(name):
    # LLM pulls in the loader and models; import it on first use so `import deepinfer` stays light.
    if name == "LLM":
        from .core.llm import LLM

        return LLM
    if name == "AsyncLLM":  # the asynchronous front end (deepinfer serve's engine), same lazy import
        from .entrypoints.async_llm import AsyncLLM

        return AsyncLLM
    raise AttributeError(f"module 'deepinfer' has no attribute {name!r}")


__all__ = ["LLM", "AsyncLLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "Logprob", "Pipeline", "PipelineError",
           "Stage", "RowError", "hookimpl", "hookspec", "__version__"]

"""Serving front ends: AsyncLLM (the engine loop in its own thread, driven from asyncio), the HTTP server
(OpenAI Completions / Chat Completions / Responses and Anthropic Messages), the one conversation format the
protocols convert into, and the tool-call and reasoning output parsers. Imported only by ``deepinfer serve``
and by users of AsyncLLM, so ``import deepinfer`` does not load FastAPI."""

from .async_llm import AsyncLLM, EngineDeadError

__all__ = ["AsyncLLM", "EngineDeadError"]

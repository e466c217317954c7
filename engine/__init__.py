"""rill's engine: continuous batching on a paged KV cache for Transformers models."""

from engine.request import (
    CompletionOutput,
    FinishReason,
    GenerationResult,
    InvalidRequest,
    QueueFull,
    RequestOutput,
    SamplingParams,
    TokenLogprob,
)

__all__ = [
    "AsyncEngine", "CompletionOutput", "EngineConfig", "FinishReason", "GenerationResult",
    "InvalidRequest", "LLM", "QueueFull", "RequestOutput", "SamplingParams", "TokenLogprob",
]


def __getattr__(name):  # torch-free imports of the records above stay cheap
    if name == "EngineConfig":
        from engine.config import EngineConfig
        return EngineConfig
    if name == "AsyncEngine":
        from engine.async_engine import AsyncEngine
        return AsyncEngine
    if name == "LLM":
        from engine.llm import LLM
        return LLM
    raise AttributeError(name)

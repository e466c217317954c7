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
    if name in ("AsyncEngine", "LLM"):
        from engine import streams
        return getattr(streams, name)
    raise AttributeError(name)

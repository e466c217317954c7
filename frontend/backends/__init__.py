"""The engine client: what the routes, the page and the resume registry use of an engine, and
its three implementations.

    local   today's in-process `AsyncEngine` (the default; engine/async_engine.py)
    ray     engine replicas as Ray Serve deployments, one rill engine each (ray_backend.py)
    openai  any OpenAI-compatible server or cluster: vLLM, TGI, llama-server, another rill
            (openai_backend.py)

`create_engine(settings)` builds the one the settings name; only the ray backend imports ray.
Every implementation honours the contract below, so the front end's features (SSE framing,
resume, metrics, API keys, 429, timeouts, disconnect abort) are the same code on all three.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterator, Protocol, runtime_checkable

if TYPE_CHECKING:  # no import at run time: the local backend must not pay for (or need) the others
    from engine.core import EngineStats
    from engine.grammar import GrammarCompiler
    from engine.request import SamplingParams
    from engine.streams import RequestStream

BACKENDS = ("local", "ray", "openai")


@runtime_checkable
class EngineClient(Protocol):
    """The surface of an engine as the front end sees it: exactly what server/, ui/ and frontend/
    use, so none of them probes an engine for a member (tests/test_engine_client.py holds every
    backend to it).

    Admission is two steps: `add_request` returns at once (local checks, the request queued or
    sent), and `wait_admitted` says whether the engine took it: it raises `InvalidRequest` (400),
    `QueueFull` (429) or `RuntimeError` (503) for a refusal. The local engine decides in the
    first step; a remote one answers the second after a round trip. Every admitted request ends
    exactly once for its consumer (an output with `finished=True`): also when it is aborted
    (ABORT) and when the engine, a replica or the remote dies (ERROR, with the reason)."""

    model_name: str  # what /v1/models and the page call the model
    max_model_len: int  # context in tokens (prompt + output)
    tokenizer: object  # the model's transformers tokenizer (the front tokenizes for every backend)
    backend: str  # "local", "ray" or "openai"
    continuable: bool  # a request can continue from its prior output ids (resume after a disconnect)
    attention_path: str  # how the engine runs attention, for the page's header and the log
    think_tags: tuple[str, str] | None  # the model's thought delimiters; None: no thought is parsed here
    grammars: "GrammarCompiler | None"  # compiles constraints before admission; None: the engine compiles them
    vision: object | None  # engine.model.vision.ImageEncoder when the model takes images (its processor); None: text only
    on_fatal: Callable[[BaseException], None] | None  # app.py's: called once when the engine stays dead

    @property
    def alive(self) -> bool: ...  # the engine (some replica, the remote) can serve now

    def unavailable_reason(self) -> str: ...  # why not, for a 503 and the page, when not alive

    @property
    def generation_config(self) -> object | None: ...  # the loaded model's GenerationConfig; None: not loaded here

    @property
    def kv_cache_tokens(self) -> int | None: ...  # tokens the KV cache holds in all; None: not known here

    def encode(self, text: str) -> list[int]: ...

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None,
                    **template_kwargs) -> list[int]: ...

    def check_prompt(self, prompt_token_ids: list[int], params: "SamplingParams") -> None: ...

    def compile_constraint(self, params: "SamplingParams") -> None: ...  # blocking; a no-op where `grammars` is None

    def add_request(self, prompt_token_ids: list[int], params: "SamplingParams", request_id: str | None = None,
                    prior_output_ids: list[int] = (), session: str | None = None,
                    client: str | None = None) -> "RequestStream": ...

    async def wait_admitted(self, stream: "RequestStream", timeout: float | None = None) -> None: ...

    def abort(self, request_id: str) -> bool: ...

    def inject_fault(self, request_id: str) -> bool: ...  # test hook (--test-hooks); False where unsupported

    def stats(self) -> "EngineStats": ...  # all replicas together

    def replica_stats(self) -> list[dict]: ...  # one entry per replica (label "replica"); [] for one engine

    def health_info(self) -> dict: ...  # what /health shows besides the common fields

    def shutdown(self, timeout: float | None = 5.0) -> None: ...


def create_engine(settings) -> "EngineClient":
    """The engine client the settings name, started. Raises `ModelLoadError` or `BackendError`."""
    if settings.backend == "local":
        from frontend.backends.local import LocalEngine

        return LocalEngine.from_settings(settings).start()
    if settings.backend == "ray":
        from frontend.backends.ray_backend import RayEngine

        return RayEngine.from_settings(settings)
    if settings.backend == "openai":
        from frontend.backends.openai_backend import OpenAIEngine

        return OpenAIEngine.from_settings(settings)
    raise ValueError(f"--backend must be one of {', '.join(BACKENDS)}. Given: {settings.backend!r}")


class BackendError(RuntimeError):
    """A backend could not start (Ray would not start, the remote is not an OpenAI server...): one line."""


def iter_engine_fields(settings) -> Iterator[tuple[str, object]]:
    """The settings every engine replica is built from (model and engine tunables)."""
    for name in ("model_id", "dtype", "device", "quantize", "activations", "trust_remote_code", "block_size",
                 "num_kv_blocks", "kv_cache_memory", "kv_cache_dtype", "max_num_seqs", "max_num_batched_tokens",
                 "max_queue", "max_model_len", "seed", "max_engine_restarts", "stall_timeout", "speculative",
                 "draft_model", "num_speculative_tokens", "speculative_max_seqs"):
        yield name, getattr(settings, name)

"""Engine tunables: one frozen dataclass, validated at construction with clear errors; and where
rill keeps what it builds once per machine (`rill_cache_dir`)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16")  # auto: the model's dtype


SPECULATIVE_MODES = ("off", "ngram", "draft")  # engine/speculative.py; draft: a second model (engine/draft.py)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Every knob of the engine. Sizes are in tokens unless said otherwise."""

    block_size: int = 16  # tokens per KV cache block
    num_kv_blocks: int | None = None  # exact pool size; overrides kv_cache_memory
    kv_cache_memory: float | None = None  # bytes (> 1) or a fraction of free memory (0..1]
    kv_cache_dtype: str = "auto"  # of the KV cache: auto (the model's) | float32 | bfloat16 | float16 (half the bytes a token)
    max_num_seqs: int = 64  # sequences running at once
    max_num_batched_tokens: int = 512  # tokens per forward (prefill chunks + decodes)
    max_queue: int = 256  # sequences waiting; beyond it add_request raises QueueFull
    max_model_len: int | None = None  # None = the model's context length
    seed: int = 0  # seeds the generator shared by unseeded sampling requests
    packed_linears: bool = True  # on CPU, nn.Linear with weights repacked once: C kernel (float32) or oneDNN
    prefix_caching: bool = True  # share the KV blocks of common prompt prefixes between requests
    decode_kernel: bool = True  # decode attention in a kernel: C on CPU (float32, built once into $RILL_CACHE), Triton on CUDA
    linear_kernel: bool = True  # on CPU (float32), linears in a C kernel of the same library (else oneDNN)
    native_decode: bool = True  # on CPU (float32, Llama family), decode steps in C, one call per step
    native_prefill_tokens: int = 128  # steps whose prompt tokens attend to no more positions than one prompt this long would run natively too
    speculative: str = "off"  # off | ngram | draft: decode steps verify tokens guessed from the request's own text or by a draft model (engine/speculative.py)
    draft_model: str | None = None  # speculative="draft": the draft model (hub id, folder, .gguf or "embedded"), same tokenizer
    num_speculative_tokens: int = 4  # a draft's length at most
    speculative_max_seqs: int = 4  # above this many running sequences, no drafts (the forward is no longer memory-bound)
    max_restarts: int = 3  # core rebuilds after faults within 10 minutes; one more death and it stays dead
    stall_timeout_s: float = 120.0  # the engine thread inside one step this long is stuck: not alive; 0: never

    def __post_init__(self):
        def need(ok: bool, what: str, given) -> None:
            if not ok:
                raise ValueError(f"EngineConfig: {what}. Given: {given!r}")

        need(self.block_size >= 1, "block_size must be >= 1", self.block_size)
        need(self.num_kv_blocks is None or self.num_kv_blocks >= 2, "num_kv_blocks must be >= 2", self.num_kv_blocks)
        need(self.kv_cache_memory is None or self.kv_cache_memory > 0,
             "kv_cache_memory must be bytes (> 1) or a fraction of free memory in (0, 1]", self.kv_cache_memory)
        need(self.kv_cache_dtype in KV_CACHE_DTYPES, f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}",
             self.kv_cache_dtype)
        need(self.max_num_seqs >= 1, "max_num_seqs must be >= 1", self.max_num_seqs)
        need(self.max_num_batched_tokens >= 1, "max_num_batched_tokens must be >= 1", self.max_num_batched_tokens)
        need(self.max_queue >= 0, "max_queue must be >= 0", self.max_queue)
        need(self.native_prefill_tokens >= 0, "native_prefill_tokens must be >= 0", self.native_prefill_tokens)
        need(self.speculative in SPECULATIVE_MODES, f"speculative must be one of {', '.join(SPECULATIVE_MODES)}",
             self.speculative)
        need(self.speculative != "draft" or bool(self.draft_model), "speculative='draft' needs draft_model, a "
             "small model with the same tokenizer (hub id, folder, .gguf, or \"embedded\")", self.draft_model)
        need(self.draft_model is None or self.speculative == "draft",
             f"draft_model is only used with speculative='draft' (speculative is {self.speculative!r})", self.draft_model)
        need(self.num_speculative_tokens >= 1, "num_speculative_tokens must be >= 1", self.num_speculative_tokens)
        need(self.speculative_max_seqs >= 1, "speculative_max_seqs must be >= 1", self.speculative_max_seqs)
        need(self.max_restarts >= 0, "max_restarts must be >= 0", self.max_restarts)
        need(self.stall_timeout_s >= 0, "stall_timeout_s must be >= 0 (0: never)", self.stall_timeout_s)
        need(self.max_model_len is None or self.max_model_len >= 2, "max_model_len must be >= 2", self.max_model_len)


def rill_cache_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """Where converted GGUF models and built kernels live: `cache_dir`, else `$RILL_CACHE`, else `~/.cache/rill`."""
    if cache_dir:
        return Path(cache_dir).expanduser()
    return Path(os.environ.get("RILL_CACHE") or Path.home() / ".cache" / "rill").expanduser()

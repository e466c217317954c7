"""Everything a deployment can set: one frozen record built by app.py from flags and environment."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Settings:
    """The settings of one server process (flags and environment variables, see `app.py --help`)."""

    # model
    model_id: str | None = None  # None = the embedded SmolLM2-135M-Instruct
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    quantize: str = "auto"  # auto (a GGUF keeps its blocks) | none | q8_0 | q4_0 | q4_1 | q4_k | q6_k
    activations: str = "float32"  # of the quantized linears: float32 | int8
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    trust_remote_code: bool = False  # run code shipped with a hub model only when asked
    # several models (frontend/models.py)
    models: tuple[str, ...] = ()  # every --model given, in order (model_id is the first)
    models_dir: str | None = None  # each .gguf file and model folder in it is a model, named by its name
    models_preset: str | None = None  # a TOML file of one table per model with its own settings (frontend/presets.py)
    default_model: str | None = None  # the model of requests that name none; None = the first
    models_autoload: bool = True  # a request naming an unloaded model loads it
    models_max: int = 4  # models loaded at once at most (the least recently used idle one makes room)
    models_memory: int | None = None  # bytes the loaded models' weights files and KV caches may take; None = no bound
    model_ttl: float = 0.0  # seconds idle before a model is unloaded; 0 = never
    pin: tuple[str, ...] = ()  # models kept loaded
    # engine
    max_num_seqs: int = 64  # requests running in one batch at most
    max_queue: int = 256  # requests waiting for a slot at most; past it /chat and /v1 answer 429
    max_num_batched_tokens: int = 512  # tokens in one forward at most (chunked prefill)
    block_size: int = 16  # tokens per KV block
    num_kv_blocks: int | None = None  # KV blocks to allocate; None = from kv_cache_memory
    kv_cache_memory: str | None = None  # e.g. "2GiB"; None = the engine's default
    kv_cache_dtype: str = "auto"  # auto (the model's dtype) | float32 | bfloat16 | float16
    max_model_len: int | None = None  # context limit; None = the model's
    seed: int = 0  # engine seed (requests without their own seed)
    speculative: str = "off"  # off | ngram | draft: guesses from the request's own tokens or a draft model (engine/speculative.py)
    draft_model: str | None = None  # --speculative draft: the draft model (hub id, folder, .gguf, or "embedded")
    num_speculative_tokens: int = 4  # a draft's length at most
    speculative_max_seqs: int = 4  # no drafts while more requests than this run
    stall_timeout: float = 120.0  # seconds inside one engine step before the engine counts as stuck (0: never)
    max_engine_restarts: int = 3  # engine rebuilds after faults within 10 minutes; one more and the process exits 1
    # where the engines run (frontend/backends)
    backend: str = "local"  # local (this process) | ray (replicas on Ray Serve) | openai (a remote server)
    replicas: int = 2  # --backend ray: engine replicas (the minimum when autoscaling)
    max_replicas: int = 0  # --backend ray: autoscale up to this many by ongoing requests; 0 = no autoscaling
    replica_cpus: float = 1.0  # --backend ray: CPUs (and torch threads) per replica
    ray_address: str | None = None  # --backend ray: an existing cluster ("auto" or an address); None = start one
    ray_auth_token: str | None = None  # --ray-address: the cluster's token (Ray's token authentication); None = none sent
    backend_url: str | None = None  # --backend openai: the remote's base URL
    backend_key: str | None = None  # --backend openai: the remote's API key
    # HTTP
    host: str = "127.0.0.1"
    port: int = 7860
    api_key: str | None = None  # when set, /chat, /v1 and /_test need `Authorization: Bearer <key>`, the page a login
    ui_auth: tuple[str, str] | None = None  # user, password for the page (Gradio's auth), beside the key
    cors_origins: tuple[str, ...] = ()  # CORS off unless origins are given; no other origin gets credentials
    forwarded_allow_ips: tuple[str, ...] = ()  # proxies whose X-Forwarded-For names the caller; () = none, ("*",) = any
    max_body_bytes: int = 1_000_000  # bigger request bodies get 413
    limit_images: int = 4  # images one request may bring (a vision-language model)
    max_image_bytes: int = 10 * 2**20  # one image's encoded bytes at most
    allowed_media_domains: tuple[str, ...] = ()  # hosts whose http(s) image URLs are fetched; () = none
    request_timeout: float = 0.0  # seconds a request may wait and run in all; 0 = no limit
    cache_salt_per_session: bool = False  # the page's requests share prefix-cache blocks within a session only
    resume_window: float = 30.0  # seconds a disconnected /chat stream stays resumable; 0 = abort at once
    resume_max_streams: int = 1024  # resumable /chat streams kept at most (oldest finished dropped first)
    resume_max_bytes: int = 64 * 2**20  # memory those streams may hold at most (events, tokens)
    shutdown_timeout: float = 30.0  # seconds running streams get to finish after SIGTERM
    default_max_new_tokens: int = 512  # /chat's and the page's default
    feedback_dir: str | None = None  # the page's likes/dislikes (JSON lines); None: /data/feedback on a Space, else off
    log_level: str = "info"
    log_format: str = "text"  # "json": one JSON object per finished request in the log
    test_hooks: bool = False  # enables fault injection for the test suite; never in production

"""The settings of one server process from its flags and environment variables (a Space passes
settings that way): the flag wins over the variable, the variable over the default. `OPTIONS`
is the one table of every setting; `python app.py --help` prints it by group.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from dataclasses import dataclass

from frontend.settings import Settings


@dataclass(frozen=True, slots=True)
class Option:
    """One setting: its flag, its environment variables (first found wins), type and help."""

    flag: str
    env: tuple[str, ...]
    dest: str
    kind: type | str  # int, float, str, "bool", "size", "bytes", "auth", "list", "ips"
    default: object
    help: str
    metavar: str | None = None
    hidden: bool = False


MODEL_OPTIONS = ("model_id", "dtype", "device", "quantize", "activations", "trust_remote_code", "models_dir",
                 "models_preset", "default_model", "models_autoload", "models_max", "models_memory", "model_ttl",
                 "pin")  # --help's groups
OPTIONS: tuple[Option, ...] = (
    # model
    Option("--model", ("MODEL_ID",), "model_id", "append", None,
           "hub id, local folder or .gguf file (default: the embedded SmolLM2-135M-Instruct); give it again "
           "for several models, the first answering requests that name none", "M"),
    Option("--dtype", ("DTYPE",), "dtype", str, "auto", "auto | float32 | bfloat16 | float16", "D"),
    Option("--device", ("DEVICE",), "device", str, "auto", "auto | cpu | cuda | cuda:N", "D"),
    Option("--quantize", ("QUANTIZE",), "quantize", str, "auto",
           "linear weights on the CPU: auto (a GGUF keeps its Q8_0/Q4_0/Q4_1/Q4_K blocks, others stay float) | none "
           "(float) | q8_0 | q4_0 | q4_1 | q4_k | q6_k (quantize at load)", "Q"),
    Option("--activations", ("ACTIVATIONS",), "activations", str, "float32",
           "what quantized linears multiply their blocks with: float32 (exact: the de-quantized model's "
           "products) | int8 (rounded per 32 inputs as llama.cpp does: faster, lossy)", "A"),
    Option("--trust-remote-code", ("TRUST_REMOTE_CODE",), "trust_remote_code", "bool", False,
           "run Python code shipped with a hub model (off unless asked)"),
    Option("--models-dir", ("MODELS_DIR",), "models_dir", str, None,
           "a folder whose .gguf files and model folders are served too, each by its file or folder name "
           "(loaded when a request names it)", "DIR"),
    Option("--models-preset", ("MODELS_PRESET",), "models_preset", str, None,
           "a TOML file of one [table] per model: its `model` (file, folder or hub id) and its own settings "
           "(max-model-len, kv-cache-memory, quantize, speculative, ...: the flags without --)", "FILE"),
    Option("--default-model", ("DEFAULT_MODEL",), "default_model", str, None,
           "the model that answers requests naming none (default: the first --model, else the first in "
           "--models-dir)", "NAME"),
    Option("--models-autoload", ("MODELS_AUTOLOAD",), "models_autoload", "bool", True,
           "a request naming an unloaded model loads it; off: it gets a 400 until POST /models/load"),
    Option("--models-max", ("MODELS_MAX",), "models_max", int, 4,
           "models loaded at once at most: the least recently used idle one is unloaded to make room", "N"),
    Option("--models-memory", ("MODELS_MEMORY",), "models_memory", "bytes", None,
           "memory the loaded models may take together (e.g. 6GiB), each counted as its weights file plus its "
           "KV cache: the least recently used idle ones are unloaded to make room", "SIZE"),
    Option("--model-ttl", ("MODEL_TTL",), "model_ttl", float, 0.0,
           "seconds a model may stay idle before it is unloaded (0 = never)", "S"),
    Option("--pin", ("PIN",), "pin", "list", (),
           "comma-separated models kept loaded (never unloaded by --model-ttl or to make room)", "NAME"),
    # server
    Option("--host", ("GRADIO_SERVER_NAME", "HOST"), "host", str, "127.0.0.1",
           "address to bind (a Space sets GRADIO_SERVER_NAME=0.0.0.0)", "H"),
    Option("--port", ("GRADIO_SERVER_PORT", "PORT"), "port", int, 7860, "port to serve on", "P"),
    Option("--api-key", ("API_KEY",), "api_key", str, None,
           "close every route that reaches the model: /chat and /v1 need `Authorization: Bearer KEY`, the page "
           "and its Gradio API a login with KEY as password (set it as a Space secret)", "KEY"),
    Option("--ui-auth", ("UI_AUTH",), "ui_auth", "auth", None,
           "put Gradio's login on the page and its API with this user and password (with --api-key: as well as "
           "the key)", "USER:PASS"),
    Option("--cors-origins", ("CORS_ORIGINS",), "cors_origins", "list", (),
           "comma-separated origins allowed to call the API from a browser (CORS is off by default)", "O1,O2"),
    Option("--forwarded-allow-ips", ("FORWARDED_ALLOW_IPS",), "forwarded_allow_ips", "ips", (),
           "comma-separated IPs or CIDRs of the proxies whose X-Forwarded-For names the caller (its right-most "
           "address not in this list); * trusts any peer. Default: none, the peer address is the caller. A Space "
           "sits behind a proxy: set it there so fair shares count each visitor, not the proxy", "IP1,CIDR2"),
    Option("--max-body-bytes", ("MAX_BODY_BYTES",), "max_body_bytes", int, 1_000_000,
           "larger request bodies get 413", "N"),
    Option("--limit-images", ("LIMIT_IMAGES",), "limit_images", int, 4,
           "images one request may bring to a vision-language model (more: a 400)", "N"),
    Option("--max-image-bytes", ("MAX_IMAGE_BYTES",), "max_image_bytes", int, 10 * 2**20,
           "one image's encoded bytes at most (a data: URL's image counts within --max-body-bytes too)", "N"),
    Option("--allowed-media-domains", ("ALLOWED_MEDIA_DOMAINS",), "allowed_media_domains", "list", (),
           "comma-separated hosts (and their subdomains) whose http(s) image URLs the server fetches; default: "
           "none, images come inline as data: URLs", "D1,D2"),
    Option("--request-timeout", ("REQUEST_TIMEOUT",), "request_timeout", float, 0.0,
           "seconds a request may wait plus generate before it is stopped with an error (0 = no limit)", "S"),
    Option("--cache-salt-per-session", ("CACHE_SALT_PER_SESSION",), "cache_salt_per_session", "bool", False,
           "salt the prefix cache per page session: one visitor's prompts never reuse (nor reveal) another's "
           "cached blocks; API clients salt theirs with the body field `cache_salt`"),
    Option("--resume-window", ("RESUME_WINDOW",), "resume_window", float, 30.0,
           "seconds a disconnected /chat stream keeps generating and stays resumable at GET /chat/{id} "
           "(0 = abort at once)", "S"),
    Option("--resume-max-streams", ("RESUME_MAX_STREAMS",), "resume_max_streams", int, 1024,
           "resumable /chat streams kept at most; past it the oldest finished one is dropped", "N"),
    Option("--resume-max-bytes", ("RESUME_MAX_BYTES",), "resume_max_bytes", "bytes", 64 * 2**20,
           "memory the resumable streams may hold (e.g. 64MiB); past it the oldest finished one is dropped",
           "SIZE"),
    Option("--shutdown-timeout", ("SHUTDOWN_TIMEOUT",), "shutdown_timeout", float, 30.0,
           "on SIGTERM, seconds running streams get to finish before the server exits", "S"),
    Option("--feedback-dir", ("FEEDBACK_DIR",), "feedback_dir", str, None,
           "folder for the page's likes and dislikes (feedback.jsonl, one JSON line each); default: "
           "/data/feedback where /data (a Space's persistent storage) exists, else none kept", "DIR"),
    Option("--max-new-tokens", ("MAX_NEW_TOKENS",), "default_max_new_tokens", int, 512,
           "default reply length for /chat and the page", "N"),
    Option("--log-level", ("LOG_LEVEL",), "log_level", str, "info", "debug | info | warning | error", "L"),
    Option("--log-format", ("LOG_FORMAT",), "log_format", str, "text",
           "text | json: the one log line per finished request", "F"),
    # engine
    Option("--max-num-seqs", ("MAX_NUM_SEQS",), "max_num_seqs", int, 64, "requests generating at once (one batch)", "N"),
    Option("--max-queue", ("MAX_QUEUE",), "max_queue", int, 256,
           "requests waiting for a slot; beyond it /chat and /v1 answer 429 with Retry-After", "N"),
    Option("--max-num-batched-tokens", ("MAX_NUM_BATCHED_TOKENS",), "max_num_batched_tokens", int, 512,
           "tokens per forward pass (long prompts are prefilled in chunks)", "N"),
    Option("--block-size", ("BLOCK_SIZE",), "block_size", int, 16, "tokens per KV cache block", "N"),
    Option("--num-kv-blocks", ("NUM_KV_BLOCKS",), "num_kv_blocks", int, None,
           "KV cache blocks to allocate (overrides --kv-cache-memory)", "N"),
    Option("--kv-cache-memory", ("KV_CACHE_MEMORY",), "kv_cache_memory", "size", None,
           "KV cache size: bytes (e.g. 2GiB, 512MB) or a fraction of free memory (e.g. 0.5)", "SIZE"),
    Option("--kv-cache-dtype", ("KV_CACHE_DTYPE",), "kv_cache_dtype", str, "auto",
           "what the KV cache holds: auto (the model's dtype) | float32 | bfloat16 | float16 (16 bits: twice the "
           "tokens in the same memory, slightly lossy; decode attention then runs in torch, not the C kernel)", "D"),
    Option("--max-model-len", ("MAX_MODEL_LEN",), "max_model_len", int, None,
           "context limit in tokens (default: the model's)", "N"),
    Option("--seed", ("SEED",), "seed", int, 0, "seed for requests that bring none", "N"),
    Option("--speculative", ("SPECULATIVE",), "speculative", str, "off",
           "speculative decoding: off | ngram (decode steps also verify tokens guessed from the request's own "
           "prompt and output: faster on answers that repeat their input) | draft (guessed by --draft-model); "
           "the same tokens either way", "MODE"),
    Option("--draft-model", ("DRAFT_MODEL",), "draft_model", str, None,
           "--speculative draft: a small model with the model's tokenizer (hub id, folder, .gguf, or embedded: "
           "the embedded SmolLM2-135M-Instruct), loaded with the same --dtype/--device/--quantize/--activations",
           "M"),
    Option("--num-speculative-tokens", ("NUM_SPECULATIVE_TOKENS",), "num_speculative_tokens", int, 4,
           "--speculative ngram|draft: tokens a draft guesses at most (fewer as its guesses fail)", "K"),
    Option("--speculative-max-seqs", ("SPECULATIVE_MAX_SEQS",), "speculative_max_seqs", int, 4,
           "--speculative ngram|draft: no drafts while more requests than this run (the batch is no longer "
           "memory-bound)", "N"),
    Option("--max-engine-restarts", ("MAX_ENGINE_RESTARTS",), "max_engine_restarts", int, 3,
           "times the engine is rebuilt in the process after an internal fault within 10 minutes; one more "
           "and the process exits with status 1 for the Space or supervisor to restart it", "N"),
    Option("--stall-timeout", ("STALL_TIMEOUT",), "stall_timeout", float, 120.0,
           "seconds the engine may spend inside one step; longer and it counts as stuck: /health answers 503, "
           "requests get an error instead of waiting (0: never)", "S"),
    # backend
    Option("--backend", ("BACKEND",), "backend", str, "local",
           "where the engines run: local (in this process) | ray (engine replicas on Ray Serve; "
           "pip install -r requirements-ray.txt) | openai (a remote OpenAI-compatible server: vLLM, TGI, "
           "llama-server, another rill)", "B"),
    Option("--replicas", ("REPLICAS",), "replicas", int, 2,
           "--backend ray: engine replicas, each one engine with its own KV cache", "N"),
    Option("--max-replicas", ("MAX_REPLICAS",), "max_replicas", int, 0,
           "--backend ray: autoscale from --replicas up to N by ongoing requests (0 = a fixed number)", "N"),
    Option("--replica-cpus", ("REPLICA_CPUS",), "replica_cpus", float, 1.0,
           "--backend ray: CPUs (and torch threads) each replica takes", "C"),
    Option("--ray-address", ("RAY_ADDRESS",), "ray_address", str, None,
           "--backend ray: an existing Ray cluster (auto, or ray://host:10001); without it a local Ray instance "
           "is started", "ADDR"),
    Option("--ray-auth-token", ("RAY_AUTH_TOKEN",), "ray_auth_token", str, None,
           "--ray-address: the cluster's token when it has token authentication on (`ray get-auth-token` on its "
           "head prints it); sets RAY_AUTH_MODE=token unless that is set. A file holding it: RAY_AUTH_TOKEN_PATH",
           "TOKEN"),
    Option("--backend-url", ("BACKEND_URL",), "backend_url", str, None,
           "--backend openai: the remote's base URL, e.g. http://host:8000 (its /v1/completions serves the page, "
           "/chat and /v1)", "URL"),
    Option("--backend-key", ("BACKEND_KEY",), "backend_key", str, None,
           "--backend openai: the remote's API key (sent as `Authorization: Bearer KEY`)", "KEY"),
    Option("--test-hooks", ("RILL_TEST_HOOKS",), "test_hooks", "bool", False, "test suite only", hidden=True),
)

_BACKEND_FLAGS = ("--backend", "--replicas", "--max-replicas", "--replica-cpus", "--ray-address", "--ray-auth-token",
                  "--backend-url", "--backend-key")

_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1e3, "KB": 1e3, "KIB": 2**10, "M": 1e6, "MB": 1e6, "MIB": 2**20,
          "G": 1e9, "GB": 1e9, "GIB": 2**30, "T": 1e12, "TB": 1e12, "TIB": 2**40}


def parse_size(text: str) -> float:
    """"2GiB" -> 2147483648.0, "0.5" -> 0.5 (a fraction of free memory)."""
    match = _SIZE.match(text)
    if not match:
        raise ValueError(f"expected bytes like 2GiB, 512MB, 1000000 or a fraction like 0.5, got {text!r}")
    number, unit = float(match.group(1)), (match.group(2) or "").upper()
    return number * _UNITS[unit]


def parse_bytes(text: str) -> int:
    """"64MiB" -> 67108864: a whole number of bytes (no fraction)."""
    value = parse_size(text)
    if value < 1 or value != int(value):
        raise ValueError(f"expected a whole number of bytes like 64MiB or 1000000, got {text!r}")
    return int(value)


def parse_auth(text: str) -> tuple[str, str]:
    user, sep, password = text.partition(":")
    if not sep or not user or not password:
        raise ValueError(f"expected USER:PASS, got {text!r}")
    return user, password


def parse_ips(text: str) -> tuple[str, ...]:
    """"10.0.0.1, 172.16.0.0/12" -> ("10.0.0.1", "172.16.0.0/12"): each an IP address or a network, or "*"
    alone (any peer); uvicorn would take a typo for a name that never matches, so it is refused here."""
    import ipaddress

    entries = tuple(s.strip() for s in text.split(",") if s.strip())
    if entries == ("*",):
        return entries
    for entry in entries:
        try:
            ipaddress.ip_network(entry, strict=False) if "/" in entry else ipaddress.ip_address(entry)
        except ValueError:
            raise ValueError(f"expected IP addresses or CIDR networks separated by commas (e.g. 127.0.0.1,"
                             f"10.0.0.0/8), or * alone; {entry!r} is neither. Given: {text!r}") from None
    return entries


def parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected true/false (1/0, yes/no), got {text!r}")


def _parse_int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"expected an integer, got {text!r}") from None


def _parse_float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"expected a number, got {text!r}") from None


def _converter(kind):
    parse = {"size": parse_size, "bytes": parse_bytes, "auth": parse_auth, "bool": parse_bool, int: _parse_int,
             float: _parse_float, "list": lambda t: tuple(s.strip() for s in t.split(",") if s.strip()),
             "ips": parse_ips, "append": str}.get(kind)
    if parse is None:
        return kind

    def convert(text: str):
        try:
            return parse(text)
        except ValueError as exc:  # argparse prints this message instead of "invalid convert value"
            raise argparse.ArgumentTypeError(str(exc)) from None

    return convert


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="app.py",
        description="rill: serve a Transformers chat model with a Gradio page, a /chat SSE endpoint and an "
                    "OpenAI-compatible API, all on one continuous-batching engine.",
        epilog="Each flag can be set by the environment variable in [brackets]; the flag wins.",
        formatter_class=lambda prog: argparse.HelpFormatter(prog, max_help_position=34, width=100))
    groups = {"model": parser.add_argument_group("model"), "server": parser.add_argument_group("server"),
              "engine": parser.add_argument_group("engine"),
              "backend": parser.add_argument_group("backend (docs/scale-out.md)")}
    for opt in OPTIONS:
        group = groups["model" if opt.dest in MODEL_OPTIONS else
                       "engine" if opt.flag in ("--max-num-seqs", "--max-queue", "--max-num-batched-tokens",
                                                "--block-size", "--num-kv-blocks", "--kv-cache-memory", "--kv-cache-dtype",
                                                "--max-model-len", "--seed", "--speculative", "--draft-model",
                                                "--num-speculative-tokens", "--speculative-max-seqs") else
                       "backend" if opt.flag in _BACKEND_FLAGS else "server"]
        help_text = argparse.SUPPRESS if opt.hidden else (
            f"{opt.help} [{' or '.join(opt.env)}]" + (f" (default: {opt.default})" if opt.default not in (None, (), False) else ""))
        if opt.kind == "append":  # --model: given again for each model
            group.add_argument(opt.flag, dest=opt.dest, action="append", default=None, metavar=opt.metavar,
                               help=help_text)
        elif opt.kind == "bool":
            group.add_argument(opt.flag, dest=opt.dest, action=argparse.BooleanOptionalAction, default=None,
                               help=help_text)
        else:
            group.add_argument(opt.flag, dest=opt.dest, type=_converter(opt.kind), default=None,
                               metavar=opt.metavar, help=help_text)
    return parser


def parse_settings(argv: list[str] | None = None, environ: dict[str, str] | None = None) -> Settings:
    """Flags over environment variables over defaults. Exits 2 with one line on a bad value."""
    environ = os.environ if environ is None else environ
    parser = build_parser()
    args = parser.parse_args(argv)
    values = {}
    for opt in OPTIONS:
        value = getattr(args, opt.dest)
        if value is None:
            for name in opt.env:
                raw = environ.get(name)
                if raw is not None and raw.strip() != "":
                    try:
                        value = _converter(opt.kind)(raw.strip())
                    except (ValueError, argparse.ArgumentTypeError) as exc:
                        parser.error(f"environment variable {name}: {exc}")
                    break
        if opt.kind == "append" and value is not None:  # every --model (or MODEL_ID) in order; the first leads
            values["models"] = tuple(value) if isinstance(value, list) else (value,)
            value = values["models"][0]
        values[opt.dest] = opt.default if value is None else value
    _check_api_key(parser, args.api_key, environ.get("API_KEY"))
    try:
        settings = Settings(**values)
    except TypeError as exc:  # pragma: no cover - Settings and OPTIONS out of step
        parser.error(str(exc))
    for name, low in (("port", 0), ("max_num_seqs", 1), ("max_queue", 0), ("max_body_bytes", 1),
                      ("limit_images", 0), ("max_image_bytes", 1), ("default_max_new_tokens", 1), ("block_size", 1), ("max_num_batched_tokens", 1),
                      ("resume_max_streams", 1), ("resume_max_bytes", 1),
                      ("max_engine_restarts", 0), ("num_speculative_tokens", 1), ("speculative_max_seqs", 1),
                      ("models_max", 1)):
        if getattr(settings, name) < low:
            parser.error(f"--{name.replace('_', '-')} must be >= {low}. Given: {getattr(settings, name)}")
    from engine.config import KV_CACHE_DTYPES

    if settings.kv_cache_dtype not in KV_CACHE_DTYPES:
        parser.error(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}. Given: {settings.kv_cache_dtype!r}")
    _check_speculative(parser, settings)
    if settings.log_format not in ("text", "json"):
        parser.error(f"--log-format must be text or json. Given: {settings.log_format!r}")
    if settings.log_level.lower() not in ("debug", "info", "warning", "error", "critical"):
        parser.error(f"--log-level must be debug, info, warning or error. Given: {settings.log_level!r}")
    for name in ("request_timeout", "resume_window", "shutdown_timeout", "model_ttl"):
        if getattr(settings, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must be >= 0 seconds. Given: {getattr(settings, name)}")
    if not 0 < settings.port < 65536:
        parser.error(f"--port must be between 1 and 65535. Given: {settings.port}")
    _check_backend(parser, settings)
    if (len(settings.models) > 1 or settings.models_dir or settings.models_preset) and settings.backend == "openai":
        parser.error(f"several models (--model given again, --models-dir, --models-preset) run on --backend local or "
                     f"ray (the remote of --backend openai serves its own). "
                     f"Given: --backend {settings.backend}")
    return settings


def _check_speculative(parser: argparse.ArgumentParser, settings: Settings) -> None:
    from engine.config import SPECULATIVE_MODES

    if settings.speculative not in SPECULATIVE_MODES:
        parser.error(f"--speculative must be one of {', '.join(SPECULATIVE_MODES)}. Given: {settings.speculative!r}")
    if settings.speculative == "draft" and not settings.draft_model:
        parser.error("--speculative draft needs --draft-model M (DRAFT_MODEL), a small model with the model's "
                     "tokenizer: a hub id, folder or .gguf, or embedded (the embedded SmolLM2-135M-Instruct)")
    if settings.draft_model and settings.speculative != "draft":
        parser.error(f"--draft-model is only used with --speculative draft (given --speculative "
                     f"{settings.speculative}). Given: --draft-model {settings.draft_model}")


def _check_api_key(parser: argparse.ArgumentParser, flag: str | None, env: str | None) -> None:
    """A key of only whitespace would mean no key (every route open): refuse to start instead."""
    name, given = ("--api-key", flag) if flag is not None else ("API_KEY", env)
    if given is not None and not given.strip() and (flag is not None or given != ""):
        parser.error(f"{name} is only whitespace, which would leave every route open without a key; give a real "
                     f"key, or leave {name} unset to serve without one. Given: {given!r}")


def _check_backend(parser: argparse.ArgumentParser, settings: Settings) -> None:
    from frontend.backends import BACKENDS

    if settings.backend not in BACKENDS:
        parser.error(f"--backend must be one of {', '.join(BACKENDS)}. Given: {settings.backend!r}")
    if settings.replicas < 1:
        parser.error(f"--replicas must be >= 1. Given: {settings.replicas}")
    if settings.max_replicas and settings.max_replicas < settings.replicas:
        parser.error(f"--max-replicas must be 0 (no autoscaling) or >= --replicas ({settings.replicas}). "
                     f"Given: {settings.max_replicas}")
    if not settings.replica_cpus > 0:
        parser.error(f"--replica-cpus must be > 0. Given: {settings.replica_cpus}")
    if settings.ray_auth_token is not None and not settings.ray_auth_token.strip():
        parser.error("--ray-auth-token is empty; give the Ray cluster's token (`ray get-auth-token` on its head "
                     "prints it), or leave the flag out to send none")
    if settings.backend == "openai":
        url = settings.backend_url or ""
        if not url.startswith(("http://", "https://")):
            parser.error("--backend openai needs --backend-url, the remote's base URL starting with http:// or "
                         f"https:// (e.g. http://127.0.0.1:8000). Given: {settings.backend_url!r}")


def engine_config(settings: Settings):
    from frontend.backends import iter_engine_fields
    from frontend.backends.local import engine_config as config_of

    return config_of(dict(iter_engine_fields(settings)))


def fail(message: str) -> None:
    print(f"app.py: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)



"""rill: a streaming chat Space. Settings and wiring only.

    python app.py [--model M] [--host H] [--port P] ...     (python app.py --help)

Every flag can also come from an environment variable (a Space passes settings that way): the
flag wins over the variable, the variable over the default. With no flags and no variables it
serves the embedded SmolLM2-135M-Instruct on http://127.0.0.1:7860, as a Space needs.

Wiring: load the model -> start the engine -> the FastAPI app with /chat, /v1, /health
(server.create_app) -> the Gradio page mounted at "/" (ui.build_demo) -> uvicorn.
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import logging
import os
import re
import signal
import sys
import threading
import time
from dataclasses import dataclass

# Before gradio or transformers are imported: nothing phones home unless asked.
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

from frontend.settings import Settings  # noqa: E402  (torch-free)

log = logging.getLogger("rill")


@dataclass(frozen=True, slots=True)
class Option:
    """One setting: its flag, its environment variables (first found wins), type and help."""

    flag: str
    env: tuple[str, ...]
    dest: str
    kind: type | str  # int, float, str, "bool", "size", "bytes", "auth", "list"
    default: object
    help: str
    metavar: str | None = None
    hidden: bool = False


MODEL_OPTIONS = ("model_id", "dtype", "device", "quantize", "activations", "trust_remote_code")  # --help's groups
OPTIONS: tuple[Option, ...] = (
    # model
    Option("--model", ("MODEL_ID",), "model_id", str, None,
           "hub id, local folder or .gguf file (default: the embedded SmolLM2-135M-Instruct)", "M"),
    Option("--dtype", ("DTYPE",), "dtype", str, "auto", "auto | float32 | bfloat16 | float16", "D"),
    Option("--device", ("DEVICE",), "device", str, "auto", "auto | cpu | cuda | cuda:N", "D"),
    Option("--quantize", ("QUANTIZE",), "quantize", str, "auto",
           "linear weights on the CPU: auto (a GGUF keeps its Q8_0/Q4_0/Q4_1/Q4_K blocks, others stay float) | none "
           "(float) | q8_0 | q4_0 | q4_1 (quantize at load)", "Q"),
    Option("--activations", ("ACTIVATIONS",), "activations", str, "float32",
           "what quantized linears multiply their blocks with: float32 (exact: the de-quantized model's "
           "products) | int8 (rounded per 32 inputs as llama.cpp does: faster, lossy)", "A"),
    Option("--trust-remote-code", ("TRUST_REMOTE_CODE",), "trust_remote_code", "bool", False,
           "run Python code shipped with a hub model (off unless asked)"),
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
    Option("--max-body-bytes", ("MAX_BODY_BYTES",), "max_body_bytes", int, 1_000_000,
           "larger request bodies get 413", "N"),
    Option("--request-timeout", ("REQUEST_TIMEOUT",), "request_timeout", float, 0.0,
           "seconds a request may wait plus generate before it is stopped with an error (0 = no limit)", "S"),
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
    Option("--max-new-tokens", ("MAX_NEW_TOKENS",), "default_max_new_tokens", int, 512,
           "default reply length for /chat and the page", "N"),
    Option("--feedback-dir", ("FEEDBACK_DIR",), "feedback_dir", str, None,
           "folder for the page's likes and dislikes (feedback.jsonl, one JSON line each); default: "
           "/data/feedback where /data (a Space's persistent storage) exists, else none kept", "DIR"),
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
    Option("--max-model-len", ("MAX_MODEL_LEN",), "max_model_len", int, None,
           "context limit in tokens (default: the model's)", "N"),
    Option("--seed", ("SEED",), "seed", int, 0, "seed for requests that bring none", "N"),
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
    Option("--backend-url", ("BACKEND_URL",), "backend_url", str, None,
           "--backend openai: the remote's base URL, e.g. http://host:8000 (its /v1/completions serves the page, "
           "/chat and /v1)", "URL"),
    Option("--backend-key", ("BACKEND_KEY",), "backend_key", str, None,
           "--backend openai: the remote's API key (sent as `Authorization: Bearer KEY`)", "KEY"),
    Option("--test-hooks", ("RILL_TEST_HOOKS",), "test_hooks", "bool", False, "test suite only", hidden=True),
)

_BACKEND_FLAGS = ("--backend", "--replicas", "--max-replicas", "--replica-cpus", "--ray-address", "--backend-url",
                  "--backend-key")

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
             float: _parse_float, "list": lambda t: tuple(s.strip() for s in t.split(",") if s.strip())}.get(kind)
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
                                                "--block-size", "--num-kv-blocks", "--kv-cache-memory",
                                                "--max-model-len", "--seed") else
                       "backend" if opt.flag in _BACKEND_FLAGS else "server"]
        help_text = argparse.SUPPRESS if opt.hidden else (
            f"{opt.help} [{' or '.join(opt.env)}]" + (f" (default: {opt.default})" if opt.default not in (None, (), False) else ""))
        if opt.kind == "bool":
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
        values[opt.dest] = opt.default if value is None else value
    try:
        settings = Settings(**values)
    except TypeError as exc:  # pragma: no cover - Settings and OPTIONS out of step
        parser.error(str(exc))
    for name, low in (("port", 0), ("max_num_seqs", 1), ("max_queue", 0), ("max_body_bytes", 1),
                      ("default_max_new_tokens", 1), ("block_size", 1), ("max_num_batched_tokens", 1),
                      ("resume_max_streams", 1), ("resume_max_bytes", 1),
                      ("max_engine_restarts", 0)):
        if getattr(settings, name) < low:
            parser.error(f"--{name.replace('_', '-')} must be >= {low}. Given: {getattr(settings, name)}")
    if settings.log_format not in ("text", "json"):
        parser.error(f"--log-format must be text or json. Given: {settings.log_format!r}")
    if settings.log_level.lower() not in ("debug", "info", "warning", "error", "critical"):
        parser.error(f"--log-level must be debug, info, warning or error. Given: {settings.log_level!r}")
    for name in ("request_timeout", "resume_window", "shutdown_timeout"):
        if getattr(settings, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must be >= 0 seconds. Given: {getattr(settings, name)}")
    if not 0 < settings.port < 65536:
        parser.error(f"--port must be between 1 and 65535. Given: {settings.port}")
    _check_backend(parser, settings)
    return settings


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


def build_demo(engine, settings: Settings, metrics=None):
    """The page: ui.build_demo when the ui package is there, else a plain chat (same API name)."""
    try:
        import ui
    except ModuleNotFoundError as exc:
        if exc.name not in ("ui",):
            raise
        ui = None
    if ui is not None and hasattr(ui, "build_demo"):
        return ui.build_demo(engine, settings, metrics=metrics)  # calls demo.queue(...) itself
    return _fallback_demo(engine, settings)


def _fallback_demo(engine, settings: Settings):
    """A minimal chat page with the API the real ui/ keeps: api_name="/chat"."""
    import gradio as gr

    from engine import SamplingParams

    async def chat(message: str, history: list, system_prompt: str, temperature: float, top_p: float,
                   top_k: int, max_new_tokens: int, repetition_penalty: float):
        messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        for turn in history or []:
            content = turn.get("content") if isinstance(turn, dict) else None
            if isinstance(content, str):
                messages.append({"role": turn["role"], "content": content})
        messages.append({"role": "user", "content": message})
        try:  # SamplingParams checks every value (type, finite, range) and says what was wrong
            params = SamplingParams(max_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                    repetition_penalty=repetition_penalty)
        except (ValueError, TypeError) as exc:
            raise gr.Error(str(exc)) from None
        text = ""
        async for out in engine.generate(engine.encode_chat(messages), params):
            if out.finish_reason is not None and out.finish_reason.value == "error":
                raise gr.Error(out.error or "generation failed")
            text += out.text
            yield text

    with gr.Blocks(title="rill") as demo:
        gr.ChatInterface(
            chat, api_name="chat",
            additional_inputs=[
                gr.Textbox("", label="system_prompt"),
                gr.Slider(0, 2, 0.7, step=0.05, label="temperature"),
                gr.Slider(0.05, 1, 1.0, step=0.05, label="top_p"),
                gr.Slider(0, 200, 0, step=1, label="top_k"),
                gr.Slider(1, 4096, settings.default_max_new_tokens, step=1, label="max_new_tokens"),
                gr.Slider(0.5, 2, 1.0, step=0.05, label="repetition_penalty"),
            ],
        )
    demo.queue(default_concurrency_limit=settings.max_num_seqs, max_size=settings.max_num_seqs + settings.max_queue)
    return demo


QUEUE_POLL_S = 0.01  # how often Gradio's queue looks for new events while the page is in use (its default: 1 ms)
IDLE_QUEUE_POLL_S = 0.1  # and while no visitor has sent anything for PAGE_ACTIVE_S
PAGE_ACTIVE_S = 10.0
PROGRESS_POLL_S = 1.0  # for progress updates, which this page does not send (Gradio's default: 10 ms)


def _patient_queue(queue_class):
    """Gradio's queue, polling for new events every IDLE_QUEUE_POLL_S while the page is unused.

    The queue looks for events in a loop that sleeps `sleep_when_free` (1 ms on Linux) while it is
    free. Each wake-up of the event loop that feeds every SSE stream takes a core from one of the
    engine's two OpenMP threads, and a parallel region waits for its slowest thread: at 10 ms (100
    wake-ups a second) one `/v1` stream ran 55.6 tok/s against 61.9 with polling off (ITL 16.6
    against 15.3 ms; 3 interleaved rounds, AMD EPYC, 2 cores). So the queue polls at 10 ms only
    while the page is used (an event queued or running, or one pushed within PAGE_ACTIVE_S), and
    every 100 ms otherwise: a visitor's first message after a quiet spell starts at most 0.1 s
    later, the next ones as before."""

    class PatientQueue(queue_class):
        _last_push = float("-inf")

        @property
        def sleep_when_free(self) -> float:
            busy = len(self) > 0 or any(job is not None for job in self.active_jobs)
            recent = time.monotonic() - self._last_push < PAGE_ACTIVE_S
            return QUEUE_POLL_S if busy or recent else IDLE_QUEUE_POLL_S

        @sleep_when_free.setter
        def sleep_when_free(self, value) -> None:  # Gradio's __init__ sets its default
            pass

        async def push(self, *args, **kwargs):
            self._last_push = time.monotonic()
            return await super().push(*args, **kwargs)

    return PatientQueue


def _slow_queue_polling(demo) -> None:
    """Gradio's queue checks for new events every 1 ms while it is free (on Linux); see
    `_patient_queue`. Its progress loop wakes every 10 ms for updates this page never sends."""
    queue = getattr(demo, "_queue", None)
    if queue is None:
        return
    queue.__class__ = _patient_queue(type(queue))
    queue.progress_update_sleep_when_free = max(getattr(queue, "progress_update_sleep_when_free", 0),
                                                PROGRESS_POLL_S)


_LOGIN_MESSAGE = "This server needs its API key: any user name, the key as password."


def build_app(engine, settings: Settings):
    """FastAPI app with the API routes first, then the Gradio page at "/" (so /chat, /v1, /health win)."""
    import gradio as gr

    from server import create_app
    from server.middleware import page_login

    app = create_app(engine, settings)
    demo = build_demo(engine, settings, metrics=getattr(app.state, "metrics", None))
    mount_kwargs = {}
    try:
        import ui
        mount_kwargs = dict(getattr(ui, "MOUNT_KWARGS", {}) or {})
    except ImportError:
        pass
    # With an API key the page is closed too: its Gradio API reaches the same model as /chat.
    app = gr.mount_gradio_app(app, demo, path="/", auth=page_login(settings.api_key, settings.ui_auth),
                              auth_message=_LOGIN_MESSAGE if settings.api_key else None, server_name=settings.host,
                              server_port=settings.port, footer_links=["api"], ssr_mode=False, **mount_kwargs)
    _slow_queue_polling(demo)
    return app


def serve(app, settings: Settings, engine=None) -> int:
    """uvicorn; on SIGTERM it stops accepting and lets streams finish up to --shutdown-timeout, exit 0.

    When the engine dies for good (it rebuilds itself after a fault, --max-engine-restarts times),
    the server shuts down the same way and the exit status is 1: every consumer already has its
    error, and a fresh process (the Space's or a supervisor's restart) is the way back."""
    import uvicorn

    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                            timeout_graceful_shutdown=settings.shutdown_timeout,
                            access_log=settings.log_level == "debug")
    server = uvicorn.Server(config)
    original = server.handle_exit

    def handle_exit(sig, frame):
        app.state.shutting_down = True
        original(sig, frame)

    server.handle_exit = handle_exit
    engine_failed = threading.Event()

    def on_fatal(exc):  # the engine thread
        log.critical("the engine stays dead (%s); the server shuts down with exit status 1", type(exc).__name__)
        engine_failed.set()
        app.state.shutting_down = True
        server.should_exit = True  # uvicorn's main loop checks it every 0.1 s

    if engine is not None:
        engine.on_fatal = on_fatal
    # uvicorn re-raises the signal it caught once it has shut down, after restoring the handler it
    # found: with Python's default handler a SIGTERM would end the process with -15, not 0.
    previous = signal.signal(signal.SIGTERM, lambda sig, frame: None)
    try:
        server.run()
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 1 if engine_failed.is_set() else 0


def main(argv: list[str] | None = None) -> int:
    settings = parse_settings(argv)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # kill -USR1 <pid>: every thread's stack on stderr
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from engine.loading import ModelLoadError
    from frontend.backends import BackendError, create_engine

    try:
        engine_config(settings)  # a bad engine setting stops here, before any model or Ray starts
        engine = create_engine(settings)
    except (ValueError, ModelLoadError, BackendError) as exc:
        fail(str(exc))
    except ModuleNotFoundError as exc:
        if exc.name != "ray":
            raise
        fail("--backend ray needs Ray Serve: pip install -r requirements-ray.txt")
    try:
        app = build_app(engine, settings)
        # Everything built so far (model, tokenizer, transformers, gradio, the app) lives as long
        # as the process: out of the collector's sight, a full collection only walks what the
        # requests create. Otherwise each one walked them all (about 490,000 objects): pauses of
        # 290-330 ms while serving, GIL held, so the engine and the event loop both stopped.
        gc.collect()
        gc.freeze()
        log.info("serving %s on http://%s:%d (backend %s, engine: %s attention)", engine.model_name, settings.host,
                 settings.port, settings.backend, getattr(engine, "attention_path", "?"))
        status = serve(app, settings, engine)
    finally:
        engine.shutdown()
    return status


if __name__ == "__main__":
    sys.exit(main())

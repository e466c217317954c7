"""rill: a streaming chat Space. Settings and wiring only.

    python app.py [--model M] [--host H] [--port P] ...     (python app.py --help)

Every flag can also come from an environment variable (a Space passes settings that way): the
flag wins over the variable, the variable over the default. With no flags and no variables it
serves the embedded SmolLM2-135M-Instruct on http://127.0.0.1:7860, as a Space needs.

Wiring: load the model -> start the engine -> the FastAPI app with /chat, /v1, /health
(server.create_app) -> the Gradio page mounted at "/" (ui.build_demo) -> uvicorn.
"""

from __future__ import annotations

import faulthandler
import gc
import logging
import os
import signal
import sys
import threading

# Before gradio or transformers are imported: nothing phones home unless asked.
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

from frontend.options import engine_config, fail, parse_settings  # noqa: E402  (torch-free)
from frontend.settings import Settings  # noqa: E402

log = logging.getLogger("rill")

_LOGIN_MESSAGE = "This server needs its API key: any user name, the key as password."


def build_app(engine, settings: Settings, models=None):
    """FastAPI app with the API routes first, then the Gradio page at "/" (so /chat, /v1, /health win)."""
    import gradio as gr

    import ui
    from server import create_app
    from server.middleware import guard_gradio, page_login

    app = create_app(engine, settings, models)
    # the page admits as the routes do: the same defaults, metrics and --request-timeout (queue set up there)
    demo = ui.build_demo(engine, settings, metrics=app.state.metrics, defaults=app.state.request_defaults,
                         models=app.state.models if app.state.models.several else None)
    # With an API key the page is closed too: its Gradio API reaches the same model as /chat.
    app = gr.mount_gradio_app(app, demo, path="/", auth=page_login(settings.api_key, settings.ui_auth),
                              auth_message=_LOGIN_MESSAGE if settings.api_key else None, server_name=settings.host,
                              server_port=settings.port, footer_links=["api"], ssr_mode=False,
                              show_error=False, max_file_size=settings.max_body_bytes, **ui.MOUNT_KWARGS)
    guard_gradio(app)  # Gradio's login on the session routes it leaves open (heartbeat, cancel, ...)
    ui.slow_queue_polling(demo)
    return app


def serve(app, settings: Settings, engine=None) -> int:
    """uvicorn; on SIGTERM it stops accepting and lets streams finish up to --shutdown-timeout, exit 0.

    When the engine dies for good (it rebuilds itself after a fault, --max-engine-restarts times),
    the server shuts down the same way and the exit status is 1: every consumer already has its
    error, and a fresh process (the Space's or a supervisor's restart) is the way back."""
    import uvicorn

    # X-Forwarded-For names the caller (fair shares) only from the proxies --forwarded-allow-ips trusts: uvicorn's
    # own default would trust 127.0.0.1 and FORWARDED_ALLOW_IPS behind our back, so it is always given explicitly.
    # With `*` the right-most entry names the caller (server/middleware.py RightmostForwarded).
    trusted = list(settings.forwarded_allow_ips)
    everyone = trusted == ["*"]
    if everyone:
        from server.middleware import RightmostForwarded
    config = uvicorn.Config(RightmostForwarded(app) if everyone else app, host=settings.host, port=settings.port,
                            log_level=settings.log_level, timeout_graceful_shutdown=settings.shutdown_timeout,
                            access_log=settings.log_level == "debug", proxy_headers=bool(trusted) and not everyone,
                            forwarded_allow_ips=(trusted or None) if not everyone else None)
    server = uvicorn.Server(config)
    original = server.handle_exit

    def handle_exit(sig, frame):
        app.state.shutting_down = True
        original(sig, frame)

    server.handle_exit = handle_exit
    begin_shutdown = server.shutdown

    async def shutdown(sockets=None):
        # Gradio's session heartbeats (a stream per open page or gradio_client) end only on its app's
        # stop_event: set as shutdown begins, else an open page holds the exit for --shutdown-timeout.
        for route in app.routes:
            stop_event = getattr(getattr(route, "app", None), "stop_event", None)
            if stop_event is not None:
                stop_event.set()
        await begin_shutdown(sockets)

    server.shutdown = shutdown
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
    from engine.model.loading import ModelLoadError
    from frontend.backends import BackendError
    from frontend.models import ModelRegistry

    try:
        engine_config(settings)  # a bad engine setting stops here, before any model or Ray starts
        models = ModelRegistry.from_settings(settings)  # every model named; the default (and pinned) loaded now
        engine = models.start()
    except (ValueError, ModelLoadError, BackendError) as exc:
        fail(str(exc))
    except ModuleNotFoundError as exc:
        if exc.name != "ray":
            raise
        fail("--backend ray needs Ray Serve: pip install -r requirements-ray.txt")
    try:
        app = build_app(engine, settings, models)
        # Everything built so far lives as long as the process: frozen out of the collector's sight,
        # a full collection walks only what requests create (pauses: docs/benchmarks-history.md).
        gc.collect()
        gc.freeze()
        log.info("serving %s on http://%s:%d (backend %s, engine: %s attention)", engine.model_name, settings.host,
                 settings.port, settings.backend, engine.attention_path)
        status = serve(app, settings, engine)
    finally:
        models.shutdown()
    return status


if __name__ == "__main__":
    sys.exit(main())

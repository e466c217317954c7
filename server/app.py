"""The FastAPI application: routes, error shapes, API guard, health, and the engine's lifecycle hooks."""

from __future__ import annotations

import asyncio
import logging
import time

from fastapi import Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse

from server import anthropic_api, chat, models_api, openai_api, responses_api
from server.errors import ApiError, install_error_handlers
from server.metrics import install_metrics
from server.middleware import ApiGuard, CorsGuard, has_key
from server.resume import ResumeRegistry
from server.streaming import release_model
from frontend.images import ImageLimits, images_health
from frontend.models import ModelRegistry
from frontend.request import RequestDefaults
from frontend.sampling_defaults import model_sampling_defaults
from frontend.settings import Settings

log = logging.getLogger("rill.server")


def _engine_stats(engine) -> dict:
    try:
        stats = engine.stats()
    except Exception:  # the engine may be dead; health still answers (the reason is in the log)
        log.warning("engine stats unavailable", exc_info=True)
        return {"error": "engine statistics are unavailable"}
    return {
        "num_running": stats.num_running,
        "num_waiting": stats.num_waiting,
        "kv_usage": stats.kv_usage,
        "num_kv_blocks": stats.num_kv_blocks,
        "num_free_kv_blocks": stats.num_free_kv_blocks,
        "num_preemptions": stats.num_preemptions,
        "prefix_cache_hit_tokens": stats.prefix_cache_hit_tokens,
        "prefix_cache_queried_tokens": stats.prefix_cache_queried_tokens,
        "spec_draft_tokens": stats.spec_draft_tokens,
        "spec_accepted_tokens": stats.spec_accepted_tokens,
        "prompt_tokens_total": stats.prompt_tokens_total,
        "generation_tokens_total": stats.generation_tokens_total,
        "finished_total": dict(stats.finished_total),
    }


def _backend_health(engine) -> dict:
    """The backend's own part of /health (local: weights, linears, restarts; ray: its replicas)."""
    try:
        return engine.health_info()
    except Exception:  # health still answers
        log.warning("backend health unavailable", exc_info=True)
        return {}


def create_app(engine, settings: Settings, models: ModelRegistry | None = None) -> FastAPI:
    """The app with every API route registered; app.py mounts the Gradio page at "/" afterwards.
    `engine`: the default model's; `models`: every model served (None: `engine`'s alone)."""
    app = FastAPI(title="rill", summary="Streaming chat on a continuous-batching engine",
                  docs_url="/docs", redoc_url=None)
    state = app.state
    state.engine = engine
    # what every entrance's unset fields take (the page's sliders start there too)
    state.request_defaults = RequestDefaults(model_sampling_defaults(engine), settings.default_max_new_tokens)
    state.settings = settings
    # the models the routes pick from by the body's `model` (frontend/models.py); one around `engine` by default
    state.models = models if models is not None else ModelRegistry.single(engine, settings, state.request_defaults)
    state.image_limits = ImageLimits(settings.limit_images, settings.allowed_media_domains,  # frontend/images.py
                                     settings.max_image_bytes)
    state.started_at = int(time.time())
    state.shutting_down = False
    state.resume = ResumeRegistry(settings.resume_window, state.models.abort, max_streams=settings.resume_max_streams,
                                  max_bytes=settings.resume_max_bytes,
                                  continuable=engine.continuable)
    state.tasks = set()  # background pump tasks, kept referenced until they finish

    def spawn(coro) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        state.tasks.add(task)
        task.add_done_callback(state.tasks.discard)
        return task

    state.spawn = spawn

    install_error_handlers(app)
    held = [Depends(release_model)]  # the model a route took is released when it returns
    app.include_router(chat.router, dependencies=held)
    app.include_router(openai_api.router, dependencies=held)
    app.include_router(responses_api.router, dependencies=held)
    app.include_router(anthropic_api.router, dependencies=held)
    app.include_router(models_api.router)

    @app.get("/health", summary="200 while the engine runs, 503 once it died")
    async def health(request: Request):
        alive = bool(engine.alive)
        body = {"status": "ok" if alive else "engine stopped", "model": engine.model_name,
                "max_model_len": engine.max_model_len, "images": images_health(engine.vision, state.image_limits)}
        if state.models.several:  # each model's state and loads counted (the default's engine is `engine`)
            body["models"] = state.models.snapshot()
        if not has_key(request.scope, settings.api_key):  # no counters: they tell what other clients sent
            return JSONResponse(body, status_code=200 if alive else 503)
        body.update({"engine": _engine_stats(engine), "resumable_streams": len(state.resume),
                     "resumable_bytes": state.resume.nbytes})
        body.update(_backend_health(engine))
        if not alive:
            body["reason"] = engine.unavailable_reason()
        return JSONResponse(body, status_code=200 if alive else 503)

    @app.get("/ready", summary="200 when the server accepts new requests")
    async def ready():
        if not engine.alive:
            return JSONResponse({"ready": False, "reason": "the engine is not running"}, status_code=503)
        if state.shutting_down:
            return JSONResponse({"ready": False, "reason": "shutting down"}, status_code=503)
        return {"ready": True}

    if settings.test_hooks:
        from testing.hooks import install_test_routes  # never imported without --test-hooks

        install_test_routes(app, engine)

    state.metrics = install_metrics(app, engine, log_format=settings.log_format,  # every entrance records there
                                    models=state.models)

    app.add_middleware(ApiGuard, api_key=settings.api_key, max_body_bytes=settings.max_body_bytes,
                       test_hooks=settings.test_hooks, page_closed=settings.ui_auth is not None)
    if settings.cors_origins:  # named origins may send credentials (the page's login cookie); `*` never
        app.add_middleware(CORSMiddleware, allow_origins=list(settings.cors_origins), allow_methods=["*"],
                           allow_headers=["*"], expose_headers=["x-request-id", "x-resume-token"],
                           allow_credentials="*" not in settings.cors_origins)
    # Outermost: no Origin --cors-origins does not name gets CORS headers, from Gradio's routes either.
    app.add_middleware(CorsGuard, allowed_origins=settings.cors_origins)
    return app


__all__ = ["create_app", "ApiError"]

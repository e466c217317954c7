"""What every generating route shares (no route imports another's module): the model check and
request id, a `ChatJob` prepared and admitted with the request's admission keywords, the deltas
of several generations merged, and a whole answer read while the client stays connected."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from fastapi import Request

from engine.request import RequestOutput
from frontend.admission import Generation, RequestFailed
from frontend.errors import ApiError
from frontend.request import ChatJob, Prepared, prepare, start_job
from server.headers import admission, client_of, request_id_from

DISCONNECT_POLL_S = 0.25  # how often a whole (non-streamed) answer checks that its client is still there


def check_model(state, model: str | None) -> None:
    """A 404 naming the models served when `model` is none of them (None or "": the default)."""
    state.models.resolve(model)


async def route_start(request: Request, body, x_request_id: str | None):
    """What every generating route does first: the engine of the model the body names (loaded on
    demand, held until the route returns: `release_model`), and the client's request id."""
    engine = await use_model(request, body.model)
    return engine, request_id_from(x_request_id)


async def use_model(request: Request, model: str | None):
    """The engine of `model` (None: the default), held for this request (404 unknown, 500 its load failed)."""
    entry = await request.app.state.models.acquire(model)
    previous = getattr(request.state, "model", None)
    if previous is not None:
        request.app.state.models.release(previous)
    request.state.model = entry
    return entry.engine


async def release_model(request: Request):
    """The routers' dependency: the model a route used may be unloaded once the route returned (its
    generation is admitted by then: the engine counts it until it finishes)."""
    try:
        yield
    finally:
        entry = getattr(request.state, "model", None)
        if entry is not None:
            request.state.model = None
            request.app.state.models.release(entry)


async def start(request: Request, job: ChatJob, label: str, route: str) -> tuple[list[Generation], Prepared]:
    """The job prepared (frontend/request.py) and admitted: its generations (one per prompt) and what
    was built (400/429/503 before any response starts)."""
    state = request.app.state
    entry = getattr(request.state, "model", None)
    engine, defaults = (entry.engine, entry.defaults) if entry is not None else (state.engine, state.request_defaults)
    prepared = await prepare(engine, job, defaults, client=client_of(request))
    gens = await start_job(engine, job, prepared, label, **admission(request, route))
    return gens, prepared


async def merged(gens: list[Generation]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Deltas of several generations as (generation index, delta), in arrival order."""
    if len(gens) == 1:
        async with contextlib.aclosing(gens[0].deltas()) as deltas:
            async for out in deltas:
                yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def read(i: int, gen: Generation):
        try:
            async for out in gen.deltas():
                await queue.put((i, out))
            await queue.put((i, done))
        except BaseException as exc:  # hand failures to the reader
            await queue.put((i, exc))

    tasks = [asyncio.ensure_future(read(i, g)) for i, g in enumerate(gens)]
    try:
        remaining = len(gens)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        for gen in gens:
            if not gen.finished:
                gen.abort()


async def run_while_connected(coro, request: Request, *gens: Generation):
    """Await `coro` (which reads `gens` whole) unless the client disconnects first; then abort them.
    A failure of the engine is the route's 504 (timeout), 503 (engine gone) or 500."""
    task = asyncio.ensure_future(coro)

    def abort_all() -> None:
        for gen in gens:
            gen.abort()

    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if task in done:
                try:
                    return task.result()
                except RequestFailed as exc:
                    status = {"timeout": 504, "engine_dead": 503}.get(exc.code, 500)
                    raise ApiError(status, exc.message, code=exc.code) from None
            if await request.is_disconnected():
                task.cancel()
                abort_all()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
                raise ApiError(499, "The client closed the connection.")
    finally:
        if not task.done():
            task.cancel()
            abort_all()

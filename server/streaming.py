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


def served_names(state) -> set[str]:
    names = {state.engine.model_name}
    if state.settings.model_id:
        names.add(state.settings.model_id)
    return names


def check_model(state, model: str | None) -> None:
    if model in (None, ""):
        return
    if model not in served_names(state):
        raise ApiError(404, f"The model `{model}` does not exist on this server. It serves "
                            f"`{state.engine.model_name}` (see GET /v1/models).", param="model",
                       code="model_not_found")


def route_start(request: Request, body, x_request_id: str | None):
    """What every generating route checks first: the model asked for, and the client's request id."""
    check_model(request.app.state, body.model)
    return request.app.state.engine, request_id_from(x_request_id)


async def start(request: Request, job: ChatJob, label: str, route: str) -> tuple[list[Generation], Prepared]:
    """The job prepared (frontend/request.py) and admitted: its generations (one per prompt) and what
    was built (400/429/503 before any response starts)."""
    state = request.app.state
    prepared = await prepare(state.engine, job, state.request_defaults, client=client_of(request))
    gens = await start_job(state.engine, job, prepared, label, **admission(request, route))
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

"""One engine request as a route sees it: admitted up front, deltas iterated with a deadline,
aborted when nobody reads it any more.

Routes admit a `Generation` before they answer (`await start_generation(...)`: so a full queue is
a 429 and a bad prompt a 400, never a broken stream), then iterate `deltas()` for the request's
`RequestOutput`s. Admission has two steps for every backend (frontend/backends): the constructor
(local checks, the request queued or sent) and `ready()` (a remote engine's answer).
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import threading
import time
from collections.abc import AsyncIterator

from engine.request import (MAX_CHARS_PER_TOKEN, FinishReason, InvalidRequest, QueueFull, RequestOutput,
                            SamplingParams, prompt_char_limit)
from frontend.errors import ApiError, public_engine_error, queue_full_error

_ALIVE_CHECK_S = 1.0  # how often a waiting reader checks that the engine thread still runs


class RequestFailed(Exception):
    """The request ended without a normal finish: engine error, timeout, engine death."""

    def __init__(self, message: str, code: str = "engine_error"):
        super().__init__(message)
        self.message = message
        self.code = code


def check_prompt_chars(engine, num_chars: int, param: str) -> None:
    """400 for a prompt too long to fit the context whatever it tokenizes to, before any tokenizing
    (which would otherwise cost time in proportion to whatever size the client sent)."""
    limit = prompt_char_limit(engine.max_model_len)
    if num_chars > limit:
        raise ApiError(400, f"`{param}` is too long: it may have at most {limit} characters (the model's context "
                            f"of {engine.max_model_len} tokens at {MAX_CHARS_PER_TOKEN} characters per token, more "
                            f"than any text needs). Given: {num_chars} characters.", param=param)


def _down_reason(engine) -> str:
    """Why the engine cannot serve now, in the backend's words when it has them."""
    return engine.unavailable_reason()


async def off_loop(function, *args):
    """Runs `function(*args)` (tokenizing, rendering a chat template) in a worker thread, so that
    the event loop keeps serving the other streams meanwhile."""
    return await asyncio.to_thread(function, *args)


RETRY_AFTER_S = 1  # a 429's Retry-After: slots free as requests finish (many per second under load)


def admit(engine, prompt_token_ids: list[int], params: SamplingParams, request_id: str, *,
          prior_output_ids: list[int] = (), session: str | None = None, client: str | None = None, on_admit=None,
          images=None):
    """The one admission path of `/chat`, `/v1`, the page and MCP: the engine checks the prompt and
    the parameters once (context, vocabulary, KV cache, capacity) and queues the request; its refusals
    come out as `InvalidRequest` (400) or `ApiError` (429, 503). Returns the request's `RequestStream`.
    `session` picks a replica (remote backends); `client` is whom the local engine shares between."""
    if not engine.alive:
        raise ApiError(503, _down_reason(engine), code="engine_dead")
    extra = {"session": session} if session is not None else {}
    if client is not None:
        extra["client"] = client
    if images is not None:  # the prompt's PromptImages (only a vision model's engine takes them)
        extra["images"] = images
    try:
        handle = engine.add_request(prompt_token_ids, params, request_id=request_id,
                                    prior_output_ids=prior_output_ids, **extra)
    except QueueFull as exc:
        raise queue_full_error(exc, RETRY_AFTER_S) from None
    except InvalidRequest:
        raise
    except RuntimeError as exc:  # the engine stopped (or a remote would not take it) between the check and now
        raise ApiError(503, f"{exc} Check /health.", code="engine_dead") from None
    if on_admit is not None:
        on_admit(request_id)  # test hook; the engine applies it before its next step
    return handle


COMPILES_PER_CALLER = 4  # one caller's constraints compiling at once; its others wait their turn
COMPILES_WAITING_PER_CALLER = 32  # and past this many waiting, a 429 naming both
_COMPILE_POLL_S = 0.02  # how often a waiting compile looks for its caller's free slot


class _CompileSlots:
    """The compiles each caller has in the grammar pool, so one caller flooding distinct grammars cannot take the pool from the others:
    at most `limit` of a caller's compile at once, up to `waiting` more wait for one of them to end."""

    def __init__(self, limit: int = COMPILES_PER_CALLER, waiting: int = COMPILES_WAITING_PER_CALLER):
        self.limit, self.waiting = limit, waiting
        self._lock = threading.Lock()
        self._running: dict[str, int] = {}
        self._queued: dict[str, int] = {}

    def _enter(self, client: str) -> None:
        """Queue `client`'s compile; ApiError 429 when it already has `limit` running and `waiting` queued."""
        with self._lock:
            running, queued = self._running.get(client, 0), self._queued.get(client, 0)
            if running >= self.limit and queued >= self.waiting:
                raise ApiError(429, f"Too many constraints compiling for this client: at most {self.limit} at once "
                                    f"and {self.waiting} waiting; {running} are compiling and {queued} waiting. "
                                    f"Retry when one is done.",
                               code="too_many_compiles", headers={"Retry-After": str(RETRY_AFTER_S)})
            self._queued[client] = queued + 1

    def _try_start(self, client: str) -> bool:
        with self._lock:
            if self._running.get(client, 0) >= self.limit:
                return False
            self._running[client] = self._running.get(client, 0) + 1
            self._leave_queue(client)
            return True

    def _leave_queue(self, client: str) -> None:
        left = self._queued.pop(client) - 1
        if left:
            self._queued[client] = left

    def _abandon(self, client: str) -> None:
        with self._lock:
            self._leave_queue(client)

    def waiting_now(self) -> int:
        """Compiles waiting for their caller's turn, all callers together."""
        with self._lock:
            return sum(self._queued.values())

    def _end(self, client: str) -> None:
        with self._lock:
            left = self._running.pop(client) - 1
            if left:
                self._running[client] = left

    @contextlib.asynccontextmanager
    async def held(self, client: str | None):
        """`client`'s slot (None: a caller nobody named, counted only in the compiler's global bound)
        for the block's duration, waited for on the event loop (the wait holds no thread)."""
        if client is None:
            yield
            return
        self._enter(client)
        try:
            while not self._try_start(client):
                await asyncio.sleep(_COMPILE_POLL_S)
        except BaseException:
            self._abandon(client)
            raise
        try:
            yield
        finally:
            self._end(client)


COMPILE_SLOTS = _CompileSlots()


def _submit(grammars, params: SamplingParams):
    """The compile's concurrent future from the engine's own grammar pool (429 when too many compile)."""
    try:
        return grammars.submit(params.constraint)
    except QueueFull as exc:
        raise queue_full_error(exc, RETRY_AFTER_S) from None


async def compile_constraint(engine, params: SamplingParams, client: str | None = None) -> None:
    """The request's constraint compiled before admission, so that the engine thread never waits for
    a grammar (400 when it does not compile, 429 when too many are compiling, for everyone or for
    `client`), waited for on the loop: the compile runs in the engine's grammar pool and this awaits
    its future, so no worker thread of the default executor (which tokenizes every request) is held
    meanwhile. `client` (server/headers.py `client_of`, the page's `page_client`) is whom
    COMPILES_PER_CALLER counts."""
    if params.constraint is None:
        return
    grammars = engine.grammars
    if grammars is None:
        return  # a remote engine compiles where it runs
    async with COMPILE_SLOTS.held(client):
        future = _submit(grammars, params)
        if not future.done():
            # asyncio.wait never cancels what it waits on: the compile may be shared with other requests
            await asyncio.wait({asyncio.wrap_future(future)}, timeout=grammars.timeout_s)
        grammars.result(params.constraint, future)  # InvalidRequest (400): no grammar, or not done in time


def new_engine_request_id() -> str:
    """The engine's key for one admission: fresh every time (a continuation gets a new one too),
    never the client's label, so no client can collide with, probe or block another's request."""
    return f"srv-{secrets.token_hex(12)}"


async def start_generation(engine, prompt_token_ids: list[int], params: SamplingParams, label: str,
                           **kwargs) -> "Generation":
    """A `Generation` the engine took (raises its 400/429/503 before any response starts)."""
    return await Generation(engine, prompt_token_ids, params, label, **kwargs).ready()


class Generation:
    """A request admitted into the engine, with its stream and deadline.

    `label` is the request id the client sees (its `x-request-id`, or the server's): headers,
    logs and metrics. The engine knows the request by `request_id`, made here for every
    admission; labels may repeat, engine ids never do."""

    def __init__(self, engine, prompt_token_ids: list[int], params: SamplingParams, label: str,
                 timeout: float = 0.0, on_admit=None, metrics=None, route: str = "chat",
                 prior_output_ids: list[int] = (), session: str | None = None, client: str | None = None,
                 images=None, model: str | None = None):
        self.engine = engine
        self.model = model  # the served model's name, for the metrics (several models: their `model` label)
        self.session = session  # the conversation's key for replica affinity (x-session-id), or None
        self.metrics = metrics  # frontend.telemetry.RequestMetrics, or None
        self.route = route  # metrics label
        self.label = label  # the client-facing request id; not unique, not a key
        self.request_id = new_engine_request_id()  # the engine's key for this admission
        self.params = params
        self.num_prompt_tokens = len(prompt_token_ids)
        self.started = time.monotonic()
        self.deadline = self.started + timeout if timeout and timeout > 0 else None
        self.timeout = timeout
        self.finished = False  # every sample reached finished=True
        self._tick: asyncio.TimerHandle | None = None  # wakes the reader every second (see _next)
        self._stopped = False
        self.stream = admit(engine, prompt_token_ids, params, self.request_id, prior_output_ids=prior_output_ids,
                            session=session, client=client, on_admit=on_admit, images=images)  # errors: see the route handlers
        self._remaining = set(range(params.n))

    async def ready(self) -> "Generation":
        """Waits until the engine took the request (at once for the local engine; a remote one
        answers after a round trip): its refusal is the same 400, 429 or 503 as a local one, and
        a request that cannot even be admitted before its deadline is a 504."""
        timeout = None if self.deadline is None else max(0.0, self.deadline - time.monotonic())
        try:
            await self.engine.wait_admitted(self.stream, timeout)
        except QueueFull as exc:
            raise queue_full_error(exc, RETRY_AFTER_S) from None
        except asyncio.TimeoutError:
            raise ApiError(504, f"The request exceeded the server's request timeout of {self.timeout:g} s "
                                "before the engine took it.", code="timeout") from None
        except InvalidRequest:
            raise
        except RuntimeError as exc:  # not running, unreachable, died before taking it
            raise ApiError(503, f"{exc} Check /health.", code="engine_dead") from None
        return self

    async def _next(self) -> RequestOutput | None:
        """The next delta, None at the end; a tick wakes the wait every second to check the
        deadline and the engine (one timer per request, not one per token)."""
        if self._tick is None:
            self._arm_tick()
        while True:
            if self.deadline is not None and time.monotonic() >= self.deadline:
                raise RequestFailed(f"The request exceeded the server's request timeout of {self.timeout:g} s "
                                    "(waiting plus generating) and was stopped.", code="timeout")
            out = await self.stream.next()
            if out is not None or self.stream.done:
                return out
            if not self.engine.alive:
                raise RequestFailed(f"This request cannot finish. {_down_reason(self.engine)}", code="engine_dead")

    def _arm_tick(self) -> None:
        wait = _ALIVE_CHECK_S
        if self.deadline is not None:
            wait = max(0.0, min(wait, self.deadline - time.monotonic()))
        self._tick = asyncio.get_running_loop().call_later(wait, self._on_tick)

    def _on_tick(self) -> None:
        self.stream.wake()
        if not self.finished and not self._stopped:
            self._arm_tick()

    def _stop_tick(self) -> None:
        self._stopped = True
        if self._tick is not None:
            self._tick.cancel()

    def deltas(self) -> AsyncIterator[RequestOutput]:
        """The request's outputs until every sample finished. Raises `RequestFailed` on an engine
        error, a timeout or the engine's death; aborts the request if the reader stops early.
        Recorded in the metrics (one log line per request) when the app has them."""
        if self.metrics is None:
            return self._deltas()
        return self.metrics.track(self.route, self._deltas(), request_id=self.label,
                                  num_prompt_tokens=self.num_prompt_tokens, arrival_time=self.started,
                                  model=self.model)

    async def _deltas(self) -> AsyncIterator[RequestOutput]:
        try:
            while self._remaining:
                out = await self._next()
                if out is None:  # the stream ended
                    break
                if out.finished:
                    self._remaining.discard(out.index)
                    if out.finish_reason == FinishReason.ERROR:
                        raise RequestFailed(f"Generation failed inside the engine: {public_engine_error(out.error)}")
                yield out
            self.finished = not self._remaining
        finally:
            self._stop_tick()
            if not self.finished:
                self.abort()

    def abort(self) -> None:
        """Stop reading and end the request in the engine (its KV blocks are freed within a step)."""
        self._stop_tick()
        try:
            self.engine.abort(self.request_id)
        except Exception:  # the engine may be gone; nothing left to free
            pass

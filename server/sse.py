"""A lean Server-Sent-Events response for `/chat` and `/v1`: one `send` per batch of events.

It sends the events its iterator yields with nothing around the ASGI `send` (sse-starlette's
cancel scope and four tasks per response cost the engine's cores twice the CPU time per event:
`python -m bench.sse_cost`, docs/benchmarks-history.md), joins the events that are ready into one
body chunk, pings while idle, and stops the iterator (whose cleanup aborts the request) when the
client disconnects. It does not cut streams on SIGTERM: uvicorn's graceful shutdown lets them
finish (--shutdown-timeout).

An event is a dict with `data` and optionally `event` and `id`, as sse-starlette takes them;
the iterator may also yield a list of such dicts (sent as one chunk).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import AsyncIterator, Callable

from starlette.responses import Response

from server.resume import MAX_BACKLOG_BYTES

PING_S = 15.0  # a keep-alive comment after this many idle seconds (proxies close silent connections)
_LINE_BREAK = re.compile(r"\r\n|\r|\n")


def encode_event(event: dict) -> str:
    """One SSE event: `id:`, `event:`, one `data:` line per line of data, a blank line."""
    out = []
    if event.get("id") is not None:
        out.append(f"id: {event['id']}\n")
    if event.get("event") is not None:
        out.append(f"event: {event['event']}\n")
    for line in _LINE_BREAK.split(str(event.get("data", ""))):
        out.append(f"data: {line}\n")
    out.append("\n")
    return "".join(out)


class _Outbox:
    """Encoded events waiting for the client: what a pump has produced and `send` has not returned from."""

    def __init__(self):
        self.chunks: list[bytes] = []
        self.nbytes = 0  # bytes in `chunks` plus the chunk being sent
        self.closed = False  # the pump put its last chunk
        self._changed = asyncio.Event()

    def put(self, body: bytes) -> None:
        self.chunks.append(body)
        self.nbytes += len(body)
        self._changed.set()

    def close(self) -> None:
        self.closed = True
        self._changed.set()

    async def changed(self) -> None:
        await self._changed.wait()
        self._changed.clear()


class SSEResponse(Response):
    """An ASGI `text/event-stream` response over an async iterator of events (or lists of them).

    `backlog_limit`: the most bytes of events the client may leave unread (the events are
    pulled from the iterator as they come, whether the client reads or not). Past it, the
    iterator is closed (its cleanup aborts the request), `on_backlog(limit)`'s events (the
    route's error, its end) are queued after the unread ones, and the stream ends once the
    client reads them, or when it disconnects. Without a limit the iterator is pulled only
    when everything before was sent (the route bounds its own backlog: /chat's resume.py).
    """

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator, headers: dict[str, str] | None = None, ping: float = PING_S,
                 backlog_limit: int | None = None, on_backlog: Callable[[int], list[dict]] | None = None):
        self.events = events
        self.ping = ping
        self.backlog_limit = backlog_limit
        self.on_backlog = on_backlog
        self.status_code = 200
        self.background = None
        self.init_headers({"cache-control": "no-store", "connection": "keep-alive", "x-accel-buffering": "no",
                           **(headers or {})})

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        if scope.get("method", "GET").upper() == "HEAD":
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            await _aclose(self.events)
            return
        outbox = _Outbox()
        last_send = [time.monotonic()]
        pump = asyncio.ensure_future(self._pump(outbox))
        sender = asyncio.ensure_future(self._send(send, outbox, pump, last_send))
        watchers = [asyncio.ensure_future(_wait_disconnect(receive))]
        if self.ping > 0:
            watchers.append(asyncio.ensure_future(self._ping(outbox, last_send)))
        try:
            await asyncio.wait([sender, watchers[0]], return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (sender, pump, *watchers):
                task.cancel()
            for task in (sender, pump, *watchers):
                with contextlib.suppress(BaseException):
                    await task
            await _aclose(self.events)
            outbox.chunks.clear()  # nothing of a gone client's stream is kept
        for task in (pump, sender):
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise task.exception()

    async def _pump(self, outbox: _Outbox) -> None:
        """Events from the iterator into the outbox, encoded; cut off past the backlog limit."""
        try:
            async for item in self.events:
                items = item if isinstance(item, list) else [item]
                outbox.put("".join(encode_event(e) for e in items).encode("utf-8"))
                if self.backlog_limit is None:
                    while outbox.nbytes and not outbox.closed:
                        await outbox.changed()
                elif outbox.nbytes > self.backlog_limit:
                    await _aclose(self.events)  # aborts the request: nobody reads it
                    tail = self.on_backlog(self.backlog_limit) if self.on_backlog is not None else []
                    outbox.put("".join(encode_event(e) for e in tail).encode("utf-8"))
                    break
        finally:
            outbox.close()

    async def _send(self, send, outbox: _Outbox, pump: asyncio.Future, last_send: list[float]) -> None:
        while True:
            if outbox.chunks:
                body = b"".join(outbox.chunks)
                outbox.chunks.clear()
                await send({"type": "http.response.body", "body": body, "more_body": True})
                last_send[0] = time.monotonic()
                outbox.nbytes -= len(body)
                outbox._changed.set()  # the pump may wait for an empty outbox
            elif outbox.closed:
                break
            else:
                await outbox.changed()
        await asyncio.wait([pump])
        if pump.cancelled() or pump.exception() is None:
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _ping(self, outbox: _Outbox, last_send: list[float]) -> None:
        while True:
            idle = time.monotonic() - last_send[0]
            if idle < self.ping:
                await asyncio.sleep(self.ping - idle)
                continue
            if not outbox.nbytes and not outbox.closed:
                outbox.put(b": ping\n\n")
            last_send[0] = time.monotonic()


def event_stream_response(events: AsyncIterator, request_id: str, headers: dict[str, str] | None = None,
                          on_backlog: Callable[[int], list[dict]] | None = None) -> SSEResponse:
    """The stream of one request, as /chat and /v1 answer it (its id echoed in `x-request-id`).

    With `on_backlog` (the route's error event and end, given the limit), a client that leaves
    more than `MAX_BACKLOG_BYTES` unread is cut off; without it the route bounds its own backlog."""
    return SSEResponse(events, headers={"x-request-id": request_id, **(headers or {})},
                       backlog_limit=MAX_BACKLOG_BYTES if on_backlog is not None else None, on_backlog=on_backlog)


async def _wait_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _aclose(events) -> None:
    aclose = getattr(events, "aclose", None)
    if aclose is not None:
        with contextlib.suppress(Exception):
            await aclose()

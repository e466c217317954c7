"""Resumable `/chat` streams: the events of a request kept while someone may come back for them.

A pump task reads the engine request and appends its SSE events to a `ResumableStream`,
independent of any HTTP connection. Readers follow the list from an event id.

When the last reader leaves an unfinished stream, the engine request is aborted at once (its KV
blocks are free within a step: nobody is reading) and the stream is *suspended*: its events
and the tokens generated so far are kept for `window` seconds. A reader who comes back in
time gets the events after its `Last-Event-ID`, and the request continues from its last
token: a new engine request whose prompt is the old prompt plus those tokens (recomputed,
like a preempted sequence), numbering its events on from the last id. Greedy output is the
same as without the interruption. After the window the record is dropped (404).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

_FIRST_READER_GRACE_S = 10.0  # how long a new stream waits for its first reader when the window is 0


class ResumableStream:
    """The SSE events of one request (ids 1, 2, ...) and who follows them."""

    def __init__(self, request_id: str, window: float, on_expire: Callable[["ResumableStream"], None],
                 on_orphan: Callable[["ResumableStream"], None] | None = None):
        self.request_id = request_id
        self.window = window  # seconds it stays resumable with nobody reading
        self.events: list[dict] = []  # event dicts for server/sse.py; events[k-1] has id k
        self.done = False  # the last event (end) is in `events`
        self.readers = 0  # connections following the stream now
        self.created = time.monotonic()
        self._changed = asyncio.Event()  # set (and replaced) whenever events or done change
        self._on_expire = on_expire
        self._on_orphan = on_orphan  # the last reader left an unfinished stream
        self._expiry: asyncio.TimerHandle | None = None
        self.expired = False
        # what a continuation needs, and where the generation stands
        self.prompt_ids: list[int] = []
        self.params = None
        self.output_ids: list[int] = []  # tokens generated so far
        self.suspending = False  # the engine request is being aborted because nobody reads it
        self.suspended = False  # it was: a reader who comes back continues it
        self.pump: asyncio.Task | None = None  # the task reading the engine request now

    def suspend(self) -> None:
        """The pump saw the abort of a `suspending` stream: wait for a reader to continue it."""
        self.suspending = False
        self.suspended = True
        self._notify()

    def append(self, event: str | None, data: str) -> None:
        """Add one event; its id is its position (1-based)."""
        item = {"id": str(len(self.events) + 1), "data": data}
        if event is not None:
            item["event"] = event
        self.events.append(item)
        self._notify()

    def finish(self) -> None:
        self.done = True
        self._notify()
        if self.readers == 0:
            self._schedule_expiry()

    def _notify(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def _schedule_expiry(self) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
        if self.window <= 0:
            self._expire()
        else:
            self._expiry = asyncio.get_running_loop().call_later(self.window, self._expire)

    def _expire(self) -> None:
        self._expiry = None
        if self.readers == 0 and not self.expired:
            self.expired = True
            self._on_expire(self)

    async def follow(self, after: int = 0) -> AsyncIterator[list[dict]]:
        """The events with id > `after`, then the rest live until the end event; each item is
        the list of events that were ready together (sent as one chunk)."""
        self.readers += 1
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None
        try:
            position = max(0, after)
            while True:
                if position < len(self.events):
                    batch = self.events[position:]
                    position += len(batch)
                    yield batch
                    continue
                if self.done or self.expired or self.suspended:
                    return
                await self._changed.wait()
        finally:
            self.readers -= 1
            if self.readers == 0:
                if not self.done and not self.suspended and not self.suspending and self._on_orphan is not None:
                    self._on_orphan(self)
                self._schedule_expiry()


class ResumeRegistry:
    """The resumable streams of a server by request id."""

    def __init__(self, window: float, abort: Callable[[str], object]):
        self.window = window
        self._abort = abort  # engine.abort
        self._streams: dict[str, ResumableStream] = {}

    def create(self, request_id: str, prompt_ids: list[int], params) -> ResumableStream:
        """The record of a new stream; `prompt_ids` and `params` let a reader who comes back continue it."""
        stream = ResumableStream(request_id, self.window, self._expire, self._orphan)
        stream.prompt_ids, stream.params = prompt_ids, params
        self._streams[request_id] = stream
        # If no reader ever attaches (the client left before the response started), the stream
        # still expires: after the window, or a short grace when resuming is off.
        loop = asyncio.get_running_loop()
        stream._expiry = loop.call_later(max(self.window, _FIRST_READER_GRACE_S), stream._expire)
        return stream

    def get(self, request_id: str) -> ResumableStream | None:
        stream = self._streams.get(request_id)
        if stream is None or stream.expired:
            return None
        return stream

    def __contains__(self, request_id: str) -> bool:
        return self.get(request_id) is not None

    def __len__(self) -> int:
        return len(self._streams)

    def _orphan(self, stream: ResumableStream) -> None:
        stream.suspending = True
        self._abort(stream.request_id)

    def _expire(self, stream: ResumableStream) -> None:
        self._streams.pop(stream.request_id, None)
        if not stream.done and not stream.suspended and not stream.suspending:
            self._abort(stream.request_id)  # nobody ever read it
        stream._notify()

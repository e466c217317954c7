"""Resumable `/chat` streams: the events of a request kept while its owner may come back for them.

A pump task reads the engine request and appends its SSE events to a `ResumableStream`,
independent of any HTTP connection. Readers follow the list from an event id.

With an engine that cannot continue a request from its output tokens (`continuable=False`: the
openai backend, whose remote does not return token ids), an abandoned stream keeps generating
instead, for the window at most, and a reader who comes back gets the rest as it comes.

When the last reader leaves an unfinished stream, the engine request is aborted at once (its KV
blocks are free within a step: nobody is reading) and the stream is *suspended*: its events
and the tokens generated so far are kept for `window` seconds. A reader who comes back in
time gets the events after its `Last-Event-ID`, and the request continues from its last
token: a new engine request whose prompt is the old prompt plus those tokens (recomputed,
like a preempted sequence), numbering its events on from the last id. Greedy output is the
same as without the interruption. After the window the record is dropped (404).

Ownership: a stream is found by its request id *and* its resume token, a random 192-bit
string given only to the client that started it (`x-resume-token`). The request id is a
label (the client may choose it, the server's own are a clock and a counter); it is never
enough. A lookup with an unknown id and one with a wrong or missing token both find nothing.

Bounds: at most `max_streams` records and `max_bytes` of what they hold (events, prompt and
output tokens, the sampling parameters' strings and lists: a constraint of up to 200,000
characters, stop strings, stop token ids; as estimated below). Past a bound the oldest finished stream nobody reads is
dropped first, then the oldest suspended one. A stream still generating is never cut: when
only such streams are left, the newest one (the one being created, or the one whose event
went past `max_bytes`) stops being resumable. Its reader keeps getting every event; the
events it has read are freed as it goes; its token stops working (404); if its reader
leaves, the request is aborted as with `--resume-window 0`. A stream created that way has
no token at all, so the client knows from the first response that it cannot resume.

Such a stream still counts what it holds: the events its reader has not read yet. A reader
that stops reading (and stays connected) would otherwise let them pile up without end; past
`backlog_limit(max_bytes)` the request is stopped, and the reader, if it reads on, gets the
events up to there, an error event saying why, and the end.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import secrets
import sys
import time
from collections.abc import AsyncIterator, Callable

_FIRST_READER_GRACE_S = 10.0  # how long a new stream waits for its first reader when the window is 0
_TOKEN_BYTES = 24  # the resume token's randomness: 192 bits
# What a record holds, in bytes of Python memory (measured with tracemalloc on CPython 3.11):
_EVENT_BYTES = 250  # one event dict and its id string, beside its data string (sys.getsizeof)
_TOKEN_ID_BYTES = 36  # one token id in a list (an int object and the list's pointer)
_RECORD_BYTES = 2048  # the record itself, its asyncio objects and its sampling parameters

DEFAULT_MAX_STREAMS = 1024
DEFAULT_MAX_BYTES = 64 * 2**20
MAX_BACKLOG_BYTES = 4 * 2**20  # unread events of a stream that is not resumable: ~13,000 tokens' worth


def new_resume_token() -> str:
    """A capability nobody can guess: 24 random bytes, URL-safe base64 (32 characters)."""
    return secrets.token_urlsafe(_TOKEN_BYTES)


def event_bytes(data: str) -> int:
    return _EVENT_BYTES + sys.getsizeof(data)


def params_bytes(params) -> int:
    """What a request's sampling parameters hold beyond `_RECORD_BYTES`: their strings (the constraint's
    schema, regex or grammar, the salt) and containers with what is in them (stop strings, stop token
    ids and their set). Walked without recursion; a number outside a container is in `_RECORD_BYTES`."""
    total, stack = 0, [(params, False)]
    while stack:
        value, contained = stack.pop()
        if isinstance(value, (str, bytes)):
            total += sys.getsizeof(value)
        elif isinstance(value, (tuple, list, set, frozenset)):
            total += sys.getsizeof(value)
            stack.extend((item, True) for item in value)
            stack.extend((extra, False) for extra in getattr(value, "__dict__", {}).values())  # TokenIds' set
        elif isinstance(value, (int, float)):
            total += sys.getsizeof(value) if contained else 0
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            stack.extend((getattr(value, f.name), False) for f in dataclasses.fields(value))
    return total


def backlog_limit(max_bytes: int) -> int:
    """The unread bytes a stream that is no longer resumable may hold before it is stopped."""
    return min(max_bytes, MAX_BACKLOG_BYTES)


def slow_reader_message(limit: int) -> str:
    return (f"The stream was stopped: its reader fell more than {limit} bytes of events behind (it stopped "
            "reading). Read the stream as it arrives, or send `\"stream\": false`.")


class ResumableStream:
    """The SSE events of one request (ids 1, 2, ...) and who follows them."""

    def __init__(self, request_id: str, window: float, on_expire: Callable[["ResumableStream"], None],
                 on_orphan: Callable[["ResumableStream"], None] | None = None,
                 on_grow: Callable[["ResumableStream", int], None] | None = None):
        self.request_id = request_id  # the label in the URL; not a secret
        self.token: str | None = None  # the resume token; None once the stream cannot be resumed
        self.window = window  # seconds it stays resumable with nobody reading
        self.events: list[dict] = []  # event dicts for server/sse.py; events[k-1-dropped] has id k
        self.dropped = 0  # events freed from the front (only once the stream is not resumable)
        self.nbytes = 0  # the estimated memory it holds (see the module docstring); unread events once not resumable
        self.backlog_limit: int | None = None  # once not resumable: the most `nbytes` may reach (then: stopped)
        self.stop_error: str | None = None  # why the server stopped the request, for the reader's error event
        self._on_backlog: Callable[["ResumableStream"], None] | None = None  # called once past backlog_limit
        self.done = False  # the last event (end) is in `events`
        self.readers = 0  # connections following the stream now
        self.created = time.monotonic()
        self._changed = asyncio.Event()  # set (and replaced) whenever events or done change
        self._on_expire = on_expire
        self._on_orphan = on_orphan  # the last reader left an unfinished stream
        self._on_grow = on_grow  # the registry's byte count
        self._expiry: asyncio.TimerHandle | None = None
        self._positions: dict[object, int] = {}  # reader -> events it has been given (by id)
        self.expired = False
        # what a continuation needs, and where the generation stands
        self.prompt_ids: list[int] = []
        self.params = None
        self.images = None  # the prompt's PromptImages (a vision-language model): a continuation brings them again
        self.output_ids: list[int] = []  # tokens generated so far
        self.suspending = False  # the engine request is being aborted because nobody reads it
        self.suspended = False  # it was: a reader who comes back continues it
        self.pump: asyncio.Task | None = None  # the task reading the engine request now
        self.engine_request_id: str | None = None  # the engine's id of that request (never the label)
        self.model: str | None = None  # the model it runs on (a continuation runs on it too); None: the default

    @property
    def resumable(self) -> bool:
        return self.token is not None

    @property
    def idle(self) -> bool:
        """Nobody reads it and nothing generates for it: the registry may drop it."""
        return self.readers == 0 and (self.done or self.suspended) and not self.suspending

    @property
    def num_events(self) -> int:
        return self.dropped + len(self.events)

    def suspend(self) -> None:
        """The pump saw the abort of a `suspending` stream: wait for a reader to continue it."""
        self.suspending = False
        self.suspended = True
        self._notify()

    def append(self, event: str | None, data: str) -> None:
        """Add one event; its id is its position (1-based)."""
        item = {"id": str(self.num_events + 1), "data": data}
        if event is not None:
            item["event"] = event
        self.events.append(item)
        self._grow(event_bytes(data))
        if (self.backlog_limit is not None and self.nbytes > self.backlog_limit and self.stop_error is None
                and self._on_backlog is not None):
            self._on_backlog(self)
        self._notify()

    def add_output(self, token_ids: list[int]) -> None:
        """Tokens generated: a continuation recomputes them (kept only while it can be resumed)."""
        if not self.resumable:
            return
        self.output_ids.extend(token_ids)
        self._grow(_TOKEN_ID_BYTES * len(token_ids))

    def _grow(self, nbytes: int) -> None:
        self.nbytes += nbytes
        if self._on_grow is not None:
            self._on_grow(self, nbytes)

    def make_unresumable(self, backlog_limit: int, on_backlog: Callable[["ResumableStream"], None]) -> None:
        """Forget the token and free what the readers have read; from now on `nbytes` counts the
        unread events, and `on_backlog` is called once they pass `backlog_limit`."""
        self.token = None
        self._on_grow = None
        self.prompt_ids, self.output_ids = [], []
        self.backlog_limit, self._on_backlog = backlog_limit, on_backlog
        self._free_read_events()
        self.nbytes = sum(event_bytes(item["data"]) for item in self.events)

    def _free_read_events(self) -> None:
        """Once nobody can come back for them: free the events every reader present has read
        (none while no reader is there: the first one may not have attached yet)."""
        if self.resumable or not self._positions:
            return
        low = min(self._positions.values())
        if low > self.dropped:
            read = self.events[: low - self.dropped]
            self.nbytes -= sum(event_bytes(item["data"]) for item in read)
            del self.events[: low - self.dropped]
            self.dropped = low

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
        if self.window <= 0 or not self.resumable:
            self._expire()
        else:
            self._expiry = asyncio.get_running_loop().call_later(self.window, self._expire)

    def await_first_reader(self) -> None:
        """Generation (re)starts before its reader attaches: expire only if none comes within
        the window, or a short grace when resuming is off (the window's own timer is replaced)."""
        self.cancel_expiry()
        self._expiry = asyncio.get_running_loop().call_later(max(self.window, _FIRST_READER_GRACE_S), self._expire)

    def cancel_expiry(self) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None

    def _expire(self) -> None:
        self._expiry = None
        if self.readers == 0 and not self.expired:
            self.expired = True
            self._on_expire(self)

    async def follow(self, after: int = 0) -> AsyncIterator[list[dict]]:
        """The events with id > `after`, then the rest live until the end event; each item is
        the list of events that were ready together (sent as one chunk)."""
        self.readers += 1
        reader = object()
        self.cancel_expiry()
        try:
            position = max(0, after, self.dropped)
            self._positions[reader] = position
            while True:
                if position < self.num_events:
                    batch = self.events[position - self.dropped:]
                    position += len(batch)
                    self._positions[reader] = position
                    yield batch
                    self._free_read_events()
                    continue
                if self.done or self.expired or self.suspended:
                    return
                await self._changed.wait()
        finally:
            self._positions.pop(reader, None)
            self.readers -= 1
            if self.readers == 0:
                if not self.done and not self.suspended and not self.suspending and self._on_orphan is not None:
                    self._on_orphan(self)
                self._schedule_expiry()


class ResumeRegistry:
    """The resumable streams of a server, found by request id and resume token, within bounds."""

    def __init__(self, window: float, abort: Callable[[str], object], max_streams: int = DEFAULT_MAX_STREAMS,
                 max_bytes: int = DEFAULT_MAX_BYTES, continuable: bool = True):
        self.window = window
        # False when the engine cannot continue a request from its output tokens (a remote OpenAI
        # server): an abandoned stream then keeps generating for the window instead of suspending.
        self.continuable = continuable
        self.max_streams = max_streams
        self.max_bytes = max_bytes
        self._abort = abort  # engine.abort
        self._streams: dict[str, ResumableStream] = {}  # token -> stream, oldest first
        self._by_id: dict[str, list[ResumableStream]] = {}  # request id -> its streams (labels may repeat)
        self.nbytes = 0  # what the registered streams hold, estimated

    def create(self, request_id: str, prompt_ids: list[int], params) -> ResumableStream:
        """The record of a new stream; `prompt_ids` and `params` let a reader who comes back continue it.
        Its `token` is None when the bounds leave no room for it (see the module docstring)."""
        stream = ResumableStream(request_id, self.window, self._expire, self._orphan)
        stream.prompt_ids, stream.params = prompt_ids, params
        stream.nbytes = _RECORD_BYTES + _TOKEN_ID_BYTES * len(prompt_ids) + params_bytes(params)
        self._make_room(extra_streams=1, extra_bytes=stream.nbytes)
        if len(self._streams) < self.max_streams and self.nbytes + stream.nbytes <= self.max_bytes:
            stream.token = new_resume_token()
            stream._on_grow = self._grown
            self._streams[stream.token] = stream
            self._by_id.setdefault(request_id, []).append(stream)
            self.nbytes += stream.nbytes
        else:
            stream.make_unresumable(backlog_limit(self.max_bytes), self._backlog_full)
        # If no reader ever attaches (the client left before the response started), the stream
        # still expires: after the window, or a short grace when resuming is off.
        stream.await_first_reader()
        return stream

    def lookup(self, request_id: str, token: str | None) -> ResumableStream | None:
        """The stream with this id whose token is `token`, else None (whichever part was wrong)."""
        given = (token or "").encode()
        found = None
        candidates = self._by_id.get(request_id) or ()
        for stream in candidates:
            if stream.token is not None and hmac.compare_digest(given, stream.token.encode()) and not stream.expired:
                found = stream
        if not candidates:  # the same work as a wrong token, so the time says nothing either
            hmac.compare_digest(given, b"\0" * 32)
        return found

    def __len__(self) -> int:
        return len(self._streams)

    def _grown(self, stream: ResumableStream, nbytes: int) -> None:
        self.nbytes += nbytes
        if self.nbytes > self.max_bytes:
            self._make_room(keep=stream)
            if self.nbytes > self.max_bytes:  # only live streams left: this one stops being resumable
                self._forget(stream)
                stream.make_unresumable(backlog_limit(self.max_bytes), self._backlog_full)

    def _make_room(self, extra_streams: int = 0, extra_bytes: int = 0, keep: ResumableStream | None = None) -> None:
        """Drop idle streams, finished ones oldest first, then suspended ones, until the bounds hold."""
        def over() -> bool:
            return (len(self._streams) + extra_streams > self.max_streams
                    or self.nbytes + extra_bytes > self.max_bytes)

        if not over():
            return
        for finished_pass in (True, False):
            for stream in list(self._streams.values()):
                if not over():
                    return
                if stream is keep or not stream.idle or stream.done != finished_pass:
                    continue
                stream.cancel_expiry()
                stream.expired = True
                self._forget(stream)
                stream._notify()

    def _forget(self, stream: ResumableStream) -> None:
        if stream.token is None or self._streams.pop(stream.token, None) is None:
            return
        self.nbytes -= stream.nbytes
        same = self._by_id.get(stream.request_id, [])
        if stream in same:
            same.remove(stream)
        if not same:
            self._by_id.pop(stream.request_id, None)

    def _orphan(self, stream: ResumableStream) -> None:
        if stream.resumable and not self.continuable:
            return  # it generates on for the window; `_expire` aborts it if nobody came back
        if stream.resumable:
            stream.suspending = True  # kept (for the window): its owner may come back
        self._abort_engine_request(stream)

    def _expire(self, stream: ResumableStream) -> None:
        self._forget(stream)
        if not stream.done and not stream.suspended and not stream.suspending:
            self._abort_engine_request(stream)  # nobody ever read it
        stream._notify()

    def _backlog_full(self, stream: ResumableStream) -> None:
        """A stream nobody can resume holds too many unread events: stop its request (the pump
        then ends the stream with `stop_error`)."""
        stream.stop_error = slow_reader_message(stream.backlog_limit)
        self._abort_engine_request(stream)

    def _abort_engine_request(self, stream: ResumableStream) -> None:
        if stream.engine_request_id is not None:
            self._abort(stream.engine_request_id)

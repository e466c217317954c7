"""What a consumer reads: one request's deltas, in order.

Outputs reach a stream from the engine thread (`engine.async_engine`) through the event loop the
stream was made in (`loop.call_soon_threadsafe`, one hand-over per step and loop).
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import AsyncIterator, Protocol

from engine.request import RequestOutput


class Aborts(Protocol):
    """What a stream asks of the engine that feeds it (the local engine, or a remote backend's relay)."""

    def abort(self, request_id: str) -> bool: ...


class RequestStream:
    """The deltas of one request (all `n` samples), in order; iterate with `async for`.

    Made inside an event loop (RuntimeError outside one), it is fed on that loop: the engine thread
    hands each step's outputs for one loop over in one `call_soon_threadsafe` (`deliver_batch`).
    """

    def __init__(self, engine: Aborts, request_id: str, n: int):
        try:
            self._loop = asyncio.get_running_loop()
        except RuntimeError:
            raise RuntimeError("A request stream is read in an event loop: add the request from one.") from None
        self.engine = engine
        self.request_id = request_id
        self.unfinished = set(range(n))  # samples still running (the engine thread removes them)
        self._items: deque[RequestOutput] = deque()  # event-loop side
        self._waiter: asyncio.Future | None = None
        self._remaining = n

    def _on_output(self, out: RequestOutput) -> None:  # engine thread (the dispatch batches them per loop)
        self._loop.call_soon_threadsafe(self._put, out)

    def _put(self, out: RequestOutput) -> None:  # event loop
        self._items.append(out)
        self.wake()

    async def next(self) -> RequestOutput | None:
        """The next delta; None once every sample finished, or when `wake()` came first."""
        if not self._items:
            if not self._remaining:
                return None
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
            if not self._items:
                return None
        out = self._items.popleft()
        self._remaining -= out.finished
        return out

    def wake(self) -> None:
        """Ends a pending `next()` (with None if nothing arrived: a reader's periodic check)."""
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    @property
    def done(self) -> bool:
        return not self._remaining and not self._items

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while not self.done:
            out = await self.next()
            if out is not None:
                yield out

    async def until_done(self) -> AsyncIterator[RequestOutput]:
        """Like `async for`, but the request is aborted if the consumer leaves before its end."""
        finished = False
        try:
            async for out in self:
                yield out
            finished = True
        finally:
            if not finished:
                self.abort()

    def abort(self) -> bool:
        return self.engine.abort(self.request_id)


def deliver_batch(batch: list[tuple[RequestStream, RequestOutput]]) -> None:
    """Hands a batch of outputs to their streams (on the streams' event loop: one callback per batch)."""
    for stream, out in batch:
        stream._put(out)

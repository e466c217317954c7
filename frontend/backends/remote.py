"""What the ray and openai backends share: requests relayed from an engine elsewhere.

The front keeps the tokenizer and everything else a route needs; a request's outputs come from
another process. One thread runs an event loop of its own (`rill-<backend>`): a pump task per
request reads the remote stream there and hands each batch of `RequestOutput`s to the request's
consumer exactly as the local engine thread does (its `RequestStream`, through its event loop),
so the routes and the page read the same objects whichever backend runs.

A subclass gives `_open(...)`: an async generator that yields `Admitted` once the engine took
the request (or raises `Refused`), then lists of `RequestOutput`, and stops the remote request
when it is closed early. Times in the outputs are the remote's clock; the pump rewrites them to
this process's `time.monotonic()` (arrival here, the remote's queue time added, first token when
it arrived here), so TTFT and queue time in /metrics mean what they mean for the local engine.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

from engine.async_engine import EngineNotRunning
from engine.chat_template import encode_chat
from engine.core import EngineStats
from engine.request import FinishReason, InvalidRequest, QueueFull, RequestOutput, SamplingParams, new_request_id
from engine.streams import RequestStream, deliver_batch

log = logging.getLogger("rill.backend")


@dataclass(frozen=True, slots=True)
class Admitted:
    """The remote took the request; `replica` names the engine that runs it."""

    replica: str = ""


class Refused(Exception):
    """The remote did not take the request: `kind` is invalid (400), queue_full (429) or unavailable (503)."""

    def __init__(self, kind: str, message: str, param: str | None = None):
        super().__init__(message)
        self.kind, self.message, self.param = kind, message, param

    def as_engine_error(self) -> Exception:
        if self.kind == "invalid":
            return InvalidRequest(self.message, self.param)
        if self.kind == "queue_full":
            return QueueFull(self.message)
        return EngineNotRunning(self.message)


@dataclass(slots=True)
class _Relay:
    """One request being relayed: its consumer and where it stands."""

    request_id: str
    sink: RequestStream  # the consumer's side
    n: int
    num_prompt_tokens: int
    arrival_time: float  # time.monotonic() here, when add_request was called
    admission: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    task: concurrent.futures.Future | None = None  # the pump (on the backend's loop)
    unfinished: set = field(default_factory=set)  # sample indices not yet finished
    num_output_tokens: dict = field(default_factory=dict)  # index -> tokens so far
    first_token_time: float | None = None  # here
    replica: str = ""


def aggregate_stats(entries: list[dict]) -> EngineStats:
    """EngineStats of several engines together (sums; KV usage from the summed blocks)."""
    total = EngineStats(num_running=0, num_waiting=0, kv_usage=0.0, num_kv_blocks=0, num_free_kv_blocks=0,
                        num_preemptions=0, prompt_tokens_total=0, generation_tokens_total=0, num_steps=0)
    for stats in entries:
        for name in ("num_running", "num_waiting", "num_kv_blocks", "num_free_kv_blocks", "num_preemptions",
                     "prompt_tokens_total", "generation_tokens_total", "num_steps", "prefix_cache_queried_tokens",
                     "prefix_cache_hit_tokens", "spec_draft_tokens", "spec_accepted_tokens"):
            setattr(total, name, getattr(total, name) + int(stats.get(name, 0) or 0))
        for reason, count in (stats.get("finished_total") or {}).items():
            total.finished_total[reason] = total.finished_total.get(reason, 0) + int(count)
    if total.num_kv_blocks:
        total.kv_usage = (total.num_kv_blocks - total.num_free_kv_blocks) / total.num_kv_blocks
    return total


class RemoteEngine:
    """The engine-client interface (frontend.backends.EngineClient) over a remote stream per request."""

    backend = "remote"
    continuable = False  # a subclass that gets output token ids back can continue a request
    attention_path = "remote"
    think_tags = None  # the remote's text arrives as it is: no thought is parsed out here
    vision = None  # no images through a remote backend (the front would have to send pixels)
    grammars = None  # a constraint is compiled where the engine runs
    generation_config = None  # no model is loaded here (sampling defaults come from the tokenizer's folder)
    kv_cache_tokens = None

    def __init__(self, *, model_name: str, max_model_len: int, tokenizer):
        self.model_name = model_name
        self.max_model_len = int(max_model_len)
        self.tokenizer = tokenizer
        self.on_fatal = None  # app.py sets it; a remote engine's death is the remote's to handle
        self._relays: dict[str, _Relay] = {}
        self._lock = threading.Lock()
        self._stopping = False
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=f"rill-{self.backend}", daemon=True)
        self._thread.start()

    # ---- what a subclass gives ------------------------------------------------------------

    def _open(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
              prior_output_ids: list[int], session: str | None) -> AsyncIterator:
        raise NotImplementedError

    @property
    def alive(self) -> bool:
        raise NotImplementedError

    def unavailable_reason(self) -> str:
        raise NotImplementedError

    def failure_message(self, exc: BaseException) -> str:
        """The sentence a consumer gets when its stream broke with `exc` (no exception text)."""
        return "The connection to the engine broke off; send the request again."

    def stats(self) -> EngineStats:
        return aggregate_stats([entry["engine"] for entry in self.replica_stats() if entry.get("engine")])

    def replica_stats(self) -> list[dict]:
        return []

    def health_info(self) -> dict:
        return {"backend": self.backend}

    # ---- the engine-client interface ------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None,
                    **template_kwargs) -> list[int]:
        return encode_chat(self.tokenizer, messages, add_generation_prompt, tools, **template_kwargs)

    def check_prompt(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """The engine behind checks the prompt against its context, vocabulary and KV cache when
        it admits the request (its 400 comes back from `wait_admitted`); nothing to check here."""

    def compile_constraint(self, params: SamplingParams) -> None:
        """The engine behind compiles a constraint when it admits the request; nothing to do here."""

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None,
                    prior_output_ids: list[int] = (), session: str | None = None,
                    client: str | None = None) -> RequestStream:
        """`client` is taken and ignored: the engine behind shares itself between its own callers
        (this front is one of them), so the local engine's fair shares do not reach through."""
        return self._admit(prompt_token_ids, params, request_id, lambda rid: RequestStream(self, rid, params.n),
                           prior_output_ids, session)

    async def wait_admitted(self, stream, timeout: float | None = None) -> None:
        """Raises the remote's refusal; TimeoutError after `timeout` s (the request is aborted)."""
        try:
            await asyncio.wait_for(asyncio.wrap_future(stream._admission), timeout)
        except (asyncio.TimeoutError, asyncio.CancelledError):
            self.abort(stream.request_id)
            raise

    def abort(self, request_id: str) -> bool:
        """Stop relaying and stop the remote request (its KV blocks are freed there); the consumer
        gets its ABORT end. False if the request is unknown or already done."""
        with self._lock:
            relay = self._relays.get(request_id)
        if relay is None or relay.task is None or relay.task.done():
            return False
        relay.task.cancel()  # thread-safe: cancels the pump task on the backend's loop
        return True

    def inject_fault(self, request_id: str) -> bool:
        return False  # the test hook reaches only an engine in this process

    def shutdown(self, timeout: float | None = 5.0) -> None:
        self._stopping = True
        with self._lock:
            relays = list(self._relays.values())
        for relay in relays:
            if relay.task is not None:
                relay.task.cancel()
        self._close()
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout)

    def _close(self) -> None:
        """A subclass's own teardown (before the loop stops)."""

    # ---- relaying -------------------------------------------------------------------------

    def _admit(self, prompt_token_ids, params: SamplingParams, request_id, sink_factory, prior_output_ids,
               session):
        if self._stopping:
            raise EngineNotRunning("The server is shutting down; it takes no new requests.")
        if not self.alive:
            raise EngineNotRunning(self.unavailable_reason())
        request_id = request_id or new_request_id()
        sink = sink_factory(request_id)
        relay = _Relay(request_id, sink, params.n, len(prompt_token_ids), time.monotonic(),
                       unfinished=set(range(params.n)))
        sink._admission = relay.admission
        with self._lock:
            if request_id in self._relays:
                raise InvalidRequest(f"Request id {request_id!r} is already in use.", "request_id")
            self._relays[request_id] = relay
        relay.task = asyncio.run_coroutine_threadsafe(
            self._pump(relay, list(prompt_token_ids), params, list(prior_output_ids), session), self.loop)
        return sink

    async def _pump(self, relay: _Relay, prompt_token_ids, params, prior_output_ids, session) -> None:
        stream = self._open(relay.request_id, prompt_token_ids, params, prior_output_ids, session)
        try:
            async for item in stream:
                if isinstance(item, Admitted):
                    relay.replica = item.replica
                    relay.admission.set_result(item)
                    continue
                self._deliver(relay, item)
                if not relay.unfinished:
                    break
            if relay.unfinished:
                raise ConnectionError("the remote stream ended before the request finished")
        except asyncio.CancelledError:  # abort(): the consumer gets its end now
            self._refuse(relay, EngineNotRunning("The request was aborted before the engine took it."))
            self._end(relay, FinishReason.ABORT, None)
        except Refused as refusal:
            self._refuse(relay, refusal.as_engine_error())
            self._end(relay, FinishReason.ERROR, refusal.message)
        except Exception as exc:  # noqa: BLE001 - the replica died, the remote went away, a bad answer
            message = self.failure_message(exc)
            log.warning("request %s: %s (%s: %s)", relay.request_id, message, type(exc).__name__, exc)
            self._refuse(relay, EngineNotRunning(message))
            self._end(relay, FinishReason.ERROR, message)
        finally:
            with self._lock:
                self._relays.pop(relay.request_id, None)
            try:
                await stream.aclose()  # stops the remote request if it still runs
            except Exception:  # noqa: BLE001 - the remote is gone already
                log.debug("closing the stream of %s failed", relay.request_id, exc_info=True)

    def _deliver(self, relay: _Relay, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        for out in outputs:
            if out.scheduled_time is not None:  # the remote's queue time, on this clock
                out.scheduled_time = relay.arrival_time + max(0.0, out.scheduled_time - out.arrival_time)
            out.arrival_time = relay.arrival_time
            if out.token_ids and relay.first_token_time is None:
                relay.first_token_time = now
            out.first_token_time = relay.first_token_time
            relay.num_output_tokens[out.index] = out.num_output_tokens
            if out.finished:
                relay.unfinished.discard(out.index)
        self._hand_over(relay, outputs)

    def _end(self, relay: _Relay, reason: FinishReason, error: str | None) -> None:
        """Finish every sample still running, for a consumer that must always see an end."""
        outputs = [RequestOutput(relay.request_id, index, [], "", finished=True, finish_reason=reason, error=error,
                                 num_prompt_tokens=relay.num_prompt_tokens,
                                 num_output_tokens=relay.num_output_tokens.get(index, 0),
                                 arrival_time=relay.arrival_time, first_token_time=relay.first_token_time)
                   for index in sorted(relay.unfinished)]
        relay.unfinished.clear()
        if outputs:
            self._hand_over(relay, outputs)

    @staticmethod
    def _refuse(relay: _Relay, exc: Exception) -> None:
        if not relay.admission.done():
            relay.admission.set_exception(exc)

    @staticmethod
    def _hand_over(relay: _Relay, outputs: list[RequestOutput]) -> None:
        sink = relay.sink
        try:
            sink._loop.call_soon_threadsafe(deliver_batch, [(sink, out) for out in outputs])
        except RuntimeError:  # the consumer's event loop is closed: nobody reads this request
            if relay.task is not None:
                relay.task.cancel()

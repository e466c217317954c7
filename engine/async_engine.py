"""The engine thread behind the server.

One thread owns the model and runs `EngineCore.step()` in a loop. Other threads (the event
loop of the HTTP routes and the page) only enqueue commands (add, abort) and read their
request's outputs from a `RequestStream` the engine thread fills through its event loop
(`loop.call_soon_threadsafe`, one hand-over per step and loop).

Faults. `EngineCore.step()` fails only the requests a fault concerns. A fault that escapes it
(or output dispatch) leaves the core's state unknown, so the engine "dies": every consumer gets
an error end at once, then the thread rebuilds the core from the loaded model (no reload; a few
seconds at most; the same number of KV blocks) and serves again. A forward that fails for every
sequence several steps in a row is such a fault too (`core.ModelBroken`). Rebuilding in the process keeps the weights in memory and the
page's visitors connected, where a process restart would reload the model for minutes. A fault
that comes back is not fixed by rebuilding (a broken device, a corrupt model): past
`config.max_restarts` deaths within `RESTART_WINDOW_S`, or when the rebuild itself fails, the
engine stays dead and calls `on_fatal`, with which app.py ends the process with status 1 for the
Space or supervisor to start it afresh.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections import deque
from typing import AsyncIterator

from engine.chat_template import encode_chat
from engine.config import EngineConfig
from engine.core import EngineCore, EngineStats
from engine.fair_share import AdmissionShares
from engine.host import in_passing_thread
from engine.request import (
    FinishReason,
    InvalidRequest,
    QueueFull,
    RequestOutput,
    SamplingParams,
    new_request_id,
)
from engine.streams import RequestStream, deliver_batch

log = logging.getLogger("rill.engine")

RESTART_WINDOW_S = 600.0  # deaths older than this no longer count against config.max_restarts
FAIR_SHARE_CAP = 2  # past max_num_seqs + max_queue, clients under their fair share are admitted up to this many times it


class EngineNotRunning(RuntimeError):
    """The engine thread is not serving (stopped, dead, or rebuilding after a fault): 503."""


class AsyncEngine:
    """The engine behind the server: a thread that steps `EngineCore` while there is work.

    Thread-safe entry points: `add_request` (from an event loop), `abort`, `inject_fault`, `stats`.
    Every admitted request ends exactly once for its consumer (its last output has
    `finished=True`), also when the engine dies; see the module docstring.
    """

    def __init__(self, loaded, config: EngineConfig | None = None, draft=None):
        self.loaded = loaded
        self.draft = draft  # the loaded draft model of speculative="draft" (engine/draft.py), kept across rebuilds
        self.config = config or EngineConfig()
        self.tokenizer = loaded.tokenizer
        self.model_name = loaded.name
        # built in a passing thread, like load_model's work (engine/host.py, in_passing_thread)
        self.core = in_passing_thread(EngineCore, loaded.model, loaded.tokenizer, self.config, loaded.context_length,
                                      draft=draft, vision=loaded.vision)
        self.max_model_len = self.core.max_model_len
        self.attention_path = self.core.attention_path
        self.grammars = self.core.grammars  # compiles constraints off the engine thread (engine/grammar.py)
        self.grammars.waits = False  # the engine thread never waits for one (see `_admit`)
        self.think_tags = self.core.think_tags  # None unless the model thinks between <think> tags
        self.vision = self.core.vision  # engine.model.vision.ImageEncoder when the model takes images, else None
        self._commands: deque = deque()  # callables run by the engine thread before its next step
        self._wakeup = threading.Event()
        self._lock = threading.Lock()
        self._sinks: dict[str, RequestStream] = {}  # request_id -> where its outputs go
        self._compiling: set[str] = set()  # admitted, added to the core once their constraint compiled
        self._shares = AdmissionShares()  # sequences added and not finished (running + waiting + pending), per client
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.dead: BaseException | None = None  # why the engine died, while it is dead or rebuilding
        self.on_fatal = None  # called with the exception, from the engine thread, when it stays dead
        self.num_restarts = 0  # core rebuilds after a death
        self._deaths: list[float] = []  # time.monotonic() of recent deaths (see RESTART_WINDOW_S)
        self._busy_since: float | None = None  # time.monotonic() when the current step or command began

    # ---- lifecycle ------------------------------------------------------------------------

    def start(self) -> "AsyncEngine":
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="rill-engine", daemon=True)
            self._thread.start()
        return self

    def shutdown(self, timeout: float | None = 5.0) -> None:
        self._stopping = True
        self._wakeup.set()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.dead is None and not self.stalled

    @property
    def busy_s(self) -> float:
        """How long the engine thread has been inside its current step (or command); 0 when idle."""
        since = self._busy_since
        return 0.0 if since is None else time.monotonic() - since

    @property
    def stalled(self) -> bool:
        """Inside one step for longer than `config.stall_timeout_s`: stuck (a deadlock, a hung
        kernel). Not alive meanwhile: /health answers 503, new requests are refused and waiting
        ones end with an error instead of hanging; alive again if the step ever returns."""
        limit = self.config.stall_timeout_s
        return limit > 0 and self.busy_s > limit

    # ---- requests -------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None,
                    **template_kwargs) -> list[int]:
        return encode_chat(self.tokenizer, messages, add_generation_prompt, tools, **template_kwargs)

    def check_prompt(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.core.check_prompt(prompt_token_ids, params)

    def compile_constraint(self, params: SamplingParams) -> None:
        """Blocking (call it off the event loop, before add_request): compiles the request's constraint
        into the cache the engine thread reads, so that admitting it costs the batch nothing; raises
        InvalidRequest when it does not compile (within the compile timeout)."""
        if params.constraint is not None:
            self.grammars.compile(params.constraint)

    def _not_running(self) -> EngineNotRunning | None:
        if self._stopping:
            return EngineNotRunning("The engine is shutting down; it takes no new requests.")
        if self.dead is not None:
            return EngineNotRunning("The engine is not running: it stopped after an internal error "
                                    "and restarts if it can. Retry in a moment.")
        return None

    def _admit(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None, sink_factory,
               prior_output_ids: list[int] = (), client=None, images=None):
        if (error := self._not_running()) is not None:
            raise error
        self.core.check_prompt(prompt_token_ids, params, prior_output_ids)
        request_id = request_id or new_request_id()
        sink = sink_factory(request_id)  # before anything is counted: it may raise
        capacity = self.config.max_num_seqs + self.config.max_queue
        prior = list(prior_output_ids)
        # A constraint the route did not compile first (the Ray replica, a resume after the cache dropped
        # it): compiled in the compiler's workers, the request added to the core once it is; the engine
        # thread never waits for a grammar. QueueFull (429) when too many compile.
        compiled = self.grammars.submit(params.constraint) if params.constraint is not None else None
        with self._lock:  # the death of the engine takes this lock: no sink is registered after it
            if (error := self._not_running()) is not None:
                raise error
            if request_id in self._sinks:
                raise InvalidRequest(f"Request id {request_id!r} is already in use.", "request_id")
            if not self._shares.admits(client, params.n, capacity, FAIR_SHARE_CAP * capacity):
                raise QueueFull(f"The server is at capacity ({self.config.max_num_seqs} running and "
                                f"{self.config.max_queue} waiting){self._shares.why_not(client, capacity)}. "
                                "Retry in a moment.")
            self._shares.add(request_id, client, params.n)
            self._sinks[request_id] = sink
            add = lambda: self._add(request_id, list(prompt_token_ids), params, prior, client, images)  # noqa: E731
            if compiled is None or compiled.done():
                self._commands.append(add)
            else:
                self._compiling.add(request_id)
        if compiled is not None and request_id in self._compiling:
            compiled.add_done_callback(lambda _: self._compiled(request_id, add))
        self._wakeup.set()
        return sink

    def _compiled(self, request_id: str, add) -> None:
        """A compiler worker: the constraint of a waiting request is compiled (or failed: the core's add
        then ends it with the reason); unless it was aborted or the engine died meanwhile, add it."""
        with self._lock:
            if request_id not in self._compiling:
                return
            self._compiling.discard(request_id)
            self._commands.append(add)
        self._wakeup.set()

    def _add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, prior: list[int],
             client=None, images=None) -> None:
        """Engine thread: a request the core refuses ends for its consumer with the reason."""
        if params.constraint is not None and not self.grammars.cached(params.constraint):
            # compiled, then dropped from the cache before its turn came: compile it again, off this thread
            try:
                compiled = self.grammars.submit(params.constraint)
            except QueueFull as exc:
                return self._dispatch([RequestOutput(request_id, index, [], "", finished=True,
                                                     finish_reason=FinishReason.ERROR, error=str(exc))
                                       for index in range(params.n)])
            with self._lock:
                self._compiling.add(request_id)
            compiled.add_done_callback(
                lambda _: self._compiled(request_id, lambda: self._add(request_id, prompt_token_ids, params, prior,
                                                                       client, images)))
            return None
        try:
            self.core.add_request(request_id, prompt_token_ids, params, prior, client, checked=True, images=images)
        except Exception as exc:
            log.error("adding %s failed", request_id, exc_info=exc)
            error = str(exc) if isinstance(exc, InvalidRequest) else (
                "The engine failed while adding this request; the server log has the details.")
            self._dispatch([RequestOutput(request_id, index, [], "", finished=True, finish_reason=FinishReason.ERROR,
                                          error=error) for index in range(params.n)])

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams,
                    request_id: str | None = None, prior_output_ids: list[int] = (), client=None,
                    images=None) -> RequestStream:
        """Queue a request; raises InvalidRequest (400) or QueueFull (429). `prior_output_ids`:
        continue from output already produced (see `EngineCore.add_request`). `client`: who sends it,
        for fair shares of a full engine (engine/fair_share.py); None: the one anonymous client.
        `images`: the prompt's `PromptImages` from `vision.prepare` (engine/model/vision.py)."""
        if images is not None and self.vision is None:
            raise InvalidRequest("This model takes text only: a request with images cannot be served.", "messages")
        return self._admit(prompt_token_ids, params, request_id, lambda rid: RequestStream(self, rid, params.n),
                           prior_output_ids, client, images)

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Add a request and yield its deltas; aborts it if the consumer goes away first."""
        stream = self.add_request(prompt_token_ids, params, request_id)
        async for out in stream.until_done():
            yield out

    def abort(self, request_id: str) -> bool:
        """End a request; its KV blocks are freed before the next step. False if unknown or done."""
        with self._lock:
            if request_id not in self._sinks:
                return False
            if request_id in self._compiling:  # not in the core yet: it ends here, and is never added
                self._compiling.discard(request_id)
                indices = sorted(self._sinks[request_id].unfinished)
                self._commands.append(lambda: self._dispatch([
                    RequestOutput(request_id, index, [], "", finished=True, finish_reason=FinishReason.ABORT)
                    for index in indices]))
            else:
                self._commands.append(lambda: self._dispatch(self.core.abort(request_id)))
        self._wakeup.set()
        return True

    def inject_fault(self, request_id: str) -> bool:
        """Test hook: the next forward that includes this request raises; only it fails."""
        with self._lock:
            if request_id not in self._sinks:
                return False
            self._commands.append(lambda: self.core.inject_fault(request_id))
        self._wakeup.set()
        return True

    def stats(self) -> EngineStats:
        core = self.core.stats()
        pending = max(0, self._shares.total - core.num_running - core.num_waiting)  # adds not yet applied
        core.num_waiting += pending
        return core

    # ---- the engine thread ----------------------------------------------------------------

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}  # one hand-over per consumers' event loop
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if sink is None:
                continue
            by_loop.setdefault(sink._loop, []).append((sink, out))
            if out.finished:
                sink.unfinished.discard(out.index)
                with self._lock:
                    self._shares.release(out.request_id, last=not sink.unfinished)
                    if not sink.unfinished:
                        del self._sinks[out.request_id]
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(deliver_batch, batch)
            except RuntimeError:  # that event loop is closed: its requests have nobody to read them
                for stream, out in batch:
                    if not out.finished:
                        self._commands.append(lambda rid=stream.request_id: self._dispatch(self.core.abort(rid)))

    def _run_commands(self) -> None:
        while self._commands:
            command = self._commands.popleft()
            try:
                command()
            except Exception:  # a bad add must not kill the loop; the request was checked before
                log.exception("engine command failed")

    def _serve(self) -> None:
        while not self._stopping:
            self._busy_since = time.monotonic()
            self._run_commands()
            if not self.core.has_work():
                self._busy_since = None
                self._wakeup.wait(0.5)
                self._wakeup.clear()
                continue
            self._dispatch(self.core.step())

    def _run(self) -> None:
        while True:
            try:
                self._serve()
                return
            except BaseException as exc:  # noqa: BLE001 - a fault escaped the step: the core is unknown
                log.error("the engine loop died", exc_info=exc)
                self._fail_all(exc.with_traceback(None))  # no frame keeps the old KV cache alive
            if not (isinstance(self.dead, Exception) and self._restart()):
                break
        if self.on_fatal is not None:
            try:
                self.on_fatal(self.dead)
            except Exception:
                log.exception("on_fatal failed")

    def _fail_all(self, exc: BaseException) -> None:
        """The engine died: refuse new requests, and end every admitted one with an error."""
        with self._lock:
            self.dead = exc
            sinks = list(self._sinks.items())
            self._sinks.clear()
            self._compiling.clear()
            self._commands.clear()  # adds and aborts of the requests ended here
            self._shares.clear()
        error = ("The engine stopped after an internal error and could not finish this "
                 "request; it restarts if it can. Send the request again in a moment.")
        for request_id, sink in sinks:
            for index in sorted(sink.unfinished):  # the samples that had not finished
                try:
                    sink._on_output(RequestOutput(request_id, index, [], "", finished=True,
                                                  finish_reason=FinishReason.ERROR, error=error))
                except Exception:  # that consumer is gone; the others still get their end
                    log.exception("could not tell %s that the engine stopped", request_id)

    def _restart(self) -> bool:
        """Rebuild the core after a death; False when the engine must stay dead (see the module doc)."""
        now = time.monotonic()
        self._deaths = [t for t in self._deaths if now - t < RESTART_WINDOW_S] + [now]
        if len(self._deaths) > self.config.max_restarts:
            log.error("the engine died %d times within %.0f s (allowed: %d restarts); it stays dead",
                      len(self._deaths), RESTART_WINDOW_S, self.config.max_restarts)
            return False
        log.warning("rebuilding the engine (restart %d)", self.num_restarts + 1)
        old = self.core
        try:
            old.close()  # its KV cache goes before the new one is allocated
            # The same pool size: sized from free memory again, it would find the old pool's memory
            # still held (the allocator keeps it) and shrink at every restart.
            config = dataclasses.replace(self.config, num_kv_blocks=old.num_kv_blocks)
            self.core = EngineCore(self.loaded.model, self.loaded.tokenizer, config, self.loaded.context_length,
                                   grammars=old.grammars, draft=self.draft)
        except Exception:
            log.exception("rebuilding the engine failed; it stays dead")
            return False
        self.num_restarts += 1
        with self._lock:
            self.dead = None
        log.warning("the engine runs again (restart %d): %d KV blocks, linears on %s", self.num_restarts,
                    self.core.num_kv_blocks, self.core.linears)
        return True

"""The resumable /chat record on its own (server/resume.py with server/chat.py's pump), against a
scripted engine whose outputs the test hands over one by one: what a reader gets when it stops
reading, and a continuation that outlives the window it was resumed in. No model, no HTTP: these
cases hinge on when a timer fires and on a reader that stays connected without reading, which
a real socket's buffers would hide."""

from __future__ import annotations

import asyncio
import contextlib
import json
from types import SimpleNamespace

from engine.request import FinishReason, RequestOutput, SamplingParams
from engine.streams import RequestStream
from server.chat import _continue, _start_pump
from frontend.admission import Generation
from frontend.models import ModelRegistry
from frontend.request import RequestDefaults
from server.headers import admission
from server.resume import ResumeRegistry
from frontend.settings import Settings

PROMPT = [5, 6, 7]


class ScriptedEngine:
    """What a `Generation` needs of an AsyncEngine; the test emits each output."""

    alive = True
    model_name = "scripted"
    max_model_len = 1024

    def __init__(self):
        self.streams: dict[str, RequestStream] = {}  # engine request id -> its stream, in order of admission
        self.prior: dict[str, list[int]] = {}  # engine request id -> the output it continues from
        self.aborted: list[str] = []  # engine request ids, in the order they were aborted
        self.num_tokens: dict[str, int] = {}
        self.finished: set[str] = set()  # like the engine, an abort of one of these does nothing

    def check_prompt(self, prompt_token_ids, params) -> None:
        pass

    async def wait_admitted(self, stream, timeout=None) -> None:
        return None  # add_request admitted it

    def add_request(self, prompt_token_ids, params, request_id, prior_output_ids=()) -> RequestStream:
        assert request_id not in self.streams
        self.streams[request_id] = RequestStream(self, request_id, params.n)
        self.prior[request_id] = list(prior_output_ids)
        self.num_tokens[request_id] = 0
        return self.streams[request_id]

    def emit(self, request_id: str, text: str, finish: FinishReason | None = None) -> None:
        if finish is not None:
            self.finished.add(request_id)
        self.num_tokens[request_id] += 1
        self.streams[request_id]._put(RequestOutput(request_id, 0, [100 + self.num_tokens[request_id]], text,
                                                    finished=finish is not None, finish_reason=finish,
                                                    num_output_tokens=self.num_tokens[request_id]))

    def abort(self, request_id: str) -> bool:
        if request_id in self.finished:
            return False
        self.finished.add(request_id)
        self.aborted.append(request_id)
        self.streams[request_id]._put(RequestOutput(request_id, 0, [], "", finished=True,
                                                    finish_reason=FinishReason.ABORT))
        return True


def app_request(engine: ScriptedEngine, window: float, max_bytes: int = 64 * 2**20):
    tasks = set()

    def spawn(coro):
        task = asyncio.ensure_future(coro)
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        return task

    settings = Settings(resume_window=window)
    state = SimpleNamespace(engine=engine, settings=settings, metrics=None, spawn=spawn,
                            resume=ResumeRegistry(window, engine.abort, max_bytes=max_bytes),
                            models=ModelRegistry.single(engine, settings, RequestDefaults()))  # the one model
    return SimpleNamespace(app=SimpleNamespace(state=state), headers={}, state=SimpleNamespace())


def start(request, label: str) -> tuple[Generation, object]:
    """What POST /chat does once the prompt is tokenized."""
    state = request.app.state
    params = SamplingParams(max_tokens=100_000, temperature=0)
    gen = Generation(state.engine, PROMPT, params, label, **admission(request, "chat"))
    record = state.resume.create(label, PROMPT, params)
    _start_pump(state, gen, record)
    return gen, record


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


async def read_all(reader) -> list[dict]:
    events = []
    async for batch in reader:
        events.extend(batch)
    return events


def test_a_reader_that_stops_reading_an_unresumable_stream_is_stopped_with_an_error_event():
    async def scenario():
        engine = ScriptedEngine()
        request = app_request(engine, window=5, max_bytes=20000)
        gen, record = start(request, "slow")
        reader = record.follow(0)
        engine.emit(gen.request_id, "one ")
        await settle()
        assert [e["data"] for e in await reader.__anext__()] == ["one "]
        for _ in range(2000):  # the reader stays connected and reads nothing of ~600 KB of events
            if engine.aborted:
                break
            engine.emit(gen.request_id, "word ")
            await settle()
        assert engine.aborted == [gen.request_id]  # the generation stopped, not only the record
        assert record.token is None and record.nbytes <= 20000 + 1000
        await settle()
        rest = await read_all(reader)
        assert [e.get("event") for e in rest[-2:]] == ["error", "end"]
        error = json.loads(rest[-2]["data"])
        assert error["code"] == "slow_reader" and "stopped reading" in error["error"]
        assert all(e["data"] == "word " for e in rest[:-2]) and len(rest) < 200

    asyncio.run(scenario())


def test_a_continuation_is_not_ended_by_the_window_of_the_suspension_it_ended():
    async def scenario():
        engine = ScriptedEngine()
        request = app_request(engine, window=0.2)
        gen, record = start(request, "shared-label")
        reader = record.follow(0)
        engine.emit(gen.request_id, "a")
        engine.emit(gen.request_id, "b")
        await settle()
        assert [e["data"] for e in await reader.__anext__()] == ["a", "b"]
        await reader.aclose()  # the reader leaves: the request is aborted, the stream suspended
        await settle()
        assert engine.aborted == [gen.request_id] and record.suspended

        await _continue(request, record)  # a reader comes back; it attaches once its response starts
        first, continuation = list(engine.streams)
        assert continuation != first and engine.prior[continuation] == [101, 102]
        assert "shared-label" not in engine.streams  # the label is never the engine's key
        await asyncio.sleep(0.4)  # the suspension's window ends before that reader attaches
        assert engine.aborted == [first] and not record.expired

        reader = record.follow(2)
        engine.emit(continuation, "c")
        engine.emit(continuation, "d", finish=FinishReason.LENGTH)
        rest = await read_all(reader)
        assert [(e["id"], e.get("event"), e["data"]) for e in rest[:2]] == [("3", None, "c"), ("4", None, "d")]
        assert [e.get("event") for e in rest[2:]] == ["usage", "end"]
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*(t for t in asyncio.all_tasks() if t is not asyncio.current_task()))

    asyncio.run(scenario())

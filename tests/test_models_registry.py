"""frontend/models.py's rules without a model (engines faked, milliseconds): --pin, --no-models-autoload,
the 503 with Retry-After when every loaded model stays busy, and the start-up checks of its flags."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

import frontend.models as models
from frontend.errors import ApiError
from frontend.models import ModelEntry, ModelRegistry
from frontend.settings import Settings


class FakeEngine:
    """What the registry reads of an engine: its name, context, config, load (running requests), shutdown."""

    def __init__(self, settings):
        self.model_name = settings.model_id
        self.max_model_len = 64
        self.generation_config = None
        self.tokenizer = SimpleNamespace(name_or_path=None)
        self.running = 0
        self.stopped = False

    def stats(self):
        return SimpleNamespace(num_running=self.running, num_waiting=0)

    def shutdown(self, timeout=None):
        self.stopped = True

    def abort(self, request_id):
        return False


def registry(**flags) -> ModelRegistry:
    entries = [ModelEntry(name, name) for name in ("a", "b", "c")]
    return ModelRegistry(entries, Settings(**flags), build=FakeEngine)


def test_a_pinned_model_is_never_unloaded_to_make_room():
    async def run():
        reg = registry(models_max=2, pin=("a",))
        for name in ("a", "b", "c"):
            reg.release(await reg.acquire(name))
        return {e.name: e.state for e in reg.entries}

    # c needed room: b (not pinned) went, though a was used longer ago
    assert asyncio.run(run()) == {"a": "loaded", "b": "unloaded", "c": "loaded"}


def test_without_autoload_an_unloaded_model_is_a_400_until_it_is_loaded():
    async def run():
        reg = registry(models_autoload=False)
        with pytest.raises(ApiError) as refused:
            await reg.acquire("b")
        entry = await reg.load("b")
        return refused.value, entry.state

    refused, state = asyncio.run(run())
    assert refused.status == 400 and "POST /models/load" in refused.message and "`b`" in refused.message
    assert state == "loaded"


def test_every_model_busy_is_a_503_with_retry_after(monkeypatch):
    monkeypatch.setattr(models, "ROOM_WAIT_S", 0.2)

    async def run():
        reg = registry(models_max=1)
        entry = await reg.acquire("a")
        reg.release(entry)
        entry.engine.running = 1  # a stream of a runs
        with pytest.raises(ApiError) as refused:
            await reg.acquire("b")
        return refused.value, reg

    refused, reg = asyncio.run(run())
    assert refused.status == 503 and refused.headers["Retry-After"]
    assert "`b` cannot be loaded now" in refused.message and "`a` (1 requests)" in refused.message
    assert [e.state for e in reg.entries] == ["loaded", "unloaded", "unloaded"]
    assert not reg.entries[0].engine.stopped


def test_flags_naming_no_served_model_are_refused():
    with pytest.raises(ValueError, match="--pin must name one of the models served"):
        registry(pin=("z",))
    with pytest.raises(ValueError, match="--default-model must name"):
        ModelRegistry([ModelEntry("a", "a")], Settings(), build=FakeEngine, default="z")
    with pytest.raises(ValueError, match="--models-max allows 1"):
        registry(models_max=1, pin=("a", "b"))


def test_the_default_models_view_follows_its_engine_through_an_unload_and_a_reload():
    async def run():
        reg = registry(models_max=1)
        view = reg.start()  # the default (a) loaded now; several models: a view of it
        first = reg.entries[0].engine
        view.on_fatal = "app's hook"
        reg.release(await reg.acquire("b"))  # a unloaded to make room
        unloaded = (view.alive, view.stats().num_running, view.model_name, view.max_model_len, first.stopped)
        with pytest.raises(RuntimeError, match="`a` is not loaded"):
            view.add_request([1], None)
        reg.release(await reg.acquire(None))
        return unloaded, reg.entries[0].engine, first

    (alive, running, name, context, stopped), second, first = asyncio.run(run())
    assert (alive, running, name, context, stopped) == (True, 0, "a", 64, True)
    assert second is not first and second.on_fatal == "app's hook"  # a reload gets app.py's hook too


def test_the_idle_timer_unloads_even_when_the_list_was_read_before_the_server_ran():
    reg = registry(models_max=2, model_ttl=0.2)
    reg.snapshot()  # the page reads the models' states while it is built, before any event loop runs

    async def run():
        reg.release(await reg.acquire("b"))
        loaded = reg.entries[1].state
        await asyncio.sleep(1.5)
        return loaded, reg.entries[1].state

    assert asyncio.run(run()) == ("loaded", "unloaded")


SIZES = {"a": 300, "b": 500, "c": 400, "huge": 2000}  # each model's estimate in the tests below


def measured(source, settings, engine=None) -> models.Footprint:
    return models.Footprint(SIZES[source] - 100, 100)  # weights + KV pool


def memory_registry(**flags) -> ModelRegistry:
    entries = [ModelEntry(name, name) for name in ("a", "b", "c", "huge")]
    return ModelRegistry(entries, Settings(**flags), build=FakeEngine, measure=measured)


def test_models_memory_unloads_the_least_recently_used_idle_models_to_make_room():
    async def run():
        reg = memory_registry(models_max=4, models_memory=1000)
        for name in ("a", "b"):  # 300 + 500: both fit
            reg.release(await reg.acquire(name))
        both = [e.state for e in reg.entries]
        reg.entries[1].engine.running = 1  # b streams: it is never unloaded for room
        reg.release(await reg.acquire("c"))  # 800 + 400 > 1000: a, the only idle one, goes
        return both, [e.state for e in reg.entries]

    both, after = asyncio.run(run())
    assert both == ["loaded", "loaded", "unloaded", "unloaded"]
    assert after == ["unloaded", "loaded", "loaded", "unloaded"]


def test_a_model_that_cannot_fit_alone_is_a_503_saying_its_estimate_and_the_budget_without_retry_after():
    async def run():
        reg = memory_registry(models_max=4, models_memory=1000)
        reg.release(await reg.acquire("a"))
        with pytest.raises(ApiError) as refused:
            await reg.acquire("huge")
        return refused.value, [e.state for e in reg.entries]

    refused, states = asyncio.run(run())
    assert refused.status == 503 and not refused.headers
    assert "`huge` cannot be loaded" in refused.message and "2,000 bytes" in refused.message
    assert "--models-memory is 1,000 bytes" in refused.message and "not fit even alone" in refused.message
    assert states == ["loaded", "unloaded", "unloaded", "unloaded"]  # nothing unloaded for it


def test_a_model_that_fits_once_the_busy_ones_finish_is_a_503_with_retry_after(monkeypatch):
    monkeypatch.setattr(models, "ROOM_WAIT_S", 0.2)

    async def run():
        reg = memory_registry(models_max=4, models_memory=1000)
        for name in ("a", "b"):
            reg.release(await reg.acquire(name))
        for entry in reg.entries[:2]:
            entry.engine.running = 1
        with pytest.raises(ApiError) as refused:
            await reg.acquire("c")  # 400 fits beside neither while both stream
        return refused.value

    refused = asyncio.run(run())
    assert refused.status == 503 and refused.headers["Retry-After"]
    assert "needs about 400 bytes" in refused.message and "take 800 bytes of --models-memory 1,000 bytes" \
        in refused.message


def test_models_memory_below_what_start_loads_is_refused_at_start():
    reg = memory_registry(models_memory=700, pin=("b",))  # a (default, 300) + b (500)
    with pytest.raises(ValueError, match="--models-memory 700 bytes cannot hold .*`a` 300 bytes, `b` 500 bytes"):
        reg.start()


def test_requests_waiting_for_a_load_see_their_place_in_line_and_what_the_load_waits_for():
    async def run():
        reg = registry(models_max=1)
        a = await reg.acquire("a")  # a stream of a runs: b's load waits for room
        first, second = object(), object()
        waiting = [asyncio.ensure_future(reg.acquire("b", ticket=t)) for t in (first, second)]
        await asyncio.sleep(0.2)
        places = reg.place("b", first), reg.place("b", second)
        waiting[0].cancel()  # the first leaves (a closed tab): the second moves up
        await asyncio.sleep(0.1)
        moved = reg.place("b", second)
        reg.release(a)  # a idle: unloaded, b loads
        b = await waiting[1]
        reg.release(b)
        return places, moved, reg.place("b", second), b.state

    places, moved, after, state = asyncio.run(run())
    assert places == ("Loading model `b` · 1st in line · waiting for `a` to finish 1 request",
                      "Loading model `b` · 2nd in line · waiting for `a` to finish 1 request")
    assert moved == "Loading model `b` · 1st in line · waiting for `a` to finish 1 request"
    assert (after, state) == (None, "loaded")

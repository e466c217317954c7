"""Issue 32: grammars never compile on the engine thread. A constrained request that reaches the
engine uncompiled (a caller that skipped the pre-compile: the Ray replica, a resumed stream whose
grammar the cache dropped) waits for its compile off the engine thread, and every other stream
keeps producing tokens meanwhile. The compile here is held on purpose until the other stream ended;
it must not matter to that stream."""

from __future__ import annotations

import asyncio
import threading

import pytest

from engine.async_engine import AsyncEngine
from engine.model.loading import load_model
from engine.request import Constraint, FinishReason, SamplingParams

OTHER_TOKENS = 24
SAFETY_S = 60  # a stuck engine fails the test instead of hanging it (not a timing assertion)


@pytest.fixture(scope="module")
def engine(tiny_model):
    engine = AsyncEngine(load_model(tiny_model("llama"))).start()
    yield engine
    engine.shutdown()


def _held_compiles(engine, monkeypatch) -> threading.Event:
    """Every compile waits for the returned event (a grammar that takes as long as the test wants)."""
    release = threading.Event()
    real_build = engine.grammars._build

    def held_build(constraint):
        release.wait(SAFETY_S)
        return real_build(constraint)

    monkeypatch.setattr(engine.grammars, "_build", held_build)
    return release


async def _outputs(stream, into: list | None = None) -> list:
    """Every output of `stream` until its end (appended to `into` as they come); a stuck engine
    fails the test after SAFETY_S instead of hanging it."""
    outs = [] if into is None else into

    async def read():
        async for out in stream:
            outs.append(out)

    await asyncio.wait_for(read(), SAFETY_S)
    return outs


def test_an_uncompiled_constraint_added_directly_never_stalls_another_stream(engine, monkeypatch):
    release = _held_compiles(engine, monkeypatch)
    prompt = engine.encode("Once upon a time")

    async def scenario():
        try:
            other = engine.add_request(prompt, SamplingParams(max_tokens=OTHER_TOKENS, ignore_eos=True,
                                                              temperature=0))
            constrained = engine.add_request(prompt, SamplingParams(max_tokens=8, temperature=0,
                                                                    constraint=Constraint("regex", "(yes|no)")))
            other_outs = []
            try:
                await _outputs(other, other_outs)
            except asyncio.TimeoutError:
                pytest.fail(f"the other stream stopped after {sum(len(o.token_ids) for o in other_outs)} "
                            "tokens: the engine thread waits for a grammar")
            assert sum(len(o.token_ids) for o in other_outs) == OTHER_TOKENS  # all while the grammar compiled
            assert not release.is_set()
        finally:
            release.set()
        return await _outputs(constrained)

    outs = asyncio.run(scenario())
    text = "".join(o.text for o in outs)
    assert outs[-1].finish_reason is FinishReason.STOP and text in ("yes", "no"), (text, outs[-1])


def test_an_uncompiled_constraint_aborted_while_it_compiles_ends_and_frees_its_place(engine, monkeypatch):
    release = _held_compiles(engine, monkeypatch)
    prompt = engine.encode("Once upon a time")

    async def scenario():
        try:
            constrained = engine.add_request(prompt, SamplingParams(max_tokens=8,
                                                                    constraint=Constraint("regex", "a+b")))
            assert engine.abort(constrained.request_id)
            outs = await _outputs(constrained)
            assert [o.finish_reason for o in outs] == [FinishReason.ABORT]
        finally:
            release.set()
        assert engine.grammars.submit(Constraint("regex", "a+b")).result(SAFETY_S) is not None
        other = engine.add_request(prompt, SamplingParams(max_tokens=4, ignore_eos=True))
        assert sum(len(o.token_ids) for o in await _outputs(other)) == 4

    asyncio.run(scenario())
    stats = engine.stats()
    assert stats.num_running == stats.num_waiting == 0  # the aborted one never ran, nothing is left admitted

"""The hooks --test-hooks installs, so the suite can prove what a client sees when things go wrong:
a request that fails inside the engine (`x-rill-inject-fault: 1`), steps slowed so a request
outlives what a test does beside it, an engine loop that dies, a route that raises.
"""

from __future__ import annotations

import asyncio
import threading
import time

from fastapi import FastAPI


def fault_hook(request):
    """With --test-hooks, a request sent with `x-rill-inject-fault: 1` fails inside the engine
    (engine.inject_fault): the test suite's way to prove one failure stays one failure."""
    if request.headers.get("x-rill-inject-fault") != "1":
        return None
    model = getattr(request.state, "model", None)  # the engine of the model the request named
    return (model.engine if model is not None else request.app.state.engine).inject_fault


def delay_steps(core, seconds: float) -> None:
    """Test hook (--test-hooks): every step of the engine core sleeps `seconds` first, 0 undoes it,
    so a request outlives what a test does beside it however fast the machine."""
    step = getattr(core, "_step_before_test_delay", core.step)
    core._step_before_test_delay = step
    if seconds > 0:
        def slowed():
            time.sleep(seconds)
            return step()

        core.step = slowed
    else:
        core.step = step


class EngineKilled(RuntimeError):
    """Raised inside the engine thread by the test hook that kills the engine loop."""


class InjectedFailure(RuntimeError):
    """Raised by the test hook that proves a route's unexpected failure tells the client nothing."""


class PageFailure(Exception):
    """Raised by the test hook that proves a page handler's unexpected failure tells the visitor nothing."""


HOLD_COMPILES_S = 30.0  # the most a held compile waits for its release


def _hold_compiles(grammars, on: bool) -> int:
    """The test hook's gate on `grammars`' compiles; returns how many compiles outwaited it so far."""
    gate = getattr(grammars, "_test_gate", None)
    if gate is None:
        gate = grammars._test_gate = threading.Event()
        gate.set()
        grammars._test_timeouts = 0
        build = grammars._build

        def held(constraint):
            if not gate.wait(HOLD_COMPILES_S):
                grammars._test_timeouts += 1
            return build(constraint)

        grammars._build = held
    if on:
        with grammars._lock:
            grammars._cache.clear()
        gate.clear()
    else:
        gate.set()
    return grammars._test_timeouts


def install_test_routes(app: FastAPI, engine) -> None:
    """--test-hooks only (without the flag these routes do not exist; with an API key they need it,
    like every route): `POST /_test/kill-engine` makes the engine loop die at its next step, so the
    suite can check /health's 503 and the error events of in-flight streams (an engine in this
    process only); `POST /_test/slow-steps` makes every step sleep first (for timeouts; also the
    replicas of --backend ray); `POST /_test/raise`
    fails inside a route with an exception whose text names a file, so the suite can check that
    a 500's body carries none of it."""

    @app.post("/_test/raise", include_in_schema=False)
    async def raise_inside():
        raise InjectedFailure("secret detail from /srv/rill/server/app.py line 1")

    local = engine.backend == "local"
    if engine.backend not in ("local", "ray"):
        return  # --backend openai: nothing of the engine runs here

    @app.post("/_test/slow-steps", include_in_schema=False)
    async def slow_steps(seconds: float = 0.0):
        """Every engine step sleeps `seconds` first (0 undoes it): a request outlives a short
        timeout however fast the machine. With --backend ray, on every replica (answered once
        each has applied it)."""
        if local:  # every model loaded now (a model loaded later steps at full speed)
            for loaded in app.state.models.engines():
                delay_steps(loaded.core, seconds)
        else:
            await asyncio.to_thread(engine.delay_steps, seconds)
        return {"step_delay_s": max(seconds, 0.0)}

    if not local:
        return

    @app.post("/_test/hold-compiles", include_in_schema=False)
    async def hold_compiles(on: int = 0):
        """on=1: the grammar cache is emptied and every compile waits until on=0 (a grammar the
        cache dropped since, slow to compile), so the suite can check that nothing else waits for it.
        Answers `timed_out`: the compiles that went on without the release (held HOLD_COMPILES_S), and
        `pending`: the compiles submitted and not done, `waiting`: those waiting for their caller's
        turn (any `on` < 0 only reads them)."""
        grammars = engine.grammars
        timed_out = getattr(grammars, "_test_timeouts", 0) if on < 0 else _hold_compiles(grammars, bool(on))
        with grammars._lock:
            pending = len(grammars._pending)
        from frontend.admission import COMPILE_SLOTS

        return {"held": on > 0, "timed_out": timed_out, "pending": pending, "waiting": COMPILE_SLOTS.waiting_now()}

    @app.post("/_test/page-raise", include_in_schema=False)
    async def page_raise(on: int = 0):
        """on=1: the page's handlers fail (their admission raises an exception whose text names a
        file), so the suite can check that a page client sees none of it; on=0 undoes it."""
        def fail(*args, **kwargs):
            raise PageFailure("secret detail from /srv/rill/ui/page.py line 1")

        if on:
            engine.add_request = fail  # the page admits as the routes do
        else:
            engine.__dict__.pop("add_request", None)
        return {"failing": bool(on)}

    @app.post("/_test/kill-engine", include_in_schema=False)
    async def kill_engine():
        def die():
            raise EngineKilled("killed by the test hook /_test/kill-engine")

        engine.core.step = die
        engine.core.has_work = lambda: True
        return {"killed": True}

"""Issue 47, item 6: grammar compiles run apart from tokenizing.

A constrained request waits for its compile on the event loop (the compile runs in the engine's
grammar pool), never in a thread of asyncio's default executor, which tokenizes every request:
so with more compiles pending than that executor has threads, a plain request is still answered,
before any of them. And one caller has at most COMPILES_PER_CALLER compiles pending; the next
is a 429 naming the limit. `/_test/hold-compiles` (--test-hooks) holds every compile until
released: compiles as slow as the test needs, no timing assertion."""

from __future__ import annotations

import os
import secrets
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from frontend.admission import COMPILES_PER_CALLER
from tests.test_security_disk import PageSession

TIMEOUT_S = 60
# more compiles than asyncio's default executor has threads (min(32, cpus + 4)): the old code's
# waits took every one of them
FLOOD = min(32, (os.cpu_count() or 1) + 4) + 2


def _hold(url: str, on: int) -> dict:
    answer = httpx.post(f"{url}/_test/hold-compiles", params={"on": on}, timeout=TIMEOUT_S)
    assert answer.status_code == 200, answer.text
    return answer.json()


def _until(check, message: str, timeout: float = TIMEOUT_S):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := check():
            return value
        time.sleep(0.05)
    raise AssertionError(message)


def test_a_plain_request_is_answered_while_many_compiles_are_pending(tiny_server):
    url = tiny_server.url
    _hold(url, 1)
    answered: list[int] = []  # the constrained requests' statuses, as they end

    def constrained(i: int) -> int:
        response = httpx.post(f"{url}/chat", timeout=TIMEOUT_S, headers={"x-session-id": f"flood-{i}"}, json={
            "prompt": "Yes or no?", "stream": False, "max_new_tokens": 4,
            "regex": f"(yes|no){secrets.token_hex(4)}{i}"})  # distinct: each its own compile
        answered.append(response.status_code)
        return response.status_code

    pool = ThreadPoolExecutor(FLOOD)
    try:
        flood = [pool.submit(constrained, i) for i in range(FLOOD)]
        # every request of the flood reached its compile (or was refused at once by a per-caller limit)
        _until(lambda: _hold(url, -1)["pending"] + len(answered) >= FLOOD, "the flood's compiles to be pending")
        pending = _hold(url, -1)["pending"]
        assert pending >= 1
        plain = httpx.post(f"{url}/chat", timeout=TIMEOUT_S, json={
            "prompt": "Tell me a story", "stream": False, "max_new_tokens": 4, "temperature": 0})
        still_pending = _hold(url, -1)["pending"]
        ended_meanwhile = [s for s in answered if s != 429]
    finally:
        released = _hold(url, 0)
        statuses = [f.result(TIMEOUT_S) for f in flood]
        pool.shutdown()
    assert plain.status_code == 200 and plain.json()["usage"]["completion_tokens"] >= 1, plain.text
    # answered while every held compile was still pending: it never queued behind them
    assert still_pending == pending and ended_meanwhile == [], (pending, still_pending, ended_meanwhile)
    assert released["timed_out"] == 0
    assert set(statuses) <= {200, 429} and 200 in statuses, statuses


def test_one_visitor_has_a_bounded_number_of_compiles_pending(tiny_server):
    """The page's visitor (its session: the caller) sends more JSON-schema answers than the limit
    while compiles are held: the one past it is refused at once, naming the limit; the rest answer."""
    url = tiny_server.url
    tab = PageSession(url)
    history = [{"role": "user", "content": [{"type": "text", "text": "JSON please"}]}]
    _hold(url, 1)
    try:
        events = []
        for i in range(COMPILES_PER_CALLER + 1):
            key = f"k{i}_{secrets.token_hex(3)}"  # distinct: each its own compile
            schema = f'{{"type": "object", "properties": {{"{key}": {{"type": "string"}}}}, "required": ["{key}"]}}'
            events.append(tab.join("respond", [history, "", 0.0, 0.9, 0, 8, 1.0, "JSON schema", schema, 0]))
        completions = tab.completions(events)
        first = next(completions)  # the refused one, while the others wait for their compiles
        assert not first["success"], first
        assert f"at most {COMPILES_PER_CALLER} at once" in (first["output"].get("error") or ""), first
        assert _hold(url, -1)["pending"] == COMPILES_PER_CALLER
        _hold(url, 0)
        rest = list(completions)
    finally:
        _hold(url, 0)
    assert len(rest) == COMPILES_PER_CALLER and all(r["success"] for r in rest), rest

"""Issue 47, item 6: grammar compiles run apart from tokenizing.

A constrained request waits for its compile on the event loop (the compile runs in the engine's
grammar pool), never in a thread of asyncio's default executor, which tokenizes every request:
so with more compiles pending than that executor has threads, a plain request is still answered,
before any of them. And one caller has at most COMPILES_PER_CALLER compiles in the pool, up to
COMPILES_WAITING_PER_CALLER more waiting their turn; the next is a 429 naming both. `/_test/hold-compiles` (--test-hooks) holds every compile until
released: compiles as slow as the test needs, no timing assertion."""

from __future__ import annotations

import os
import secrets
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from frontend.admission import COMPILES_PER_CALLER, COMPILES_WAITING_PER_CALLER

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
        _until(lambda: (h := _hold(url, -1))["pending"] + h["waiting"] + len(answered) >= FLOOD,
               "the flood's compiles to be pending")
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


def test_one_caller_has_a_bounded_number_of_compiles_pending(tiny_server):
    """One caller sends more distinct JSON schemas than its compiles in the pool and its waiting ones
    together: COMPILES_PER_CALLER compile, COMPILES_WAITING_PER_CALLER wait their turn (holding no
    thread), the next is a 429 naming both limits; once released every admitted one is answered."""
    url = tiny_server.url
    total = COMPILES_PER_CALLER + COMPILES_WAITING_PER_CALLER + 1

    def constrained(i: int) -> httpx.Response:
        key = f"k{i}_{secrets.token_hex(3)}"  # distinct: each its own compile
        schema = {"type": "object", "properties": {key: {"type": "string"}}, "required": [key]}
        return httpx.post(f"{url}/v1/chat/completions", timeout=TIMEOUT_S, json={
            "messages": [{"role": "user", "content": "JSON please"}], "max_tokens": 4,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})

    _hold(url, 1)
    pool = ThreadPoolExecutor(total)
    try:
        calls = [pool.submit(constrained, i) for i in range(total)]
        _until(lambda: (h := _hold(url, -1))["pending"] + h["waiting"] >= total - 1,
               "the caller's compiles to be pending or waiting")
        done = _until(lambda: [c for c in calls if c.done()], "the call past both limits to be refused")
        held = _hold(url, -1)
        refused = done[0]
    finally:
        _hold(url, 0)
        replies = [c.result(TIMEOUT_S) for c in calls]
        pool.shutdown()
    assert held["pending"] == COMPILES_PER_CALLER and held["waiting"] == COMPILES_WAITING_PER_CALLER, held
    statuses = [r.status_code for r in replies]
    assert statuses.count(429) == 1 and statuses.count(200) == total - 1, statuses
    assert refused.result().status_code == 429
    message = refused.result().json()["error"]["message"]
    assert (f"at most {COMPILES_PER_CALLER} at once and {COMPILES_WAITING_PER_CALLER} waiting" in message), message

"""Issue 47, item 3, over real HTTP: the engine's fair share counts callers by who they are (the peer
address, or the right-most untrusted address of `X-Forwarded-For` from a proxy --forwarded-allow-ips
trusts), never by the `x-session-id` they choose: one peer flooding under 60 names gains nothing, a
newcomer is still admitted, and an `X-Forwarded-For` from a peer nobody trusts names nobody."""

from __future__ import annotations

import asyncio
import subprocess

import httpx

from tests.servers import ROOT, clean_env, python, slow_steps, wait_idle

KEY = "security-key-3c81"
AUTH = {"Authorization": f"Bearer {KEY}"}
GOOD_ORIGIN = "https://good.example"
# One server for tests/test_security_identity.py and tests/test_security_cors.py: a key, a named CORS
# origin, a trusted proxy (the test client itself) and a small engine (8 running + 24 waiting: two n=16).
SECURITY_FLAGS = ("--api-key", KEY, "--cors-origins", GOOD_ORIGIN, "--forwarded-allow-ips", "127.0.0.1",
                  "--max-num-seqs", "8", "--max-queue", "24")
FAIR_SHARE_FLAGS = ("--max-num-seqs", "8", "--max-queue", "24")  # tests/test_fair_share_http.py's server

FLOOD = {"prompt": "Count the stars one by one:", "n": 16, "max_tokens": 200, "temperature": 0, "ignore_eos": True,
         "stream": True}
SINGLE = {"prompt": "Say hello.", "max_tokens": 4, "temperature": 0, "ignore_eos": True, "stream": True}


async def _statuses(url: str, requests: list[dict], newcomer: dict, body: dict = FLOOD) -> tuple[list[int], int, str]:
    """Opens every request of `requests` (headers) at once and waits for each status (a stream's
    status comes after admission), then sends `newcomer`'s. Streams are closed at the end (their
    requests aborted). -> (the flood's statuses, the newcomer's status, its error text if any)."""
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=len(requests) + 4)) as client:
        streams = [client.stream("POST", f"{url}/v1/completions", json=body, headers=h) for h in requests]
        try:
            responses = await asyncio.gather(*(s.__aenter__() for s in streams))
            async with client.stream("POST", f"{url}/v1/completions", json=SINGLE, headers=newcomer) as answer:
                text = (await answer.aread()).decode()
                status = answer.status_code
        finally:
            await asyncio.gather(*(s.__aexit__(None, None, None) for s in streams), return_exceptions=True)
    return [r.status_code for r in responses], status, text


def test_a_peer_rotating_60_session_names_gains_nothing_and_a_newcomer_is_admitted(server_with):
    url = server_with(*SECURITY_FLAGS).url
    wait_idle(url, headers=AUTH)
    # Behind the trusted proxy (this client): the flooder is 10.0.0.1, whatever it puts in front of it.
    flood = [{**AUTH, "x-session-id": f"name-{i}", "X-Forwarded-For": f"203.0.113.{i}, 10.0.0.1"} for i in range(60)]
    newcomer = {**AUTH, "x-session-id": "name-0", "X-Forwarded-For": "10.0.0.2"}
    with slow_steps(url, 0.05, headers=AUTH):
        statuses, status, text = asyncio.run(_statuses(url, flood, newcomer))
    admitted = statuses.count(200)
    assert set(statuses) <= {200, 429}, statuses
    assert admitted == 2, f"one caller under 60 names took {admitted} n=16 requests (its share is 2): {statuses}"
    assert status == 200, f"the newcomer was refused while one peer flooded under 60 names: {status} {text[:300]}"
    wait_idle(url, headers=AUTH)


EVERY_PROXY_FLAGS = ("--api-key", KEY, "--forwarded-allow-ips", "*", "--max-num-seqs", "8", "--max-queue", "24")


def test_behind_a_proxy_trusted_as_star_the_right_most_address_is_the_caller(server_with):
    """`--forwarded-allow-ips *` (a Space): the caller is the address the proxy appended (right-most),
    never what the client wrote before it. 60 requests of n=4 whose left-most entries differ are one
    caller: it gets at most the engine's capacity (8 running + 24 waiting = 8 such requests) and a
    newcomer is admitted; counted by their left-most entries they would fill the hard cap (64)."""
    url = server_with(*EVERY_PROXY_FLAGS).url
    wait_idle(url, headers=AUTH)
    flood = [{**AUTH, "X-Forwarded-For": f"203.0.113.{i}, 10.0.0.1"} for i in range(60)]
    newcomer = {**AUTH, "X-Forwarded-For": "203.0.113.1, 10.0.0.2"}
    with slow_steps(url, 0.05, headers=AUTH):
        statuses, status, text = asyncio.run(_statuses(url, flood, newcomer, body={**FLOOD, "n": 4}))
    assert set(statuses) <= {200, 429}, statuses
    assert statuses.count(200) <= 8, f"one caller behind the proxy took {statuses.count(200)} n=4 requests: {statuses}"
    assert status == 200, f"the newcomer was refused: {status} {text[:300]}"
    wait_idle(url, headers=AUTH)


def test_x_forwarded_for_from_a_peer_nobody_trusts_names_nobody(server_with):
    url = server_with(*FAIR_SHARE_FLAGS).url  # no --forwarded-allow-ips: the peer is the caller
    wait_idle(url)
    flood = [{"x-session-id": "first"}, {"x-session-id": "second"}]  # the engine's whole capacity
    again = {"x-session-id": "third", "X-Forwarded-For": "10.0.0.2"}
    with slow_steps(url, 0.05):
        statuses, status, text = asyncio.run(_statuses(url, flood, again))
    assert statuses == [200, 200], statuses
    assert status == 429, f"a new name and a forged X-Forwarded-For passed for another caller: {status}"
    assert "Server busy" in text and "at capacity" in text, text[:300]
    wait_idle(url)


def test_a_forwarded_allow_ips_entry_that_is_no_address_stops_the_start_with_what_is_allowed():
    done = subprocess.run([python(), "app.py", "--forwarded-allow-ips", "127.0.0.1,proxy.internal"], cwd=ROOT,
                          env=clean_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "'proxy.internal' is neither" in done.stderr and "CIDR" in done.stderr, done.stderr[-2000:]

"""Issue 32, the second hardening pass, over real HTTP against tiny-Llama servers: no client can
slow, starve or read another. A reader that stops reading is cut off with a clear error instead of
growing the server without end."""

from __future__ import annotations

import json
import secrets
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.servers import LONG_RESUME_FLAGS, SSEReader, chat_text, parse_sse, slow_steps, usage_of, wait_idle

STALLED_READERS = 3
SMALL_RCVBUF = 4096  # bytes: the client's window stays tiny, so the server's sends block at once


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS in /proc/{pid}/status")


def _stalled_reader(port: int, path: str, body: dict) -> socket.socket:
    """A raw connection that sends a streaming request and then never reads."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SMALL_RCVBUF)
    sock.connect(("127.0.0.1", port))
    payload = json.dumps(body).encode()
    sock.sendall(b"POST " + path.encode() + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
    return sock


def _read_to_end(sock: socket.socket) -> bytes:
    sock.settimeout(60)
    chunks = []
    while True:
        chunk = sock.recv(1 << 16)
        if not chunk or chunk.endswith(b"0\r\n\r\n"):
            chunks.append(chunk)
            break
        chunks.append(chunk)
    return b"".join(chunks)


# Within the answer budget (16 x 750 x 21 = 252,000 token entries, ~17 MB): far past a stalled reader's 4 MiB.
HEAVY = {"stream": True, "n": 16, "logprobs": True, "top_logprobs": 20, "ignore_eos": True, "max_tokens": 750,
         "temperature": 1.0}


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {**HEAVY, "messages": [{"role": "user", "content": "Hi"}]}),
    ("/v1/completions", {**{k: v for k, v in HEAVY.items() if k != "top_logprobs"}, "logprobs": 20,
                         "prompt": "Once upon a time"}),
])
def test_a_v1_reader_that_stops_reading_is_cut_off_with_a_slow_reader_error(server_with, path, body):
    server = server_with("--resume-window", "5", "--max-num-seqs", "64")
    wait_idle(server.url, timeout=60)
    before_health = server.health()["engine"]
    rss_before = _rss_bytes(server.process.pid)
    socks = [_stalled_reader(server.port, path, body) for _ in range(STALLED_READERS)]
    try:
        wait_idle(server.url, timeout=300)  # every request ended: cut off (or, unbounded, finished)
        rss_after = _rss_bytes(server.process.pid)
        after_health = server.health()["engine"]
        aborted = after_health["finished_total"].get("abort", 0) - before_health["finished_total"].get("abort", 0)
        generated = after_health["generation_tokens_total"] - before_health["generation_tokens_total"]
        grown = rss_after - rss_before
        print(f"{path}: RSS {rss_before / 2**20:.0f} -> {rss_after / 2**20:.0f} MiB, {generated} tokens, {aborted} aborted")
        # Each stalled stream may hold 4 MiB of unread events (server/sse.py); three of them, plus the
        # allocator's slack, stay far below what 3 x 16 x 1000 tokens with logprobs take unbounded.
        assert grown < 48 * 2**20, f"the server grew by {grown / 2**20:.0f} MiB with {STALLED_READERS} stalled readers"
        assert aborted >= STALLED_READERS, f"{aborted} sequences aborted; {generated} tokens generated"
        assert generated < STALLED_READERS * body["n"] * body["max_tokens"], generated
        raw = _read_to_end(socks[0])
    finally:
        for sock in socks:
            sock.close()
    text = raw.decode("utf-8", errors="replace")
    assert '"code": "slow_reader"' in text, text[-2000:]
    assert text.rstrip("\r\n0").rstrip().endswith("data: [DONE]"), text[-500:]
    assert "fell more than" in text


# --------------------------------------------------------------------------- the prefix cache is no side channel

def _hits(url: str, headers: dict | None = None) -> int:
    return httpx.get(f"{url}/health", timeout=10, headers=headers).json()["engine"]["prefix_cache_hit_tokens"]


def _secret_prompt() -> str:
    """A prompt nobody sent before (so only this test's requests can have cached it): over 3 blocks."""
    return " ".join(secrets.token_hex(3) for _ in range(24)) + " is the account recovery phrase of the user."


def _send(url: str, path: str, prompt: str, salt: str | None, headers: dict | None = None) -> None:
    extra = {} if salt is None else {"cache_salt": salt}
    if path == "/chat":
        body = {"prompt": prompt, "max_new_tokens": 1, "stream": False, **extra}
    elif path == "/v1/completions":
        body = {"prompt": prompt, "max_tokens": 1, **extra}
    else:
        body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 1, **extra}
    response = httpx.post(url + path, json=body, timeout=60, headers=headers)
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("path", ["/chat", "/v1/chat/completions", "/v1/completions"])
def test_the_same_prompt_under_another_salt_gets_no_prefix_cache_hit(tiny_server, path):
    url, prompt, victim, attacker = tiny_server.url, _secret_prompt(), secrets.token_hex(8), secrets.token_hex(8)
    _send(url, path, prompt, victim)  # the victim's request: its prompt is now cached
    deltas = {}
    for name, guess, salt in (("attacker", prompt, attacker), ("unsalted", prompt, None),
                              ("unsalted wrong guess", _secret_prompt(), None), ("victim", prompt, victim)):
        before = _hits(url)
        _send(url, path, guess, salt)
        deltas[name] = _hits(url) - before
    # The right guess tells nothing: no hit under another salt; unsalted, only the chat template's
    # own blocks (shared by any unsalted prompt), as for a wrong guess.
    assert deltas["attacker"] == 0 and deltas["unsalted"] == deltas["unsalted wrong guess"], deltas
    assert deltas["victim"] >= deltas["unsalted"] + 32, deltas  # the same salt shares the cache as before


def test_a_cache_salt_that_is_empty_or_too_long_is_a_400_saying_what_is_allowed(tiny_server):
    for salt, allowed in (("", "at least 1 character"), ("s" * 257, "at most 256 characters")):
        for path, body in (("/v1/completions", {"prompt": "Hi", "max_tokens": 1}), ("/chat", {"prompt": "Hi"})):
            response = httpx.post(f"{tiny_server.url}{path}", timeout=30, json={**body, "cache_salt": salt})
            assert response.status_code == 400, response.text
            assert "`cache_salt`" in response.text and allowed in response.text, response.text


def test_page_sessions_share_no_prefix_cache_with_cache_salt_per_session(server_with):
    from gradio_client import Client

    server = server_with("--resume-window", "5", "--cache-salt-per-session")
    prompt = _secret_prompt()
    control = _secret_prompt()
    first, second = Client(server.url + "/", verbose=False), Client(server.url + "/", verbose=False)
    first.predict(prompt, [], "", 0.0, 1.0, 0, 1, 1.0, api_name="/chat")  # the visitor's question: cached
    before = _hits(server.url)
    second.predict(prompt, [], "", 0.0, 1.0, 0, 1, 1.0, api_name="/chat")  # another visitor guesses it
    other_session = _hits(server.url) - before
    before = _hits(server.url)
    second.predict(control, [], "", 0.0, 1.0, 0, 1, 1.0, api_name="/chat")  # ... or guesses wrong
    wrong_guess = _hits(server.url) - before
    before = _hits(server.url)
    first.predict(prompt, [], "", 0.0, 1.0, 0, 1, 1.0, api_name="/chat")  # the same visitor asks again
    same_session = _hits(server.url) - before
    assert other_session == wrong_guess and same_session >= other_session + 32, (other_session, same_session)
    before = _hits(server.url)
    _send(server.url, "/v1/completions", prompt, None)  # nor can an API client match a page session
    assert _hits(server.url) - before == 0


def test_with_a_key_health_and_metrics_show_no_counters_to_a_caller_without_it(server_with):
    key = "edge-test-key-5b1e9c"  # tests/test_access.py's flags: its server
    server = server_with("--api-key", key)
    health = httpx.get(f"{server.url}/health", timeout=10)
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert "engine" not in health.json() and "prefix_cache" not in health.text, health.text
    metrics = httpx.get(f"{server.url}/metrics", timeout=10)
    assert metrics.status_code == 401 and "prefix_cache" not in metrics.text, metrics.text
    auth = {"Authorization": f"Bearer {key}"}
    assert "prefix_cache_hit_tokens" in httpx.get(f"{server.url}/health", timeout=10, headers=auth).json()["engine"]
    assert "rill_prefix_cache_hit_tokens_total" in httpx.get(f"{server.url}/metrics", timeout=10, headers=auth).text


# --------------------------------------------------------------------------- grammars never compile on the engine thread

def test_a_resume_whose_grammar_the_cache_dropped_never_stalls_another_stream(server_with):
    """The resumed request's grammar compiles again (held here until the other stream ended): it
    must not hold the engine thread, so the other stream produces every token meanwhile."""
    url = server_with(*LONG_RESUME_FLAGS).url  # a window of 60 s (its record is far below the bytes it allows)
    with slow_steps(url, 0.05):
        with httpx.stream("POST", f"{url}/chat", timeout=60, json={
                "prompt": "Count", "regex": "(yes|no)( (yes|no)){0,60}", "max_new_tokens": 40,
                "temperature": 0}) as response:
            assert response.status_code == 200, response.read()
            request_id, token = response.headers["x-request-id"], response.headers["x-resume-token"]
            first = []
            for event in SSEReader(response):
                first.append(event)
                if len(first) == 2:
                    break  # the reader leaves: the stream is suspended (for the window: 60 s)
    held = httpx.post(f"{url}/_test/hold-compiles", params={"on": 1}, timeout=10)
    assert held.status_code == 200, held.text
    with slow_steps(url, 0.02):  # the other stream outlasts the resume's way to the engine (its compile: < 10 s)
        try:
            with httpx.stream("POST", f"{url}/chat", timeout=30, json={
                    "prompt": "Tell me a story", "max_new_tokens": 30, "ignore_eos": True,
                    "temperature": 0}) as other:
                reader = iter(SSEReader(other))
                events = [next(reader)]  # the other stream runs
                with ThreadPoolExecutor(1) as pool:
                    resumed = pool.submit(httpx.get, f"{url}/chat/{request_id}", timeout=60, headers={
                        "Last-Event-ID": first[-1].id, "x-resume-token": token})
                    try:
                        events.extend(reader)  # the other stream's every token, while the grammar is held
                    finally:
                        released = httpx.post(f"{url}/_test/hold-compiles", params={"on": 0}, timeout=10).json()
                    rest = resumed.result()
        finally:
            httpx.post(f"{url}/_test/hold-compiles", params={"on": 0}, timeout=10)
    assert usage_of(events)["completion_tokens"] == 30
    # The other stream ended while the grammar was still held: nothing waited for it. (A compile on the
    # engine thread stalls the other stream until the hold runs out and the compile goes on.)
    assert released["timed_out"] == 0, released
    assert rest.status_code == 200, rest.text
    rest_events = parse_sse(rest.content)
    assert usage_of(rest_events)["finish_reason"] in ("stop", "length"), rest.text[-500:]
    words = chat_text(first + rest_events).split()
    assert all(word in ("yes", "no") for word in words[:-1]), words  # the grammar held across the resume

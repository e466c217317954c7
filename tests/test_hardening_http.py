"""Issue 32, the second hardening pass, over real HTTP against tiny-Llama servers: no client can
slow, starve or read another. A reader that stops reading is cut off with a clear error instead of
growing the server without end."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import httpx
import pytest

from tests.servers import wait_idle

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


HEAVY = {"stream": True, "n": 16, "logprobs": True, "top_logprobs": 20, "ignore_eos": True, "max_tokens": 1000,
         "temperature": 1.0}


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {**HEAVY, "messages": [{"role": "user", "content": "Hi"}]}),
    ("/v1/completions", {**{k: v for k, v in HEAVY.items() if k != "top_logprobs"}, "logprobs": 5,
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

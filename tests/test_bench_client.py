"""The benchmark's load client (bench/run.py over bench/lean_http.py): what it reads off the wire
is what the server sent, over chunked, sized and closed bodies and reused connections."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from bench.lean_http import LeanClient
from bench.run import ChatApi, OpenAIApi, RequestRecord, run_level


def serve_once(responses: list[bytes]):
    """A raw TCP server's connection handler answering each request with the next of
    `responses` (`None` closes the connection instead); returns (handler, the requests it read)."""
    seen: list[bytes] = []

    async def handle(reader, writer):
        while responses:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)
            seen.append(head + await reader.readexactly(length))
            answer = responses.pop(0)
            if answer is None:
                break
            for i in range(0, len(answer), 7):  # in small pieces: chunk sizes and lines cut anywhere
                writer.write(answer[i:i + 7])
                await writer.drain()
                await asyncio.sleep(0)
        writer.close()

    return handle, seen


async def _exchange(responses, requests: int):
    handle, seen = serve_once(list(responses))
    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    got = []
    async with server, LeanClient(timeout=5) as client:
        for _ in range(requests):
            async with client.stream("POST", f"http://127.0.0.1:{port}/v1/x?a=1", json={"q": "é"}) as response:
                lines = [line async for line in response.aiter_lines()]
                got.append((response.status_code, response.headers.get("content-type"), lines))
    return got, seen


def chunked(*pieces: bytes) -> bytes:
    return b"".join(b"%x;ext=1\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\nX-Trailer: t\r\n\r\n"


def test_chunked_sized_and_reused_connections_read_exactly_the_bytes_sent():
    body = "data: {\"t\": \"héllo\"}\r\n\r\ndata: [DONE]\n\n".encode()
    first = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked(
        body[:5], body[5:9], body[9:])  # a chunk ends inside "é"'s two bytes
    second = b"HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\n{\"e\": \"no\"}"
    got, seen = asyncio.run(_exchange([first, second], 2))
    assert got[0] == (200, "text/event-stream", ['data: {"t": "héllo"}', "", "data: [DONE]", ""])
    assert got[1] == (400, "application/json", ['{"e": "no"}'])
    assert len(seen) == 2  # both requests went over the one connection
    assert seen[0].startswith(b"POST /v1/x?a=1 HTTP/1.1\r\nHost: 127.0.0.1:")
    assert seen[0].endswith(b"Content-Type: application/json\r\n\r\n" + '{"q": "\\u00e9"}'.encode())


def test_a_connection_the_server_closed_is_replaced_and_a_closing_body_is_read_to_its_end():
    ok = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nhi"
    closing = b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nline one\nline two"
    # first connection: one answer, then the server hangs up before the second request is read
    got, seen = asyncio.run(_exchange([ok, None, closing], 2))
    assert [g[2] for g in got] == [["hi"], ["line one", "line two"]]
    assert len(seen) == 3  # the second request was read by the dead connection, then sent anew


@pytest.mark.parametrize("api_class", [ChatApi, OpenAIApi])
def test_the_load_client_reads_the_same_text_as_httpx(tiny_server, api_class):
    """Against rill itself: greedy streams read by the lean client equal the non-streaming
    answers, on eight closed-loop clients at once, with no error."""
    api = api_class(tiny_server.url, max_tokens=12, ignore_eos=False)  # /chat has no ignore_eos
    prompts = [f"Tell me about number {i}." for i in range(8)]
    records, t0, t1, cpu_s = asyncio.run(run_level(api, prompts, [12] * 8, 8, timeout=60, progress=False, label="t"))
    assert all(r.error is None for r in records), [r.error for r in records]
    assert t1 > t0 and cpu_s > 0
    by_prompt = {}
    for prompt in prompts:
        answer = httpx.post(f"{tiny_server.url}/v1/completions", json={
            "prompt": prompt, "max_tokens": 12, "temperature": 0}, timeout=60).json()
        by_prompt[prompt] = answer["choices"][0]["text"]
    # /chat with raw=True takes the prompt unformatted, as /v1/completions does
    assert sorted(r.text for r in records) == sorted(by_prompt.values())
    assert all(isinstance(r, RequestRecord) and r.piece_times for r in records)

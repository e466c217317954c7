"""Fair share over real HTTP: one client flooding `/v1/completions` with n=16 does not take the
engine from a second client (another peer address: a caller is who connects, not the
`x-session-id` it sends), who is admitted and served ahead of the flood's queued samples."""

from __future__ import annotations

import asyncio
import json

import httpx

from tests.servers import slow_steps, wait_idle

FLOOD = {"prompt": "Count the stars one by one:", "n": 16, "max_tokens": 40, "temperature": 0, "ignore_eos": True,
         "stream": True}
SINGLE = {"prompt": "Say hello.", "max_tokens": 4, "temperature": 0, "ignore_eos": True, "stream": True}


async def _stream(client: httpx.AsyncClient, url: str, body: dict, session: str, name: str, firsts: list,
                  started: asyncio.Event | None = None) -> int:
    """Streams one completion; appends (name, choice index) to `firsts` as each choice's first chunk
    arrives (one event loop: the list is the order of arrival). Returns the status."""
    seen: set[int] = set()
    async with client.stream("POST", f"{url}/v1/completions", json=body,
                             headers={"x-session-id": session}) as response:
        if started is not None:
            started.set()
        if response.status_code != 200:
            await response.aread()
            return response.status_code
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:]).get("choices", ()):
                if choice["index"] not in seen:
                    seen.add(choice["index"])
                    firsts.append((name, choice["index"]))
    return response.status_code


def test_a_second_client_is_admitted_and_served_ahead_of_a_flood(server_with):
    url = server_with("--max-num-seqs", "8", "--max-queue", "24").url  # 32 sequences: two n=16 requests
    wait_idle(url)
    firsts: list[tuple[str, int]] = []

    async def scenario():
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=16)) as client:
            await client.get(f"{url}/health")
            started = [asyncio.Event(), asyncio.Event()]
            flood = [asyncio.create_task(_stream(client, url, FLOOD, "A", f"A{i}", firsts, started[i]))
                     for i in range(2)]
            for event in started:
                await event.wait()  # both admitted: 8 running, 24 waiting, all A's
            more = await client.post(f"{url}/v1/completions", json={**FLOOD, "stream": False},
                                     headers={"x-session-id": "A"})
            # B connects from another loopback address: another caller (its own x-session-id would not do)
            async with httpx.AsyncClient(timeout=120, transport=httpx.AsyncHTTPTransport(
                    local_address="127.0.0.2")) as other:
                single = await _stream(other, url, SINGLE, "B", "B", firsts)
            return more.status_code, single, await asyncio.gather(*flood)

    with slow_steps(url, 0.02):  # 40 tokens take a wave of 8 samples about a second
        more, single, flood = asyncio.run(scenario())
    assert flood == [200, 200]
    assert more == 429, "the flooding client already holds every slot and the whole queue"
    assert single == 200, "the second client holds nothing: it is admitted past the full queue"
    order = [name for name, _ in firsts]
    assert "B" in order and order.count("A0") == 16 and order.count("A1") == 16, firsts
    second = max(("A0", "A1"), key=order.index)  # the flood's request admitted last: all 16 samples queued
    # FIFO would serve B after all 24 queued samples; fair, it takes the first slot that frees,
    # before any sample of the flood's second request (they waited behind the first's 8)
    assert second not in order[:order.index("B")], f"the second client waited behind the flood's queue: {firsts}"
    wait_idle(url)

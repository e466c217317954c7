"""What one Server-Sent Event costs the server: server/sse.py's `SSEResponse` against sse-starlette's
`EventSourceResponse` (the card's package), side by side in one run.

    python -m bench.sse_cost [--streams 16] [--events 400] [--rounds 5]

A uvicorn process serves two routes that stream the same events (openai-sized JSON chunks, one per
wake-up of the event loop, as the engine delivers tokens) through each response. A client process
reads `--streams` streams at once, and the server's CPU time (user + system, from /proc) per event
is the figure: that time is taken from the engine's cores. Rounds alternate the two responses;
the medians and their ratio are printed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time

SERVER = r'''
import asyncio, json, sys
from fastapi import FastAPI
from sse_starlette.sse import EventSourceResponse
from server.sse import SSEResponse

app = FastAPI()
CHUNK = json.dumps({"id": "cmpl-0123456789abcdef", "object": "text_completion", "created": 1764590000,
                    "model": "SmolLM2-135M-Instruct", "choices": [{"index": 0, "text": " word", "logprobs": None,
                    "finish_reason": None}]})

async def events(n):
    for i in range(n):
        await asyncio.sleep(0)  # one event per wake-up, as tokens arrive from the engine
        yield {"data": CHUNK}
    yield {"data": "[DONE]"}

@app.get("/lean")
async def lean(n: int):
    return SSEResponse(events(n))

@app.get("/starlette")
async def starlette(n: int):
    return EventSourceResponse(events(n), ping=15)

import uvicorn
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
'''


def _cpu_seconds(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


async def _read_streams(url: str, streams: int) -> int:
    import httpx

    async def one(client) -> int:
        count = 0
        async with client.stream("GET", url) as response:
            async for line in response.aiter_lines():
                count += line.startswith("data:")
        return count

    async with httpx.AsyncClient(timeout=60) as client:
        return sum(await asyncio.gather(*(one(client) for _ in range(streams))))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--events", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    port = _free_port()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    server = subprocess.Popen([sys.executable, "-c", SERVER, str(port)], cwd=root)
    try:
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.2)
        per_event = {"lean": [], "starlette": []}
        for round_ in range(args.rounds + 1):  # round 0 warms both routes up
            for route in per_event:
                before = _cpu_seconds(server.pid)
                received = asyncio.run(_read_streams(f"http://127.0.0.1:{port}/{route}?n={args.events}", args.streams))
                spent = _cpu_seconds(server.pid) - before
                if received != args.streams * (args.events + 1):
                    raise SystemExit(f"{route}: {received} events arrived, not {args.streams * (args.events + 1)}")
                if round_:
                    per_event[route].append(spent / received * 1e6)
        # CPU time counts in clock ticks: a small run may spend none on a route (no ratio then)
        lean, other = (statistics.median(v) for v in per_event.values())
        print(json.dumps({"streams": args.streams, "events_per_stream": args.events, "rounds": args.rounds,
                          "server_cpu_us_per_event": {"server/sse.py": round(lean, 1), "sse-starlette": round(other, 1)},
                          "ratio_sse_starlette_over_lean": round(other / lean, 2) if lean and other else None,
                          "cpu": _cpu_name()}, indent=1))
    finally:
        server.terminate()
        server.wait()


def _cpu_name() -> str:
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


if __name__ == "__main__":
    main()

"""Fair share: a second client's time to first token on an idle server against during a flood.

    .venv/bin/python bench/fair_share.py [--model PATH] [--tries 5]

Starts `app.py` (the benchmark Llama of bench/model.py unless `--model`; 8 slots, 24 queued), then
client B (`x-session-id: B`) sends one short streamed `/v1/completions` `--tries` times on the idle
server, then as many times while client A (`x-session-id: A`) keeps two `n=16` requests in flight
(a new one as each ends): slots and queue full of A's samples. Prints the medians, B's 429s, one
engine step (the median gap between a flood stream's chunks) and issue 32's target: B's TTFT
during the flood within 2x its idle TTFT plus one step.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
FLOOD = {"prompt": "Count the stars one by one:", "n": 16, "max_tokens": 96, "temperature": 0, "ignore_eos": True,
         "stream": True}
SINGLE = {"prompt": "Say hello.", "max_tokens": 8, "temperature": 0, "ignore_eos": True, "stream": True}


async def _stream(client: httpx.AsyncClient, url: str, body: dict, session: str, gaps: list | None = None):
    """(status, seconds to the first chunk with text, or to the first chunk when no token printed any
    text, e.g. a random model's special tokens; None when none came); `gaps`: the seconds between chunks."""
    sent = time.monotonic()
    first, first_chunk, last = None, None, None
    async with client.stream("POST", f"{url}/v1/completions", json=body, headers={"x-session-id": session}) as r:
        if r.status_code != 200:
            await r.aread()
            return r.status_code, None
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = time.monotonic()
            choices = json.loads(line[6:]).get("choices", ())
            if first_chunk is None and choices:
                first_chunk = now - sent
            if first is None and any(c.get("text") for c in choices):
                first = now - sent
            if any(c.get("index") == 0 for c in choices):  # one sample's chunks: one a step
                if gaps is not None and last is not None:
                    gaps.append(now - last)
                last = now
    return r.status_code, first if first is not None else first_chunk


async def _flood(client: httpx.AsyncClient, url: str, stop: asyncio.Event, gaps: list) -> None:
    while not stop.is_set():
        status, _ = await _stream(client, url, FLOOD, "A", gaps)
        if status != 200:
            await asyncio.sleep(0.05)


async def _measure(url: str, tries: int) -> dict:
    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=32)) as client:
        idle = [(await _stream(client, url, SINGLE, "B"))[1] for _ in range(tries)]
        stop, gaps = asyncio.Event(), []
        flood = [asyncio.create_task(_flood(client, url, stop, gaps)) for _ in range(2)]
        await asyncio.sleep(3.0)  # both n=16 admitted and decoding: 8 running, 24 waiting
        busy = []
        for _ in range(tries):
            busy.append(await _stream(client, url, SINGLE, "B"))
            await asyncio.sleep(0.5)
        stop.set()
        for task in flood:  # A's requests in flight are dropped, not waited for (the server aborts them)
            task.cancel()
        await asyncio.gather(*flood, return_exceptions=True)
    return {"idle": idle, "busy": busy, "step": statistics.median(gaps) if gaps else float("nan")}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a model folder (default: the benchmark Llama, built once)")
    parser.add_argument("--tries", type=int, default=5)
    args = parser.parse_args(argv)
    if args.model is None:
        sys.path.insert(0, str(ROOT))
        from bench.model import ensure_bench_model

        args.model = str(ensure_bench_model())
    from bench.servers import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "app.py", "--model", args.model, "--port", str(port), "--log-level",
                               "warning", "--max-num-seqs", "8", "--max-queue", "24"], cwd=ROOT,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(600):
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        result = asyncio.run(_measure(url, args.tries))
    finally:
        server.terminate()
        server.wait()
    idle = statistics.median(result["idle"])
    ok = [t for status, t in result["busy"] if status == 200 and t is not None]
    refused = sum(status == 429 for status, _ in result["busy"])
    busy = statistics.median(ok) if ok else float("nan")
    target = 2 * idle + result["step"]
    print(f"model {args.model}: 8 slots, 24 queued; client A floods with two n=16 requests, B sends {args.tries}")
    print(f"B's TTFT idle:        {idle * 1000:8.1f} ms (median of {len(result['idle'])})")
    print(f"B's TTFT under flood: {busy * 1000:8.1f} ms (median of {len(ok)}; 429s: {refused})")
    print(f"one engine step:      {result['step'] * 1000:8.1f} ms (median gap between one flood sample's chunks)")
    print(f"target 2 x idle + 1 step: {target * 1000:.1f} ms -> {'met' if busy <= target else 'NOT met'} "
          f"(ratio under flood / idle: {busy / idle:.2f})")


if __name__ == "__main__":
    main()

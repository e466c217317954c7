"""Soak: many requests from concurrent clients over the three routes, random prompts and lengths,
some clients disconnecting; afterwards every completed answer equals its greedy reference, no KV
block is leaked and the server still answers.

RILL_SOAK_REQUESTS sets the number of requests (CI: 200; `make soak`: 2000).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
from dataclasses import dataclass

import httpx
from gradio_client import Client

from tests.servers import chat_text, iter_sse_blocks, wait_idle

NUM_REQUESTS = int(os.environ.get("RILL_SOAK_REQUESTS", "200"))
CONCURRENCY = 32
DISCONNECT_RATE = 0.10
PROMPTS = [
    "What is the capital of France?", "Tell me a story about a robot.", "def add(a, b):", "你好，世界！",
    "List three colours.", "Why is the sky blue?", "Emoji time: 😀🚀", "Count from one to ten.",
    "Explain a KV cache.", "Translate 'good morning' into French.", "Write a haiku about rain.", "Hello!",
]
MAX_TOKENS = (4, 16, 40)
ROUTES = ("chat_stream", "chat_plain", "v1_chat_stream", "v1_chat", "v1_completions_stream", "v1_completions",
          "gradio")
GREEDY_PAGE = dict(system_prompt="", temperature=0.0, top_p=1.0, top_k=0, repetition_penalty=1.0)


@dataclass
class Job:
    route: str
    prompt: str
    max_tokens: int
    disconnect_after: int | None  # close the stream after this many events (streaming routes only)
    text: str | None = None  # the whole answer, when the job completed
    error: str | None = None

    @property
    def template(self) -> str:
        return "raw" if self.route.startswith("v1_completions") else "chat"


def make_jobs(rng: random.Random) -> list[Job]:
    jobs = []
    for _ in range(NUM_REQUESTS):
        route = rng.choice(ROUTES)
        streaming = route.endswith("_stream")
        disconnect = rng.randint(1, 3) if streaming and rng.random() < DISCONNECT_RATE else None
        jobs.append(Job(route, rng.choice(PROMPTS), rng.choice(MAX_TOKENS), disconnect))
    return jobs


async def read_sse(response: httpx.Response, job: Job) -> list:
    events, buffer = [], ""
    async for text in response.aiter_text():
        buffer += text
        while "\n\n" in buffer:
            block, buffer = buffer.split("\n\n", 1)
            events.extend(iter_sse_blocks([block]))
            if job.disconnect_after is not None and len(events) >= job.disconnect_after:
                return events  # leaving the `async with` closes the connection mid-stream
    return events


async def run_http(client: httpx.AsyncClient, url: str, job: Job) -> None:
    messages = [{"role": "user", "content": job.prompt}]
    if job.route.startswith("chat"):
        body = {"prompt": job.prompt, "temperature": 0, "max_new_tokens": job.max_tokens,
                "stream": job.route == "chat_stream"}
        path = "/chat"
    elif job.route.startswith("v1_chat"):
        body = {"messages": messages, "temperature": 0, "max_tokens": job.max_tokens,
                "stream": job.route.endswith("_stream")}
        path = "/v1/chat/completions"
    else:
        body = {"prompt": job.prompt, "temperature": 0, "max_tokens": job.max_tokens,
                "stream": job.route.endswith("_stream")}
        path = "/v1/completions"
    async with client.stream("POST", url + path, json=body) as response:
        if response.status_code != 200:
            job.error = f"{response.status_code}: {(await response.aread())[:200]!r}"
            return
        if not body["stream"]:
            data = json.loads(await response.aread())
            if path == "/chat":
                job.text = data["response"]
            elif path == "/v1/chat/completions":
                job.text = data["choices"][0]["message"]["content"]
            else:
                job.text = data["choices"][0]["text"]
            return
        events = await read_sse(response, job)
    if job.disconnect_after is not None:
        return
    if path == "/chat":
        if events[-1].event != "end" or any(e.event == "error" for e in events):
            job.error = f"stream ended badly: {events[-2:]}"
            return
        job.text = chat_text(events)
        return
    pieces = []
    for event in events:
        if event.data == "[DONE]":
            break
        chunk = json.loads(event.data)
        if "error" in chunk:
            job.error = str(chunk["error"])
            return
        for choice in chunk["choices"]:
            pieces.append(choice.get("delta", {}).get("content") or choice.get("text") or "")
    job.text = "".join(pieces)


def run_gradio(url: str, job: Job) -> None:
    """One job on a Client of its own, as each visitor of the page has its own session. Jobs that
    come and go on one shared Client race in gradio_client: the server closes the session's event
    stream when its last job completes, and a job that Client registered meanwhile is cancelled
    (`CancelledError`, seen once in CI)."""
    client = Client(url + "/", verbose=False)
    job.text = client.submit(message=job.prompt, history=[], max_new_tokens=job.max_tokens, api_name="/chat",
                             **GREEDY_PAGE).result(timeout=300)


async def soak(url: str, jobs: list[Job]) -> None:
    gate = asyncio.Semaphore(CONCURRENCY)
    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=CONCURRENCY + 8)) as client:

        async def one(job: Job):
            async with gate:
                try:
                    if job.route == "gradio":
                        await asyncio.to_thread(run_gradio, url, job)
                    else:
                        await run_http(client, url, job)
                except Exception as exc:  # recorded and asserted on below
                    job.error = f"{type(exc).__name__}: {exc}"

        await asyncio.gather(*(one(job) for job in jobs))


def references(url: str, jobs: list[Job]) -> dict[tuple, str]:
    refs = {}
    with httpx.Client(timeout=120) as client:
        for key in sorted({(j.template, j.prompt, j.max_tokens) for j in jobs if j.text is not None}):
            template, prompt, max_tokens = key
            if template == "chat":
                refs[key] = client.post(f"{url}/chat", json={"prompt": prompt, "temperature": 0, "stream": False,
                                                             "max_new_tokens": max_tokens}).json()["response"]
            else:
                refs[key] = client.post(f"{url}/v1/completions", json={"prompt": prompt, "temperature": 0,
                                                                       "max_tokens": max_tokens}).json()["choices"][0]["text"]
    return refs


def test_soak_over_three_routes_with_disconnects(tiny_server, server_with):
    url = tiny_server.url
    wait_idle(url)
    jobs = make_jobs(random.Random(1234))
    asyncio.run(soak(url, jobs))

    failed = [j for j in jobs if j.error is not None]
    assert not failed, f"{len(failed)} requests failed, e.g. {failed[:3]}"
    completed = [j for j in jobs if j.text is not None]
    disconnected = [j for j in jobs if j.disconnect_after is not None]
    assert len(completed) + len(disconnected) == len(jobs)
    assert disconnected, "the random plan should include disconnects"

    engine = wait_idle(url, timeout=60)  # aborted and finished requests gave every KV block back
    assert engine["num_free_kv_blocks"] == engine["num_kv_blocks"]

    # the references from a server that never saw the soak: a block it corrupted cannot answer them
    refs = references(server_with("--seed", "0", "--resume-window", "7").url, jobs)
    wrong = [(j.route, j.prompt, j.max_tokens, j.text, refs[(j.template, j.prompt, j.max_tokens)])
             for j in completed if j.text != refs[(j.template, j.prompt, j.max_tokens)]]
    assert not wrong, f"{len(wrong)} of {len(completed)} answers differ from their greedy reference: {wrong[:3]}"
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    print(f"soak: {len(jobs)} requests, {len(completed)} completed, {len(disconnected)} disconnected")

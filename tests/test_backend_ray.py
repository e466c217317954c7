"""--backend ray against the local backend: real app.py processes, a real local Ray instance with
two engine replicas (each a tiny random Llama in its own process, one torch thread), no mocks.

One Ray front end serves the whole module (Ray and two replicas start once, about a minute on
two cores); its tests run in file order and the replica-killing one comes last."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import time

import httpx
import pytest
from gradio_client import Client

from tests.servers import SSEReader, chat_text, run_server, slow_steps, wait_idle

pytest.importorskip("ray.serve", reason="--backend ray needs requirements-ray.txt")
pytestmark = [pytest.mark.ray, pytest.mark.server]

RAY_FLAGS = ("--backend", "ray", "--replicas", "2", "--max-num-seqs", "16", "--max-queue", "8",
             "--resume-window", "5")  # each replica's engine admits 24 sequences
QUESTIONS = [f"Question {i}: what do you know about the number {i * 7}?" for i in range(16)]


@pytest.fixture(scope="module")
def local(tiny_server):
    """The local backend: the shared tiny server (the same model and flags, --resume-window 5)."""
    return tiny_server


@pytest.fixture(scope="module")
def ray_front(tiny_llama_path):
    with run_server("--model", str(tiny_llama_path), *RAY_FLAGS) as server:
        yield server


def replicas(server) -> dict[str, dict]:
    """The live replicas /health lists, by id."""
    return {r["replica"]: r for r in server.health()["replicas"] if r["alive"]}


def settle() -> None:
    time.sleep(1.2)  # replicas post their statistics every 0.5 s


def chat_once(url: str, body: dict, **headers) -> str:
    response = httpx.post(f"{url}/chat", json={"temperature": 0, "stream": False, **body}, headers=headers,
                          timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["response"]


def chat_stream_text(url: str, question: str) -> str:
    with httpx.stream("POST", f"{url}/chat", json={"prompt": question, "temperature": 0, "max_new_tokens": 24},
                      timeout=120) as response:
        assert response.status_code == 200
        events = list(SSEReader(response))
    assert events[-1].event == "end" and not [e for e in events if e.event == "error"], events
    return chat_text(events)


def v1_stream_text(url: str, question: str) -> str:
    body = {"messages": [{"role": "user", "content": question}], "temperature": 0, "max_tokens": 24,
            "stream": True}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        chunks = [json.loads(e.data) for e in SSEReader(response) if e.data != "[DONE]"]
    return "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])


def in_parallel(function, items) -> list:
    with concurrent.futures.ThreadPoolExecutor(len(items)) as pool:
        return list(pool.map(function, items))


def test_sixteen_concurrent_greedy_requests_equal_the_local_backend_on_every_api(local, ray_front):
    expected = [chat_once(local.url, {"prompt": q, "max_new_tokens": 24}) for q in QUESTIONS]
    served_before = {rid: r["requests_total"] for rid, r in replicas(ray_front).items()}
    assert len(served_before) == 2

    assert in_parallel(lambda q: chat_stream_text(ray_front.url, q), QUESTIONS) == expected
    assert in_parallel(lambda q: v1_stream_text(ray_front.url, q), QUESTIONS) == expected
    client = Client(ray_front.url + "/", verbose=False)
    jobs = [client.submit(q, [], "", 0.0, 1.0, 0, 24, 1.0, api_name="/chat") for q in QUESTIONS]
    assert [job.result(timeout=120) for job in jobs] == expected

    settle()
    served = {rid: r["requests_total"] - served_before.get(rid, 0) for rid, r in replicas(ray_front).items()}
    assert sum(served.values()) == 3 * len(QUESTIONS)
    assert all(count > 0 for count in served.values()), f"one replica served everything: {served}"
    metrics = httpx.get(f"{ray_front.url}/metrics", timeout=10).text
    for rid, r in replicas(ray_front).items():
        assert f'rill_replica_requests_total{{replica="{rid}"}} {float(r["requests_total"])}' in metrics
    wait_idle(ray_front.url)


def test_a_conversation_stays_on_the_replica_that_holds_its_prefix(ray_front):
    system = "You are a patient assistant. Answer in one short sentence, and never use lists. " * 2
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Tell me about tea."}]
    settle()
    before = {rid: (r["requests_total"], r["engine"]["prefix_cache_hit_tokens"])
              for rid, r in replicas(ray_front).items()}
    for turn in range(4):
        answer = chat_once(ray_front.url, {"messages": messages, "max_new_tokens": 8})
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": f"And turn {turn}?"}]
    # A session key keeps short unrelated prompts together too.
    for i in range(4):
        chat_once(ray_front.url, {"prompt": f"hi {i}", "max_new_tokens": 4}, **{"x-session-id": "visitor-42"})
    settle()
    after = replicas(ray_front)
    served = {rid: after[rid]["requests_total"] - before[rid][0] for rid in before}
    hits = {rid: after[rid]["engine"]["prefix_cache_hit_tokens"] - before[rid][1] for rid in before}
    assert sorted(served.values()) in ([0, 8], [4, 4]), served  # each group of 4 on one replica
    assert max(hits.values()) > 0  # later turns reused the earlier turns' blocks there


def test_a_resumed_chat_stream_continues_on_the_replicas(local, ray_front):
    question = "Write a long story about a lighthouse keeper."
    expected = chat_once(local.url, {"prompt": question, "max_new_tokens": 60})
    with httpx.stream("POST", f"{ray_front.url}/chat", json={"prompt": question, "temperature": 0,
                                                               "max_new_tokens": 60}, timeout=60) as response:
        token, request_id = response.headers["x-resume-token"], response.headers["x-request-id"]
        reader = iter(SSEReader(response))
        first = [next(reader) for _ in range(3)]
    time.sleep(0.5)
    with httpx.stream("GET", f"{ray_front.url}/chat/{request_id}", headers={
            "x-resume-token": token, "Last-Event-ID": first[-1].id}, timeout=60) as response:
        assert response.status_code == 200
        rest = list(SSEReader(response))
    # Exactly, also when the cut fell inside a character whose bytes span tokens, or after a token
    # whose text was held: the replica's abort never sends what was held, and the continuation
    # releases it in context.
    assert chat_text(first + rest) == expected
    assert [e.event for e in rest][-2:] == ["usage", "end"]


def test_a_disconnect_aborts_the_request_on_its_replica(ray_front):
    settle()
    aborted_before = sum(r["engine"]["finished_total"].get("abort", 0) for r in replicas(ray_front).values())
    body = {"prompt": "Count forever.", "max_tokens": 900, "ignore_eos": True, "stream": True}
    with slow_steps(ray_front.url, 0.01):  # 900 tokens take 9 s or more: the client leaves long before
        with httpx.stream("POST", f"{ray_front.url}/v1/completions", json=body, timeout=60) as response:
            reader = iter(SSEReader(response))
            for _ in range(5):
                next(reader)
        wait_idle(ray_front.url)  # every replica: nothing running, every KV block free
    settle()
    aborted = sum(r["engine"]["finished_total"].get("abort", 0) for r in replicas(ray_front).values())
    assert aborted == aborted_before + 1


def test_overload_is_a_429_with_retry_after(ray_front):
    # Three prompts of 16 samples each: 48 sequences, and no replica's engine takes two of them.
    body = {"prompt": ["Talk.", "Sing.", "Shout."], "n": 16, "max_tokens": 200, "ignore_eos": True,
            "temperature": 1.0, "stream": True}
    with slow_steps(ray_front.url, 0.01):  # the first prompt's samples still run when the third comes
        response = httpx.post(f"{ray_front.url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 429, response.text
    assert response.headers["Retry-After"] == "1"
    error = response.json()["error"]
    assert error["code"] == "queue_full" and "capacity" in error["message"]
    wait_idle(ray_front.url)  # the samples admitted before the refusal were aborted


def both_running(server, wait_s: float = 1.5) -> dict[str, int]:
    """The replicas' running counts as soon as both run a sequence (polled every 0.1 s), else {}."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        running = {rid: r["engine"]["num_running"] for rid, r in replicas(server).items()}
        if len(running) == 2 and all(running.values()):
            return running
        time.sleep(0.1)
    return {}


def test_a_killed_replica_errors_its_streams_the_other_serves_and_ray_restarts_it(ray_front):
    """Last in the module: it kills a replica process. The kill comes as soon as both replicas
    run a stream (their statistics are at most 0.5 s old, more when a replica is busy). Each
    stream is 4 samples of 500 tokens, and every step of the replicas sleeps 10 ms first
    (`/_test/slow-steps` reaches them through the board), so a stream lasts at least 5 s however
    fast the machine: without the sleep they took 1.5-1.9 s, and the kill once came after both
    had finished."""
    body = {"max_tokens": 500, "ignore_eos": True, "stream": True, "n": 4}
    clients, streams, running = [], [], {}
    try:
        with slow_steps(ray_front.url, 0.01):
            for i in range(0, 6, 2):  # two at a time, until both replicas run some (24 samples fill one)
                for j in (i, i + 1):
                    client = httpx.Client(timeout=120)
                    request = client.build_request("POST", f"{ray_front.url}/v1/completions",
                                                   json={**body, "prompt": f"Stream {j}: say something long."})
                    clients.append(client)
                    streams.append(client.send(request, stream=True))
                running = both_running(ray_front)
                if running:
                    break
            assert running, f"the streams did not spread over both replicas: {ray_front.health()['replicas']}"
            started = time.monotonic()
            victim_id = max(running, key=running.get)
            victim = replicas(ray_front)[victim_id]
            os.kill(victim["pid"], signal.SIGKILL)

            def read(response) -> tuple[list[str], float]:
                events = [e.event for e in SSEReader(response)]
                return events, time.monotonic() - started

            timed = in_parallel(read, streams)
    finally:
        for client in clients:
            client.close()
    outcomes = [events for events, _ in timed]
    errored = [events for events in outcomes if "error" in events]
    summary = [(len(events), "error" in events, f"ended {seconds:.1f} s after the kill") for events, seconds in timed]
    assert errored and len(errored) < len(outcomes), (running, summary)
    assert all(events[-1] == "message" for events in outcomes)  # each ends with data: [DONE]
    # New requests go to the live replica.
    for i in range(4):
        assert chat_once(ray_front.url, {"prompt": f"after {i}", "max_new_tokens": 4}) is not None
    # Ray starts a new replica in the dead one's place.
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        alive = replicas(ray_front)
        if len(alive) == 2 and victim["pid"] not in {r["pid"] for r in alive.values()}:
            break
        time.sleep(1)
    else:
        pytest.fail(f"the killed replica did not come back: {ray_front.health()['replicas']}")
    assert ray_front.health()["status"] == "ok"

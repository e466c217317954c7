"""Reliability over real HTTP against real app.py processes: concurrent conversations on three
routes, disconnects, overload, resumable streams, API key, body limit, timeouts, faults, engine
death, SIGTERM."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from gradio_client import Client

from tests.servers import SSEReader, chat_text, parse_sse, slow_steps, usage_of, wait_idle

# The page's defaults sample (temperature 0.7, top-p 0.9, top-k 50, repetition penalty 1.1);
# these settings make a gradio_client call greedy like `/chat` with temperature 0.
GREEDY = dict(system_prompt="", temperature=0.0, top_p=1.0, top_k=0, repetition_penalty=1.0)
PROMPTS = [f"Question {i}: tell me something about the number {i * 7}." for i in range(16)]


def chat_greedy(url: str, prompt: str, max_new_tokens: int, headers: dict | None = None) -> str:
    response = httpx.post(f"{url}/chat", timeout=120, headers=headers,
                          json={"prompt": prompt, "temperature": 0, "max_new_tokens": max_new_tokens, "stream": False})
    assert response.status_code == 200, response.text
    return response.json()["response"]


def stream_chat_events(url: str, body: dict, headers: dict | None = None) -> list:
    with httpx.stream("POST", f"{url}/chat", json=body, headers=headers, timeout=120) as response:
        assert response.status_code == 200, response.read()
        return list(SSEReader(response))


def finished_total(url: str) -> dict[str, int]:
    """The engine's finished requests by reason (stop, length, abort, ...) so far."""
    return httpx.get(f"{url}/health", timeout=10).json()["engine"]["finished_total"]


def finished_since(url: str, before: dict[str, int]) -> dict[str, int]:
    """The requests finished since `before`, by reason (a shared server's earlier ones left out)."""
    now = finished_total(url)
    return {reason: now[reason] - before.get(reason, 0) for reason in now if now[reason] != before.get(reason, 0)}


@pytest.fixture(scope="module")
def abort_server(server_with):
    """Resuming off: a client that leaves aborts its request at once."""
    return server_with("--resume-window", "0")


# --------------------------------------------------------------------------- isolation


def test_16_concurrent_conversations_over_three_routes_each_get_their_own_text(tiny_server):
    url = tiny_server.url
    max_new = 24
    reference = [chat_greedy(url, p, max_new) for p in PROMPTS]
    openai_client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    gradio = Client(url + "/", verbose=False)
    model = openai_client.models.list().data[0].id

    def via_chat(prompt):
        return chat_text(stream_chat_events(url, {"prompt": prompt, "temperature": 0, "max_new_tokens": max_new}))

    def via_openai(prompt):
        stream = openai_client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                                       max_tokens=max_new, temperature=0, stream=True)
        return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    def via_gradio(prompt):
        return gradio.submit(message=prompt, history=[], **GREEDY,
                             max_new_tokens=max_new, api_name="/chat").result(timeout=120)

    routes = [via_chat, via_openai, via_gradio]
    start = threading.Barrier(len(PROMPTS))

    def run(i):
        start.wait()
        return routes[i % 3](PROMPTS[i])

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        answers = list(pool.map(run, range(len(PROMPTS))))
    for i, (answer, expected) in enumerate(zip(answers, reference)):
        assert answer == expected, f"conversation {i} via {routes[i % 3].__name__}"


# --------------------------------------------------------------------------- disconnects


def test_closed_chat_stream_is_aborted_and_its_kv_blocks_freed(tiny_server):
    url = tiny_server.url  # resuming on (--resume-window 5): the request is aborted anyway, kept resumable
    wait_idle(url)
    before = finished_total(url)
    # steps of at least 10 ms: the tiny model would otherwise write all 900 tokens in about 0.2 s
    with slow_steps(url, 0.01), httpx.stream("POST", f"{url}/chat", timeout=120, json={
            "prompt": "Talk for a long time.", "max_new_tokens": 900, "temperature": 0}) as response:
        events = iter(SSEReader(response))
        pieces = [next(events) for _ in range(5)]
        assert all(p.event == "message" for p in pieces)
        assert httpx.get(f"{url}/health").json()["engine"]["num_running"] == 1
        events.close()  # the client goes away after 5 pieces
    closed = time.monotonic()
    engine = wait_idle(url, timeout=10)
    print(f"idle {time.monotonic() - closed:.3f} s after the client closed")
    assert finished_since(url, before) == {"abort": 1}


def test_closed_openai_stream_and_abandoned_plain_request_are_aborted(abort_server):
    url = abort_server.url
    body = {"messages": [{"role": "user", "content": "Talk."}], "max_tokens": 900, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as response:
        for i, _ in enumerate(response.iter_lines()):
            if i == 8:
                break
    wait_idle(url, timeout=10)
    # a non-streaming client that gives up: with 10 ms steps its 900 tokens take far longer than 0.1 s
    with slow_steps(url, 0.01), pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/chat", json={"prompt": "Talk.", "max_new_tokens": 900, "stream": False}, timeout=0.1)
    wait_idle(url, timeout=10)


def test_cancelled_gradio_job_is_aborted(abort_server):
    url = abort_server.url
    client = Client(url + "/", verbose=False)
    wait_idle(url)
    before = finished_total(url)
    # steps of at least 20 ms: 900 tokens then take 18 s, far longer than the wait below, so only an
    # abort can end the request in time (the tiny model would otherwise finish them in about 0.2 s)
    with slow_steps(url, 0.02):
        job = client.submit(message="Talk for a long time.", history=[], **GREEDY,
                            max_new_tokens=900, api_name="/chat")
        deadline = time.monotonic() + 60
        while not job.outputs() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert job.outputs(), "no streamed update arrived"
        job.cancel()
        wait_idle(url, timeout=10)
    assert finished_since(url, before) == {"abort": 1}


# --------------------------------------------------------------------------- overload


def test_past_the_queue_chat_answers_429_at_once_with_retry_after(server_with):
    server = server_with("--max-num-seqs", "4", "--max-queue", "4")
    url = server.url
    wait_idle(url)

    async def one(client: httpx.AsyncClient, i: int):
        sent = time.monotonic()
        body = {"prompt": PROMPTS[i % len(PROMPTS)], "max_new_tokens": 400, "temperature": 0}
        async with client.stream("POST", f"{url}/chat", json=body) as response:
            answered = time.monotonic()
            raw = await response.aread()
            return response.status_code, answered - sent, time.monotonic(), response.headers, raw

    async def burst():
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=32)) as client:
            await client.get(f"{url}/health")
            return await asyncio.gather(*(one(client, i) for i in range(20)))

    with slow_steps(url, 0.01):  # 10 ms steps: no admitted request ends before the burst is answered
        results = asyncio.run(burst())
    ok = [r for r in results if r[0] == 200]
    busy = [r for r in results if r[0] == 429]
    failed = [parse_sse(r[4])[-2].data for r in ok if parse_sse(r[4])[-2].event == "error"]
    assert not failed, f"admitted streams failed inside the engine: {failed}"  # a failure frees its slot early
    assert (len(ok), len(busy)) == (8, 12), [r[0] for r in results]
    for status, latency, _, headers, raw in busy:
        assert int(headers["retry-after"]) >= 1
        assert "capacity" in json.loads(raw)["error"]
    first_success_done = min(done for _, _, done, _, _ in ok)
    assert all(sent_latency_done <= first_success_done for _, _, sent_latency_done, _, _ in busy)
    for *_, raw in ok:
        assert parse_sse(raw)[-1].event == "end"
    print("429 latencies (ms):", sorted(round(r[1] * 1000) for r in busy))
    wait_idle(url)


def test_openai_route_answers_429_in_its_shape_when_full(server_with):
    url = server_with("--max-num-seqs", "4", "--max-queue", "4").url
    wait_idle(url)
    body = {"prompt": "Talk.", "max_new_tokens": 900, "temperature": 0}
    with slow_steps(url, 0.01), httpx.Client(timeout=120) as client:  # the 8 outlive the 429 check
        streams = [client.stream("POST", f"{url}/chat", json=body) for _ in range(8)]
        responses = [s.__enter__() for s in streams]
        try:
            assert all(r.status_code == 200 for r in responses)
            full = client.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
            assert full.status_code == 429
            assert full.json()["error"]["type"] == "rate_limit_error"
            assert int(full.headers["retry-after"]) >= 1
        finally:
            for s in streams:
                s.__exit__(None, None, None)
    wait_idle(url)


def test_page_queue_holds_extra_visitors_in_line_with_their_position(server_with):
    """Gradio's queue runs --max-num-seqs page events at once; the rest wait with a queue rank."""
    url = server_with("--max-num-seqs", "4", "--max-queue", "4").url
    wait_idle(url)
    client = Client(url + "/", verbose=False)
    with slow_steps(url, 0.01):  # 10 ms steps: the 4 answers outlive the polling below
        jobs = [client.submit(message=f"Talk about {i}.", history=[], max_new_tokens=900, api_name="/chat", **GREEDY)
                for i in range(6)]
        try:
            seen = None  # a moment with 4 page events generating and the others waiting with a rank
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and seen is None:
                statuses = [job.status() for job in jobs]
                working = [s for s in statuses if s.code.name in ("PROCESSING", "ITERATING")]
                waiting = [s for s in statuses if s.code.name == "IN_QUEUE" and s.rank is not None]
                if len(working) == 4 and waiting:
                    seen = sorted(s.rank for s in waiting)
                time.sleep(0.05)
            assert seen is not None, "never saw 4 answers generating while the others waited in line"
            assert httpx.get(f"{url}/health", timeout=10).json()["engine"]["num_running"] <= 4
        finally:
            for job in jobs:
                job.cancel()
    wait_idle(url, timeout=30)


# --------------------------------------------------------------------------- resumable streams


def test_stream_cut_after_event_k_resumes_with_exactly_the_rest(tiny_server):
    url = tiny_server.url
    body = {"prompt": "Tell me a long story about a robot.", "max_new_tokens": 300, "temperature": 0}
    expected = chat_greedy(url, body["prompt"], 300)
    k = 7
    before = finished_total(url)
    # steps of at least 10 ms, so that the request is still running when the client leaves (the tiny
    # model would otherwise write its 300 tokens in about 0.1 s)
    with slow_steps(url, 0.01), httpx.stream("POST", f"{url}/chat", json=body, timeout=120) as response:
        request_id, token = response.headers["x-request-id"], response.headers["x-resume-token"]
        first = []
        for event in SSEReader(response):
            first.append(event)
            if len(first) == k:
                break
    assert [e.id for e in first] == [str(i) for i in range(1, k + 1)]
    # nobody reads it now: the engine request is aborted, its KV blocks freed, the stream kept
    wait_idle(url, timeout=10)
    assert finished_since(url, before) == {"abort": 1}
    assert httpx.get(f"{url}/health").json()["resumable_streams"] >= 1
    with httpx.stream("GET", f"{url}/chat/{request_id}", headers={"Last-Event-ID": str(k), "x-resume-token": token},
                      timeout=120) as response:
        assert response.status_code == 200
        rest = list(SSEReader(response))
    assert rest[0].id == str(k + 1) and rest[-1].event == "end"
    assert chat_text(first) + chat_text(rest) == expected
    assert usage_of(rest)["completion_tokens"] == 300
    # EventSource sends Last-Event-ID itself on reconnects but no headers of ours; a first GET can
    # pass both in the query
    again = parse_sse(httpx.get(f"{url}/chat/{request_id}", params={"last_event_id": 0, "resume_token": token},
                                timeout=120).content)
    assert chat_text(again) == expected
    bad = httpx.get(f"{url}/chat/{request_id}", headers={"Last-Event-ID": "seven", "x-resume-token": token}, timeout=30)
    assert bad.status_code == 400 and "Last-Event-ID" in bad.json()["error"]


def test_resuming_after_the_window_is_404_and_the_request_is_freed(tiny_server):
    url = tiny_server.url  # --resume-window 5
    with httpx.stream("POST", f"{url}/chat", json={"prompt": "Talk.", "max_new_tokens": 900, "temperature": 0},
                      timeout=120) as response:
        request_id, token = response.headers["x-request-id"], response.headers["x-resume-token"]
        for i, _ in enumerate(SSEReader(response)):
            if i == 2:
                break
    deadline = time.monotonic() + 60  # the window is 5 s; wait until the server dropped the stream
    while time.monotonic() < deadline and httpx.get(f"{url}/health", timeout=10).json()["resumable_streams"]:
        time.sleep(0.2)
    late = httpx.get(f"{url}/chat/{request_id}", headers={"Last-Event-ID": "3", "x-resume-token": token}, timeout=30)
    assert late.status_code == 404
    assert "resume window" in late.json()["error"] and "x-resume-token" in late.json()["error"]
    wait_idle(url, timeout=30)
    missing = httpx.get(f"{url}/chat/never-existed", timeout=30)
    assert missing.status_code == 404


# --------------------------------------------------------------------------- API key, body limit, timeout


@pytest.fixture(scope="module")
def guarded(server_with):
    return server_with("--api-key", "sekret-key", "--max-body-bytes", "4096", "--request-timeout", "2")


def test_api_key_is_required_on_chat_and_v1(guarded):
    url = guarded.url
    before = httpx.get(f"{url}/health", timeout=10, headers={"Authorization": "Bearer sekret-key"}).json()["engine"]["prompt_tokens_total"]
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret-key"}):
        chat = httpx.post(f"{url}/chat", json={"prompt": "Hi", "max_new_tokens": 2}, headers=headers, timeout=30)
        assert chat.status_code == 401 and "Authorization: Bearer" in chat.json()["error"]
        v1 = httpx.post(f"{url}/v1/chat/completions", headers=headers, timeout=30,
                        json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
        assert v1.status_code == 401
        assert v1.json()["error"]["type"] == "authentication_error" and v1.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{url}/v1/models", timeout=30).status_code == 401
    assert httpx.get(f"{url}/health", timeout=10, headers={"Authorization": "Bearer sekret-key"}).json()["engine"]["prompt_tokens_total"] == before  # no model work
    assert httpx.get(f"{url}/config", timeout=30).status_code == 401  # the page's API too (tests/test_access.py)
    good = httpx.post(f"{url}/chat", json={"prompt": "Hi", "max_new_tokens": 2, "stream": False}, timeout=60,
                      headers={"Authorization": "Bearer sekret-key"})
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 2
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="sekret-key", max_retries=0, timeout=60)
    assert client.completions.create(model=client.models.list().data[0].id, prompt="Hi", max_tokens=2,
                                     temperature=0).usage.completion_tokens == 2


def test_bodies_over_the_limit_get_413(guarded):
    url = guarded.url
    auth = {"Authorization": "Bearer sekret-key"}
    big = {"prompt": "x" * 5000, "max_new_tokens": 2}
    response = httpx.post(f"{url}/chat", json=big, headers=auth, timeout=30)
    assert response.status_code == 413 and "4096" in response.json()["error"]

    def chunks():  # no Content-Length: the limit still holds
        for _ in range(10):
            yield b"x" * 1000

    chunked = httpx.post(f"{url}/v1/completions", content=chunks(), timeout=30,
                         headers={**auth, "content-type": "application/json"})
    assert chunked.status_code == 413 and chunked.json()["error"]["type"] == "invalid_request_error"


def test_request_timeout_ends_a_long_request_with_a_clear_error(guarded):
    url = guarded.url
    auth = {"Authorization": "Bearer sekret-key"}
    # 10 ms a step: 1000 tokens outlive the 2 s timeout on any machine (the native steps are fast)
    with slow_steps(url, 0.01, headers=auth):
        events = stream_chat_events(url, {"prompt": "Talk.", "max_new_tokens": 1000, "temperature": 0}, headers=auth)
        assert [e.event for e in events[-2:]] == ["error", "end"]
        assert "timeout" in json.loads(events[-2].data)["error"] and "2 s" in json.loads(events[-2].data)["error"]
        plain = httpx.post(f"{url}/v1/completions", json={"prompt": "Talk.", "max_tokens": 1000, "ignore_eos": True},
                           headers=auth, timeout=60)
        assert plain.status_code == 504 and "timeout" in plain.json()["error"]["message"]
    wait_idle(url, headers=auth)


def test_a_stuck_engine_answers_503_and_ends_its_requests_instead_of_hanging(server_with):
    """--stall-timeout 1, and a step that takes 5 s (as a deadlock or a hung kernel would hold it):
    the stream ends with an error saying so, /health is 503 with the reason, and once the step
    returns the server is healthy and answers again."""
    server = server_with("--stall-timeout", "1")
    url = server.url
    with slow_steps(url, 5):
        events = stream_chat_events(url, {"prompt": "Talk.", "max_new_tokens": 4, "temperature": 0})
        health = httpx.get(f"{url}/health", timeout=10)
    assert [e.event for e in events[-2:]] == ["error", "end"], events
    error = json.loads(events[-2].data)["error"]
    assert "inside one step" in error and "stuck" in error and "--stall-timeout 1 s" in error, error
    assert health.status_code == 503 and "stuck" in health.json()["reason"], health.text
    deadline = time.monotonic() + 30
    while httpx.get(f"{url}/health", timeout=10).status_code != 200 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    assert chat_text(stream_chat_events(url, {"prompt": "Hi", "max_new_tokens": 4, "temperature": 0}))


# --------------------------------------------------------------------------- faults


def test_a_request_failing_inside_the_engine_fails_alone(tiny_server):
    url = tiny_server.url
    prompts = PROMPTS[:3]
    expected = [chat_greedy(url, p, 40) for p in prompts]
    results = {}

    def normal(i):
        results[i] = chat_text(stream_chat_events(url, {"prompt": prompts[i], "temperature": 0, "max_new_tokens": 40}))

    def faulty():
        results["fault"] = stream_chat_events(url, {"prompt": "This one breaks.", "max_new_tokens": 40},
                                              headers={"x-rill-inject-fault": "1"})

    threads = [threading.Thread(target=normal, args=(i,)) for i in range(3)] + [threading.Thread(target=faulty)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [results[i] for i in range(3)] == expected
    fault = results["fault"]
    assert [e.event for e in fault[-2:]] == ["error", "end"]
    assert "engine" in json.loads(fault[-2].data)["error"]
    # a step that succeeds between the faults: MAX_FAILED_STEPS (3) steps in a row whose forward
    # fails for every sequence are taken for a broken model and rebuild the engine, and the faulty
    # stream above may have run alone once the normal answers had ended
    assert chat_greedy(url, prompts[1], 40) == expected[1]
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    with pytest.raises(openai.APIError):
        list(client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], max_tokens=8,
                                            stream=True, extra_headers={"x-rill-inject-fault": "1"}))
    with pytest.raises(openai.InternalServerError):
        client.completions.create(model=model, prompt="x", max_tokens=8, extra_headers={"x-rill-inject-fault": "1"})
    assert chat_greedy(url, prompts[0], 40) == expected[0]  # the server goes on
    wait_idle(url)


def _kill_with_http_and_gradio_consumers(url: str) -> tuple[list, Exception | None, str | None]:
    """An HTTP `/chat` stream and a gradio_client job in flight, then `/_test/kill-engine`: the
    stream's events and what the job ended with (its exception, or its answer if it finished)."""
    gradio = Client(url + "/", verbose=False)
    streaming = threading.Event()
    seen: list = []
    # 20 ms a step: both answers are still running when the engine dies, however fast the machine
    # (unslowed, the tiny model's 900 tokens could end before the page's job had started)
    assert httpx.post(f"{url}/_test/slow-steps", params={"seconds": 0.02}, timeout=10).status_code == 200

    def http_consumer():
        with httpx.stream("POST", f"{url}/chat", timeout=120,
                          json={"prompt": "Talk.", "max_new_tokens": 900, "temperature": 0}) as response:
            for event in SSEReader(response):
                seen.append(event)
                streaming.set()

    reader = threading.Thread(target=http_consumer)
    reader.start()
    assert streaming.wait(60), "the /chat stream sent nothing"
    job = gradio.submit(message="Talk for a long time.", history=[], **GREEDY, max_new_tokens=900, api_name="/chat")
    deadline = time.monotonic() + 60
    while not job.outputs() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert job.outputs(), "the gradio job streamed nothing"
    assert httpx.post(f"{url}/_test/kill-engine", timeout=10).status_code == 200
    reader.join(120)
    assert not reader.is_alive(), "the /chat stream never ended"
    try:
        return seen, None, job.result(timeout=120)
    except Exception as exc:  # gradio_client raises what the page showed
        return seen, exc, None


def test_engine_death_ends_page_and_http_consumers_with_an_error_then_the_engine_restarts(server_with):
    server = server_with("--max-engine-restarts", "2")
    server_with.retire(server)
    url = server.url
    expected = chat_greedy(url, PROMPTS[0], 24)
    gradio_expected = Client(url + "/", verbose=False).predict(message=PROMPTS[1], history=[], **GREEDY,
                                                               max_new_tokens=24, api_name="/chat")
    seen, page_error, page_answer = _kill_with_http_and_gradio_consumers(url)
    assert [e.event for e in seen[-2:]] == ["error", "end"]
    assert "engine stopped" in json.loads(seen[-2].data)["error"]
    assert page_answer is None and "engine stopped" in str(page_error)  # shown on the page as an error
    deadline = time.monotonic() + 60
    while httpx.get(f"{url}/health", timeout=10).status_code != 200 and time.monotonic() < deadline:
        time.sleep(0.1)
    health = httpx.get(f"{url}/health", timeout=10).json()
    assert health["status"] == "ok" and health["engine_restarts"] == 1
    assert chat_greedy(url, PROMPTS[0], 24) == expected  # the rebuilt engine answers as before
    gradio = Client(url + "/", verbose=False)  # and no page worker was left held
    answers = [gradio.submit(message=PROMPTS[1], history=[], **GREEDY, max_new_tokens=24, api_name="/chat")
               for _ in range(3)]
    assert [a.result(timeout=120) for a in answers] == [gradio_expected] * 3
    assert server.process.poll() is None


def test_engine_death_past_max_restarts_ends_every_consumer_then_the_process_exits_1(server_with):
    server = server_with("--max-engine-restarts", "0")
    server_with.retire(server)
    seen, page_error, page_answer = _kill_with_http_and_gradio_consumers(server.url)
    assert [e.event for e in seen[-2:]] == ["error", "end"]
    assert "engine stopped" in json.loads(seen[-2].data)["error"]
    assert page_answer is None and "engine stopped" in str(page_error)
    assert server.process.wait(60) == 1  # for the Space or supervisor to start a fresh process
    assert "the engine stays dead" in server.log()


@pytest.fixture(scope="module")
def nan_llama(tiny_llama_path, tmp_path_factory):
    """(the tiny Llama with NaN in one embedding row, a prompt holding that token)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.chat_template import encode_chat

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_path)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32)

    def ids(text):  # as /chat encodes it
        return encode_chat(tokenizer, [{"role": "user", "content": text}])

    used = {t for p in PROMPTS[:3] for t in ids(p)}
    poison, token = next((p, t) for t in range(len(tokenizer) - 1, 100, -1) if t not in used
                         for p in [f"Say {tokenizer.decode([t])} now."] if t in ids(p))
    with torch.no_grad():
        model.get_input_embeddings().weight[token] = float("nan")
    if model.config.tie_word_embeddings:  # the head reads the same rows: untie, so the others' logits stay finite
        model.config.tie_word_embeddings = False
        model.lm_head.weight = torch.nn.Parameter(torch.randn_like(model.lm_head.weight) * 0.02)
    out = tmp_path_factory.mktemp("nan_llama")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out, poison


def test_nan_weights_in_one_row_fail_the_request_that_reads_them_and_the_others_finish(server_with, nan_llama):
    """A real fault inside the model, over HTTP: NaN in the embedding row of one token turns that
    request's activations and logits into NaN, in a batch with three running requests. (The raising
    layer, a real exception from inside the forward, is tests/test_engine_faults.py.)"""
    path, poison = nan_llama
    server = server_with(model=path)
    url = server.url
    prompts = PROMPTS[:3]
    body = {"temperature": 0, "max_new_tokens": 200}
    expected = [chat_text(stream_chat_events(url, {"prompt": p, **body})) for p in prompts]
    results = {}
    streaming = [threading.Event() for _ in prompts]

    def normal(i):
        events = []
        with httpx.stream("POST", f"{url}/chat", json={"prompt": prompts[i], **body}, timeout=120) as response:
            for event in SSEReader(response):
                events.append(event)
                streaming[i].set()
        results[i] = chat_text(events)

    threads = [threading.Thread(target=normal, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    assert all(e.wait(60) for e in streaming)  # the poisoned prompt joins running decodes
    results["fault"] = stream_chat_events(url, {"prompt": poison, **body})
    for t in threads:
        t.join()
    assert [results[i] for i in range(3)] == expected
    fault = results["fault"]
    assert [e.event for e in fault[-2:]] == ["error", "end"]
    assert "non-finite" in json.loads(fault[-2].data)["error"]
    assert httpx.get(f"{url}/health", timeout=10).json()["engine_restarts"] == 0
    wait_idle(url)


# --------------------------------------------------------------------------- preemption


def test_32_concurrent_greedy_streams_on_a_small_kv_pool_each_equal_their_answer_alone(server_with):
    # 640 tokens of KV for 32 streams of ~180 (160 tokens out, past EOS): three fit at once, so
    # any four that overlap preempt one, however the requests' arrivals spread
    server = server_with("--num-kv-blocks", "40", "--block-size", "16")
    url = server.url
    prompts = [f"Stream {i}: count the boats in harbour {i * 13}." for i in range(32)]
    body = {"temperature": 0, "max_new_tokens": 160, "ignore_eos": True}
    alone = [chat_text(stream_chat_events(url, {"prompt": p, **body})) for p in prompts]
    before = httpx.get(f"{url}/health", timeout=10).json()["engine"]["num_preemptions"]
    start = threading.Barrier(len(prompts))

    def run(prompt):
        start.wait()
        return chat_text(stream_chat_events(url, {"prompt": prompt, **body}))

    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(run, prompts))
    preemptions = httpx.get(f"{url}/health", timeout=10).json()["engine"]["num_preemptions"] - before
    print(f"{preemptions} preemptions")
    assert preemptions > 0, "the pool was large enough for every stream: nothing was preempted"
    for i, (answer, expected) in enumerate(zip(together, alone)):
        assert answer == expected, f"stream {i}"
    wait_idle(url)


def test_sigterm_lets_running_streams_finish_then_exits_0(abort_server, server_with):
    """Runs last: it ends the abort server's process."""
    server = abort_server
    server_with.retire(server)
    url = server.url
    with httpx.stream("POST", f"{url}/chat", json={"prompt": "Talk.", "max_new_tokens": 600, "temperature": 0},
                      timeout=120) as response:
        events = iter(SSEReader(response))
        first = next(events)
        server.process.send_signal(signal.SIGTERM)
        refused = False
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not refused:
            try:
                httpx.get(f"{url}/health", timeout=2)
                time.sleep(0.05)
            except httpx.TransportError:
                refused = True
        rest = list(events)
    assert first.event == "message"
    assert refused, "the server still accepted connections after SIGTERM"
    assert [e.event for e in rest[-2:]] == ["usage", "end"]
    assert usage_of(rest)["completion_tokens"] == 600
    assert server.process.wait(60) == 0

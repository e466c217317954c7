"""Who may read what, over real HTTP against real app.py processes: a /chat stream resumes only
with the token its own response carried; the record of resumable streams stays within its
bounds; with an API key every route that reaches the model is closed (the Gradio side is in
tests/test_gradio_client.py) and the test hooks with them; without --test-hooks they do not
exist; an unexpected failure tells the client nothing about the inside."""

from __future__ import annotations

import json
import re
import secrets
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from transformers import AutoTokenizer

from frontend.errors import public_engine_error
from tests.servers import SSEReader, chat_text, parse_sse, run_server, slow_steps, usage_of, wait_idle

KEY = "edge-test-key-5b1e9c"
AUTH = {"Authorization": f"Bearer {KEY}"}
STORY = "Tell me a long story about a robot."
MAX_STREAMS, MAX_BYTES = 3, 20000  # the bounded server's --resume-max-streams and --resume-max-bytes


def greedy(url: str, body: dict, headers: dict | None = None) -> dict:
    response = httpx.post(f"{url}/chat", json={**body, "temperature": 0, "stream": False}, headers=headers,
                          timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def stream(url: str, body: dict, headers: dict | None = None, keep: int | None = None):
    """POST /chat; reads `keep` events (all when None) and leaves. -> (response headers, events)."""
    with httpx.stream("POST", f"{url}/chat", json={"temperature": 0, **body}, headers=headers,
                      timeout=120) as response:
        assert response.status_code == 200, response.read()
        events = []
        for event in SSEReader(response):
            events.append(event)
            if keep is not None and len(events) == keep:
                break
        return response.headers, events


def resume(url: str, request_id: str, token: str | None = None, after: int = 0,
           headers: dict | None = None) -> httpx.Response:
    sent = {"Last-Event-ID": str(after), **(headers or {})}
    if token is not None:
        sent["x-resume-token"] = token
    return httpx.get(f"{url}/chat/{request_id}", headers=sent, timeout=120)


def wire(events) -> list[tuple[str, str | None, str]]:
    return [(e.event, e.id, e.data) for e in events]


@pytest.fixture(scope="module")
def bounded(tiny_llama_path):
    """Tight resume bounds, a long window (so only the bounds drop streams), and no --test-hooks."""
    with run_server("--model", str(tiny_llama_path), "--resume-max-streams", str(MAX_STREAMS),
                    "--resume-max-bytes", str(MAX_BYTES), "--resume-window", "60", test_hooks=False) as server:
        yield server


@pytest.fixture(scope="module")
def keyed(server_with):
    return server_with("--api-key", KEY)


# --------------------------------------------------------------------------- the resume token


def test_only_the_token_from_the_streams_own_response_resumes_it(tiny_server):
    url = tiny_server.url
    body = {"prompt": STORY, "max_new_tokens": 120}
    expected = greedy(url, body)["response"]
    headers, first = stream(url, body, keep=5)
    request_id, token = headers["x-request-id"], headers["x-resume-token"]
    other_headers, _ = stream(url, {"prompt": "Hi", "max_new_tokens": 3})
    other_token = other_headers["x-resume-token"]
    assert len(token) >= 22 and re.fullmatch(r"[A-Za-z0-9_-]+", token)  # >= 128 bits, URL-safe
    assert token != other_token and request_id not in token

    refused = [
        resume(url, request_id),  # no token: what a second client with the id from the header has
        resume(url, request_id, secrets.token_urlsafe(24)),  # a guess
        resume(url, request_id, other_token),  # a real token of another stream
        httpx.get(f"{url}/chat/{request_id}", params={"resume_token": "x" * 32}, timeout=30),
        resume(url, "no-such-stream-7f3a", token),  # an unknown id, even with a real token
    ]
    assert [r.status_code for r in refused] == [404] * len(refused)
    assert len({r.content for r in refused}) == 1, [r.content for r in refused]  # the same bytes every time
    message = refused[0].json()["error"]
    assert "x-resume-token" in message and request_id not in message

    rest = resume(url, request_id, token, after=5)
    assert rest.status_code == 200
    events = parse_sse(rest.content)
    assert events[0].id == "6" and events[-1].event == "end"
    assert chat_text(first) + chat_text(events) == expected


def test_a_client_given_request_id_is_a_label_not_a_key(tiny_server):
    url = tiny_server.url
    answers = {}
    for prompt in ("Name a colour.", "Count to five."):
        headers, events = stream(url, {"prompt": prompt, "max_new_tokens": 12},
                                 headers={"x-request-id": "shared-label"})
        assert headers["x-request-id"] == "shared-label"  # the second is not refused: the first finished
        answers[headers["x-resume-token"]] = wire(events)
    assert len(answers) == 2 and len({tuple(a) for a in answers.values()}) == 2
    for token, events in answers.items():  # each token finds its own stream under the same label
        again = resume(url, "shared-label", token)
        assert again.status_code == 200 and wire(parse_sse(again.content)) == events
    plain = httpx.post(f"{url}/chat", json={"prompt": "Hi", "max_new_tokens": 2, "stream": False}, timeout=60)
    assert plain.status_code == 200 and "x-resume-token" not in plain.headers  # nothing to resume


def test_a_label_in_use_blocks_nobody_and_tells_nothing(tiny_server):
    """The engine keys requests by ids of its own: two live requests may share a label, and a
    request sent with another stream's label neither learns of it nor keeps it from resuming."""
    url = tiny_server.url
    body = {"prompt": STORY, "max_new_tokens": 120}
    expected = greedy(url, body)["response"]
    headers, first = stream(url, body, headers={"x-request-id": "victim-label"}, keep=4)
    token = headers["x-resume-token"]
    wait_idle(url, timeout=10)  # nobody reads it: aborted in the engine, kept resumable
    long_body = {"prompt": "Talk for a long time.", "max_new_tokens": 400, "temperature": 0}
    with httpx.stream("POST", f"{url}/chat", json=long_body, headers={"x-request-id": "victim-label"},
                      timeout=120) as squatter:
        assert squatter.status_code == 200  # not 409: the label says nothing about who else has it
        events = iter(SSEReader(squatter))
        assert next(events).event == "message"  # it runs now, under the victim's label
        twin = httpx.post(f"{url}/chat", json={"prompt": "Hi", "max_new_tokens": 3, "stream": False},
                          headers={"x-request-id": "victim-label"}, timeout=60)
        assert twin.status_code == 200 and twin.json()["usage"]["completion_tokens"] == 3
        rest = resume(url, "victim-label", token, after=4)  # continues in the engine beside the squatter
        assert rest.status_code == 200, rest.text
        assert chat_text(first) + chat_text(parse_sse(rest.content)) == expected
        assert parse_sse(rest.content)[-1].event == "end"
        squatter_events = list(events)
    assert squatter_events[-1].event == "end" and usage_of(squatter_events)["completion_tokens"] == 400


# --------------------------------------------------------------------------- the bounds


def test_the_record_keeps_at_most_max_streams_dropping_the_oldest_finished(bounded):
    url = bounded.url
    started = []
    for i in range(5):
        headers, events = stream(url, {"prompt": f"Say the number {i}.", "max_new_tokens": 4})
        started.append((headers["x-request-id"], headers["x-resume-token"], wire(events)))
    assert httpx.get(f"{url}/health", timeout=10).json()["resumable_streams"] == MAX_STREAMS
    for request_id, token, _ in started[:2]:
        assert resume(url, request_id, token).status_code == 404
    for request_id, token, events in started[2:]:
        kept = resume(url, request_id, token)
        assert kept.status_code == 200 and wire(parse_sse(kept.content)) == events

    def one(i):
        return stream(url, {"prompt": f"Flood {i}: say something.", "max_new_tokens": 6})[1]

    with ThreadPoolExecutor(8) as pool:  # a flood: every stream is served, the record stays bounded
        flood = list(pool.map(one, range(24)))
    assert all(events[-1].event == "end" for events in flood)
    health = httpx.get(f"{url}/health", timeout=10).json()
    assert health["resumable_streams"] <= MAX_STREAMS and 0 < health["resumable_bytes"] <= MAX_BYTES


def test_a_live_stream_past_the_byte_bound_is_served_whole_but_no_longer_kept(bounded):
    url = bounded.url
    short_headers, _ = stream(url, {"prompt": "Say hi.", "max_new_tokens": 4})
    body = {"prompt": STORY, "max_new_tokens": 300}
    expected = greedy(url, body)
    headers, events = stream(url, body)
    assert "x-resume-token" in headers  # there was room when it started
    assert chat_text(events) == expected["response"] and usage_of(events) == expected["usage"]
    assert usage_of(events)["completion_tokens"] == 300  # 300 events: far more than 20000 bytes
    assert resume(url, headers["x-request-id"], headers["x-resume-token"]).status_code == 404
    assert resume(url, short_headers["x-request-id"], short_headers["x-resume-token"]).status_code == 404
    assert httpx.get(f"{url}/health", timeout=10).json()["resumable_bytes"] <= MAX_BYTES
    after_headers, after = stream(url, {"prompt": "Say hi again.", "max_new_tokens": 4})  # room again
    again = resume(url, after_headers["x-request-id"], after_headers["x-resume-token"])
    assert again.status_code == 200 and wire(parse_sse(again.content)) == wire(after)


def test_a_stream_with_no_room_gets_no_token_and_its_whole_answer(bounded, tiny_llama_path):
    url = bounded.url
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_path)
    ids = tokenizer.encode(" ".join(f"w{i % 50}" for i in range(2000)), add_special_tokens=False)[:600]
    body = {"prompt": tokenizer.decode(ids), "raw": True, "max_new_tokens": 8}
    expected = greedy(url, body)
    assert expected["usage"]["prompt_tokens"] >= 560  # 36 bytes a token: more than the 20000 bytes alone
    headers, events = stream(url, body)
    assert "x-resume-token" not in headers and headers["x-request-id"]
    assert chat_text(events) == expected["response"] and usage_of(events) == expected["usage"]


# --------------------------------------------------------------------------- test hooks


def test_test_hooks_do_not_exist_without_the_flag(bounded):
    url = bounded.url
    for hook in ("/_test/kill-engine", "/_test/raise"):
        assert httpx.post(f"{url}{hook}", timeout=30).status_code == 404
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200  # the engine still runs
    assert greedy(url, {"prompt": "Hi", "max_new_tokens": 2})["usage"]["completion_tokens"] == 2


def test_without_the_flag_the_test_hooks_do_not_exist_with_a_key_either(tiny_llama_path):
    with run_server("--model", str(tiny_llama_path), "--api-key", KEY, test_hooks=False) as server:
        for hook in ("/_test/kill-engine", "/_test/raise"):
            for headers in (None, AUTH):  # no 401 first: the answer is the same as for any unknown path
                assert httpx.post(f"{server.url}{hook}", headers=headers, timeout=30).status_code == 404
        assert httpx.post(f"{server.url}/chat", json={"prompt": "Hi"}, timeout=30).status_code == 401
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


def test_test_hooks_need_the_key_and_a_500_says_nothing_of_the_inside(keyed):
    url = keyed.url
    for hook in ("/_test/kill-engine", "/_test/raise"):
        refused = httpx.post(f"{url}{hook}", timeout=30)
        assert refused.status_code == 401 and "Authorization: Bearer" in refused.json()["error"]
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200  # not killed
    failed = httpx.post(f"{url}/_test/raise", headers=AUTH, timeout=30)
    assert failed.status_code == 500
    message = failed.json()["error"]
    assert message.startswith("Internal error: the server could not complete this request")
    for inside in ("secret", "/srv", "app.py", "InjectedFailure", "Traceback", "line 1"):
        assert inside not in failed.text, failed.text
    reference = re.search(r"reference ([0-9a-f]{8})", message).group(1)
    log = keyed.log()
    assert f"[reference {reference}]" in log and "secret detail" in log  # the owner finds the details


# --------------------------------------------------------------------------- the key


def test_with_a_key_what_stays_open_reaches_no_model(keyed):
    url = keyed.url
    for path in ("/health", "/ready", "/docs"):
        assert httpx.get(f"{url}{path}", timeout=30).status_code == 200, path
    page = httpx.get(f"{url}/", timeout=30)
    assert page.status_code == 200 and '"auth_required":true' in page.text.replace(" ", "")  # a login form
    assert "the key as password" in page.text
    for path in ("/config", "/gradio_api/info"):
        assert httpx.get(f"{url}{path}", timeout=30).status_code == 401, path


def test_another_key_holder_cannot_resume_a_stream(keyed):
    url = keyed.url
    headers, first = stream(url, {"prompt": STORY, "max_new_tokens": 60}, headers=AUTH, keep=3)
    request_id, token = headers["x-request-id"], headers["x-resume-token"]
    assert resume(url, request_id, headers=AUTH).status_code == 404  # the key alone is not the stream
    assert resume(url, request_id, secrets.token_urlsafe(24), headers=AUTH).status_code == 404
    assert resume(url, request_id, token).status_code == 401  # the token alone is not the key
    rest = resume(url, request_id, token, after=3, headers=AUTH)
    assert rest.status_code == 200
    assert chat_text(first) + chat_text(parse_sse(rest.content)) == greedy(
        url, {"prompt": STORY, "max_new_tokens": 60}, headers=AUTH)["response"]


def test_an_engine_failure_reaches_clients_without_the_exception_text(keyed, server_with):
    """Runs last in this module: it kills the keyed server's engine."""
    server_with.retire(keyed)
    url = keyed.url
    # 10 ms steps: the tiny model writes 900 tokens in well under a second, so the request could
    # end before the kill reaches it (CI saw ['usage', 'end'])
    with slow_steps(url, 0.01, headers=AUTH), httpx.stream(
            "POST", f"{url}/chat", json={"prompt": "Talk.", "max_new_tokens": 900}, headers=AUTH,
            timeout=60) as response:
        seen = []
        for event in SSEReader(response):
            seen.append(event)
            if len(seen) == 1:
                assert httpx.post(f"{url}/_test/kill-engine", headers=AUTH, timeout=10).status_code == 200
    assert [e.event for e in seen[-2:]] == ["error", "end"]
    error = json.loads(seen[-2].data)["error"]
    assert "engine" in error
    for inside in ("EngineKilled", "killed by the test hook", "/_test"):
        assert inside not in error, error
    assert "EngineKilled" in keyed.log()  # the owner still has the cause


@pytest.mark.parametrize("engine_error, client_sees", [
    ("The engine failed while running this request: RuntimeError: shape '[2, 8]' is invalid (/opt/model.py:12)",
     "The engine failed while running this request; the server log has the details."),
    ("The engine stopped: EngineKilled: killed by the test hook /_test/kill-engine",
     "The engine stopped; the server log has the details."),
    ("Detokenizing the output failed: UnicodeDecodeError: ",
     "Detokenizing the output failed; the server log has the details."),
    ("The model produced non-finite (NaN or inf) logits for this request.",
     "The model produced non-finite (NaN or inf) logits for this request."),  # the engine's own words stay
    (None, "unknown error"),
])
def test_an_engine_error_is_passed_on_without_the_exception_under_it(engine_error, client_sees):
    assert public_engine_error(engine_error) == client_sees

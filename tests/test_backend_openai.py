"""--backend openai: a rill front end in front of a second rill process (the "remote"), both real
app.py processes on the tiny random Llama. The front streams what the remote streams directly;
resume, limits and error shapes stay the front's; a stopped remote is a 503, never a hang.

The module shares one remote and one front; the last test stops the remote."""

from __future__ import annotations

import json
import signal
import time

import httpx
import pytest
from gradio_client import Client

from tests.servers import SSEReader, chat_text, run_server

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def remote(tiny_llama_path):
    with run_server("--model", str(tiny_llama_path), "--resume-window", "5", test_hooks=False) as server:
        yield server


@pytest.fixture(scope="module")
def front(tiny_llama_path, remote):
    # credentials in the URL (the remote, without a key, ignores them): they never show (redacted)
    with run_server("--model", str(tiny_llama_path), "--backend", "openai", "--backend-url", secret_url(remote),
                    "--resume-window", "5", "--api-key", "front-key") as server:
        yield server


KEY = {"Authorization": "Bearer front-key"}
SECRET = "hunter2-secret"


def secret_url(remote) -> str:
    return remote.url.replace("http://", f"http://admin:{SECRET}@")


def shown_url(remote) -> str:
    """The remote's URL as the front shows it: the credentials replaced."""
    return remote.url.replace("http://", "http://***@")


def test_health_shows_the_backend_url_without_its_credentials(front, remote):
    response = httpx.get(f"{front.url}/health", timeout=10, headers=KEY)  # the details are for the key holder
    assert response.status_code == 200
    assert SECRET not in response.text and "admin" not in response.text
    assert response.json()["backend_url"] == shown_url(remote)


def test_the_redaction_covers_userinfo_and_query_keys():
    from frontend.backends.openai_backend import redact_url
    assert redact_url("https://u:p@host:8000/v1?api_key=abc&x=1") == "https://***@host:8000/v1?api_key=***&x=***"
    assert redact_url("http://host:8000") == "http://host:8000"
    assert redact_url("http://token@host/") == "http://***@host/"


def chat_events(url: str, body: dict, headers=None) -> list:
    with httpx.stream("POST", f"{url}/chat", json=body, headers=headers, timeout=60) as response:
        assert response.status_code == 200, response.read()
        return list(SSEReader(response))


def v1_text(url: str, path: str, body: dict, headers=None) -> tuple[str, list[dict]]:
    with httpx.stream("POST", f"{url}/v1/{path}", json={**body, "stream": True}, headers=headers,
                      timeout=60) as response:
        assert response.status_code == 200, response.read()
        chunks = [json.loads(e.data) for e in SSEReader(response) if e.data != "[DONE]"]
    pieces = [c["choices"][0].get("text") or c["choices"][0].get("delta", {}).get("content") or ""
              for c in chunks if c["choices"]]
    return "".join(pieces), chunks


def test_the_front_streams_what_the_remote_streams(front, remote):
    conversation = {"messages": [{"role": "user", "content": "Tell me about the sea."},
                                 {"role": "assistant", "content": "It is big."},
                                 {"role": "user", "content": "And blue?"}],
                    "system": "Be brief.", "temperature": 0, "max_new_tokens": 40}
    direct = chat_events(remote.url, conversation)
    relayed = chat_events(front.url, conversation, KEY)
    assert chat_text(relayed) == chat_text(direct)
    assert [e.event for e in relayed][-2:] == ["usage", "end"]
    assert json.loads(relayed[-2].data) == json.loads(direct[-2].data)  # prompt and completion tokens, reason

    sampled = {"prompt": "Once upon a time", "max_tokens": 30, "temperature": 0.9, "top_k": 40, "seed": 7,
               "stop": ["ka"]}
    assert v1_text(front.url, "completions", sampled, KEY)[0] == v1_text(remote.url, "completions", sampled)[0]
    chat = {"messages": [{"role": "user", "content": "Hello!"}], "temperature": 0, "max_tokens": 25,
            "stream_options": {"include_usage": True}}
    front_text, front_chunks = v1_text(front.url, "chat/completions", chat, KEY)
    remote_text, remote_chunks = v1_text(remote.url, "chat/completions", chat)
    assert front_text == remote_text and front_chunks[-1]["usage"] == remote_chunks[-1]["usage"]

    client = Client(front.url + "/", auth=("user", "front-key"), verbose=False)
    page = client.predict("Hello!", [], "", 0.0, 1.0, 0, 25, 1.0, api_name="/chat")
    assert page == remote_text

    metrics = httpx.get(f"{front.url}/metrics", timeout=10, headers=KEY).text  # counted from the remote's usage
    generated = [line for line in metrics.splitlines() if line.startswith('rill_generation_tokens_total{route="v1_chat"}')]
    assert generated == [f'rill_generation_tokens_total{{route="v1_chat"}} {float(remote_chunks[-1]["usage"]["completion_tokens"])}']


def test_the_front_keeps_its_own_key_limits_and_error_shapes(front):
    assert httpx.post(f"{front.url}/chat", json={"prompt": "hi"}, timeout=10).status_code == 401
    too_long = httpx.post(f"{front.url}/chat", json={"prompt": "hi", "max_new_tokens": 5000}, headers=KEY, timeout=30)
    assert too_long.status_code == 400
    assert "beyond this model's context of 1024 tokens" in too_long.json()["error"]
    logprobs = httpx.post(f"{front.url}/v1/completions", json={"prompt": "hi", "max_tokens": 3, "logprobs": 1},
                          headers=KEY, timeout=30)
    assert logprobs.status_code == 400
    assert logprobs.json()["error"]["param"] == "logprobs"


def test_resume_works_in_front(front, remote):
    body = {"prompt": "Write a long story about a lighthouse keeper.", "temperature": 0, "max_new_tokens": 80}
    expected = chat_text(chat_events(remote.url, body))
    with httpx.stream("POST", f"{front.url}/chat", json=body, headers=KEY, timeout=60) as response:
        token, request_id = response.headers["x-resume-token"], response.headers["x-request-id"]
        reader = iter(SSEReader(response))
        first = [next(reader) for _ in range(3)]
    time.sleep(0.5)  # the remote generates on while nobody reads (for the resume window at most)
    with httpx.stream("GET", f"{front.url}/chat/{request_id}", headers={
            **KEY, "x-resume-token": token, "Last-Event-ID": first[-1].id}, timeout=60) as response:
        assert response.status_code == 200
        rest = list(SSEReader(response))
    assert chat_text(first + rest) == expected
    assert [e.event for e in rest][-2:] == ["usage", "end"]
    ids = [int(e.id) for e in first + rest]
    assert ids == list(range(1, len(ids) + 1))


def test_a_stopped_remote_is_a_503_and_a_page_message_never_a_hang(front, remote):
    """Last in the module: it stops the remote."""
    body = {"prompt": "Count.", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{front.url}/v1/completions", json=body, headers=KEY, timeout=60) as response:
        reader = iter(SSEReader(response))
        next(reader)
        remote.stop(signal.SIGKILL)
        events = list(reader)
    assert [e.event for e in events][-2:] == ["error", "message"] and events[-1].data == "[DONE]"
    assert "model server" in json.loads(events[-2].data)["error"]["message"]

    refused = httpx.post(f"{front.url}/chat", json={"prompt": "hi", "max_new_tokens": 4}, headers=KEY, timeout=30)
    assert refused.status_code == 503
    assert f"The model server behind this app ({shown_url(remote)}) is not reachable" in refused.json()["error"]
    assert SECRET not in refused.text and SECRET not in json.dumps(events[-2].data)
    deadline = time.monotonic() + 10
    while (health := httpx.get(f"{front.url}/health", timeout=10, headers=KEY)).status_code != 503:  # noticed within a second
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert SECRET not in health.text and shown_url(remote) in health.text
    assert SECRET not in front.log()  # nor in the log the operator shares
    client = Client(front.url + "/", auth=("user", "front-key"), verbose=False)
    with pytest.raises(Exception, match="not reachable"):
        client.predict("Hello!", [], "", 0.0, 1.0, 0, 5, 1.0, api_name="/chat")

"""Issue 32, the Gradio side of the key, over real HTTP against a tiny-Llama server with --api-key:
every Gradio route a caller without the login can reach is closed (heartbeat, cancel, the stream
controls, reset, upload, file serving), so nobody without it can cancel another visitor's job or
end its session by its session hash; and no exception text of the page's handlers reaches a page
client."""

from __future__ import annotations

import time

import httpx
import pytest
from gradio_client import Client

from tests.servers import slow_steps, wait_idle

KEY = "edge-test-key-5b1e9c"  # tests/test_access.py's flags (--api-key KEY): one server for every module
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def keyed(server_with):
    return server_with("--api-key", KEY)


def _aborted(url: str) -> int:
    return httpx.get(f"{url}/health", headers=AUTH, timeout=10).json()["engine"]["finished_total"].get("abort", 0)


@pytest.mark.parametrize("method, path, body", [
    ("GET", "/gradio_api/heartbeat/victimsession1", None),
    ("POST", "/gradio_api/cancel", {"session_hash": "victimsession1", "fn_index": 0, "event_id": "e1"}),
    ("POST", "/gradio_api/stream/e1", {"data": [], "fn_index": 0, "session_hash": "victimsession1"}),
    ("POST", "/gradio_api/stream/e1/close", None),
    ("POST", "/gradio_api/reset", {"event_id": "e1"}),
    ("GET", "/gradio_api/startup-events", None),
    ("POST", "/gradio_api/upload", None),
    ("GET", "/gradio_api/upload_progress?upload_id=x", None),
    ("GET", "/gradio_api/file=/etc/hostname", None),
    ("GET", "/gradio_api/queue/data?session_hash=victimsession1", None),
])
def test_without_the_login_no_gradio_api_route_answers(keyed, method, path, body):
    kwargs = {"json": body} if body is not None else {}
    if path.endswith("/upload"):
        kwargs = {"files": {"files": ("a.txt", b"hello")}}
    with httpx.stream(method, f"{keyed.url}{path}", timeout=30, **kwargs) as response:  # heartbeat: endless
        status = response.status_code
        text = response.read().decode() if status != 200 else ""
    assert status == 401, (path, status, text[:300])
    assert "Not authenticated" in text


def test_a_caller_without_the_login_cannot_cancel_or_end_another_visitors_job(keyed):
    url = keyed.url
    victim = Client(url + "/", auth=("visitor", KEY), verbose=False)
    aborted = _aborted(url)
    with slow_steps(url, 0.02, headers=AUTH):
        job = victim.submit("Tell me a long story.", [], "", 0.0, 1.0, 0, 40, 1.0, api_name="/chat")
        while not job.outputs():  # the answer is streaming
            if job.done():
                break
        session = victim.session_hash
        answers = []
        for fn_index in range(8):  # whatever the chat function's index is
            answers.append(httpx.post(f"{url}/gradio_api/cancel", timeout=30, json={
                "session_hash": session, "fn_index": fn_index, "event_id": "any"}).status_code)
        with httpx.stream("GET", f"{url}/gradio_api/heartbeat/{session}", timeout=30) as beat:
            answers.append(beat.status_code)  # closing it would unload the victim's session
        text = job.result(timeout=120)
    assert set(answers) == {401}, answers
    assert isinstance(text, str) and text, text
    wait_idle_with_key(url)
    assert _aborted(url) == aborted  # the victim's request ran to its end


def wait_idle_with_key(url: str) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        engine = httpx.get(f"{url}/health", headers=AUTH, timeout=10).json()["engine"]
        if engine["num_running"] == 0 and engine["num_waiting"] == 0:
            return
        time.sleep(0.05)
    raise AssertionError(f"the engine did not become idle: {engine}")


def test_a_failing_page_handler_shows_no_exception_text_to_the_page_client(keyed):
    url = keyed.url
    client = Client(url + "/", auth=("visitor", KEY), verbose=False)
    hook = httpx.post(f"{url}/_test/page-raise", params={"on": 1}, headers=AUTH, timeout=10)
    assert hook.status_code == 200, hook.text
    try:
        with pytest.raises(Exception) as failure:
            client.predict("Hello", [], "", 0.0, 1.0, 0, 5, 1.0, api_name="/chat")
    finally:
        httpx.post(f"{url}/_test/page-raise", params={"on": 0}, headers=AUTH, timeout=10)
    assert "secret" not in str(failure.value) and "/srv/rill" not in str(failure.value), str(failure.value)
    assert "secret detail" in keyed.log()  # the owner finds the details in the log
    assert client.predict("Hello", [], "", 0.0, 1.0, 0, 5, 1.0, api_name="/chat")  # the page serves on

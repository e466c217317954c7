"""The Gradio API through `gradio_client` against a real app.py process: api_name="/chat" with
`predict` and streaming `submit`, its documented inputs, and agreement with `POST /chat`; with
an API key, closed to a client without it and open to one that logs in with it."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from gradio_client import Client
from gradio_client.exceptions import AuthenticationError

from tests.servers import run_server

CAPITAL = "What is the capital of France?"
# The page's defaults are every route's (the model's generation config, else rill's: greedy); these
# settings make a gradio_client call greedy whatever the model's config says, like `/chat` at temperature 0.
GREEDY = dict(system_prompt="", temperature=0.0, top_p=1.0, top_k=0, repetition_penalty=1.0)
KEY = "edge-test-key-5b1e9c"  # the same flags as tests/test_access.py: one server for both
INPUTS = ["message", "history", "system_prompt", "temperature", "top_p", "top_k", "max_new_tokens",
          "repetition_penalty", "images"]


@pytest.fixture(scope="module")
def client(tiny_server) -> Client:
    return Client(tiny_server.url + "/", verbose=False)


def chat_greedy(url: str, messages: list[dict], max_new_tokens: int) -> str:
    response = httpx.post(f"{url}/chat", timeout=120, json={"messages": messages, "temperature": 0,
                                                             "max_new_tokens": max_new_tokens, "stream": False})
    assert response.status_code == 200, response.text
    return response.json()["response"]


def test_view_api_shows_the_chat_endpoint_with_named_inputs_and_defaults(client):
    api = client.view_api(return_format="dict", print_info=False)
    assert "/chat" in api["named_endpoints"]
    parameters = api["named_endpoints"]["/chat"]["parameters"]
    names = [p["parameter_name"] for p in parameters]
    assert names == INPUTS
    defaults = {p["parameter_name"]: p.get("parameter_default") for p in parameters}
    assert defaults["max_new_tokens"] >= 1 and 0 <= defaults["temperature"] <= 2
    assert all(p["parameter_has_default"] for p in parameters if p["parameter_name"] != "message")


def test_predict_equals_the_chat_endpoint_for_the_same_greedy_conversation(client, tiny_server):
    answer = client.predict("Tell me a joke.", [], "", 0.0, 1.0, 0, 20, 1.0, api_name="/chat")
    assert isinstance(answer, str) and answer
    assert answer == chat_greedy(tiny_server.url, [{"role": "user", "content": "Tell me a joke."}], 20)
    history = [{"role": "user", "content": "Hello!"}, {"role": "assistant", "content": "Hi there."}]
    with_history = client.predict(message="And now?", history=history, **GREEDY,
                                  max_new_tokens=12, api_name="/chat")
    assert with_history == chat_greedy(tiny_server.url, history + [{"role": "user", "content": "And now?"}], 12)


def test_submit_streams_updates_that_grow_to_the_final_text(client):
    job = client.submit(message="Describe a robot.", history=[], **GREEDY,
                        max_new_tokens=40, api_name="/chat")
    final = job.result(timeout=120)
    updates = [u for u in job.outputs() if isinstance(u, str)]
    assert len(updates) >= 3  # streamed, not one answer at the end
    for earlier, later in zip(updates, updates[1:]):
        assert later.startswith(earlier)
    assert updates[-1] == final
    assert final == client.predict(message="Describe a robot.", history=[], **GREEDY,
                                   max_new_tokens=40, api_name="/chat")


def test_bad_settings_are_a_clear_error(client):
    with pytest.raises(Exception) as caught:
        client.predict(message="Hi", temperature=-1.0, api_name="/chat")
    assert "temperature" in str(caught.value)


def test_embedded_model_answers_paris_and_agrees_with_chat(embedded_server):
    client = Client(embedded_server.url + "/", verbose=False)
    answer = client.predict(message=CAPITAL, history=[], **GREEDY, max_new_tokens=48,
                            api_name="/chat")
    assert "Paris" in answer
    assert answer == chat_greedy(embedded_server.url, [{"role": "user", "content": CAPITAL}], 48)


def test_embedded_model_answers_right_at_the_defaults(embedded_server):
    """No settings at all: the page's defaults, the API's (the embedded GGUF has no generation config:
    rill's greedy), shown on the sliders and as /chat's parameter defaults. The embedded model's first
    word to CAPITAL is a near tie ("The" 0.152, "L" 0.140): sampled, about half the answers were
    "L'Étoile, ..." (docs/benchmarks-history.md); greedy says Paris every time."""
    client = Client(embedded_server.url + "/", verbose=False)
    parameters = client.view_api(return_format="dict", print_info=False)["named_endpoints"]["/chat"]["parameters"]
    defaults = {p["parameter_name"]: p.get("parameter_default") for p in parameters}
    assert (defaults["temperature"], defaults["top_p"], defaults["top_k"], defaults["repetition_penalty"]) == (0, 1, 0, 1)
    answers = [client.predict(CAPITAL, api_name="/chat") for _ in range(3)]
    assert answers == ["The capital of France is Paris."] * 3, answers
    assert client.predict(CAPITAL, temperature=0, api_name="/chat") == "The capital of France is Paris."


def test_embedded_chinese_streams_without_replacement_characters(embedded_server):
    client = Client(embedded_server.url + "/", verbose=False)
    job = client.submit(message="法国的首都是哪里？请用中文回答。", history=[], **GREEDY,
                        max_new_tokens=48, api_name="/chat")
    final = job.result(timeout=120)
    assert all("\ufffd" not in u for u in job.outputs() if isinstance(u, str))
    assert any("\u4e00" <= ch <= "\u9fff" for ch in final), final


@pytest.fixture(scope="module")
def keyed(server_with):
    return server_with("--api-key", KEY)


def test_with_a_key_a_client_without_it_gets_no_answer_and_the_model_does_no_work(keyed):
    url = keyed.url
    before = httpx.get(f"{url}/health", timeout=10, headers={"Authorization": f"Bearer {KEY}"}).json()["engine"]["prompt_tokens_total"]
    with pytest.raises(AuthenticationError, match="credentials were not provided"):
        Client(url + "/", verbose=False)
    with pytest.raises(ValueError, match="Could not login"):
        Client(url + "/", auth=("anyone", "not-the-key"), verbose=False)
    # what gradio_client would send, sent by hand without a login
    call = httpx.post(f"{url}/gradio_api/call/chat", json={"data": ["Say hi"]}, timeout=30)
    join = httpx.post(f"{url}/gradio_api/queue/join", timeout=30,
                      json={"data": ["Say hi", []], "fn_index": 0, "session_hash": "abc123"})
    bearer = httpx.post(f"{url}/gradio_api/call/chat", json={"data": ["Say hi"]}, timeout=30,
                        headers={"Authorization": "Bearer not-the-key"})
    assert [call.status_code, join.status_code, bearer.status_code] == [401, 401, 401]
    assert "Not authenticated" in call.text
    assert httpx.get(f"{url}/health", timeout=10, headers={"Authorization": f"Bearer {KEY}"}).json()["engine"]["prompt_tokens_total"] == before


def test_with_a_key_a_client_logged_in_with_it_gets_the_answer_chat_gives(keyed):
    url = keyed.url
    client = Client(url + "/", auth=("any-user-name", KEY), verbose=False)
    answer = client.predict(message="Tell me a joke.", history=[], **GREEDY, max_new_tokens=16, api_name="/chat")
    response = httpx.post(f"{url}/chat", timeout=120, headers={"Authorization": f"Bearer {KEY}"},
                          json={"prompt": "Tell me a joke.", "temperature": 0, "max_new_tokens": 16, "stream": False})
    assert response.status_code == 200 and answer == response.json()["response"] and answer


def _wakeups(pid: int) -> int:
    """How many times the process's main thread (the event loop) has been switched in so far."""
    status = Path(f"/proc/{pid}/task/{pid}/status").read_text()
    return sum(int(line.split()[1]) for line in status.splitlines()
               if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_an_idle_page_does_not_wake_the_event_loop_a_hundred_times_a_second_nor_hold_the_exit(tiny_llama_path):
    # Gradio's queue polls for new events every 1 ms (10 ms in earlier rill), and each wake-up of
    # the loop takes a core from the engine's threads; unused, the page polls every 100 ms.
    with run_server("--model", str(tiny_llama_path), "--shutdown-timeout", "120") as server:
        pid = server.process.pid
        time.sleep(2)
        before, start = _wakeups(pid), time.monotonic()
        time.sleep(3)
        per_second = (_wakeups(pid) - before) / (time.monotonic() - start)
        assert per_second < 50, f"the idle server's event loop woke {per_second:.0f} times a second"
        client = Client(server.url + "/", verbose=False)  # and a visitor is still answered
        answer = client.predict(message="Tell me a joke.", history=[], **GREEDY, max_new_tokens=8, api_name="/chat")
        assert answer == chat_greedy(server.url, [{"role": "user", "content": "Tell me a joke."}], 8)
        # the visitor's session heartbeat (an open stream) ends as shutdown begins: it does not hold the
        # exit for the --shutdown-timeout that running answers get
        server.process.send_signal(signal.SIGTERM)
        try:
            assert server.process.wait(60) == 0
        except subprocess.TimeoutExpired:
            raise AssertionError("an open page held the SIGTERM'd server past 60 s") from None
        client.close()

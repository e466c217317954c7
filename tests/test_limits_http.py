"""The limits of section "one request must not stall the others", over real HTTP against a tiny
Llama server: overlong stop strings and prompts get a clear 400 on `/chat` and `/v1`, the longest
allowed stops with `n` at its maximum are served, and the page's Gradio API answers raw hostile
bodies (Infinity, NaN, 1e400, huge integers, wrong types, huge histories) with a clear error while
the server keeps answering."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.request import MAX_STOP_LENGTH, MAX_STOP_STRINGS
from tests.servers import error_text, wait_idle
from tests.tiny_models import CONTEXT

CHAR_LIMIT = CONTEXT * 16  # engine.request.prompt_char_limit for the tiny model's context


@pytest.fixture(scope="module")
def url(tiny_server):
    yield tiny_server.url
    wait_idle(tiny_server.url, timeout=60)


OVERLONG_STOP = ["fine", "x" * (MAX_STOP_LENGTH + 1)]


@pytest.mark.parametrize("path, body", [
    ("/chat", {"prompt": "Hi", "stop": OVERLONG_STOP, "stream": False}),
    ("/chat", {"prompt": "Hi", "stop": OVERLONG_STOP}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "stop": OVERLONG_STOP}),
    ("/v1/completions", {"prompt": "Hi", "stop": OVERLONG_STOP[1]}),
])
def test_an_overlong_stop_string_is_a_400_naming_the_limit_and_its_length(url, path, body):
    response = httpx.post(url + path, json=body, timeout=30)
    assert response.status_code == 400, response.text
    text = error_text(response)
    assert f"at most {MAX_STOP_LENGTH} characters" in text and f"{MAX_STOP_LENGTH + 1} characters" in text, text


def test_the_longest_allowed_stops_with_n_at_its_maximum_are_served(url):
    stops = [chr(0x4e00 + i) * MAX_STOP_LENGTH for i in range(MAX_STOP_STRINGS)]
    response = httpx.post(f"{url}/v1/completions", timeout=120, json={
        "prompt": "Once upon a time", "stop": stops, "n": 16, "max_tokens": 12, "temperature": 1.0, "seed": 3})
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    assert len(choices) == 16 and all(c["finish_reason"] in ("stop", "length") for c in choices)
    assert sum(response.json()["usage"]["completion_tokens"] for _ in [0]) >= 16


@pytest.mark.parametrize("path, body, param", [
    ("/chat", {"prompt": "x" * (CHAR_LIMIT + 1), "stream": False}, "prompt"),
    ("/chat", {"prompt": "x" * (CHAR_LIMIT - 10), "system": "y" * 11}, "prompt"),
    ("/chat", {"messages": [{"role": "user", "content": "x" * (CHAR_LIMIT // 2)},
                            {"role": "assistant", "content": "x" * (CHAR_LIMIT // 2 + 1)}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * (CHAR_LIMIT + 1)}]}, "messages"),
    ("/v1/completions", {"prompt": "x" * (CHAR_LIMIT + 1)}, "prompt"),
    ("/v1/completions", {"prompt": ["Hi", "x" * (CHAR_LIMIT + 1)]}, "prompt"),
])
def test_a_prompt_past_the_character_bound_is_a_400_before_tokenizing(url, path, body, param):
    response = httpx.post(url + path, json=body, timeout=30)
    assert response.status_code == 400, response.text
    text = error_text(response)
    assert f"`{param}` is too long: it may have at most {CHAR_LIMIT} characters" in text, text
    assert f"context of {CONTEXT} tokens" in text


def test_a_completions_prompt_list_is_capped(url):
    response = httpx.post(f"{url}/v1/completions", json={"prompt": ["Hi"] * 65, "max_tokens": 1}, timeout=30)
    assert response.status_code == 400
    assert "at most 64 prompts in one request. Given: 65 prompts" in error_text(response)
    token_lists = httpx.post(f"{url}/v1/completions", json={"prompt": [[5, 6]] * 65, "max_tokens": 1}, timeout=30)
    assert token_lists.status_code == 400 and "Given: 65 prompts" in error_text(token_lists)
    allowed = httpx.post(f"{url}/v1/completions", json={"prompt": ["Hi"] * 64, "max_tokens": 1}, timeout=60)
    assert allowed.status_code == 200 and len(allowed.json()["choices"]) == 64


@pytest.mark.parametrize("field, value, message", [
    ("temperature", float("inf"), "`temperature`: input should be a finite number. Given: inf"),
    ("temperature", float("nan"), "`temperature`: input should be a finite number. Given: nan"),
    ("repetition_penalty", float("inf"), "`repetition_penalty`: input should be a finite number. Given: inf"),
    ("seed", 2**70, f"`seed`: input should be less than or equal to {2**63 - 1}. Given: {2**70}"),
    ("seed", 2**64, f"`seed`: input should be less than or equal to {2**63 - 1}. Given: {2**64}"),
])
def test_non_finite_numbers_and_huge_seeds_are_a_400_on_every_route(url, field, value, message):
    bodies = [("/chat", {"prompt": "Hi", "max_new_tokens": 2, field: value}),
              ("/v1/completions", {"prompt": "Hi", "max_tokens": 2, field: value})]
    for path, body in bodies:
        response = httpx.post(url + path, content=json.dumps(body), timeout=30,
                              headers={"content-type": "application/json"})
        assert response.status_code == 400, (path, body, response.text)
        assert message in error_text(response), response.text


# --------------------------------------------------------------------------- the page's Gradio API, raw


def gradio_call(url: str, raw_body: bytes, timeout: float = 120) -> tuple[int, str, object]:
    """POST the raw JSON to the call endpoint of api_name="/chat", read its event stream.
    Returns (status of the POST, the last event's name, its data)."""
    post = httpx.post(f"{url}/gradio_api/call/chat", content=raw_body, timeout=timeout,
                      headers={"content-type": "application/json"})
    if post.status_code != 200:
        return post.status_code, "", post.text
    event_id = post.json()["event_id"]
    last_event, last_data = "", None
    with httpx.stream("GET", f"{url}/gradio_api/call/chat/{event_id}", timeout=timeout) as stream:
        for line in stream.iter_lines():
            if line.startswith("event:"):
                last_event = line.split(":", 1)[1].strip()
            elif line.startswith("data:"):
                last_data = json.loads(line.split(":", 1)[1])
    return post.status_code, last_event, last_data


def _data(*items: str) -> bytes:
    """A call body with each input written as raw JSON text (so Infinity, NaN, 1e400 stay raw)."""
    return ('{"data": [' + ", ".join(items) + "]}").encode()


GOOD = dict(message='"Hi"', history="[]", system_prompt='""', temperature="0", top_p="1", top_k="0",
            max_new_tokens="3", repetition_penalty="1", images="null")


def _inputs(**changes: str) -> bytes:
    return _data(*{**GOOD, **changes}.values())


def assert_still_answers(url: str) -> None:
    status, event, data = gradio_call(url, _inputs())
    assert (status, event) == (200, "complete") and isinstance(data[0], str) and data[0], (status, event, data)


HUGE_HISTORY_MESSAGES = json.dumps([{"role": "user", "content": "hi"}] * 1001)


@pytest.mark.parametrize("changes, message", [
    ({"temperature": "Infinity"}, "`temperature` must be a number in [0, 100] (0 = greedy). Given: inf"),
    ({"temperature": "NaN"}, "`temperature` must be a number in [0, 100] (0 = greedy). Given: nan"),
    ({"temperature": "1e400"}, "`temperature` must be a number in [0, 100] (0 = greedy). Given: inf"),
    ({"top_p": "-Infinity"}, "`top_p` must be in (0, 1]. Given: -inf"),
    ({"repetition_penalty": "Infinity"}, "`repetition_penalty` must be a number in (0, 100] (1 = off). Given: inf"),
    ({"top_k": "1e400"}, "`top_k` must be an integer >= 0 (0 = off). Given: inf"),
    ({"top_k": "NaN"}, "`top_k` must be an integer >= 0 (0 = off). Given: nan"),
    ({"max_new_tokens": "Infinity"}, "`max_new_tokens` must be an integer >= 1. Given: inf"),
    ({"max_new_tokens": "-1e400"}, "`max_new_tokens` must be an integer >= 1. Given: -inf"),
    ({"max_new_tokens": '"many"'}, "`max_new_tokens` must be an integer >= 1. Given: 'many'"),
    ({"temperature": '"hot"'}, "`temperature` must be a number in [0, 100] (0 = greedy). Given: 'hot'"),
    ({"top_k": "[1, 2]"}, "`top_k` must be an integer >= 0 (0 = off). Given: [1, 2]"),
    ({"message": "42"}, "`message` must be a string. Given: int"),
    ({"system_prompt": '["be brief"]'}, "`system_prompt` must be a string. Given: list"),
    ({"history": '"not a list"'}, "`history` must be a list of messages"),
    ({"history": "1e400"}, "`history` must be a list of messages"),
    ({"history": HUGE_HISTORY_MESSAGES}, "at most 1000 messages are allowed. Given: 1001 messages"),
    ({"message": json.dumps("x" * (CHAR_LIMIT + 1))}, f"takes at most {CHAR_LIMIT} characters"),
])
def test_the_gradio_api_answers_raw_hostile_inputs_with_a_clear_error(url, changes, message):
    status, event, data = gradio_call(url, _inputs(**changes))
    assert (status, event) == (200, "error"), (status, event, data)
    assert message in data["error"], data
    assert_still_answers(url)


def test_a_malformed_call_body_is_a_4xx_and_the_page_api_keeps_answering(url):
    for raw in (b'{"data": "garbage"}', b'{"data": [', b"\xff\xfe", b'{"nodata": 1}', _data('"Hi"', "[]", "1e400") + b"}"):
        status, _event, _data_ = gradio_call(url, raw)
        assert 400 <= status < 500, (raw, status, _data_)
    assert_still_answers(url)


raw_number = st.sampled_from(["Infinity", "-Infinity", "NaN", "1e400", "-1e400", str(2**70), str(-(2**70)),
                              "1e-400", "0", "-0.0", "0.5", "2", "1"])
raw_junk = st.one_of(raw_number, st.sampled_from(['"x"', "null", "true", "[]", "{}", '[{"role": "user"}]',
                                                  '[["a", "b"]]', '[{"role": "user", "content": NaN}]',
                                                  '{"role": "user", "content": "hi"}']),
                     st.text(max_size=12).map(json.dumps))
small_tokens = st.sampled_from(["1", "2", "3", '"3"', "0", "-1", "NaN", "Infinity", "2.5", "null"])


@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(message=st.one_of(st.just('"Hi"'), raw_junk), history=st.one_of(st.just("[]"), raw_junk),
       system_prompt=st.one_of(st.just('""'), raw_junk), temperature=raw_junk, top_p=raw_junk, top_k=raw_junk,
       max_new_tokens=small_tokens, repetition_penalty=raw_junk, images=st.one_of(st.just("null"), raw_junk))
def test_fuzz_the_gradio_api_with_raw_bodies(url, message, history, system_prompt, temperature, top_p, top_k,
                                            max_new_tokens, repetition_penalty, images):
    status, event, data = gradio_call(url, _data(message, history, system_prompt, temperature, top_p, top_k,
                                                 max_new_tokens, repetition_penalty, images))
    assert status == 200 and event in ("complete", "error"), (status, event, data)
    if event == "error":  # a message for the client, never Gradio's bare "Error" of an uncaught exception
        assert isinstance(data, dict) and isinstance(data.get("error"), str) and data["error"], data
    else:
        assert isinstance(data[0], str)


def test_after_the_fuzz_the_page_api_still_answers(url):
    assert_still_answers(url)


def test_a_gradio_api_body_past_the_body_limit_is_a_413_before_gradio_parses_it(url):
    """Over HTTP the body limit (1 MB) comes before the history's character bound (unit-tested in test_limits)."""
    huge_history = json.dumps([{"role": "user", "content": "y" * 1000}] * 2100)  # about 2.1 MB
    raw = _data('"Hi"', huge_history, '""', "0", "1", "0", "4", "1", "null") + b"}"
    declared = httpx.post(f"{url}/gradio_api/call/chat", content=raw, timeout=60,
                          headers={"content-type": "application/json"})

    def chunks():  # no Content-Length: the limit is counted as the body arrives
        for start in range(0, len(raw), 65536):
            yield raw[start:start + 65536]

    chunked = httpx.post(f"{url}/gradio_api/call/chat", content=chunks(), timeout=60,
                         headers={"content-type": "application/json"})
    for response in (declared, chunked):
        assert response.status_code == 413, response.text
        assert "The request body is too large: at most 1000000 bytes are allowed" in response.text
    assert_still_answers(url)


# --------------------------------------------------------------------------- a chat template that refuses

ALTERNATE = "Conversation roles must alternate user/assistant/user/assistant/..."
STRICT_TEMPLATE = ("{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
                   "{{ raise_exception('" + ALTERNATE + "') }}{% endif %}"
                   "{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
                   "{% if add_generation_prompt %}assistant:{% endif %}")


@pytest.fixture(scope="module")
def strict_server(server_with, tiny_llama_path, tmp_path_factory):
    """The tiny Llama with a chat template that raises on roles that do not alternate."""
    import shutil

    folder = tmp_path_factory.mktemp("strict") / "llama"
    shutil.copytree(tiny_llama_path, folder)
    (folder / "chat_template.jinja").write_text(STRICT_TEMPLATE)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return server_with(model=folder)


def test_a_conversation_the_chat_template_refuses_is_a_400_with_the_templates_message(strict_server):
    url = strict_server.url
    twice = [{"role": "user", "content": "Hi"}, {"role": "user", "content": "Hi again"}]
    for path, body in (("/chat", {"messages": twice, "stream": False}), ("/chat", {"messages": twice}),
                       ("/v1/chat/completions", {"messages": twice, "max_tokens": 4})):
        response = httpx.post(f"{url}{path}", json=body, timeout=60)
        assert response.status_code == 400, (path, response.text)
        assert error_text(response) == f"The model's chat template refused this conversation: {ALTERNATE}"
    fine = httpx.post(f"{url}/chat", json={"messages": twice[:1], "max_new_tokens": 3, "stream": False}, timeout=60)
    assert fine.status_code == 200 and fine.json()["usage"]["completion_tokens"] == 3

    from gradio_client import Client

    client = Client(url + "/", verbose=False)
    with pytest.raises(Exception) as caught:  # the page: the same message, as a Gradio error
        client.predict(message="Hi again", history=twice[:1] + [{"role": "user", "content": "and"}],
                       max_new_tokens=3, api_name="/chat")
    assert ALTERNATE in str(caught.value)
    assert client.predict(message="Hi", history=[], max_new_tokens=3, api_name="/chat")  # and it still answers

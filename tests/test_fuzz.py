"""Fuzz the JSON bodies of /chat, /v1/chat/completions and /v1/completions (hypothesis) against a
real server: whatever arrives, the answer is never a 5xx, always JSON or a well-formed stream,
and the server keeps serving with its KV cache free afterwards."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.servers import wait_idle

EXAMPLES = 60

scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
                    st.floats(allow_nan=False), st.text(max_size=20))
json_values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                            st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                           max_leaves=10)
# Lengths stay small so that a body that happens to be valid does not generate for long.
max_tokens = st.one_of(st.integers(min_value=-3, max_value=8), json_values)
unit = st.one_of(st.floats(min_value=-1, max_value=3, allow_nan=False), json_values)
prompt_text = st.text(max_size=60)
message = st.fixed_dictionaries({}, optional={"role": st.one_of(st.sampled_from(["user", "assistant", "system",
                                                                                 "developer", "tool", "robot"]),
                                                                json_values),
                                              "content": st.one_of(prompt_text, json_values)})
messages = st.one_of(st.lists(message, max_size=3), json_values)
stop = st.one_of(st.text(max_size=4), st.lists(st.text(max_size=4), max_size=20), json_values)

chat_bodies = st.fixed_dictionaries({"max_new_tokens": max_tokens}, optional={
    "prompt": st.one_of(prompt_text, json_values), "messages": messages, "system": st.one_of(prompt_text, json_values),
    "raw": st.one_of(st.booleans(), json_values), "stream": st.one_of(st.booleans(), json_values),
    "temperature": unit, "top_p": unit, "top_k": st.one_of(st.integers(-2, 100), json_values),
    "repetition_penalty": unit, "stop": stop, "seed": st.one_of(st.integers(-5, 2**65), json_values),
    "unknown_field": json_values,
})
openai_common = {
    "model": st.one_of(st.sampled_from(["tiny-llama", "gpt-4o", ""]), json_values),
    "temperature": unit, "top_p": unit, "n": st.one_of(st.integers(-1, 3), json_values), "stop": stop,
    "seed": st.one_of(st.integers(-(2**64), 2**64), json_values), "presence_penalty": unit,
    "frequency_penalty": unit, "stream": st.one_of(st.booleans(), json_values),
    "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": st.booleans()}), json_values),
    "top_k": st.one_of(st.integers(-2, 50), json_values), "min_p": unit, "repetition_penalty": unit,
    "min_tokens": st.one_of(st.integers(-2, 10), json_values), "ignore_eos": st.one_of(st.booleans(), json_values),
    "stop_token_ids": st.one_of(st.lists(st.integers(-5, 5000), max_size=4), json_values),
}
v1_chat_bodies = st.fixed_dictionaries({"max_tokens": max_tokens}, optional={
    **openai_common, "messages": messages, "max_completion_tokens": max_tokens,
    "logprobs": st.one_of(st.booleans(), json_values), "top_logprobs": st.one_of(st.integers(-1, 25), json_values),
})
v1_completion_bodies = st.fixed_dictionaries({"max_tokens": max_tokens}, optional={
    **openai_common, "logprobs": st.one_of(st.integers(-1, 25), json_values), "echo": st.booleans(),
    "prompt": st.one_of(prompt_text, st.lists(prompt_text, max_size=3), st.lists(st.integers(-5, 5000), max_size=8),
                        st.lists(st.lists(st.integers(0, 2000), max_size=4), max_size=3), json_values),
})


# Near-valid bodies: every field of a plausible type and range (edges included), then at most one
# field replaced by arbitrary JSON, so that many requests really reach the engine.
edge_unit = st.one_of(st.sampled_from([0.0, 1.0, 1e-9, 0.5, 2.0]), st.floats(min_value=0, max_value=2, allow_nan=False))
small_tokens = st.integers(min_value=1, max_value=6)
valid_messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system"]),
                                                 "content": prompt_text}), min_size=1, max_size=3)
valid_chat = st.fixed_dictionaries({"max_new_tokens": small_tokens}, optional={
    "temperature": edge_unit, "top_p": st.floats(min_value=0.01, max_value=1), "top_k": st.integers(0, 50),
    "repetition_penalty": st.floats(min_value=0.5, max_value=2), "stop": st.lists(st.text(min_size=1, max_size=3),
                                                                                   max_size=3),
    "seed": st.integers(0, 2**32), "stream": st.booleans(), "system": prompt_text,
}).flatmap(lambda d: st.one_of(st.just({**d, "prompt": "x"}), prompt_text.map(lambda p: {**d, "prompt": p}),
                               valid_messages.map(lambda m: {**d, "messages": m})))
valid_openai = {
    "temperature": edge_unit, "top_p": st.floats(min_value=0.01, max_value=1), "n": st.integers(1, 3),
    "stop": st.lists(st.text(min_size=1, max_size=3), max_size=3), "seed": st.integers(-(2**31), 2**31),
    "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2), "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}), "top_k": st.integers(-1, 50),
    "min_p": st.floats(0, 1), "repetition_penalty": st.floats(min_value=0.5, max_value=2),
    "min_tokens": st.integers(0, 6), "ignore_eos": st.booleans(),
    "stop_token_ids": st.lists(st.integers(0, 1023), max_size=3),
}
valid_v1_chat = st.fixed_dictionaries({"max_tokens": small_tokens, "messages": valid_messages}, optional={
    **valid_openai, "logprobs": st.booleans()})
valid_v1_completions = st.fixed_dictionaries({"max_tokens": small_tokens, "prompt": st.one_of(
    prompt_text.filter(bool), st.lists(prompt_text.filter(bool), min_size=1, max_size=2),
    st.lists(st.integers(0, 1023), min_size=1, max_size=8))}, optional={**valid_openai, "logprobs": st.integers(0, 5)})


def one_junk_field(valid):
    """`valid` bodies, sometimes with one field (existing or new) set to arbitrary JSON."""
    def spoil(body):
        keys = sorted(body) + ["extra"]
        return st.one_of(st.just(body), st.tuples(st.sampled_from(keys), json_values).map(
            lambda kv: {**body, kv[0]: kv[1]}))
    return valid.flatmap(spoil)


def check(url: str, path: str, body, headers: dict | None = None, raw: bytes | None = None) -> None:
    content = raw if raw is not None else json.dumps(body).encode()
    with httpx.stream("POST", url + path, content=content, timeout=120,
                      headers={"content-type": "application/json", **(headers or {})}) as response:
        data = response.read()
    assert response.status_code < 500, (path, body, response.status_code, data[:300])
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        text = data.decode("utf-8")
        assert text.endswith("\n\n") and ("[DONE]" in text), text[-300:]
    else:
        payload = json.loads(data)
        if response.status_code >= 400:
            assert "error" in payload and payload["error"], payload


@pytest.fixture(scope="module")
def url(tiny_server):
    yield tiny_server.url
    assert httpx.get(f"{tiny_server.url}/health", timeout=10).status_code == 200
    wait_idle(tiny_server.url, timeout=60)


fuzz_settings = settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
                         suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                                HealthCheck.data_too_large])


@fuzz_settings
@given(body=st.one_of(one_junk_field(valid_chat), chat_bodies), request_id=st.one_of(st.none(), st.text(alphabet=st.characters(min_codepoint=33,
                                                                                        max_codepoint=126),
                                                                     max_size=140)))
def test_fuzz_chat(url, body, request_id):
    check(url, "/chat", body, headers={"x-request-id": request_id} if request_id else None)


@fuzz_settings
@given(body=st.one_of(one_junk_field(valid_v1_chat), v1_chat_bodies))
def test_fuzz_v1_chat_completions(url, body):
    check(url, "/v1/chat/completions", body)


@fuzz_settings
@given(body=st.one_of(one_junk_field(valid_v1_completions), v1_completion_bodies))
def test_fuzz_v1_completions(url, body):
    check(url, "/v1/completions", body)


@fuzz_settings
@given(raw=st.one_of(st.binary(max_size=200), json_values.map(lambda v: json.dumps(v).encode())),
       path=st.sampled_from(["/chat", "/v1/chat/completions", "/v1/completions"]))
def test_fuzz_arbitrary_bytes(url, raw, path):
    check(url, path, None, raw=raw)

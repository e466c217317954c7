"""Fuzz the JSON bodies of /chat, /v1/chat/completions and /v1/completions (hypothesis) against a
real server: whatever arrives, the answer is never a 5xx nor a stream carrying an internal error,
always JSON or a well-formed stream, and the server keeps serving with its KV cache free afterwards.
Every field of every route is sent, with sizes up to the limits (engine/request.py, server/schemas.py)
and a little past them."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.chat_template import TAKEN_TEMPLATE_NAMES
from engine.request import MAX_N, MAX_STOP_LENGTH, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS
from server.schemas import MAX_PROMPTS, MAX_TEMPLATE_KWARGS, MAX_TOOLS
from tests.servers import parse_sse, wait_idle

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
tool_call_in = st.one_of(st.fixed_dictionaries({"function": st.fixed_dictionaries(
    {"name": st.text(max_size=8)}, optional={"arguments": st.one_of(st.sampled_from(['{"a": 1}', "{", "[]"]),
                                                                    json_values)})},
    optional={"id": st.text(max_size=8), "type": st.sampled_from(["function", "x"])}), json_values)
message = st.fixed_dictionaries({}, optional={"role": st.one_of(st.sampled_from(["user", "assistant", "system",
                                                                                 "developer", "tool", "robot"]),
                                                                json_values),
                                              "content": st.one_of(prompt_text, json_values, st.lists(
                                                  st.fixed_dictionaries({"type": st.sampled_from(["text", "image"]),
                                                                         "text": prompt_text}), max_size=2)),
                                              "name": st.one_of(st.text(max_size=8), json_values),
                                              "tool_calls": st.one_of(st.lists(tool_call_in, max_size=2), json_values),
                                              "tool_call_id": st.one_of(st.text(max_size=8), json_values)})
messages = st.one_of(st.lists(message, max_size=3), json_values)
stop = st.one_of(st.text(max_size=4), st.lists(st.text(max_size=4), max_size=20), json_values,
                 # up to the limits and one past them: 16 strings of 256 characters
                 st.tuples(st.integers(0, MAX_STOP_STRINGS + 1), st.integers(1, MAX_STOP_LENGTH + 1),
                           st.characters()).map(lambda t: [t[2] * t[1]] * t[0]))
# stop_token_ids up to the cap and past it (a whole list, not drawn id by id: 1024 draws are slow)
stop_token_ids = st.one_of(st.lists(st.integers(-5, 5000), max_size=4), json_values,
                           st.tuples(st.integers(0, MAX_STOP_TOKEN_IDS + 2), st.integers(0, 2**31)).map(
                               lambda t: [(t[1] + i) % 2**31 for i in range(t[0])]),
                           st.sampled_from([list(range(MAX_STOP_TOKEN_IDS)), list(range(MAX_STOP_TOKEN_IDS + 1))]))
template_name = st.one_of(st.sampled_from(sorted(TAKEN_TEMPLATE_NAMES)), st.sampled_from(["enable_thinking", "x"]),
                          st.text(max_size=8))
chat_template_kwargs = st.one_of(st.dictionaries(template_name, json_values, max_size=MAX_TEMPLATE_KWARGS + 1),
                                 json_values)
small_schema = st.one_of(
    st.just({"type": "object", "properties": {"a": {"type": "integer", "maximum": 9}}, "required": ["a"]}),
    st.just({"type": "string", "maxLength": 3}), st.just({"enum": ["x", "y"]}), st.just(True), st.just(False),
    st.just({"type": "object", "additionalProperties": True}), st.just({"$ref": "#/nowhere"}),
    st.just({"type": "array", "items": {"type": "boolean"}, "maxItems": 2}), json_values)
response_format = st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "json_schema", "xml"])},
                          optional={"json_schema": st.one_of(st.fixed_dictionaries(
                              {"schema": small_schema}, optional={"name": st.text(max_size=70),
                                                                  "strict": st.one_of(st.booleans(), json_values)}),
                              json_values)}),
    json_values)
regex = st.one_of(st.sampled_from(["[ab]{1,3}", "yes|no", "\\d+", "(", "a{99999}", "[z-a]", ".*"]),
                  st.text(max_size=12), json_values)
grammar = st.one_of(st.sampled_from(['start: "yes" | "no"', "start: x\nx: /[0-9]+/", "start:", "start: start",
                                     'start: "a"*']), st.text(max_size=20), json_values)
tool_function = st.fixed_dictionaries({"name": st.one_of(st.sampled_from(["get_weather", "f", "a.b-c"]),
                                                         st.text(max_size=70))},
                                      optional={"description": st.text(max_size=20), "parameters": small_schema,
                                                "strict": st.one_of(st.booleans(), json_values)})
tool = st.one_of(st.fixed_dictionaries({"type": st.sampled_from(["function", "code"]), "function": tool_function}),
                 json_values)
tools = st.one_of(st.lists(tool, max_size=3), json_values,
                  st.integers(MAX_TOOLS - 1, MAX_TOOLS + 1).map(lambda k: [
                      {"type": "function", "function": {"name": f"f{i}"}} for i in range(k)]))
tool_choice = st.one_of(st.sampled_from(["auto", "none", "required", "any"]),
                        st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
                            {"name": st.sampled_from(["get_weather", "f", "f0", "nope"])})}), json_values)
constraint_fields = {"response_format": response_format, "chat_template_kwargs": chat_template_kwargs,
                     "max_reasoning_tokens": st.one_of(st.integers(-1, 8), json_values)}

chat_bodies = st.fixed_dictionaries({"max_new_tokens": max_tokens}, optional={
    "prompt": st.one_of(prompt_text, json_values), "messages": messages, "system": st.one_of(prompt_text, json_values),
    "raw": st.one_of(st.booleans(), json_values), "stream": st.one_of(st.booleans(), json_values),
    "temperature": unit, "top_p": unit, "top_k": st.one_of(st.integers(-2, 100), json_values),
    "repetition_penalty": unit, "stop": stop, "seed": st.one_of(st.integers(-5, 2**65), json_values),
    "ignore_eos": st.one_of(st.booleans(), json_values), "regex": regex, "grammar": grammar, **constraint_fields,
    "unknown_field": json_values,
})
openai_common = {
    "model": st.one_of(st.sampled_from(["tiny-llama", "gpt-4o", ""]), json_values),
    "temperature": unit, "top_p": unit, "n": st.one_of(st.integers(-1, 3), st.sampled_from([MAX_N, MAX_N + 1]),
                                                       json_values), "stop": stop,
    "seed": st.one_of(st.integers(-(2**64), 2**64), json_values), "presence_penalty": unit,
    "frequency_penalty": unit, "stream": st.one_of(st.booleans(), json_values),
    "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": st.booleans()}), json_values),
    "top_k": st.one_of(st.integers(-2, 50), json_values), "min_p": unit, "repetition_penalty": unit,
    "min_tokens": st.one_of(st.integers(-2, 10), json_values), "ignore_eos": st.one_of(st.booleans(), json_values),
    "stop_token_ids": stop_token_ids, "user": st.one_of(st.text(max_size=10), json_values), **constraint_fields,
}
v1_chat_bodies = st.fixed_dictionaries({"max_tokens": max_tokens}, optional={
    **openai_common, "messages": messages, "max_completion_tokens": max_tokens,
    "logprobs": st.one_of(st.booleans(), json_values), "top_logprobs": st.one_of(st.integers(-1, 25), json_values),
    "tools": tools, "tool_choice": tool_choice, "parallel_tool_calls": st.one_of(st.booleans(), json_values),
})
v1_completion_bodies = st.fixed_dictionaries({"max_tokens": max_tokens}, optional={
    **openai_common, "logprobs": st.one_of(st.integers(-1, 25), json_values), "echo": st.booleans(),
    "suffix": st.one_of(st.text(max_size=4), json_values), "best_of": st.one_of(st.integers(-1, MAX_N + 1), json_values),
    "prompt": st.one_of(prompt_text, st.lists(prompt_text, max_size=3), st.lists(st.integers(-5, 5000), max_size=8),
                        st.lists(st.lists(st.integers(0, 2000), max_size=4), max_size=3), json_values,
                        st.integers(MAX_PROMPTS - 1, MAX_PROMPTS + 1).map(lambda k: ["a b"] * k)),
})


# Near-valid bodies: every field of a plausible type and range (edges included), then at most one
# field replaced by arbitrary JSON, so that many requests really reach the engine.
edge_unit = st.one_of(st.sampled_from([0.0, 1.0, 1e-9, 0.5, 2.0]), st.floats(min_value=0, max_value=2, allow_nan=False))
small_tokens = st.integers(min_value=1, max_value=6)
# template variables, now and then one the tokenizer takes for itself (a 400, never a 500)
valid_template_kwargs = st.dictionaries(st.sampled_from(["enable_thinking", "x", "self", "tokenizer", "truncation",
                                                         "return_assistant_tokens_mask"]), st.booleans(), max_size=2)
valid_messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system"]),
                                                 "content": prompt_text}), min_size=1, max_size=3)
valid_chat = st.fixed_dictionaries({"max_new_tokens": small_tokens}, optional={
    "temperature": edge_unit, "top_p": st.floats(min_value=0.01, max_value=1), "top_k": st.integers(0, 50),
    "repetition_penalty": st.floats(min_value=0.5, max_value=2), "stop": st.lists(st.text(min_size=1, max_size=3),
                                                                                   max_size=3),
    "seed": st.integers(0, 2**32), "stream": st.booleans(), "system": prompt_text, "ignore_eos": st.booleans(),
    "chat_template_kwargs": valid_template_kwargs,
    "max_reasoning_tokens": st.integers(0, 4),
    **{k: v for k, v in [("regex", st.sampled_from(["[ab]{1,3}", "yes|no", "[0-9]{2}"])),
                         ("grammar", st.sampled_from(['start: "yes" | "no"', "start: x\nx: /[0-9]{1,3}/"]))]},
}).flatmap(lambda d: st.one_of(st.just({**d, "prompt": "x"}), prompt_text.map(lambda p: {**d, "prompt": p}),
                               valid_messages.map(lambda m: {**d, "messages": m})))
valid_openai = {
    "temperature": edge_unit, "top_p": st.floats(min_value=0.01, max_value=1), "n": st.integers(1, 3),
    "stop": st.lists(st.text(min_size=1, max_size=3), max_size=3), "seed": st.integers(-(2**31), 2**31),
    "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2), "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}), "top_k": st.integers(-1, 50),
    "min_p": st.floats(0, 1), "repetition_penalty": st.floats(min_value=0.5, max_value=2),
    "min_tokens": st.integers(0, 6), "ignore_eos": st.booleans(),
    "stop_token_ids": st.one_of(st.lists(st.integers(0, 1023), max_size=3),
                                st.integers(0, MAX_STOP_TOKEN_IDS).map(lambda k: list(range(k)))),
    "chat_template_kwargs": valid_template_kwargs,
    "response_format": st.one_of(st.just({"type": "text"}), st.just({"type": "json_object"}), small_schema.filter(
        lambda v: isinstance(v, (dict, bool))).map(lambda v: {"type": "json_schema", "json_schema": {"schema": v}})),
}
valid_tools = st.lists(st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
    {"name": st.sampled_from(["get_weather", "f"])}, optional={"parameters": small_schema.filter(
        lambda v: isinstance(v, dict)), "strict": st.booleans()})}), min_size=1, max_size=2).filter(
    lambda ts: len({t["function"]["name"] for t in ts}) == len(ts))
valid_v1_chat = st.fixed_dictionaries({"max_tokens": small_tokens, "messages": valid_messages}, optional={
    **valid_openai, "logprobs": st.booleans()}).flatmap(lambda d: st.one_of(st.just(d), st.tuples(
        valid_tools, st.sampled_from(["auto", "required", "none", None]), st.sampled_from([True, False, None])).map(
            lambda t: {**{k: v for k, v in d.items() if k != "response_format"}, "tools": t[0],
                       **({"tool_choice": t[1]} if t[1] else {}),
                       **({"parallel_tool_calls": t[2]} if t[2] is not None else {})})))
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
        for event in parse_sse(data):  # a 200 that carries an internal error is a 500 all the same
            assert not _internal_error(event.data), (path, body, event)
    else:
        payload = json.loads(data)
        if response.status_code >= 400:
            assert "error" in payload and payload["error"], payload


def _internal_error(data: str) -> bool:
    """Whether an event's data is the server's report of a failure it did not expect (server/errors.py)."""
    try:
        payload = json.loads(data)
    except ValueError:
        return False
    if not isinstance(payload, dict):
        return False
    error = payload.get("error")
    if isinstance(error, dict):
        return error.get("code") == "internal_error" or str(error.get("message", "")).startswith("Internal error")
    return payload.get("code") == "internal" or str(error or "").startswith("Internal error")


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

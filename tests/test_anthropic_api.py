"""`POST /v1/messages` and `/v1/messages/count_tokens` over real HTTP (tiny random models, app.py
processes), through the official anthropic SDK and raw httpx: the same tokens as
/v1/chat/completions, the stream's events on the wire, stop reasons, the tool loop and thinking
blocks of the tiny "qwen3", structured output, x-api-key, and Anthropic's error shape."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest

from tests.servers import parse_sse

KEY = "edge-test-key-5b1e9c"  # tests/test_access.py's flags (--api-key KEY): one server for every module
WEATHER = {"name": "get_weather", "description": "Weather of a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}},
                            "required": ["city"], "additionalProperties": False}}
THINK = {"type": "enabled", "budget_tokens": 4}  # the tiny thinking model's thought, closed early
GREEDY = {"temperature": 0}  # this SDK has no `temperature` argument any more; the API still takes it


@pytest.fixture(scope="module")
def qwen3_server(server_with, tiny_model):
    return server_with(model=tiny_model("qwen3"))


def _client(server, key: str = "unused") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=key, max_retries=0, timeout=120)


def _post(server, body: dict, path: str = "/v1/messages", **headers) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=120)


def test_greedy_output_equals_chat_completions(tiny_server):
    chat = openai.OpenAI(base_url=f"{tiny_server.url}/v1", api_key="x", max_retries=0).chat.completions.create(
        model="", messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there."}],
        max_tokens=24, temperature=0)
    client = _client(tiny_server)
    kwargs = dict(model="", system="Be brief.", max_tokens=24, extra_body=GREEDY,
                  messages=[{"role": "user", "content": [{"type": "text", "text": "Hello there."}]}])
    whole = client.messages.create(**kwargs)
    assert [b.type for b in whole.content] == ["text"] and whole.content[0].text == chat.choices[0].message.content
    assert whole.usage.input_tokens == chat.usage.prompt_tokens
    assert whole.usage.output_tokens == chat.usage.completion_tokens
    assert whole.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[chat.choices[0].finish_reason]
    with client.messages.stream(**kwargs) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == whole.content[0].text and final.stop_reason == whole.stop_reason
    counted = client.messages.count_tokens(model="", system="Be brief.",
                                           messages=[{"role": "user", "content": "Hello there."}])
    assert counted.input_tokens == whole.usage.input_tokens


def test_stream_events_in_order_on_the_wire(tiny_server):
    body = {"max_tokens": 10, "stream": True, "temperature": 0, "messages": [{"role": "user", "content": "Hi"}]}
    with httpx.stream("POST", f"{tiny_server.url}/v1/messages", json=body, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = parse_sse(r.read())
    data = [json.loads(e.data) for e in events]
    assert [e.event for e in events] == [d["type"] for d in data]
    kinds = [d["type"] for d in data]
    deltas = kinds.count("content_block_delta")
    assert kinds == ["message_start", "ping", "content_block_start", *["content_block_delta"] * deltas,
                     "content_block_stop", "message_delta", "message_stop"]
    start = data[0]["message"]
    assert start["role"] == "assistant" and start["content"] == [] and start["usage"]["input_tokens"] > 0
    assert data[2]["content_block"] == {"type": "text", "text": ""}
    assert all(d["delta"]["type"] == "text_delta" for d in data if d["type"] == "content_block_delta")
    assert data[-2]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert data[-2]["usage"]["output_tokens"] == 10


def test_stop_sequence_ends_the_answer_and_is_named(tiny_server):
    client = _client(tiny_server)
    messages = [{"role": "user", "content": "Count with me."}]
    first = client.messages.create(model="", max_tokens=30, messages=messages, extra_body=GREEDY)
    text = first.content[0].text
    at = next(k for k in range(4, len(text) - 3) if text.find(text[k:k + 3]) == k and text[k:k + 3].strip())
    stop = text[at:at + 3]
    cut = client.messages.create(model="", max_tokens=30, messages=messages, stop_sequences=["\u00a7never", stop],
                                 extra_body=GREEDY)
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[:at]


def test_tool_loop_with_the_sdk(qwen3_server):
    client = _client(qwen3_server)
    question = {"role": "user", "content": "What is the weather in Oslo?"}
    first = client.messages.create(model="", max_tokens=150, messages=[question], tools=[WEATHER],
                                   tool_choice={"type": "any", "disable_parallel_tool_use": True}, thinking=THINK,
                                   extra_body=GREEDY)
    assert first.stop_reason == "tool_use"
    assert [b.type for b in first.content] == ["thinking", "tool_use"] and first.content[0].thinking
    call = first.content[1]
    assert call.name == "get_weather" and call.id.startswith("toolu_")
    jsonschema.validate(call.input, WEATHER["input_schema"])
    result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "sunny, 20 C"}]}
    final = client.messages.create(model="", max_tokens=12, tools=[WEATHER], thinking=THINK, extra_body=GREEDY,
                                   messages=[question, {"role": "assistant", "content": first.content}, result])
    assert final.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert final.usage.input_tokens > first.usage.input_tokens


def test_streamed_named_tool_call_gives_input_json_deltas(qwen3_server):
    with _client(qwen3_server).messages.stream(
            model="", max_tokens=150, messages=[{"role": "user", "content": "Weather?"}], tools=[WEATHER],
            tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
            thinking=THINK, extra_body=GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_message()
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    assert {d.type for d in deltas} == {"thinking_delta", "input_json_delta"}
    arguments = "".join(d.partial_json for d in deltas if d.type == "input_json_delta")
    assert final.stop_reason == "tool_use" and final.content[-1].input == json.loads(arguments)
    jsonschema.validate(final.content[-1].input, WEATHER["input_schema"])


def test_thinking_disabled_gives_no_thinking_block(qwen3_server):
    reply = _client(qwen3_server).messages.create(model="", max_tokens=10, thinking={"type": "disabled"},
                                                  messages=[{"role": "user", "content": "Hi"}], extra_body=GREEDY)
    assert [b.type for b in reply.content] == ["text"]


def test_output_config_format_validates(tiny_server):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10}, "ok": {"type": "boolean"}},
              "required": ["name", "ok"], "additionalProperties": False}
    reply = _client(tiny_server).messages.create(model="", max_tokens=100, messages=[{"role": "user", "content": "x"}],
                                                 output_config={"format": {"type": "json_schema", "schema": schema}},
                                                 extra_body={"temperature": 0.8})
    assert reply.stop_reason == "end_turn"
    jsonschema.validate(json.loads(reply.content[0].text), schema)


def test_x_api_key_and_bearer_are_the_servers_key(server_with):
    keyed = server_with("--api-key", KEY)
    reply = _client(keyed, KEY).messages.create(model="", max_tokens=3, messages=[{"role": "user", "content": "Hi"}])
    assert reply.usage.output_tokens == 3
    bearer = _post(keyed, {"max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]},
                   authorization=f"Bearer {KEY}")
    assert bearer.status_code == 200
    with pytest.raises(anthropic.AuthenticationError):
        _client(keyed, "wrong").messages.create(model="", max_tokens=3, messages=[{"role": "user", "content": "Hi"}])
    wrong = _post(keyed, {"max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}, **{"x-api-key": "wrong"})
    assert wrong.status_code == 401
    assert wrong.json() == {"type": "error", "error": {"type": "authentication_error", "message": (
        "This server needs an API key: send `Authorization: Bearer <key>` or `x-api-key: <key>` "
        "(the key in `x-api-key` is not the server's key).")}}
    responses = httpx.post(f"{keyed.url}/v1/responses", json={"input": "Hi", "max_output_tokens": 2},
                           headers={"x-api-key": KEY}, timeout=60)
    assert responses.status_code == 200  # the key counts on every route


HI = [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize("body, words", [
    ({"messages": HI}, "`max_tokens` is required"),
    ({"max_tokens": 0, "messages": HI}, "`max_tokens`: input should be greater than or equal to 1"),
    ({"max_tokens": 5, "messages": HI, "n": 2}, "`n` is not a known field. Allowed: model, messages"),
    ({"max_tokens": 5, "messages": []}, "`messages`: list should have at least 1 item"),
    ({"max_tokens": 5, "messages": HI, "temperature": 1.5}, "`temperature`: input should be less than or equal to 1"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "x" * 400_000}]}, "`messages` is too long"),
    ({"max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}, "`messages.0.role`: input should be"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "f",
                                                                   "input": {}}]}]},
     "a user message cannot hold `tool_use` blocks"),
    ({"max_tokens": 5, "messages": HI, "tools": [{"name": "f", "input_schema": {"type": "string"}}]},
     "`tools.0.input_schema`: must be the JSON schema of an object"),
    ({"max_tokens": 5, "messages": HI, "tools": [{"name": "bad name", "input_schema": {"type": "object"}}]},
     "`tools.0.name`: string should match pattern"),
    ({"max_tokens": 5, "messages": HI, "tool_choice": {"type": "any"}}, '`tool_choice` "any" needs `tools`'),
    ({"max_tokens": 5, "messages": HI, "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}},
     "names the function `nope`, which is not in `tools`"),
    ({"max_tokens": 5, "messages": HI, "stop_sequences": [""]}, "`stop_sequences` must be at most 16 non-empty strings"),
    ({"max_tokens": 5, "messages": HI, "thinking": {"type": "enabled"}}, "needs `budget_tokens`"),
    ({"max_tokens": 5, "messages": HI, "tools": [{"name": "f", "input_schema": {
        "type": "object", "properties": {"a": {"type": 7}}}}], "tool_choice": {"type": "any"}},
     "cannot be used for constrained output"),
])
def test_hostile_bodies_get_anthropic_400s(tiny_server, body, words):
    reply = _post(tiny_server, body)
    assert reply.status_code == 400, reply.text
    assert reply.json()["type"] == "error" and reply.json()["error"]["type"] == "invalid_request_error"
    assert words in reply.json()["error"]["message"], reply.json()["error"]["message"]


def test_the_sdk_raises_on_an_unknown_model(tiny_server):
    with pytest.raises(anthropic.NotFoundError) as caught:
        _client(tiny_server).messages.create(model="claude-none", max_tokens=3, messages=HI)
    assert caught.value.body["error"]["type"] == "not_found_error"
    assert "The model `claude-none` does not exist on this server" in caught.value.body["error"]["message"]

"""`POST /v1/responses` over real HTTP (tiny random models, app.py processes), through the official
openai SDK and raw httpx: the same tokens as /v1/chat/completions, the semantic stream events,
forced tool calls and the tool loop, text.format, previous_response_id and the store, reasoning
items of the thinking "qwen3", and the 400s of hostile bodies in OpenAI's error shape."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.servers import parse_sse

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}},
                          "required": ["city"], "additionalProperties": False}}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                          "role": {"enum": ["admin", "user"]}},
          "required": ["name", "role"], "additionalProperties": False}
REASONING = {"max_reasoning_tokens": 4}  # the tiny thinking model's thought, closed early


class Person(BaseModel):
    name: str = Field(max_length=10)
    age: int = Field(ge=0, le=120)


@pytest.fixture(scope="module")
def qwen3_server(server_with, tiny_model):
    return server_with(model=tiny_model("qwen3"))


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def _post(server, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/responses", json=body, timeout=120)


def test_greedy_output_equals_chat_completions(tiny_server):
    client = _client(tiny_server)
    chat = client.chat.completions.create(model="", messages=[{"role": "system", "content": "Be brief."},
                                                              {"role": "user", "content": "Tell me about rivers."}],
                                          max_tokens=24, temperature=0)
    whole = client.responses.create(model="", instructions="Be brief.", input="Tell me about rivers.",
                                    max_output_tokens=24, temperature=0)
    assert whole.output_text == chat.choices[0].message.content
    assert whole.usage.input_tokens == chat.usage.prompt_tokens
    assert whole.usage.output_tokens == chat.usage.completion_tokens
    assert whole.usage.total_tokens == whole.usage.input_tokens + whole.usage.output_tokens
    expected_status = "incomplete" if chat.choices[0].finish_reason == "length" else "completed"
    assert whole.status == expected_status
    items = [{"role": "system", "content": "Be brief."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Tell me about rivers."}]}]
    streamed = list(client.responses.create(model="", input=items, max_output_tokens=24, temperature=0, stream=True))
    assert "".join(e.delta for e in streamed if e.type == "response.output_text.delta") == whole.output_text
    assert streamed[-1].response.output_text == whole.output_text


def test_stream_events_in_order_on_the_wire(tiny_server):
    with httpx.stream("POST", f"{tiny_server.url}/v1/responses", timeout=120,
                      json={"input": "Hello", "max_output_tokens": 12, "temperature": 0, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = parse_sse(r.read())
    data = [json.loads(e.data) for e in events]
    assert [e.event for e in events] == [d["type"] for d in data]
    assert [d["sequence_number"] for d in data] == list(range(len(data)))
    kinds = [d["type"] for d in data]
    deltas = kinds.count("response.output_text.delta")
    assert deltas >= 1
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * deltas,
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.incomplete" if data[-1]["response"]["status"] == "incomplete" else "response.completed"]
    text = "".join(d["delta"] for d in data if d["type"] == "response.output_text.delta")
    done = data[-1]["response"]
    assert done["output"][0]["content"][0]["text"] == text and done["usage"]["output_tokens"] == 12


def test_sdk_stream_helper_gives_the_final_response(tiny_server):
    with _client(tiny_server).responses.stream(model="", input="Hi", max_output_tokens=200, temperature=0,
                                               text={"format": {"type": "json_schema", "name": "person", "strict": True,
                                                                "schema": PERSON}}) as stream:
        texts = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.status == "completed" and final.output_text == "".join(texts)
    jsonschema.validate(json.loads(final.output_text), PERSON)


@pytest.mark.parametrize("stream", [False, True])
def test_parse_with_a_pydantic_model_validates(tiny_server, stream):
    client = _client(tiny_server)
    if stream:
        with client.responses.stream(model="", input="A person.", text_format=Person, max_output_tokens=150,
                                     temperature=0.8, extra_body={"seed": 3}) as s:
            parsed = s.get_final_response().output_parsed
    else:
        parsed = client.responses.parse(model="", input="A person.", text_format=Person, max_output_tokens=150,
                                        temperature=0.8, extra_body={"seed": 3}).output_parsed
    assert isinstance(parsed, Person)
    jsonschema.validate(parsed.model_dump(), Person.model_json_schema())


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "get_weather"}])
def test_forced_tool_calls_are_valid_items_and_the_loop_answers(qwen3_server, choice):
    client = _client(qwen3_server)
    first = client.responses.create(model="", input="Weather in Oslo?", tools=[WEATHER], tool_choice=choice,
                                    parallel_tool_calls=False, max_output_tokens=150, temperature=0,
                                    extra_body=REASONING)
    assert [o.type for o in first.output] == ["reasoning", "function_call"]
    call = first.output[1]
    assert call.name == "get_weather" and call.call_id.startswith("call_") and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    loop = [{"role": "user", "content": "Weather in Oslo?"}, *[o.model_dump() for o in first.output],
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 20 C"}]
    second = client.responses.create(model="", input=loop, tools=[WEATHER], max_output_tokens=8, temperature=0,
                                     extra_body=REASONING)
    assert second.status in ("completed", "incomplete")
    assert second.usage.input_tokens > first.usage.input_tokens


def test_streamed_tool_call_has_the_arguments_events(qwen3_server):
    events = list(_client(qwen3_server).responses.create(
        model="", input="Weather?", tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
        max_output_tokens=150, temperature=0, stream=True, extra_body=REASONING))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "response.reasoning_text.delta" in kinds
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and done[0].arguments == arguments and done[0].name == "get_weather"
    jsonschema.validate(json.loads(arguments), WEATHER["parameters"])
    assert events[-1].response.output[-1].arguments == arguments


def test_reasoning_item_comes_before_the_message(qwen3_server):
    response = _client(qwen3_server).responses.create(model="", input="Hi", max_output_tokens=30, temperature=0,
                                                      extra_body=REASONING)
    kinds = [o.type for o in response.output]
    assert kinds[0] == "reasoning" and response.output[0].content[0].text
    assert response.usage.output_tokens_details.reasoning_tokens >= 4
    plain = _client(qwen3_server).responses.create(model="", input="Hi", max_output_tokens=30, temperature=0,
                                                   reasoning={"effort": "none"})
    assert [o.type for o in plain.output] == ["message"]


def test_previous_response_id_continues_the_conversation_and_store_false_is_not_kept(tiny_server):
    client = _client(tiny_server)
    first = client.responses.create(model="", input="Name a river.", max_output_tokens=10, temperature=0)
    assert client.responses.retrieve(first.id).output_text == first.output_text
    second = client.responses.create(model="", input="And another?", previous_response_id=first.id,
                                     max_output_tokens=10, temperature=0)
    alone = client.responses.create(model="", input="And another?", max_output_tokens=10, temperature=0)
    # the second prompt holds the first turn: its question and its answer, before the same new question
    assert second.usage.input_tokens > alone.usage.input_tokens + first.usage.output_tokens
    assert second.previous_response_id == first.id

    unstored = client.responses.create(model="", input="Hi", store=False, max_output_tokens=4, temperature=0)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    reply = _post(tiny_server, {"input": "x", "previous_response_id": unstored.id, "max_output_tokens": 2})
    assert reply.status_code == 404
    error = reply.json()["error"]
    assert error["type"] == "not_found_error" and error["param"] == "previous_response_id"
    assert f"No response `{unstored.id}` is stored" in error["message"] and "`store: false`" in error["message"]


@pytest.mark.parametrize("body, words", [
    ({"input": 5}, "`input.str`: input should be a valid string. Given: 5"),
    ({"input": "x", "max_tokens": 3}, "`max_tokens` is not a known field. Allowed: model, input"),
    ({"input": "x", "temperature": 3}, "`temperature`: input should be less than or equal to 2. Given: 3"),
    ({"input": []}, "`input` must hold at least one item"),
    ({"input": [{"type": "image_generation_call"}]}, "does not match any of the expected tags"),
    ({"input": "x" * 400_000}, "`input` is too long"),
    ({"input": "x", "tools": [{"type": "function", "name": "no spaces"}]}, "`tools.0.name`: string should match"),
    ({"input": "x", "tools": [WEATHER, WEATHER]}, "`tools` must have distinct function names"),
    ({"input": "x", "tool_choice": "required"}, '`tool_choice` "required" needs `tools`'),
    ({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}},
     "names the function `nope`, which is not in `tools`"),
    ({"input": "x", "tools": [WEATHER], "text": {"format": {"type": "json_object"}}},
     "`text.format` cannot be combined with `tools`"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "schema": {"type": "object"}}}},
     '`text.format` of type "json_schema" needs a `name` and a `schema`'),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "a", "schema": {"type": "strin"}}}},
     "The JSON schema cannot be used for constrained output"),
    ({"input": "x", "tools": [{**WEATHER, "parameters": {"type": "object", "properties": {"a": {"type": 7}}}}],
      "tool_choice": "required"}, "cannot be used for constrained output"),
])
def test_hostile_bodies_get_openai_400s(tiny_server, body, words):
    reply = _post(tiny_server, body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and words in error["message"], error["message"]
    if "text" in body and "tools" not in body:
        assert error["param"] == "text.format"

"""The "done when" checks of structured output and tools on the embedded SmolLM2-135M-Instruct over
real HTTP (its template has no tool syntax: the generic format): 20 varied JSON schemas validate at
temperature 0 and 0.8, `tool_choice="required"` always calls a declared function, and the openai
SDK's tool loop and `parse()` work, streaming and not."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

S = {"type": "string", "maxLength": 20}  # every schema is bounded: a reply always ends within max_tokens
SCHEMAS = [  # (prompt, schema): nested objects, enums, arrays, required fields
    ("Give a person's name and age.", {"type": "object", "properties": {"name": S, "age": {"type": "integer"}},
                                       "required": ["name", "age"]}),
    ("Is Paris in France?", {"type": "object", "properties": {"answer": {"type": "boolean"}}, "required": ["answer"]}),
    ("Pick a primary color.", {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}},
                               "required": ["color"]}),
    ("List three fruits.", {"type": "object", "properties": {"fruits": {"type": "array", "items": S,
                                                                        "minItems": 3, "maxItems": 3}},
                            "required": ["fruits"]}),
    ("Describe a book.", {"type": "object", "properties": {
        "title": S, "author": {"type": "object", "properties": {"first": S, "last": S}, "required": ["first", "last"]},
        "year": {"type": "integer", "minimum": 1000, "maximum": 2100}}, "required": ["title", "author", "year"]}),
    ("Rate this movie from 1 to 5.", {"type": "object", "properties": {"stars": {"type": "integer", "minimum": 1,
                                                                                  "maximum": 5}}, "required": ["stars"]}),
    ("Give the coordinates of Paris.", {"type": "object", "properties": {"lat": {"type": "number"},
                                                                         "lon": {"type": "number"}},
                                        "required": ["lat", "lon"]}),
    ("Classify: 'I love it!'", {"type": "object", "properties": {
        "sentiment": {"enum": ["positive", "negative", "neutral"]}, "confidence": {"type": "number", "minimum": 0,
                                                                                    "maximum": 1}},
        "required": ["sentiment", "confidence"]}),
    ("Make a todo list.", {"type": "object", "properties": {"todos": {"type": "array", "maxItems": 3, "items": {
        "type": "object", "properties": {"task": S, "done": {"type": "boolean"}}, "required": ["task", "done"],
        "additionalProperties": False}}}, "required": ["todos"]}),
    ("What is 2 + 2?", {"type": "object", "properties": {"result": {"type": "integer"}}, "required": ["result"]}),
    ("Name a country and its capital.", {"type": "object", "properties": {"country": S, "capital": S},
                                         "required": ["country", "capital"], "additionalProperties": False}),
    ("Give an address.", {"type": "object", "properties": {"address": {"type": "object", "properties": {
        "street": S, "city": S, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
        "required": ["street", "city", "zip"]}}, "required": ["address"]}),
    ("Pick a weekday.", {"enum": ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday"]}),
    ("Give three numbers.", {"type": "array", "items": {"type": "integer"}, "minItems": 3, "maxItems": 3}),
    ("Describe a user account.", {"type": "object", "properties": {
        "username": {"type": "string", "pattern": "^[a-z]{3,12}$"}, "role": {"enum": ["admin", "editor", "viewer"]},
        "active": {"type": "boolean"}}, "required": ["username", "role", "active"], "additionalProperties": False}),
    ("Give a recipe.", {"type": "object", "properties": {"dish": S, "ingredients": {
        "type": "array", "items": S, "minItems": 1, "maxItems": 3}, "minutes": {"type": "integer", "minimum": 1}},
        "required": ["dish", "ingredients", "minutes"]}),
    ("Report the weather.", {"type": "object", "properties": {"city": S, "temperature": {"type": "number"},
                                                              "unit": {"enum": ["C", "F"]}},
                             "required": ["city", "temperature", "unit"]}),
    ("Translate 'hello' to French.", {"type": "object", "properties": {"source": S, "target": S},
                                      "required": ["source", "target"]}),
    ("Give an event with a date.", {"type": "object", "properties": {
        "event": S, "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}},
        "required": ["event", "date"]}),
    ("Describe a team.", {"type": "object", "properties": {"team": S, "members": {"type": "array", "maxItems": 3,
        "items": {"type": "object", "properties": {"name": S, "lead": {"type": "boolean"}},
                  "required": ["name", "lead"]}}}, "required": ["team", "members"]}),
]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                   "required": ["city"], "additionalProperties": False}}}
CONVERT = {"type": "function", "function": {
    "name": "convert_currency", "description": "Convert an amount between currencies",
    "parameters": {"type": "object", "properties": {"amount": {"type": "number"}, "to": {"enum": ["EUR", "USD"]}},
                   "required": ["amount", "to"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def client(embedded_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{embedded_server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def _ask(client, prompt: str, schema: dict, temperature: float, seed: int) -> tuple[str, str]:
    reply = client.chat.completions.create(
        model="", messages=[{"role": "user", "content": f"{prompt} Answer in JSON."}], max_tokens=500,
        temperature=temperature, seed=seed,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}})
    return reply.choices[0].message.content, reply.choices[0].finish_reason


@pytest.mark.parametrize("temperature", [0, 0.8])
def test_twenty_json_schemas_validate(client, temperature):
    with ThreadPoolExecutor(len(SCHEMAS)) as pool:  # one batch in the engine
        replies = list(pool.map(lambda i: _ask(client, *SCHEMAS[i], temperature, i), range(len(SCHEMAS))))
    for (prompt, schema), (text, reason) in zip(SCHEMAS, replies):
        assert reason == "stop", (prompt, text)
        jsonschema.validate(json.loads(text), schema)


def test_required_tool_choice_always_calls_a_declared_function(client):
    prompts = ["What is the weather in Tokyo?", "Convert 20 dollars to euros.", "Hello!", "Tell me a joke.",
               "Is it raining in Oslo?", "How much is 5 EUR in USD?"]
    tools = [WEATHER, CONVERT]
    declared = {t["function"]["name"]: t["function"]["parameters"] for t in tools}

    def ask(i: int):
        return client.chat.completions.create(model="", messages=[{"role": "user", "content": prompts[i]}],
                                              tools=tools, tool_choice="required", max_tokens=120,
                                              temperature=0.8, seed=i)

    with ThreadPoolExecutor(len(prompts)) as pool:
        replies = list(pool.map(ask, range(len(prompts))))
    for reply in replies:
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        for call in choice.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), declared[call.function.name])


def _get_weather(city: str) -> str:
    return json.dumps({"city": city, "temperature_c": 21, "sky": "sunny"})


@pytest.mark.parametrize("stream", [False, True])
def test_openai_sdk_tool_loop(client, stream):
    """call -> run the function -> send the result -> the final answer (no call)."""
    messages = [{"role": "user", "content": "What is the weather in Paris right now?"}]
    for step in range(2):
        kwargs = dict(model="", messages=messages, tools=[WEATHER], max_tokens=120, temperature=0,
                      tool_choice="required" if step == 0 else "none")
        if stream:
            calls: dict[int, dict] = {}
            content = ""
            reason = None
            for chunk in client.chat.completions.create(stream=True, **kwargs):
                delta = chunk.choices[0].delta
                content += delta.content or ""
                for piece in delta.tool_calls or ():
                    call = calls.setdefault(piece.index, {"id": piece.id, "name": piece.function.name,
                                                          "arguments": ""})
                    call["arguments"] += piece.function.arguments or ""
                reason = chunk.choices[0].finish_reason or reason
            tool_calls = [{"id": c["id"], "type": "function",
                           "function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls.values()]
        else:
            message = client.chat.completions.create(**kwargs).choices[0]
            reason, content = message.finish_reason, message.message.content or ""
            tool_calls = [c.model_dump() for c in message.message.tool_calls or ()]
        if step == 0:
            assert reason == "tool_calls" and not content and len(tool_calls) >= 1
            messages.append({"role": "assistant", "content": None, "tool_calls": tool_calls})
            for call in tool_calls:
                assert call["function"]["name"] == "get_weather"
                arguments = json.loads(call["function"]["arguments"])
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": _get_weather(**arguments)})
        else:
            assert reason in ("stop", "length") and content.strip() and not tool_calls


class Person(BaseModel):
    name: str = Field(max_length=20)
    age: int
    role: Literal["admin", "user", "guest"]


class WeatherQuery(BaseModel):
    """Ask for the weather of a city."""

    city: str = Field(max_length=30)
    unit: Literal["celsius", "fahrenheit"]


def test_openai_sdk_parse_with_a_pydantic_model(client):
    messages = [{"role": "user", "content": "Invent a person with a name, an age and a role."}]
    parsed = client.chat.completions.parse(model="", messages=messages, response_format=Person, max_tokens=120,
                                           temperature=0).choices[0].message.parsed
    assert isinstance(parsed, Person)
    with client.chat.completions.stream(model="", messages=messages, response_format=Person, max_tokens=120,
                                        temperature=0.8, seed=3) as stream:
        final = stream.get_final_completion()
    assert isinstance(final.choices[0].message.parsed, Person)


def test_openai_sdk_parse_with_strict_tools(client):
    tool = openai.pydantic_function_tool(WeatherQuery)
    assert tool["function"]["strict"] is True
    messages = [{"role": "user", "content": "What's the weather in Rome, in celsius?"}]
    reply = client.chat.completions.parse(model="", messages=messages, tools=[tool], tool_choice="required",
                                          max_tokens=120, temperature=0)
    call = reply.choices[0].message.tool_calls[0]
    assert call.function.name == "WeatherQuery" and isinstance(call.function.parsed_arguments, WeatherQuery)
    with client.chat.completions.stream(model="", messages=messages, tools=[tool], tool_choice="required",
                                        max_tokens=120, temperature=0.8, seed=1) as stream:
        final = stream.get_final_completion()
    assert isinstance(final.choices[0].message.tool_calls[0].function.parsed_arguments, WeatherQuery)


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"]}}}


def test_a_required_call_takes_only_the_declared_keys_and_streams_as_it_answers(embedded_server):
    """Undeclared keys are closed by default (as xgrammar's strict mode in vLLM and SGLang): the
    model filled `arguments` with invented keys (unit_map, unit_map_map, ...) until max_tokens, and
    the answer came back with no tool_calls and the raw call in `content`."""
    client = openai.OpenAI(base_url=f"{embedded_server.url}/v1", api_key="none", max_retries=0, timeout=120)
    ask = dict(model="", messages=[{"role": "user", "content": "What is the weather in Paris?"}],
               tools=[WEATHER_TOOL], tool_choice="required", max_tokens=100, temperature=0)
    whole = client.chat.completions.create(**ask)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content, choice
    (call,) = choice.message.tool_calls
    arguments = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and set(arguments) <= {"city", "unit"} and "city" in arguments
    chunks = list(client.chat.completions.create(**ask, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    streamed = "".join(d.tool_calls[0].function.arguments or "" for d in deltas if d.tool_calls)
    assert json.loads(streamed) == arguments
    assert "".join(d.content or "" for d in deltas) == ""
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]


def test_a_call_cut_by_the_length_limit_is_reported_as_such_never_as_content(embedded_server):
    """A call cut by max_tokens: finish_reason "length", no tool_calls, and no half call in content
    (its raw JSON used to come back as the answer's text), streamed and whole alike."""
    client = openai.OpenAI(base_url=f"{embedded_server.url}/v1", api_key="none", max_retries=0, timeout=120)
    ask = dict(model="", messages=[{"role": "user", "content": "What is the weather in Paris?"}],
               tools=[WEATHER_TOOL], tool_choice="required", max_tokens=6, temperature=0)
    choice = client.chat.completions.create(**ask).choices[0]
    assert choice.finish_reason == "length" and not choice.message.content and not choice.message.tool_calls, choice
    chunks = list(client.chat.completions.create(**ask, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == "" and not any(d.tool_calls for d in deltas)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]

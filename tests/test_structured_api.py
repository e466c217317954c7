"""Structured output, thinking and tool calls over real HTTP (tiny random models, app.py processes):
`/v1` through the openai SDK and raw httpx, `/chat` SSE. The tiny Llama's ChatML template has no
tool syntax (the generic format); the tiny "qwen3" thinks and writes Hermes `<tool_call>` blocks."""

from __future__ import annotations

import json
import threading

import httpx
import jsonschema
import openai
import pytest

from tests.servers import SSEReader, chat_text, parse_sse, slow_steps, usage_of

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "role": {"enum": ["admin", "user"]},
}, "required": ["name", "age", "role"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "maxLength": 6}}, "required": ["zone"],
    "additionalProperties": False}}}


@pytest.fixture(scope="module")
def qwen3_server(server_with, tiny_model):
    return server_with(model=tiny_model("qwen3"))


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def _valid_call(call, tools: list[dict]) -> dict:
    """The call's arguments, after checking it names a declared function and matches its schema."""
    declared = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in declared
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, declared[call.function.name])
    return arguments


@pytest.mark.parametrize("stream", [False, True])
def test_v1_json_schema_replies_validate(tiny_server, stream):
    client = _client(tiny_server)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    for temperature, seed in ((0, None), (0.8, 1), (0.8, 2)):
        kwargs = dict(model="", messages=_user("Describe a person."), max_tokens=150, temperature=temperature,
                      seed=seed, response_format=fmt)
        if stream:
            chunks = list(client.chat.completions.create(stream=True, **kwargs))
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            reason = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
            assert reason == ["stop"]
        else:
            reply = client.chat.completions.create(**kwargs)
            text = reply.choices[0].message.content
            assert reply.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(text), PERSON)


def test_v1_json_object_and_completions_response_format(tiny_server):
    client = _client(tiny_server)
    reply = client.chat.completions.create(model="", messages=_user("JSON please"), max_tokens=2, temperature=0,
                                           response_format={"type": "json_object"})
    assert reply.choices[0].message.content.startswith("{") and reply.choices[0].finish_reason == "length"
    completion = client.completions.create(model="", prompt="Answer:", max_tokens=20, temperature=0,
                                           extra_body={"response_format": {"type": "json_schema", "json_schema": {
                                               "name": "yn", "schema": {"enum": ["yes", "no"]}}}})
    assert completion.choices[0].text in ('"yes"', '"no"') and completion.choices[0].finish_reason == "stop"


def test_chat_regex_grammar_and_response_format(tiny_server):
    url = f"{tiny_server.url}/chat"
    events = parse_sse(httpx.post(url, json={"prompt": "Code?", "regex": "[A-Z]{2}-[0-9]{3}", "temperature": 1.0,
                                             "seed": 3, "max_new_tokens": 30}, timeout=60).content)
    code = chat_text(events)
    assert len(code) == 6 and code[:2].isupper() and code[2] == "-" and code[3:].isdigit()
    assert usage_of(events)["finish_reason"] == "stop"
    reply = httpx.post(url, json={"prompt": "Yes?", "stream": False, "grammar": 'start: "yes" | "no"',
                                  "max_new_tokens": 10}, timeout=60).json()
    assert reply["response"] in ("yes", "no") and reply["usage"]["finish_reason"] == "stop"
    reply = httpx.post(url, json={"prompt": "Person?", "stream": False, "max_new_tokens": 150, "temperature": 0,
                                  "response_format": {"type": "json_schema", "json_schema": {"schema": PERSON}}},
                       timeout=60).json()
    jsonschema.validate(json.loads(reply["response"]), PERSON)
    both = httpx.post(url, json={"prompt": "x", "regex": "a", "grammar": 'start: "a"'}, timeout=30)
    assert both.status_code == 400 and "at most one of `response_format`, `regex` or `grammar`" in both.text


def test_bad_and_hostile_constraints_are_400_while_other_streams_flow(tiny_server):
    """A stream in progress keeps producing tokens while hostile schemas are refused beside it."""
    received: list[str] = []
    done = threading.Event()

    def stream():
        with httpx.stream("POST", f"{tiny_server.url}/chat", timeout=120,
                          json={"prompt": "Tell me a story", "max_new_tokens": 300, "temperature": 0}) as response:
            for event in SSEReader(response):
                received.append(event.event)
        done.set()

    with slow_steps(tiny_server.url, 0.02):  # a 6 s stream
        _refuse_beside_a_stream(tiny_server, stream, received, done)


def _refuse_beside_a_stream(tiny_server, stream, received, done):
    reader = threading.Thread(target=stream)
    reader.start()
    while not received:  # the stream runs
        threading.Event().wait(0.05)
    depth = 200
    deep = json.loads('{"type": "object", "properties": {"a": ' * depth + '{"type": "string"}'
                      + '}, "required": ["a"]}' * depth)
    huge_enum = {"enum": [f"value-{i}-xxxxxx" for i in range(12_000)]}
    refusals = []
    for schema, expected in ((deep, "nests objects and arrays 401 levels deep; at most 64 levels are allowed"),
                             (huge_enum, "too long: at most 200000 characters")):
        fmt = {"type": "json_schema", "json_schema": {"name": "h", "schema": schema}}
        response = httpx.post(f"{tiny_server.url}/v1/chat/completions", timeout=60,
                              json={"messages": _user("hi"), "response_format": fmt})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"].startswith("response_format") and expected in error["message"], error
        refusals.append(len(received))
    bad = httpx.post(f"{tiny_server.url}/chat", json={"prompt": "x", "regex": "[a-"}, timeout=30)
    assert bad.status_code == 400 and "unclosed character class" in bad.json()["error"]
    lark = httpx.post(f"{tiny_server.url}/chat", json={"prompt": "x", "grammar": "start: nowhere"}, timeout=30)
    assert lark.status_code == 400 and "Lark grammar cannot be used" in lark.json()["error"]
    after_refusals = len(received)
    reader.join(120)
    assert done.is_set() and received[-2:] == ["usage", "end"]
    assert len(received) > after_refusals + 2  # tokens kept coming after the refusals


def test_thinking_is_split_on_v1_and_chat(qwen3_server):
    client = _client(qwen3_server)
    reply = client.chat.completions.create(model="", messages=_user("hi"), max_tokens=20, temperature=0,
                                           extra_body={"max_reasoning_tokens": 5})
    message = reply.choices[0].message.model_dump()
    assert message["reasoning"] == message["reasoning_content"] and message["reasoning"]
    assert "</think>" not in (message["content"] or "") and "<think>" not in message["reasoning"]
    chunks = list(client.chat.completions.create(model="", messages=_user("hi"), max_tokens=20, temperature=0,
                                                 stream=True, extra_body={"max_reasoning_tokens": 5}))
    deltas = [c.choices[0].delta.model_dump() for c in chunks if c.choices]
    thought = "".join(d.get("reasoning") or "" for d in deltas)
    assert thought == message["reasoning"] == "".join(d.get("reasoning_content") or "" for d in deltas)
    assert "".join(d.get("content") or "" for d in deltas) == (message["content"] or "")
    first_content = next(i for i, d in enumerate(deltas) if d.get("content"))
    assert all(not d.get("reasoning") for d in deltas[first_content:])  # the thought comes first
    off = client.chat.completions.create(model="", messages=_user("hi"), max_tokens=8, temperature=0,
                                         extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert "reasoning" not in off.choices[0].message.model_dump(exclude_none=True)
    events = parse_sse(httpx.post(f"{qwen3_server.url}/chat", timeout=60, json={
        "prompt": "hi", "max_new_tokens": 20, "temperature": 0, "max_reasoning_tokens": 5}).content)
    assert "".join(e.data for e in events if e.event == "reasoning") == message["reasoning"]
    assert [e.event for e in events].index("reasoning") < [e.event for e in events].index("message")
    reserved = httpx.post(f"{qwen3_server.url}/v1/chat/completions", timeout=30, json={
        "messages": _user("hi"), "chat_template_kwargs": {"messages": []}})
    assert reserved.status_code == 400 and "`chat_template_kwargs.messages` cannot be passed" in reserved.text


def test_schema_applies_after_the_thought(qwen3_server):
    reply = _client(qwen3_server).chat.completions.create(
        model="", messages=_user("Who?"), max_tokens=120, temperature=0.8, seed=4,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}},
        extra_body={"max_reasoning_tokens": 10})
    message = reply.choices[0].message.model_dump()
    assert message["reasoning"] and reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(message["content"]), PERSON)


@pytest.mark.parametrize("which", ["qwen3", "tiny"])
def test_required_and_named_tool_choice_give_valid_calls(which, qwen3_server, tiny_server):
    """Hermes blocks (qwen3) and the generic JSON format (tiny Llama), non-streaming and streaming."""
    client = _client(qwen3_server if which == "qwen3" else tiny_server)
    tools = [WEATHER, TIME]
    named = {"type": "function", "function": {"name": "get_time"}}
    for choice, parallel in (("required", True), (named, False)):
        reply = client.chat.completions.create(model="", messages=_user("What is the weather in Paris?"),
                                               tools=tools, tool_choice=choice, parallel_tool_calls=parallel,
                                               max_tokens=150, temperature=0.7, seed=2,
                                               extra_body={"max_reasoning_tokens": 4})
        choice_out = reply.choices[0]
        # a random model may go on listing parallel calls until max_tokens: the complete ones still count
        assert choice_out.finish_reason == ("length" if parallel and choice_out.finish_reason == "length"
                                            else "tool_calls")
        assert choice_out.message.content is None
        assert choice_out.message.tool_calls and (parallel or len(choice_out.message.tool_calls) == 1)
        for call in choice_out.message.tool_calls:
            _valid_call(call, tools)
            if isinstance(choice, dict):
                assert call.function.name == "get_time"
    chunks = list(client.chat.completions.create(model="", messages=_user("Weather?"), tools=tools,
                                                 tool_choice="required", parallel_tool_calls=False,
                                                 max_tokens=150, temperature=0, stream=True,
                                                 extra_body={"max_reasoning_tokens": 4}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert not "".join(d.content or "" for d in deltas)  # no call text leaks into content
    pieces = [tc for d in deltas for tc in (d.tool_calls or ())]
    first = pieces[0]
    assert first.index == 0 and first.id.startswith("call_") and first.type == "function"
    assert first.function.name in ("get_weather", "get_time") and first.function.arguments == ""
    later = [p for p in pieces if p.index == 0][1:]
    assert later and all(p.id is None and p.function.name is None for p in later)
    arguments = json.loads("".join(p.function.arguments for p in later))
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in tools}[first.function.name]
    jsonschema.validate(arguments, schema)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]


def test_tool_results_go_back_through_the_template(qwen3_server, tiny_server):
    for server in (qwen3_server, tiny_server):
        client = _client(server)
        history = _user("Weather in Paris?") + [
            {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                "name": "get_weather", "arguments": json.dumps({"city": "Paris", "unit": "c"})}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees, sunny"}]
        short = client.chat.completions.create(model="", messages=_user("Weather in Paris?"), tools=[WEATHER],
                                               max_tokens=1, temperature=0)
        reply = client.chat.completions.create(model="", messages=history, tools=[WEATHER], max_tokens=40,
                                               temperature=0)
        assert reply.usage.prompt_tokens > short.usage.prompt_tokens + 10  # the call and its result are in the prompt
        assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")
        content = reply.choices[0].message.content or ""
        assert '{"response"' not in content and "<tool_call>" not in content


def test_tool_choice_errors_name_the_problem(tiny_server):
    url = f"{tiny_server.url}/v1/chat/completions"
    missing = httpx.post(url, timeout=30, json={"messages": _user("x"), "tools": [WEATHER], "tool_choice": {
        "type": "function", "function": {"name": "nope"}}})
    assert missing.status_code == 400 and "`nope`, which is not in `tools`" in missing.text
    required = httpx.post(url, timeout=30, json={"messages": _user("x"), "tool_choice": "required"})
    assert required.status_code == 400 and '"required" needs `tools`' in required.json()["error"]["message"]
    mixed = httpx.post(url, timeout=30, json={"messages": _user("x"), "tools": [WEATHER],
                                              "response_format": {"type": "json_object"}})
    assert mixed.status_code == 400 and "cannot be combined with `tools`" in mixed.text

"""Issue 47, items 7, 8 and 9, over real HTTP: one answer's byte budget (a 400 naming n x max_tokens x
(1 + top_logprobs), the allowed maximum and what was given), resumable /chat records counted with
their constraint (so `--resume-max-bytes` bounds them), and a depth limit on tool and response-format
schemas and call arguments (a 400 naming the limit and the depth, never a 500 or a stall)."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from server.schemas import MAX_ANSWER_ENTRIES, MAX_SCHEMA_DEPTH, check_answer_budget
from tests.servers import LONG_RESUME_FLAGS

CHAT = [{"role": "user", "content": "hi"}]


def _error(reply: httpx.Response) -> dict:
    body = reply.json()
    return body["error"]


# --------------------------------------------------------------------------- item 7: the answer's budget

@pytest.mark.parametrize("stream", [True, False])
def test_an_answer_past_the_byte_budget_is_a_400_naming_the_product(tiny_server, stream):
    body = {"messages": CHAT, "n": 16, "logprobs": True, "top_logprobs": 20, "max_tokens": 1000, "stream": stream}
    reply = httpx.post(f"{tiny_server.url}/v1/chat/completions", json=body, timeout=120)
    assert reply.status_code == 400, reply.text[:300]
    error = _error(reply)
    assert error["type"] == "invalid_request_error" and error["param"] == "max_tokens"
    assert ("`n` x `max_tokens` x (1 + `top_logprobs`) = 16 x 1000 x 21 = 336,000 token entries, which exceeds "
            f"this server's answer budget of {MAX_ANSWER_ENTRIES:,}") in error["message"], error["message"]
    assert "Given: n=16, max_tokens=1000, top_logprobs=20." in error["message"]


def test_the_budget_counts_unset_max_tokens_as_the_context_and_every_prompt(tiny_server):
    url = tiny_server.url
    context = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["max_model_len"]
    reply = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
        "messages": CHAT, "n": 16, "logprobs": True, "top_logprobs": 20, "max_completion_tokens": None,
        "stream": True})
    assert reply.status_code == 400
    assert f"max_tokens unset (up to the context left: {context})" in _error(reply)["message"]

    reply = httpx.post(f"{url}/v1/completions", json={"prompt": ["a"] * 64, "n": 16, "max_tokens": 300,
                                                      "stream": True}, timeout=120)
    assert reply.status_code == 400
    message = _error(reply)["message"]
    assert "`n` x prompts x `max_tokens` x (1 + `logprobs`) = 16 x 64 x 300 x 1 = 307,200" in message, message
    assert "Given: n=16, prompts=64, max_tokens=300, logprobs unset." in message


def test_normal_use_stays_within_the_budget(tiny_server):
    """One choice of the whole context with 20 alternatives, and n=16 of a short answer, are admitted."""
    for body in ({"messages": CHAT, "logprobs": True, "top_logprobs": 20},  # max_tokens: up to the context
                 {"messages": CHAT, "n": 16, "logprobs": True, "top_logprobs": 20, "max_tokens": 16}):
        with httpx.stream("POST", f"{tiny_server.url}/v1/chat/completions", json={**body, "stream": True},
                          timeout=120) as reply:
            assert reply.status_code == 200, reply.read()
            first = next(reply.iter_lines())  # admitted and streaming; leaving aborts it
            assert first.startswith("data: {")


@pytest.mark.parametrize("context", [1024, 8192, 131_072, 1_048_576])
def test_one_choice_of_the_whole_context_is_never_refused(context):
    for max_tokens in (None, context, 10**9):  # past the context: the engine's own 400 names it
        check_answer_budget(1, max_tokens, context, 20)
    with pytest.raises(ValueError, match="exceeds this server's answer budget"):
        check_answer_budget(16, None, max(context, 8192), 20)  # the issue's ~200 MB answer


# --------------------------------------------------------------------------- item 8: resume records

RESUME_MAX_BYTES = int(LONG_RESUME_FLAGS[LONG_RESUME_FLAGS.index("--resume-max-bytes") + 1])  # 200,000


def _chat_stream(server, constraint_chars: int, label: str) -> httpx.Response:
    schema = {"type": "string", "description": "d" * constraint_chars}
    body = {"prompt": "hi", "max_new_tokens": 2, "response_format": {"type": "json_schema",
                                                                     "json_schema": {"schema": schema}}}
    reply = httpx.post(f"{server.url}/chat", json=body, headers={"x-request-id": label}, timeout=120)
    assert reply.status_code == 200, reply.text[:300]
    assert "event: end" in reply.text, reply.text[-300:]  # the whole answer, resumable or not
    return reply


def test_resume_records_count_their_constraint_within_resume_max_bytes(server_with):
    server = server_with(*LONG_RESUME_FLAGS)
    small = _chat_stream(server, 120_000, "resume-47-a")
    assert small.headers.get("x-resume-token")
    held = httpx.get(f"{server.url}/health", timeout=30).json()["resumable_bytes"]
    assert 120_000 <= held <= RESUME_MAX_BYTES, held  # the record counts its 120,000-character schema

    # a record whose constraint alone passes the bound is not kept: no token, the answer still whole
    large = _chat_stream(server, 199_000, "resume-47-b")
    assert large.headers.get("x-resume-token") is None
    assert httpx.get(f"{server.url}/health", timeout=30).json()["resumable_bytes"] <= RESUME_MAX_BYTES


# --------------------------------------------------------------------------- item 9: schema depth

def _nested(levels: int) -> dict:
    """A schema nesting exactly `levels` JSON objects."""
    schema: dict = {"type": "string"}
    for _ in range(levels - 1):
        schema = {"type": "array", "items": schema}
    return schema


def _deep_text(levels: int) -> str:
    """A schema nesting `levels` (odd) objects and arrays as JSON text, built without json.dumps."""
    pairs = (levels - 1) // 2
    return '{"anyOf": [' * pairs + '{"type": "string"}' + "]}" * pairs


def _bodies(schema_text: str) -> list[tuple[str, str, str]]:
    """(path, body as JSON text, the field named) of every route and schema field, the schema spliced in."""
    tool_params = '{"type": "object", "properties": {"a": %s}}' % schema_text
    return [
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, '
         '"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": %s}}}' % schema_text,
         "response_format.json_schema.schema"),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "tools": '
         '[{"type": "function", "function": {"name": "f", "parameters": %s}}], "tool_choice": "required"}'
         % tool_params, "tools.0.function.parameters"),
        ("/chat", '{"prompt": "hi", "max_new_tokens": 2, "stream": false, "response_format": {"type": '
         '"json_schema", "json_schema": {"schema": %s}}}' % schema_text, "response_format.json_schema.schema"),
        ("/v1/responses", '{"input": "hi", "max_output_tokens": 2, "text": {"format": {"type": "json_schema", '
         '"name": "x", "schema": %s}}}' % schema_text, "text.format.schema"),
        ("/v1/responses", '{"input": "hi", "max_output_tokens": 2, "tools": [{"type": "function", "name": "f", '
         '"parameters": %s}], "tool_choice": "required"}' % tool_params, "tools.0.parameters"),
        ("/v1/messages", '{"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], "output_config": '
         '{"format": {"type": "json_schema", "schema": %s}}}' % schema_text, "output_config.format.schema"),
        ("/v1/messages", '{"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], "tools": [{"name": '
         '"f", "input_schema": %s}], "tool_choice": {"type": "any"}}' % tool_params, "tools.0.input_schema"),
    ]


def _post_text(server, path: str, text: str) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", content=text, headers={"content-type": "application/json"}, timeout=60)


def _message(reply: httpx.Response) -> str:
    error = reply.json()["error"]
    return error if isinstance(error, str) else error["message"]


@pytest.mark.parametrize("levels", [MAX_SCHEMA_DEPTH + 1, 959])
def test_a_schema_nested_past_the_limit_is_a_400_naming_it(tiny_server, levels):
    """Past the limit, and near where the server's own JSON encoding ran out of stack (a 500 before)."""
    for path, text, field in _bodies(_deep_text(levels) if levels > 200 else json.dumps(_nested(levels))):
        start = time.monotonic()
        reply = _post_text(tiny_server, path, text)
        assert reply.status_code == 400, (path, field, reply.text[:300])
        message = _message(reply)
        nested = levels + 2 if field.startswith("tools") else levels  # a tool's schema sits in its parameters
        assert (f"`{field}` nests objects and arrays {nested} levels deep; at most {MAX_SCHEMA_DEPTH} levels are "
                f"allowed. Given: {nested} levels.") in message, (path, message)
        assert time.monotonic() - start < 10, (path, "no stall")


def test_a_schema_at_the_limit_is_used(tiny_server):
    for path, text, field in _bodies(json.dumps(_nested(MAX_SCHEMA_DEPTH - 2))):
        reply = _post_text(tiny_server, path, text)
        # the tiny model's context may not fit a tool's prompt; everything else is answered
        assert reply.status_code == 200 or "context" in _message(reply), (path, field, reply.text[:300])
    reply = _post_text(tiny_server, "/v1/chat/completions", _bodies(json.dumps(_nested(MAX_SCHEMA_DEPTH)))[0][1])
    assert reply.status_code == 200, reply.text[:300]


def test_call_arguments_nested_past_the_limit_are_a_400_not_a_500(tiny_server):
    arguments = "[" * 5000 + "]" * 5000
    chat = {"messages": [CHAT[0], {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"}], "max_tokens": 2}
    responses = {"input": [{"type": "function_call", "call_id": "c1", "name": "f", "arguments": arguments},
                           {"type": "function_call_output", "call_id": "c1", "output": "ok"}], "max_output_tokens": 2}
    for path, body, field in (("/v1/chat/completions", chat, "messages.1.tool_calls.0.function.arguments"),
                              ("/v1/responses", responses, "input.0.arguments")):
        reply = httpx.post(f"{tiny_server.url}{path}", json=body, timeout=60)
        assert reply.status_code == 400, (path, reply.text[:300])
        error = _error(reply)
        assert error["param"] == field
        assert f"`{field}` nests objects and arrays 5000 levels deep; at most {MAX_SCHEMA_DEPTH}" in error["message"]
    # strings hold brackets that are not nesting
    fine = {**chat, "messages": [CHAT[0], {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": json.dumps({"a": "[" * 5000})}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"}]}
    reply = httpx.post(f"{tiny_server.url}/v1/chat/completions", json=fine, timeout=60)
    assert reply.status_code != 500 and "levels deep" not in reply.text, reply.text[:300]


def test_an_unclosed_string_in_call_arguments_cannot_stall_the_server(tiny_server):
    """Brackets then a string that never closes, full of escaped quotes: the depth scan reads it once
    (a scan that started again at every quote took minutes of the event loop for 200 KB)."""
    arguments = "[" * 70 + '"' + '\\"' * 100_000
    chat = {"messages": [CHAT[0], {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"}], "max_tokens": 2}
    reply = httpx.post(f"{tiny_server.url}/v1/chat/completions", json=chat, timeout=60)
    assert reply.status_code == 400, reply.text[:300]
    assert "nests objects and arrays 70 levels deep" in _error(reply)["message"]
    assert httpx.get(f"{tiny_server.url}/health", timeout=10).status_code == 200

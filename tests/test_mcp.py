"""The MCP endpoint (Gradio's, at /gradio_api/mcp/) through the `mcp` Python client over streamable
HTTP, on real app.py processes with the tiny Llama: the tools it lists, a chat and a JSON schema
answer, and the API key: without the Bearer key an MCP client is refused before any model work."""

from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import pytest

pytest.importorskip("mcp")

from mcp import ClientSession  # noqa: E402
from mcp.client.streamable_http import streamable_http_client  # noqa: E402

KEY = "edge-test-key-5b1e9c"  # tests/test_access.py's flags (--api-key KEY): one server for every module
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
}, "required": ["name", "age"], "additionalProperties": False}


async def _session_run(url: str, work, headers: dict | None = None):
    async with httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(120, read=300)) as http:
        async with streamable_http_client(f"{url}/gradio_api/mcp/", http_client=http) as (read, write, _):
            async with ClientSession(read, write) as session:
                await session.initialize()
                return await work(session)


def run_mcp(url: str, work, headers: dict | None = None):
    """`work(session)` in an initialized MCP client session on the server at `url`; its result."""
    return asyncio.run(asyncio.wait_for(_session_run(url, work, headers), timeout=300))


def _leaves(error: BaseException) -> list[BaseException]:
    """The exceptions an exception group holds, however nested (anyio's task groups nest them)."""
    if isinstance(error, BaseExceptionGroup):
        return [leaf for inner in error.exceptions for leaf in _leaves(inner)]
    return [error]


def _text(result) -> str:
    assert not result.isError, result.content
    return "".join(part.text for part in result.content if part.type == "text")


async def _list_and_call(session):
    tools = {tool.name: tool for tool in (await session.list_tools()).tools}
    chat = await session.call_tool("chat", {"message": "Hello there", "temperature": 0, "max_new_tokens": 12})
    person = await session.call_tool("generate_json", {"prompt": "Describe a person.",
                                                       "json_schema": json.dumps(PERSON), "max_new_tokens": 120})
    return tools, chat, person


def test_mcp_lists_and_calls_the_chat_and_json_tools(tiny_server):
    tools, chat, person = run_mcp(tiny_server.url, _list_and_call)
    assert {"chat", "generate_json"} <= set(tools), sorted(tools)
    assert not any(name.startswith("chat_") for name in tools)  # the page's streaming /chat API is not a tool
    assert {"message", "temperature"} <= set(tools["chat"].inputSchema["properties"])
    assert {"prompt", "json_schema"} <= set(tools["generate_json"].inputSchema["required"])
    answer = _text(chat)
    # the same question through /chat, greedy: the MCP tool gives the model's answer, not a placeholder
    direct = httpx.post(f"{tiny_server.url}/chat", json={"prompt": "Hello there", "temperature": 0,
                                                         "max_new_tokens": 12, "stream": False}, timeout=120)
    assert answer and answer == direct.json()["response"]
    jsonschema.validate(json.loads(_text(person)), PERSON)


def test_mcp_json_tool_reports_a_bad_schema(tiny_server):
    async def work(session):
        return await session.call_tool("generate_json", {"prompt": "x", "json_schema": "{not json"})
    result = run_mcp(tiny_server.url, work)
    assert result.isError
    assert "schema" in " ".join(part.text for part in result.content if part.type == "text").lower()


def test_mcp_needs_the_api_key(server_with):
    server = server_with("--api-key", KEY)
    init = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}}
    accept = {"Accept": "application/json, text/event-stream"}
    for headers in ({}, {"Authorization": "Bearer wrong-key"}):
        for method, path in (("POST", "/gradio_api/mcp/"), ("GET", "/gradio_api/mcp/sse"),
                             ("GET", "/gradio_api/mcp/schema")):
            response = httpx.request(method, f"{server.url}{path}", json=init if method == "POST" else None,
                                     headers={**accept, **headers}, timeout=30)
            assert response.status_code == 401, (path, headers, response.text)
            assert "API key" in response.json()["error"]
    with pytest.raises(ExceptionGroup) as refused:  # the client itself is refused: its task group ends in the 401
        run_mcp(server.url, lambda session: session.list_tools())
    errors = _leaves(refused.value)
    assert [type(error) for error in errors] == [httpx.HTTPStatusError], errors
    assert errors[0].response.status_code == 401 and errors[0].request.url.path == "/gradio_api/mcp/"
    assert "401 Unauthorized" in str(errors[0])
    tools, chat, person = run_mcp(server.url, _list_and_call, headers={"Authorization": f"Bearer {KEY}"})
    assert {"chat", "generate_json"} <= set(tools)
    assert _text(chat)
    jsonschema.validate(json.loads(_text(person)), PERSON)


def test_mcp_is_closed_behind_a_page_login_without_a_key(server_with):
    server = server_with("--ui-auth", "ada:lovelace-pass")
    response = httpx.post(f"{server.url}/gradio_api/mcp/", json={}, timeout=30,
                          headers={"Accept": "application/json, text/event-stream"})
    assert response.status_code == 401 and "--api-key" in response.json()["error"]

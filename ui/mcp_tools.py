"""The page's MCP tools: Gradio's MCP server (mounted with `mcp_server=True`, at
`/gradio_api/mcp/`) lists every public API endpoint of the page as a tool named after its function.

- `chat`: one message (with an optional system prompt) -> the model's whole answer.
- `generate_json`: a prompt and a JSON schema -> JSON text that matches the schema (the engine's
  grammar constraint, as the page's "JSON schema" output format).

Both are endpoints outside Gradio's queue (`queue=False`): Gradio's MCP server then calls them
in-process instead of through a gradio_client loopback to the page's queue, which with an API key
set would need the page's login cookie that an MCP client does not have. The MCP routes are closed
by the API key's Bearer header instead (server/middleware.py). Requests are recorded under route "mcp".
"""

from __future__ import annotations

import json
from dataclasses import replace

import gradio as gr

from ui.chat import ChatSettings, stream_answer
from ui.history import ChatError

ROUTE = "mcp"


def mcp_available() -> bool:
    """True when the `mcp` package Gradio's MCP server needs is installed."""
    try:
        import mcp  # noqa: F401
    except ImportError:
        return False
    return True


def hide_from_mcp(fn):
    """An API function Gradio's MCP server leaves out of its tool list (it lists functions whose
    `_mcp_type`, set by `gr.mcp.tool`/`resource`/`prompt`, is unset or "tool")."""
    fn._mcp_type = "hidden"
    return fn


def _answer(engine, metrics, message: str, settings: ChatSettings) -> str:
    text = ""
    try:
        for text, _stats in stream_answer(engine, metrics, ROUTE, [], message, settings):
            pass
    except ChatError as exc:
        raise gr.Error(str(exc)) from None
    return text


def register_mcp_tools(engine, metrics, defaults: ChatSettings, default_max_new_tokens: int) -> None:
    """Adds the `chat` and `generate_json` endpoints (call inside an open `gr.Blocks`, before any
    other API function named `chat`, so that this one gets the tool name)."""

    def chat(message: str, system_prompt: str = "", temperature: float = defaults.temperature,
             max_new_tokens: int = default_max_new_tokens) -> str:
        """Answers one chat message with the model this server runs.

        Args:
            message: the user's message.
            system_prompt: instructions put before the message; empty = the model's default.
            temperature: 0 = greedy (deterministic); higher is more varied.
            max_new_tokens: the answer's length limit in tokens.
        Returns:
            the model's answer.
        """
        settings = replace(defaults, system_prompt=system_prompt or "", temperature=temperature,
                           max_new_tokens=max_new_tokens)
        return _answer(engine, metrics, message, settings)

    def generate_json(prompt: str, json_schema: str, system_prompt: str = "", temperature: float = 0.0,
                      max_new_tokens: int = default_max_new_tokens) -> str:
        """Generates JSON that matches a JSON schema (constrained decoding: every token is checked
        against the schema as it is generated).

        Args:
            prompt: what to generate, e.g. "A user profile for Ada Lovelace".
            json_schema: the JSON schema (as JSON text) the output must match.
            system_prompt: instructions put before the prompt; empty = the model's default.
            temperature: 0 = greedy (deterministic); higher is more varied.
            max_new_tokens: the output's length limit in tokens (a JSON cut short does not parse).
        Returns:
            the JSON text, matching the schema.
        """
        if isinstance(json_schema, (dict, list)):
            json_schema = json.dumps(json_schema)
        settings = replace(defaults, system_prompt=system_prompt or "", temperature=temperature,
                           max_new_tokens=max_new_tokens, output_format="JSON schema",
                           json_schema=json_schema or "")
        return _answer(engine, metrics, prompt, settings)

    gr.api(chat, api_name="mcp_chat", queue=False)
    gr.api(generate_json, api_name="generate_json", queue=False)

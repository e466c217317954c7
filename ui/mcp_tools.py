"""The page's MCP tools: Gradio's MCP server (mounted with `mcp_server=True`, at
`/gradio_api/mcp/`) lists every public API endpoint of the page as a tool named after its function.

- `chat`: one message (with an optional system prompt, and image URLs for a vision-language model:
  data: URLs, or http(s) from --allowed-media-domains, through frontend/images.py) -> the whole answer.
- `generate_json`: a prompt and a JSON schema -> JSON text that matches the schema (the engine's
  grammar constraint, as the page's "JSON schema" output format).

Both are endpoints outside Gradio's queue (`queue=False`): Gradio's MCP server then calls them
in-process instead of through a gradio_client loopback to the page's queue, which with an API key
set would need the page's login cookie that an MCP client does not have. The MCP routes are closed
by the API key's Bearer header instead (server/middleware.py). Requests are recorded under route "mcp".
"""

from __future__ import annotations

import json
import gradio as gr

from ui.chat import ChatSettings

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


def register_mcp_tools(handlers) -> None:
    """Adds the `chat` and `generate_json` endpoints (call inside an open `gr.Blocks`, before any
    other API function named `chat`, so that this one gets the tool name). `handlers`: the page's
    (ui/handlers.py `PageHandlers`), whose request path and defaults they take."""
    defaults = handlers.defaults.resolved()

    async def answer(message, settings: ChatSettings) -> str:
        text = ""
        async for text, _stats in handlers.answer([], message, settings, None, route=ROUTE):
            pass
        return text

    async def chat(message: str, system_prompt: str = "", temperature: float = defaults["temperature"],
                   max_new_tokens: int = handlers.defaults.max_new_tokens, images: list[str] | None = None) -> str:
        """Answers one chat message with the model this server runs.

        Args:
            message: the user's message.
            system_prompt: instructions put before the message; empty = the model's default.
            temperature: 0 = greedy (deterministic); higher is more varied.
            max_new_tokens: the answer's length limit in tokens.
            images: pictures the message is about (a vision-language model), each a data URL
                (data:image/png;base64,...) or an http(s) URL of a domain the server allows.
        Returns:
            the model's answer.
        """
        if images:  # as /chat's `images`: before the message's text, parsed by frontend/images.py
            urls = [images] if isinstance(images, str) else images
            if not isinstance(urls, list) or not all(isinstance(url, str) for url in urls):
                raise gr.Error("`images` must be a list of image URLs (data:image/png;base64,...). "
                               f"Given: {type(images).__name__}.")
            message = [{"type": "image_url", "url": url} for url in urls] + [{"type": "text", "text": message}]
        return await answer(message, ChatSettings(system_prompt or "", temperature, max_new_tokens=max_new_tokens,
                                                  image_limits=handlers.image_limits))

    async def generate_json(prompt: str, json_schema: str, system_prompt: str = "", temperature: float = 0.0,
                            max_new_tokens: int = handlers.defaults.max_new_tokens) -> str:
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
        return await answer(prompt, ChatSettings(system_prompt or "", temperature, max_new_tokens=max_new_tokens,
                                                 output_format="JSON schema", json_schema=json_schema or ""))

    gr.api(chat, api_name="mcp_chat", queue=False)
    gr.api(generate_json, api_name="generate_json", queue=False)

"""A conversation as the page and its API take it: Gradio's message shapes to plain messages, and
bounds on its size (the oldest turns are dropped to fit the context in frontend/request.py)."""

from __future__ import annotations

from ui.markup import unescape_html

MAX_HISTORY_MESSAGES = 1000  # messages of a conversation the page or its API takes
MAX_HISTORY_CHARS = 1_000_000  # characters of all its messages together


class ChatError(Exception):
    """A chat request the page cannot serve; the message is shown to the user as is."""


def content_text(content) -> str:
    """The text of one message's content: a string, a list of parts, or a dict part."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, dict):
        if content.get("type", "text") == "text" and isinstance(content.get("text"), str):
            return content["text"]
        return ""  # files and components carry no text for a text model
    if isinstance(content, (list, tuple)):
        return "".join(content_text(part) for part in content)
    text = getattr(content, "text", None)
    return text if isinstance(text, str) else ""


def to_engine_messages(history, *, escaped: bool) -> list[dict]:
    """Gradio history -> [{"role": "user" | "assistant" | "system", "content": str}].

    `escaped`: the history comes from the page's Chatbot (its text went through `escape_html`).
    Also takes gradio's older pair format [[user, assistant], ...]. Messages with no text are dropped.
    Raises `ChatError` when `history` is not a list, or longer than `check_history` allows.
    """
    if history is None:
        return []
    if not isinstance(history, (list, tuple)):
        raise ChatError("`history` must be a list of messages, [{\"role\": \"user\" | \"assistant\", "
                        f"\"content\": \"...\"}}, ...]. Given: {type(history).__name__}")
    _check_history_size(len(history), 0)  # before any per-message work
    texts: list[tuple[str, str]] = []  # (role, text), checked against the bounds before unescaping
    for item in history:
        if isinstance(item, (list, tuple)) and len(item) == 2 and not isinstance(item, dict):
            pairs = (("user", item[0]), ("assistant", item[1]))
        else:
            role = item.get("role") if isinstance(item, dict) else getattr(item, "role", None)
            content = item.get("content") if isinstance(item, dict) else getattr(item, "content", None)
            metadata = item.get("metadata") if isinstance(item, dict) else getattr(item, "metadata", None)
            if metadata and (metadata.get("title") if isinstance(metadata, dict) else None):
                continue  # tool/thought bubbles are not part of the conversation
            pairs = ((role, content),)
        for role, content in pairs:
            if role not in ("user", "assistant", "system"):
                continue
            text = content_text(content)
            if text:
                texts.append((role, text))
    _check_history_size(len(texts), sum(len(text) for _, text in texts))
    return [{"role": role, "content": unescape_html(text) if escaped else text} for role, text in texts]


def check_history(messages: list[dict]) -> None:
    """Raises `ChatError` for a conversation beyond MAX_HISTORY_MESSAGES messages or
    MAX_HISTORY_CHARS characters (what was wrong, what is allowed, what was given)."""
    _check_history_size(len(messages), sum(len(m["content"]) for m in messages))


def _check_history_size(num_messages: int, chars: int) -> None:
    if num_messages > MAX_HISTORY_MESSAGES:
        raise ChatError(f"The conversation is too long: at most {MAX_HISTORY_MESSAGES} messages are allowed. "
                        f"Given: {num_messages} messages. Start a new conversation (Clear).")
    if chars > MAX_HISTORY_CHARS:
        raise ChatError(f"The conversation is too long: at most {MAX_HISTORY_CHARS} characters are allowed in all "
                        f"its messages. Given: {chars} characters. Start a new conversation (Clear).")

"""A conversation as the page and its API take it: Gradio's message shapes to plain messages, and
bounds on its size (the oldest turns are dropped to fit the context in frontend/request.py)."""

from __future__ import annotations

import os

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


def file_path(content) -> str | None:
    """The path of a file part in any of Gradio's shapes ({"type": "file", "file": {...}}, FileData,
    a FileData dict as gradio_client's `handle_file` sends it), else None."""
    if isinstance(content, dict):
        if isinstance(content.get("file"), dict):
            content = content["file"]
        path = content.get("path")
        return path if isinstance(path, str) and path else None
    path = getattr(content, "path", None) or getattr(getattr(content, "file", None), "path", None)
    return path if isinstance(path, str) and path else None


def upload_part(path: str) -> dict:
    """A file of a message as frontend/images.py's part: only a file Gradio's upload route wrote (its
    upload folder); any other path (a caller of the API may name one) is a `ChatError`."""
    from gradio.utils import get_upload_folder, is_in_or_equal

    real = os.path.realpath(path)
    if not is_in_or_equal(real, os.path.realpath(get_upload_folder())):
        raise ChatError("An image must be a file uploaded to this server (gradio_client's handle_file, or the "
                        f"page's upload). Given: a path outside its upload folder, {os.path.basename(path)!r}.")
    return {"type": "image_file", "path": real}


def _parts(content, images: bool) -> list:
    """One message's content as (text or file path) pieces in order: files only with `images`."""
    if content is None:
        return []
    if isinstance(content, (list, tuple)):
        return [piece for part in content for piece in _parts(part, images)]
    if images and file_path(content) is not None:
        return [upload_part(file_path(content))]
    text = content_text(content)
    return [text] if text else []


def to_engine_messages(history, *, escaped: bool, images: bool = False) -> list[dict]:
    """Gradio history -> [{"role": "user" | "assistant" | "system", "content": str}].

    `escaped`: the history comes from the page's Chatbot (its text went through `escape_html`).
    `images`: a message's uploaded files are kept, as `{"type": "image_file"}` parts before its text
    (its content a list of parts then); without it a message's files are dropped (its text alone).
    Also takes gradio's older pair format [[user, assistant], ...]. Messages with nothing are dropped.
    Raises `ChatError` when `history` is not a list, or longer than `check_history` allows.
    """
    if history is None:
        return []
    if not isinstance(history, (list, tuple)):
        raise ChatError("`history` must be a list of messages, [{\"role\": \"user\" | \"assistant\", "
                        f"\"content\": \"...\"}}, ...]. Given: {type(history).__name__}")
    _check_history_size(len(history), 0)  # before any per-message work
    texts: list[tuple[str, str, list]] = []  # (role, text, image parts), checked against the bounds before unescaping
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
            pieces = _parts(content, images and role == "user")
            text = "".join(piece for piece in pieces if isinstance(piece, str))
            files = [piece for piece in pieces if isinstance(piece, dict)]
            if text or files:
                texts.append((role, text, files))
    _check_history_size(len(texts), sum(len(text) for _, text, _ in texts))
    out = []
    for role, text, files in texts:
        text = unescape_html(text) if escaped else text
        out.append({"role": role, "content": files + [{"type": "text", "text": text}] if files else text})
    return out


def check_history(messages: list[dict]) -> None:
    """Raises `ChatError` for a conversation beyond MAX_HISTORY_MESSAGES messages or
    MAX_HISTORY_CHARS characters (what was wrong, what is allowed, what was given)."""
    _check_history_size(len(messages), sum(len(content_text(m["content"])) for m in messages))


def _check_history_size(num_messages: int, chars: int) -> None:
    if num_messages > MAX_HISTORY_MESSAGES:
        raise ChatError(f"The conversation is too long: at most {MAX_HISTORY_MESSAGES} messages are allowed. "
                        f"Given: {num_messages} messages. Start a new conversation (Clear).")
    if chars > MAX_HISTORY_CHARS:
        raise ChatError(f"The conversation is too long: at most {MAX_HISTORY_CHARS} characters are allowed in all "
                        f"its messages. Given: {chars} characters. Start a new conversation (Clear).")

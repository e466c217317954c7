"""The parsers that turn a model's answer back into content and `ToolCall`s, whole or while
streaming, one per tool format (frontend/tools.py chooses the format and builds its constraint).
Plain Python."""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass


@dataclass(slots=True)
class ToolCall:
    """One call of a declared function, as the API returns it (arguments: JSON text)."""

    name: str
    arguments: str
    id: str = ""

    def __post_init__(self):
        if not self.id:
            self.id = f"call_{secrets.token_hex(12)}"


def _arguments_text(value) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value if value is not None else {}, ensure_ascii=False)


class ToolParser:
    """Feeds on the answer's text; returns events: ("content", text) or ("call", ToolCall)."""

    def __init__(self):
        self.buffer = ""
        self.num_calls = 0

    def feed(self, text: str) -> list[tuple[str, object]]:
        self.buffer += text
        return self._scan(final=False)

    def finish(self) -> list[tuple[str, object]]:
        return self._scan(final=True)

    def _call(self, data) -> ToolCall | None:
        if not isinstance(data, dict) or not isinstance(data.get("name"), str):
            return None
        arguments = data.get("arguments", data.get("parameters", {}))
        self.num_calls += 1
        return ToolCall(data["name"], _arguments_text(arguments))

    def _content(self, text: str) -> list[tuple[str, object]]:
        if not text or (self.num_calls and not text.strip()):
            return []  # the whitespace between and after calls is no content
        return [("content", text)]


def _held_prefix(text: str, tag: str) -> int:
    """Length of the longest tail of `text` that begins `tag` (held back: the tag may be coming)."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0


class HermesParser(ToolParser):
    START, END = "<tool_call>", "</tool_call>"

    def __init__(self):
        super().__init__()
        self.inside = False

    def _scan(self, final: bool):
        events = []
        while True:
            if not self.inside:
                at = self.buffer.find(self.START)
                if at < 0:
                    keep = 0 if final else _held_prefix(self.buffer, self.START)
                    events += self._content(self.buffer[:len(self.buffer) - keep])
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                    return events
                events += self._content(self.buffer[:at])
                self.buffer = self.buffer[at + len(self.START):]
                self.inside = True
            at = self.buffer.find(self.END)
            if at < 0 and not final:
                return events
            block = self.buffer if at < 0 else self.buffer[:at]
            self.buffer = "" if at < 0 else self.buffer[at + len(self.END):]
            self.inside = False
            try:
                call = self._call(json.loads(block))
            except ValueError:
                call = None
            if call is not None:
                events.append(("call", call))
            elif at >= 0:  # a closed block that is no call: the text as the model wrote it
                events += self._content(self.START + block + self.END)
            if at < 0:  # an unclosed block that is no call (cut by max_tokens) is dropped, never content
                return events


class Llama3Parser(ToolParser):
    """A reply that starts with `{` is held whole and read as a call (or calls separated by `;`)."""

    TAG = "<|python_tag|>"

    def __init__(self):
        super().__init__()
        self.mode: str | None = None  # "call" or "text" once the reply's first character shows it

    def _scan(self, final: bool):
        if self.mode is None:
            head = self.buffer.lstrip()
            if head.startswith(self.TAG):
                head = head[len(self.TAG):].lstrip()
            elif self.TAG.startswith(head) and not final:
                return []  # nothing yet, or the tag being written
            if head:
                self.mode = "call" if head.startswith("{") else "text"
            elif not final:
                return []
            else:
                self.mode = "text"
        if self.mode == "text":
            text, self.buffer = self.buffer, ""
            return self._content(text)
        if not final:
            return []
        body = self.buffer.strip()
        body = body[len(self.TAG):] if body.startswith(self.TAG) else body
        calls = []
        for part in body.split(";"):
            try:
                call = self._call(json.loads(part))
            except ValueError:
                call = None
            if call is None:
                self.num_calls = 0
                return self._content(self.buffer)
            calls.append(("call", call))
        return calls


_RESPONSE_PREFIX = '{"response":"'


class GenericParser(ToolParser):
    """The generic format's JSON: `"response"` text streams as it is decoded; calls come whole."""

    def __init__(self):
        super().__init__()
        self.mode: str | None = None  # "response" (decoding its string), "json" (held whole) or "done"
        self.decoded = 0  # characters of buffer already decoded (response mode)

    def _scan(self, final: bool):
        if self.mode is None:
            if self.buffer.startswith(_RESPONSE_PREFIX):
                self.mode = "response"
                self.buffer = self.buffer[len(_RESPONSE_PREFIX):]
            elif len(self.buffer) >= len(_RESPONSE_PREFIX) or not _RESPONSE_PREFIX.startswith(self.buffer) or final:
                self.mode = "json"
            else:
                return []
        if self.mode == "response":
            return self._response(final)
        if self.mode == "json" and final:
            return self._whole(self.buffer)
        return []

    def _response(self, final: bool):
        """Decode the JSON string's complete escapes; stop at its closing quote."""
        raw, end = self.buffer, None
        i = 0
        cut = 0
        while i < len(raw):
            ch = raw[i]
            if ch == '"':
                end = i
                break
            if ch == "\\":
                width = 6 if raw[i + 1:i + 2] == "u" else 2
                if i + width > len(raw):
                    break
                if width == 6 and 0xD800 <= int(raw[i + 2:i + 6] or "0", 16) <= 0xDBFF:
                    if i + 12 > len(raw):
                        break  # half of a surrogate pair: wait for the other half
                    width = 12
                i += width
            else:
                i += 1
            cut = i
        piece = raw[:end if end is not None else cut]
        try:
            text = json.loads(f'"{piece}"')
        except ValueError:
            text = piece
        if end is not None:
            self.mode, self.buffer = "done", ""
        else:
            self.buffer = raw[cut:]
        return self._content(text)

    def _whole(self, body: str):
        try:
            data = json.loads(body)
        except ValueError:  # the reply is constrained to whole JSON: this is a call cut short (max_tokens,
            return []       # a stop string), reported by its finish reason; half a call is not an answer
        if isinstance(data, dict) and isinstance(data.get("response"), str):
            return self._content(data["response"])
        raw_calls = data.get("tool_calls") if isinstance(data, dict) else None
        if raw_calls is None and isinstance(data, dict) and "tool_call" in data:
            raw_calls = [data["tool_call"]]
        calls = [self._call(c) for c in raw_calls] if isinstance(raw_calls, list) else [None]
        if not calls or any(c is None for c in calls):
            self.num_calls = 0
            return self._content(body)
        return [("call", c) for c in calls]

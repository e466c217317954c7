"""Model and user text in the page: `escape_html` / `unescape_html` keep it from ever becoming
HTML (markdown and code still render; `<img src=x onerror=...>` shows as text)."""

from __future__ import annotations

import re

_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
_BACKTICKS = re.compile(r"`+")


def _split_code(text: str) -> list[tuple[bool, str]]:
    """Cuts markdown `text` into (is_code, piece): fenced blocks and inline code spans are code.

    An unclosed fence runs to the end, as markdown renders it (so a streaming code block stays code).
    """
    pieces: list[tuple[bool, str]] = []
    prose: list[str] = []
    fence: str | None = None
    block: list[str] = []
    for line in text.splitlines(keepends=True):
        match = _FENCE.match(line)
        if fence is None:
            if match:
                if prose:
                    pieces.extend(_split_inline("".join(prose)))
                    prose = []
                fence = match.group(1)
                block = [line]
            else:
                prose.append(line)
        else:
            block.append(line)
            if match and match.group(1)[0] == fence[0] and len(match.group(1)) >= len(fence) \
                    and not line.strip()[len(match.group(1)):].strip():
                pieces.append((True, "".join(block)))
                fence, block = None, []
    if block:
        pieces.append((True, "".join(block)))
    if prose:
        pieces.extend(_split_inline("".join(prose)))
    return pieces


def _split_inline(text: str) -> list[tuple[bool, str]]:
    """Inline code spans: a run of n backticks up to the next run of exactly n backticks."""
    pieces: list[tuple[bool, str]] = []
    position = 0
    search_from = 0
    while True:
        opener = _BACKTICKS.search(text, search_from)
        if opener is None:
            break
        width = len(opener.group(0))
        closer = None
        for candidate in _BACKTICKS.finditer(text, opener.end()):
            if len(candidate.group(0)) == width:
                closer = candidate
                break
        if closer is None:
            search_from = opener.end()  # a lone backtick run is plain text
            continue
        if opener.start() > position:
            pieces.append((False, text[position:opener.start()]))
        pieces.append((True, text[opener.start():closer.end()]))
        position = search_from = closer.end()
    if position < len(text):
        pieces.append((False, text[position:]))
    return pieces


def escape_html(text: str) -> str:
    """`&` and `<` outside code become entities: no tag can form, markdown still renders."""
    return "".join(piece if is_code else piece.replace("&", "&amp;").replace("<", "&lt;")
                   for is_code, piece in _split_code(text))


def unescape_html(text: str) -> str:
    """The inverse of `escape_html` (the same pieces are code in the escaped text)."""
    return "".join(piece if is_code else piece.replace("&lt;", "<").replace("&amp;", "&")
                   for is_code, piece in _split_code(text))



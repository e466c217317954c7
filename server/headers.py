"""What a route reads of the HTTP request besides its body: the client's request id, its session,
who is calling (for fair shares and compile slots), and the keywords every admission takes."""

from __future__ import annotations

import re

from engine.request import new_request_id
from frontend.errors import ApiError

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
SESSION_HEADER = "x-session-id"  # a conversation's key: its requests go to the same replica (prefix cache)
_MAX_SESSION_CHARS = 256


def request_id_from(header_value: str | None) -> str:
    """The client's `x-request-id` when it is a usable id, else a fresh one."""
    if header_value is None or header_value == "":
        return new_request_id()
    if not _REQUEST_ID.match(header_value):
        raise ApiError(400, "`x-request-id` must be 1 to 128 characters of letters, digits, '.', '_', ':' or '-'. "
                            f"Given: {header_value[:140]!r}", param="x-request-id")
    return header_value


def session_from(request) -> str | None:
    """The client's `x-session-id`: which replica's prefix cache its conversation should reuse."""
    value = request.headers.get(SESSION_HEADER) if getattr(request, "headers", None) else None
    if value is None or value == "":
        return None
    if len(value) > _MAX_SESSION_CHARS:
        raise ApiError(400, f"`{SESSION_HEADER}` may have at most {_MAX_SESSION_CHARS} characters. "
                            f"Given: {len(value)} characters.", param=SESSION_HEADER)
    return value


def client_of(request, session: str | None = None) -> str | None:
    """Who sends the request, for the engine's fair shares: the caller's address, never what it says.

    The address is the TCP peer's, or, when that peer is a proxy --forwarded-allow-ips trusts, the
    right-most untrusted one of its `X-Forwarded-For` (uvicorn puts it in `request.client`; app.py
    `serve`). `x-session-id` (`session`) is the caller's own name for a conversation: it picks a
    replica but takes no share, so rotating names gains nothing. The one `--api-key` is shared by
    all, so it names nobody either. The page counts its visitors the same way (ui/handlers.py
    `page_client`)."""
    peer = getattr(request, "client", None)
    return f"addr:{peer.host}" if peer is not None and peer.host else None


def admission(request, route: str) -> dict:
    """The keyword arguments every route passes to `Generation` (timeout, metrics, test hook, session,
    client)."""
    state = request.app.state
    on_admit = None
    if state.settings.test_hooks:
        from testing.hooks import fault_hook  # never imported without --test-hooks

        on_admit = fault_hook(request)
    entry = getattr(request.state, "model", None)  # the model server/streaming.py `use_model` took
    return dict(timeout=state.settings.request_timeout, on_admit=on_admit,
                metrics=state.metrics, route=route, session=(session := session_from(request)),
                client=client_of(request, session), model=entry.name if entry is not None else None)

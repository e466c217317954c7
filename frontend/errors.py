"""The refusals the front end raises before or while it serves a request, whatever the transport.

`ApiError` carries an HTTP status, a message that says what was wrong, what is allowed and what
was given, and the offending field; server/errors.py renders it in each API's shape, the page
shows its message.
"""

from __future__ import annotations

import re

from engine.request import QueueFull


class ApiError(Exception):
    """An HTTP error with a message for the client; rendered in the route family's shape."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}


# "<what failed>: <ExceptionType>: <its text>", as the engine words a failure it caught.
_EXCEPTION_TAIL = re.compile(r":\s+[A-Za-z_][\w.]*:(\s.*)?$", re.DOTALL)


def public_engine_error(error: str | None) -> str:
    """An engine error as a client may read it: the engine's own sentence, without the text of the
    exception under it (which can name files, tensors or internals; the engine logged it)."""
    text = (error or "").strip()
    cut = _EXCEPTION_TAIL.search(text)
    if cut is not None:
        text = text[: cut.start()].rstrip(" .:") + "; the server log has the details."
    return text or "unknown error"


def queue_full_error(exc: QueueFull, retry_after: int) -> ApiError:
    detail = str(exc) or "the waiting queue is full"
    return ApiError(429, f"Server busy: {detail}. Retry after {retry_after} s.", code="queue_full",
                    headers={"Retry-After": str(retry_after)})



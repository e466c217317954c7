"""Errors a client can act on, in each route family's shape.

`/v1/messages...` answers Anthropic's `{"type": "error", "error": {"type", "message"}}`, the rest of
`/v1/...` OpenAI's `{"error": {"message", "type", "param", "code"}}`; every other route
answers `{"error": "<message>"}`. Messages say what was wrong, what is allowed, what was given.
An unexpected failure says only that it happened and a reference to find it in the log: no
exception text, no traceback, no path ever reaches a client.
"""

from __future__ import annotations

import json
import logging
import secrets
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse

from engine.request import InvalidRequest
from frontend.errors import ApiError
from server.resume import slow_reader_message

_OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}


_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
}


def is_openai_path(path: str) -> bool:
    return path == "/v1" or path.startswith("/v1/")


def is_anthropic_path(path: str) -> bool:
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def error_body(path: str, status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    """The JSON body of an error for a request to `path`."""
    if is_anthropic_path(path):
        kind = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
        return {"type": "error", "error": {"type": kind, "message": message}}
    if is_openai_path(path):
        kind = _OPENAI_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        return {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return {"error": message}


def error_response(path: str, status: int, message: str, *, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(path, status, message, param, code), status_code=status, headers=headers)


log = logging.getLogger("rill.server")


def internal_error_message(reference: str | None = None) -> str:
    """What a client is told about a failure the server did not expect."""
    where = f" (reference {reference})" if reference else ""
    return f"Internal error: the server could not complete this request{where}; its log has the details."


def log_internal_error(what: str, exc: BaseException | None = None) -> str:
    """Log `exc` (default: the one being handled) with a fresh reference; returns the reference."""
    reference = secrets.token_hex(4)
    log.error("%s [reference %s]", what, reference, exc_info=exc or True)
    return reference


def _describe_input(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


BODY_FIELDS: dict[str, list[str]] = {}  # path -> the body fields its route knows (for "unknown field" errors)


def validation_message(exc: RequestValidationError, path: str = "") -> tuple[str, str | None]:
    """pydantic's errors as one readable line, and the first offending field."""
    parts = []
    first_param = None
    for err in exc.errors()[:5]:
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        field = ".".join(loc)
        kind = err.get("type", "")
        if first_param is None and field:
            first_param = field
        if kind == "json_invalid":
            parts.append(f"The body is not valid JSON ({err.get('ctx', {}).get('error', 'parse error')}).")
            continue
        if kind == "missing":
            parts.append(f"`{field}` is required.")
            continue
        if kind == "extra_forbidden":
            known = BODY_FIELDS.get(path) if len(loc) == 1 else None
            allowed = f" Allowed: {', '.join(known)}." if known else ""
            parts.append(f"`{field}` is not a known field.{allowed}")
            continue
        msg = err.get("msg", "is invalid")
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, "):]
        if not field:
            if kind in ("model_type", "dict_type", "model_attributes_type"):
                parts.append(f"The body must be a JSON object. Given: {_describe_input(err.get('input'))}")
            else:  # a rule about several fields
                parts.append(msg[0].upper() + msg[1:] if msg else "Invalid request body")
            continue
        msg = msg[0].lower() + msg[1:] if msg else msg
        parts.append(f"`{field}`: {msg}. Given: {_describe_input(err.get('input'))}")
    if len(exc.errors()) > 5:
        parts.append(f"({len(exc.errors()) - 5} more errors)")
    return "; ".join(p.rstrip(".") for p in parts) + "." if parts else "Invalid request body.", first_param


def route_label(path: str) -> str:
    """The metrics label of an API path."""
    if path == "/chat":
        return "chat"
    if path.startswith("/chat/"):
        return "chat_resume"
    if path.startswith("/v1/chat"):
        return "v1_chat"
    if path.startswith("/v1/completions"):
        return "v1_completions"
    if path.startswith("/v1/responses"):
        return "v1_responses"
    if is_anthropic_path(path):
        return "v1_messages"
    if path.startswith("/v1"):
        return "v1_other"
    return "other"


def count_error(app, path: str, status: int) -> None:
    metrics = getattr(app.state, "metrics", None)
    if metrics is not None:
        metrics.error(route_label(path), status)


def install_error_handlers(app: FastAPI) -> None:
    """Route every failure through `error_response`: no traceback ever reaches a client."""

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        count_error(request.app, request.url.path, exc.status)
        return error_response(request.url.path, exc.status, exc.message, param=exc.param, code=exc.code,
                              headers=exc.headers)

    @app.exception_handler(InvalidRequest)
    async def _invalid(request: Request, exc: InvalidRequest):
        count_error(request.app, request.url.path, 400)
        return error_response(request.url.path, 400, str(exc), param=exc.param)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        message, param = validation_message(exc, request.url.path)
        count_error(request.app, request.url.path, 400)
        return error_response(request.url.path, 400, message, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404:
            message = f"No route {request.method} {request.url.path}."
        elif exc.status_code == 405:
            message = f"Method {request.method} is not allowed on {request.url.path}."
        return error_response(request.url.path, exc.status_code, message, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        reference = log_internal_error(f"unhandled error on {request.method} {request.url.path}", exc)
        count_error(request.app, request.url.path, 500)
        return error_response(request.url.path, 500, internal_error_message(reference), code="internal_error")


def slow_reader_end(path: str, done: bool):
    """What a stream cut off for its unread backlog ends with (server/sse.py): an `error` event in
    the route's shape, then `[DONE]` where the API ends its streams with it (OpenAI's chat and
    completions; not the Responses or Anthropic streams)."""
    def end(limit: int) -> list[dict]:
        body = error_body(path, 400, slow_reader_message(limit), code="slow_reader")
        return [{"event": "error", "data": json.dumps(body)}] + ([{"data": "[DONE]"}] if done else [])
    return end

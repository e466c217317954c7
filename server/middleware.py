"""ASGI middleware: the API key on the API routes (`/chat...`, `/v1/...`, and `/_test/...` when the
test hooks exist: without them those paths are not routes, and answer 404 like any unknown path), the body
size limit on every request body, the page's Gradio API included; and the page's login (`page_login`), which app.py gives Gradio,
put by `PageLoginGuard` on every `/gradio_api/` route (Gradio leaves some that act on a session open).

Both checks answer before the body is parsed, so a refused request costs no model work. With an
API key every route that reaches the model is closed: these routes by the `Authorization`
header, the page and its Gradio API (the same model, through `gradio_client`) by Gradio's login,
which takes the key as password. /health, /ready and /docs stay open; /metrics needs the key too,
and /health without it says only whether the server runs: the engine's counters (the prefix
cache's hits above all) tell one client what the others sent (see the README's Operations).
"""

from __future__ import annotations

import hmac
import json

from server.errors import count_error, error_body

_MCP_PREFIX = "/gradio_api/mcp"  # Gradio's MCP server (ui/mcp_tools.py): its clients send the Bearer key
_API_PREFIXES = ("/chat", "/v1", _MCP_PREFIX)
_TEST_HOOK_PREFIX = "/_test"


_KEYED_PATHS = ("/metrics",)  # not the model, but what it tells about other clients' requests


def is_api_path(path: str, test_hooks: bool = False) -> bool:
    prefixes = (*_API_PREFIXES, _TEST_HOOK_PREFIX) if test_hooks else _API_PREFIXES
    return path in _KEYED_PATHS or any(path == p or path.startswith(p + "/") for p in prefixes)


def has_key(headers, api_key: str | None) -> bool:
    """The request (a Starlette `Headers`) carries `Authorization: Bearer <api_key>`; True without a key."""
    if api_key is None:
        return True
    scheme, _, token = (headers.get("authorization") or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), api_key.encode())


async def _send_json(send, path: str, status: int, message: str, *, code: str | None = None,
                     headers: list[tuple[bytes, bytes]] | None = None, app=None) -> None:
    if app is not None:
        count_error(app, path, status)
    body = json.dumps(error_body(path, status, message, code=code)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


def page_login(api_key: str | None, ui_auth: tuple[str, str] | None):
    """Gradio's `auth` for the page: None (open) without a key and without UI_AUTH; else a check
    that takes any user name with the API key as password, and UI_AUTH's user with its password."""
    if api_key is None and ui_auth is None:
        return None
    key = api_key.encode() if api_key is not None else None
    user, password = (ui_auth[0].encode(), ui_auth[1].encode()) if ui_auth is not None else (None, None)

    def check(username: str, given: str) -> bool:
        given_bytes = (given or "").encode()
        by_key = key is not None and hmac.compare_digest(given_bytes, key)
        by_login = (user is not None and hmac.compare_digest((username or "").encode(), user)
                    and hmac.compare_digest(given_bytes, password))
        return bool(by_key or by_login)

    return check


class ApiGuard:
    """`Authorization: Bearer <key>` (or `x-api-key: <key>`) on the API routes when a key is set (401), and `--max-body-bytes`
    on every request body, the page's Gradio API included (413)."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int, test_hooks: bool = False,
                 page_closed: bool = False):
        self.app = app
        self.page_closed = page_closed  # a page login (UI_AUTH) without a key: MCP, which has no login, is off
        self.api_key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes
        self.test_hooks = test_hooks  # /_test/... are routes (and need the key) only with the hooks

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        headers = dict(scope["headers"])
        if self.page_closed and self.api_key is None and is_api_path(path) and path.startswith(_MCP_PREFIX):
            return await _send_json(send, path, 401, "This server's page has a login (UI_AUTH): its MCP endpoint "
                                    "needs an API key too. Start it with --api-key (API_KEY) and send "
                                    "`Authorization: Bearer <key>`.", code="invalid_api_key", app=scope.get("app"))
        if self.api_key is not None and is_api_path(path, self.test_hooks):  # the page's routes: Gradio's login
            given = headers.get(b"authorization", b"")
            scheme, _, token = given.partition(b" ")
            if b"x-api-key" in headers:  # Anthropic's clients send the key this way
                given, scheme, token = headers[b"x-api-key"], b"bearer", headers[b"x-api-key"]
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.api_key):
                what = ("no `Authorization` or `x-api-key` header was sent" if not given
                        else "the key given is not the server's key")
                message = (f"This server needs an API key: send `Authorization: Bearer <key>` or `x-api-key: <key>` "
                           f"({what}).")
                return await _send_json(send, path, 401, message, code="invalid_api_key", app=scope.get("app"),
                                        headers=[(b"www-authenticate", b"Bearer")])
        if scope["method"] in ("GET", "HEAD", "OPTIONS", "DELETE"):
            return await self.app(scope, receive, send)
        declared = headers.get(b"content-length")
        if declared is not None:
            try:
                size = int(declared)
            except ValueError:
                return await _send_json(send, path, 400, f"Bad Content-Length header: {declared.decode(errors='replace')!r}")
            if size > self.max_body_bytes:
                return await _send_json(send, path, 413, self._too_big(size), app=scope.get("app"))
        # Read the whole body (bounded) so a chunked upload cannot exceed the limit either.
        chunks: list[bytes] = []
        total = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            total += len(chunk)
            if total > self.max_body_bytes:
                return await _send_json(send, path, 413, self._too_big(f"more than {total}"), app=scope.get("app"))
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)

    def _too_big(self, size) -> str:
        return (f"The request body is too large: at most {self.max_body_bytes} bytes are allowed "
                f"(--max-body-bytes). Given: {size} bytes.")
_GRADIO_API = "/gradio_api/"
_GRADIO_OPEN = ("login_check", "token", "app_id", "user", "theme.css")  # what the login form itself needs


class PageLoginGuard:
    """Gradio's login on every `/gradio_api/...` route, for a page that has one (--api-key, --ui-auth).

    Gradio checks its login on the routes that run the app (`/config`, `/gradio_api/queue/join`,
    `call`, `info`, `upload`, `file=`) but not on some that act on a session named by its hash:
    `heartbeat/<session>` (closing it unloads the session: its answers are aborted), `cancel`
    (cancels a session's job), `stream/<event>` and `stream/<event>/close`, `reset`,
    `startup-events`. Without the login, whoever learns a visitor's session hash could end its
    answers. This middleware, wrapped around Gradio's app, answers 401 (Gradio's own body) to any
    `/gradio_api/` request without a valid login, except the few the login form needs and the MCP
    endpoint (its clients cannot log in: ApiGuard asks them for the Bearer key instead)."""

    def __init__(self, app, gradio_app):
        self.app = app
        self.gradio_app = gradio_app  # gradio.routes.App: its `auth`, `tokens` and `cookie_id`

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or self.gradio_app.auth is None:
            return await self.app(scope, receive, send)
        path = scope["path"]
        root = scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root):]
        if path.startswith(_MCP_PREFIX):  # ApiGuard's: the Bearer key (or a 401 with a page login and no key)
            return await self.app(scope, receive, send)
        if path.startswith(_GRADIO_API) and path[len(_GRADIO_API):].rstrip("/") not in _GRADIO_OPEN:
            if not self._logged_in(scope):
                body = json.dumps({"detail": {"error": "Not authenticated",
                                              "auth_message": "Log in on the page first."}}).encode()
                await send({"type": "http.response.start", "status": 401,
                            "headers": [(b"content-type", b"application/json"),
                                        (b"content-length", str(len(body)).encode())]})
                return await send({"type": "http.response.body", "body": body})
        return await self.app(scope, receive, send)

    def _logged_in(self, scope) -> bool:
        from starlette.requests import HTTPConnection

        cookies = HTTPConnection(scope).cookies
        app = self.gradio_app
        token = cookies.get(f"access-token-{app.cookie_id}") or cookies.get(f"access-token-unsecure-{app.cookie_id}")
        return token is not None and app.tokens.get(token) is not None


def guard_gradio(app) -> None:
    """Wraps the Gradio app mounted in `app` (FastAPI) in `PageLoginGuard`."""
    from starlette.routing import Mount

    for route in app.routes:
        if isinstance(route, Mount) and hasattr(route.app, "tokens"):
            route.app.add_middleware(PageLoginGuard, gradio_app=route.app)
            return
    raise RuntimeError("the Gradio app is not mounted: nothing to put its login on")

"""ASGI middleware: the API key on the API routes (`/chat...`, `/v1/...`, and `/_test/...` when the
test hooks exist: without them those paths are not routes, and answer 404 like any unknown path), the body
size limit on every request body, the page's Gradio API included; and the page's login (`page_login`), which app.py gives Gradio,
put by `PageLoginGuard` on every `/gradio_api/` route (Gradio leaves some that act on a session open).

Both checks answer before the body is parsed, so a refused request costs no model work. With an
API key every route that reaches the model is closed: these routes by the `Authorization`
header, the page and its Gradio API (the same model, through `gradio_client`) by Gradio's login,
which takes the key as password. /health, /ready and /docs stay open; /metrics needs the key too,
and /health without it says only whether the server runs: the engine's counters (the prefix
cache's hits above all) tell one client what the others sent (see docs/operations.md).

The key's rule, the same on every route (`key_problem`): the key may come as `Authorization:
Bearer <key>`, as `x-api-key: <key>`, or both; if any key header sent is wrong, the request has no
key (401 on the keyed routes, /health without its counters), whatever the other header says.

CORS (`CorsGuard`, around everything, Gradio's routes included): an Origin that `--cors-origins`
does not name never gets `Access-Control-Allow-*` headers (Gradio's own middleware reflects any
Origin with credentials on a public Host), and its preflight is a 400.
"""

from __future__ import annotations

import hmac
import json
import re

from server.errors import count_error, error_body

_MCP_PREFIX = "/gradio_api/mcp"  # Gradio's MCP server (ui/mcp_tools.py): its clients send the Bearer key
_API_PREFIXES = ("/chat", "/v1", "/models", _MCP_PREFIX)  # /models: load and unload (server/models_api.py)
_TEST_HOOK_PREFIX = "/_test"


_KEYED_PATHS = ("/metrics",)  # not the model, but what it tells about other clients' requests


def is_api_path(path: str, test_hooks: bool = False) -> bool:
    prefixes = (*_API_PREFIXES, _TEST_HOOK_PREFIX) if test_hooks else _API_PREFIXES
    return path in _KEYED_PATHS or any(path == p or path.startswith(p + "/") for p in prefixes)


def key_problem(raw_headers, api_key: bytes) -> str | None:
    """The one rule for the two key headers, on every route that looks at them (ApiGuard, /health):
    None when at least one of `Authorization: Bearer <key>` and `x-api-key: <key>` is sent and every
    one sent (each repeat too) carries the server's key; else what is wrong. A wrong key beside a
    right one is refused: which header wins must never depend on the route. `raw_headers`: the
    ASGI scope's (name, value) byte pairs."""
    sent = False
    for name, value in raw_headers:
        if name == b"authorization":
            scheme, _, token = value.partition(b" ")
            if scheme.lower() != b"bearer":
                return "the `Authorization` header is not `Bearer <key>`"
        elif name == b"x-api-key":
            token = value
        else:
            continue
        sent = True
        if not hmac.compare_digest(token.strip(), api_key):
            return f"the key in `{name.decode()}` is not the server's key"
    return None if sent else "no `Authorization` or `x-api-key` header was sent"


def has_key(scope, api_key: str | None) -> bool:
    """The request (its ASGI scope) passes `key_problem`'s rule; True on a server without a key."""
    return api_key is None or key_problem(scope["headers"], api_key.encode()) is None


def _replaying(body: bytes, receive):
    """An ASGI `receive` that hands the app the body already read, then the connection's own events."""
    replayed = False

    async def replay():
        nonlocal replayed
        if not replayed:
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


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
    """`Authorization: Bearer <key>` or `x-api-key: <key>` on the API routes when a key is set (401; a wrong
    one beside a right one is a 401 too: `key_problem`), and `--max-body-bytes` on every request body, the
    page's Gradio API included (413)."""

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
            what = key_problem(scope["headers"], self.api_key)  # x-api-key: Anthropic's clients send it
            if what is not None:
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
        return await self.app(scope, _replaying(body, receive), send)

    def _too_big(self, size) -> str:
        return (f"The request body is too large: at most {self.max_body_bytes} bytes are allowed "
                f"(--max-body-bytes). Given: {size} bytes.")
_CORS_RESPONSE_HEADERS = frozenset((b"access-control-allow-origin", b"access-control-allow-credentials",
                                    b"access-control-allow-methods", b"access-control-allow-headers",
                                    b"access-control-expose-headers", b"access-control-max-age"))


class CorsGuard:
    """The outermost middleware: no `Access-Control-Allow-*` header for an Origin `--cors-origins` does not
    name, on every route. Gradio's CustomCORSMiddleware reflects any Origin with `Allow-Credentials: true`
    when the Host is not localhost (a Space's), so any site could read the page's routes as a logged-in
    visitor; Starlette's CORSMiddleware (server/app.py, with --cors-origins) answers the named origins.

    A request from another origin still runs (a browser then hides the answer from the page that
    sent it); its preflight gets a 400 saying which origins are allowed. With `*` among the origins
    any origin may call, never with credentials (no `Access-Control-Allow-Credentials`)."""

    def __init__(self, app, allowed_origins=()):
        self.app = app
        self.named = frozenset(o for o in allowed_origins if o != "*")
        self.any_origin = "*" in allowed_origins

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        origin = next((v for k, v in scope["headers"] if k == b"origin"), None)
        if origin is None or origin.decode("latin-1") in self.named:
            return await self.app(scope, receive, send)
        preflight = scope["method"] == "OPTIONS" and any(k == b"access-control-request-method"
                                                          for k, _ in scope["headers"])
        if preflight and not self.any_origin:
            allowed = ", ".join(sorted(self.named)) or "none (--cors-origins is not set)"
            body = (f"Disallowed CORS origin: this server answers browsers only from the origins --cors-origins "
                    f"(CORS_ORIGINS) names: {allowed}. Given: {origin.decode('latin-1')[:200]}").encode()
            await send({"type": "http.response.start", "status": 400,
                        "headers": [(b"content-type", b"text/plain; charset=utf-8"),
                                    (b"content-length", str(len(body)).encode()), (b"vary", b"Origin")]})
            return await send({"type": "http.response.body", "body": body})
        # Not named: no CORS header at all; with `*` listed, all but the credentials' one stay.
        dropped = {b"access-control-allow-credentials"} if self.any_origin else _CORS_RESPONSE_HEADERS

        async def send_without_cors(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [(k, v) for k, v in message.get("headers", ())
                                                  if k.lower() not in dropped]}
            await send(message)

        return await self.app(scope, receive, send_without_cors)


_GRADIO_API = "/gradio_api/"
# The Gradio routes that call a function: the queue's join (by fn_index), run/api/call by API name.
_FUNCTION_ROUTE = re.compile(r"^/gradio_api/(?:queue/join/?|(?:run|api|call)/([^/]+)/?)$")
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
    endpoint (its clients cannot log in: ApiGuard asks them for the Bearer key instead).

    On every page, login or not, a call of a function the page lacks (an unknown `fn_index` on
    `queue/join`, an unknown name on `run/`, `api/`, `call/`) is a 404 naming the ones it has:
    Gradio answered 500 and logged a traceback."""

    def __init__(self, app, gradio_app):
        self.app = app
        self.gradio_app = gradio_app  # gradio.routes.App: its `auth`, `tokens`, `cookie_id` and blocks

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        root = scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root):]
        if path.startswith(_MCP_PREFIX):  # ApiGuard's: the Bearer key (or a 401 with a page login and no key)
            return await self.app(scope, receive, send)
        if (self.gradio_app.auth is not None and path.startswith(_GRADIO_API)
                and path[len(_GRADIO_API):].rstrip("/") not in _GRADIO_OPEN and not self._logged_in(scope)):
            return await _send_detail(send, 401, {"error": "Not authenticated",
                                                  "auth_message": "Log in on the page first."})
        called = _FUNCTION_ROUTE.match(path) if scope["method"] == "POST" else None
        if called is None:
            return await self.app(scope, receive, send)
        return await self._known_function(called.group(1), scope, receive, send)

    async def _known_function(self, api_name: str | None, scope, receive, send):
        """Gradio answers 500 with a traceback in the log to a call of a function it lacks (`fns[fn_index]`'s
        KeyError, FnIndexInferError for an unknown API name): a 404 that names what exists instead.
        The body is already read and bounded by ApiGuard; it is replayed to Gradio as it came."""
        chunks = []
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        problem = self._unknown_function(api_name, body)
        if problem is not None:
            return await _send_detail(send, 404, problem)
        return await self.app(scope, _replaying(body, receive), send)

    def _unknown_function(self, api_name: str | None, body: bytes) -> str | None:
        """What is wrong with the function a call names, or None (Gradio's own checks see the rest)."""
        try:
            call = json.loads(body)
        except ValueError:
            return None  # Gradio's 422
        if not isinstance(call, dict):
            return None
        blocks = self.gradio_app.get_blocks()
        fns = blocks.fns
        session = call.get("session_hash")
        if isinstance(session, str) and session in blocks.state_holder:  # never creates a session
            fns = blocks.state_holder[session].blocks_config.fns  # what Gradio looks in (rendered ones too)
        fn_index = call.get("fn_index")
        if isinstance(fn_index, int) and not isinstance(fn_index, bool):
            if fn_index in fns or fn_index in blocks.fns:
                return None
            return (f"No function with this `fn_index`: this page's are {_ranges(sorted(blocks.fns))} "
                    f"(GET /config lists them). Given: {fn_index}")
        if fn_index is not None or api_name is None:
            return None  # Gradio's 422 (not an integer) or 400 (no fn_index)
        if any(fn.api_name == api_name for fn in (*fns.values(), *blocks.fns.values())):
            return None
        names = sorted(fn.api_name for fn in blocks.fns.values() if isinstance(fn.api_name, str))
        shown = ", ".join(f"/{n}" for n in names[:20]) + (", ..." if len(names) > 20 else "")
        return (f"No API function named /{api_name[:100]}: this page's are {shown or 'none'}. "
                f"Given: /{api_name[:100]}")

    def _logged_in(self, scope) -> bool:
        from starlette.requests import HTTPConnection

        cookies = HTTPConnection(scope).cookies
        app = self.gradio_app
        token = cookies.get(f"access-token-{app.cookie_id}") or cookies.get(f"access-token-unsecure-{app.cookie_id}")
        return token is not None and app.tokens.get(token) is not None


async def _send_detail(send, status: int, detail) -> None:
    """An error in Gradio's own shape, `{"detail": ...}`."""
    body = json.dumps({"detail": detail}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def _ranges(numbers: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5": a page's function indexes, short."""
    parts, start = [], None
    for i, n in enumerate(numbers):
        start = n if start is None else start
        if i + 1 == len(numbers) or numbers[i + 1] != n + 1:
            parts.append(f"{start}-{n}" if n != start else str(n))
            start = None
    return ", ".join(parts) or "none"


def guard_gradio(app) -> None:
    """Wraps the Gradio app mounted in `app` (FastAPI) in `PageLoginGuard` (its login, known functions)."""
    from starlette.routing import Mount

    for route in app.routes:
        if isinstance(route, Mount) and hasattr(route.app, "tokens"):
            route.app.add_middleware(PageLoginGuard, gradio_app=route.app)
            return
    raise RuntimeError("the Gradio app is not mounted: nothing to put its login on")


class RightmostForwarded:
    """`--forwarded-allow-ips *` (a server only its proxy can reach, such as a Space): the caller is the
    right-most `X-Forwarded-For` entry, the address the proxy in front saw, and the scheme its
    `X-Forwarded-Proto`. (uvicorn's own `*` takes the left-most entry, which the client writes.)"""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] in ("http", "websocket"):
            forwarded, proto = [], None
            for name, value in scope.get("headers", ()):
                if name == b"x-forwarded-for":
                    forwarded += [e.strip() for e in value.decode("latin-1").split(",") if e.strip()]
                elif name == b"x-forwarded-proto":
                    proto = value.decode("latin-1").split(",")[-1].strip().lower()
            if forwarded or proto in ("http", "https"):
                scope = dict(scope)
                if forwarded:
                    scope["client"] = (forwarded[-1], 0)
                if proto in ("http", "https"):
                    scope["scheme"] = proto if scope["type"] == "http" else {"http": "ws", "https": "wss"}[proto]
        return await self.app(scope, receive, send)

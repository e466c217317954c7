"""What the page's events do, apart from its layout (ui/page.py wires them to components):
answering (the page's generator and the `/chat` API for gradio_client), the chat buttons' small
history edits, and the answers each browser session streams (a closed tab aborts them). Every
refusal or failure becomes what the visitor sees in one place, `page_error`."""

import asyncio
import contextlib
import hashlib
import hmac
import secrets
import threading

import gradio as gr
from gradio.data_classes import FileData

from engine.request import InvalidRequest
from frontend.admission import RequestFailed
from frontend.errors import ApiError
from frontend.images import ImageLimits
from frontend.request import RequestDefaults
from frontend.telemetry import RequestMetrics
from frontend.tools import tool_format
from ui import status
from ui.chat import ChatSettings, answer_messages, stream_answer
from ui.history import ChatError, content_text, file_path, to_engine_messages, upload_part
from ui.markup import escape_html

ROUTE = "gradio"  # the page's requests in the metrics
PLACE_POLL_S = 0.25  # how often a message waiting for its model's load looks at its place in line again
# (send, stop, textbox) while an answer streams and after
GENERATING = (gr.update(visible=False), gr.update(visible=True), gr.update(interactive=False))
IDLE = (gr.update(visible=True), gr.update(visible=False), gr.update(interactive=True))


def page_error(exc: Exception, metrics: RequestMetrics | None, route: str = ROUTE) -> Exception:
    """What the visitor sees of a refusal or failure: its message as a `gr.Error` (a refusal counted
    in the metrics under its status, as the HTTP routes count theirs). Anything else is returned as
    it is: Gradio logs it and shows no text of it (mounted with show_error=False)."""
    if isinstance(exc, (ChatError, InvalidRequest)):
        status_code, message = 400, str(exc)
    elif isinstance(exc, ApiError):
        status_code, message = exc.status, exc.message
    elif isinstance(exc, RequestFailed):  # during the answer: its metrics record ended with the error
        return gr.Error(exc.message)
    else:
        return exc
    if metrics is not None:
        metrics.error(route, status_code)
    return gr.Error(message)


class VisitorStreams:
    """The engine requests each browser session is streaming, so a closed tab aborts its answers."""

    def __init__(self):
        self._lock = threading.Lock()
        self._by_session: dict[str, set] = {}  # session hash -> generations in flight

    def watcher(self, request: gr.Request | None):
        session = getattr(request, "session_hash", None)
        if session is None:
            return None

        def watch(generation):
            with self._lock:
                self._by_session.setdefault(session, set()).add(generation)

            def unwatch():
                with self._lock:
                    streams = self._by_session.get(session)
                    if streams is not None:
                        streams.discard(generation)
                        if not streams:
                            del self._by_session[session]
            return unwatch

        return watch

    def abort_session(self, request: gr.Request) -> None:
        """Aborts every answer the session still streams (its tab was closed)."""
        session = getattr(request, "session_hash", None)
        with self._lock:
            streams = self._by_session.pop(session, set())
        for generation in streams:
            generation.abort()


def page_client(request) -> str | None:
    """The visitor the engine shares itself between (engine/fair_share.py): its address, as the API's
    callers are counted (frontend/admission.py `client_of`: behind --forwarded-allow-ips's proxy, the
    forwarded one), so a page tab and the API calls of one caller share one share. Gradio's session
    hash is chosen by a `gradio_client` caller, so it names nobody; without an address, the session."""
    peer = getattr(request, "client", None)
    if peer is not None and getattr(peer, "host", None):
        return f"addr:{peer.host}"
    session = getattr(request, "session_hash", None)
    return f"page:{session}" if session else None


def session_salts():
    """--cache-salt-per-session: a page session's prefix-cache salt, from its session hash under a
    secret of this process (so no API client can send the same `cache_salt` and share its blocks)."""
    secret = secrets.token_bytes(32)

    def salt(request) -> str | None:
        session = getattr(request, "session_hash", None)
        if not session:
            return None
        return "page:" + hmac.new(secret, session.encode(), hashlib.sha256).hexdigest()

    return salt


def api_images(images) -> list[dict]:
    """The `/chat` API's `images` (gradio_client `handle_file`s, uploaded before the call) -> image parts."""
    if not isinstance(images, (list, tuple)):
        images = [images]
    parts = []
    for image in images:
        path = file_path(image)
        if path is None:
            raise ChatError("Each of `images` must be a file: gradio_client.handle_file(path or URL). "
                            f"Given: {type(image).__name__}.")
        parts.append(upload_part(path))
    return parts


class PageHandlers:
    """The page's event handlers for one engine; the page's requests are recorded under "gradio" and
    admitted as the routes admit theirs (--request-timeout, fair share, metrics)."""

    def __init__(self, engine, metrics: RequestMetrics, defaults: RequestDefaults, request_timeout: float = 0.0,
                 salt_sessions: bool = False, served=None, models=None, image_limits: ImageLimits = ImageLimits()):
        self.engine, self.metrics = engine, metrics
        self.image_limits = image_limits  # what a page or API message's images may be (frontend/images.py)
        self.takes_images = getattr(engine, "vision", None) is not None  # the input takes uploads
        self.models = models  # frontend/models.py ModelRegistry: the default model is held while it answers
        self.served = served  # ui/feedback.py ServedAnswers: what each session was streamed (kept for ratings)
        self.defaults = defaults  # what unset fields take; the sliders and the `/chat` API start there
        self.request_timeout = request_timeout
        self.session_salt = session_salts() if salt_sessions else (lambda request: None)
        self.visitors = VisitorStreams()
        self.thinks = engine.think_tags is not None  # a thinking model: its thought in its own box
        tokenizer = engine.tokenizer
        self.calls_format = tool_format(tokenizer).name if tokenizer is not None else None  # calls as tool messages

    def admission(self, request, route: str = ROUTE, model: str | None = None) -> dict:
        """`Generation`'s keywords for a page request, as server/headers.py `admission` gives a route's
        (`model`: the name of the model answering, for the metrics)."""
        return dict(timeout=self.request_timeout, metrics=self.metrics, route=route, client=page_client(request),
                    model=model)

    async def answer(self, messages: list[dict], message: str, settings: ChatSettings, request, *,
                     route: str = ROUTE, warn=None, watch=None, model: str | None = None, held=None):
        """(text so far, stats) of the answer; every refusal or failure raised as `page_error` has it.
        `held`: the model's entry already acquired (`wait_for_model`), released here."""
        try:
            engine, defaults, name = self.engine, self.defaults, None
            if self.models is not None:  # the model picked (None: the default), loaded if it is not
                held = held or await self.models.acquire(model)
                engine, defaults, name = held.engine, held.defaults, held.name
            async for update in stream_answer(engine, defaults, messages, message, settings,
                                              admission=self.admission(request, route, name), warn=warn,
                                              watch=watch):
                yield update
        except Exception as exc:
            raise page_error(exc, self.metrics, route) from None
        finally:
            if held is not None:
                self.models.release(held)

    async def respond(self, history, system_prompt, temperature, top_p, top_k, max_new_tokens, repetition_penalty,
                      output_format, json_schema, thinking_budget, request: gr.Request, model: str | None = None):
        """The page's generator: answers the last user message of `history`, streaming."""
        history = list(history or [])
        if not history or not isinstance(history[-1], dict) or history[-1].get("role") != "user":
            return
        try:
            messages = to_engine_messages(history, escaped=True, images=True)
        except ChatError as exc:
            raise page_error(exc, self.metrics) from None
        if not messages or messages[-1]["role"] != "user":
            return
        message = messages.pop()["content"]
        chat_settings = ChatSettings(system_prompt or "", temperature, top_p, top_k, max_new_tokens,
                                     repetition_penalty, output_format or "Text", json_schema or "",
                                     thinking_budget or None, cache_salt=self.session_salt(request),
                                     image_limits=self.image_limits)
        fmt = self.calls_format if chat_settings.output_format == "Text" else None  # JSON mode: the JSON as it is
        shown: list[dict] = []
        held = None
        if self.models is not None:  # the model held first; while its load is awaited, the place in line shown
            async with contextlib.aclosing(self.wait_for_model(model or None)) as waiting:
                async for place in waiting:
                    if not isinstance(place, str):
                        held = place
                        break
                    yield history, place
        try:
            async for text, stats in self.answer(messages, message, chat_settings, request, warn=gr.Warning,
                                                 watch=self.visitors.watcher(request), model=model or None,
                                                 held=held):
                shown = answer_messages(text, stats, fmt)
                yield history + shown, stats.markdown()
        finally:  # also when Stop closed it: what was streamed so far is what the visitor may rate
            if self.served is not None and shown:
                self.served.add(getattr(request, "session_hash", None), len(history), shown,
                                [{"role": m["role"], "content": content_text(m["content"])}
                                 for m in messages + [{"role": "user", "content": message}]])

    async def wait_for_model(self, model: str | None):
        """The status line's text each time the message's place changes while it waits for its model to
        load ("Loading model `a` · 2nd in line…"), then the model's entry, held (`answer` releases it)."""
        ticket, shown = object(), None
        acquiring = asyncio.ensure_future(self.models.acquire(model, ticket=ticket))
        held = None
        try:
            while not acquiring.done():
                place = self.models.place(model, ticket)
                if place is not None and place != shown:
                    shown = place
                    yield place + "…"
                await asyncio.wait({acquiring}, timeout=PLACE_POLL_S)
            held = acquiring.result()
        except Exception as exc:
            raise page_error(exc, self.metrics) from None
        finally:
            if held is None:  # the visitor left (Stop, a closed tab) or it failed: nothing stays held
                acquiring.cancel()
                if acquiring.done() and not acquiring.cancelled() and acquiring.exception() is None:
                    self.models.release(acquiring.result())
        yield held

    def api_chat(self):
        """The `/chat` API function (its signature and docstring are what gradio_client shows); with
        several models it takes `model` last (a name of GET /v1/models; empty: the default)."""
        defaults, session_salt, answer = self.defaults.resolved(), self.session_salt, self.answer
        metrics, max_new, limits = self.metrics, self.defaults.max_new_tokens, self.image_limits

        async def run(message, history, system_prompt, temperature, top_p, top_k, max_new_tokens, repetition_penalty,
                      request, model=None, images=None):
            chat_settings = ChatSettings(system_prompt or "", temperature, top_p, top_k, max_new_tokens,
                                         repetition_penalty, cache_salt=session_salt(request), image_limits=limits)
            try:
                messages = to_engine_messages(history, escaped=False, images=True)
                if images:  # the uploaded files (handle_file) before the message's text
                    message = api_images(images) + [{"type": "text", "text": message}] \
                        if isinstance(message, str) else message
            except ChatError as exc:
                raise page_error(exc, metrics) from None
            async for text, _stats in answer(messages, message, chat_settings, request, warn=gr.Warning,
                                             model=model or None):
                yield text

        async def chat(message: str, history: list[dict] | None = None, system_prompt: str = "",
                       temperature: float = defaults["temperature"], top_p: float = defaults["top_p"],
                       top_k: int = defaults["top_k"], max_new_tokens: int = max_new,
                       repetition_penalty: float = defaults["repetition_penalty"],
                       images: list[FileData] | None = None, request: gr.Request = None) -> str:
            """Streams the assistant's answer to `message` (the text so far on each update).

            history: earlier messages, [{"role": "user" | "assistant", "content": "..."}] (oldest first).
            system_prompt: empty = the model's default. temperature: 0 = greedy. top_k: 0 = off.
            images: pictures for the message, each `gradio_client.handle_file(path or URL)` (a
            vision-language model; to a text model a refusal).
            Conversations longer than the context lose their oldest turns (a warning says so).
            """
            async for text in run(message, history, system_prompt, temperature, top_p, top_k, max_new_tokens,
                                  repetition_penalty, request, images=images):
                yield text

        if self.models is None:
            return chat
        default_model = self.models.default.name

        async def chat_with_model(message: str, history: list[dict] | None = None, system_prompt: str = "",
                                  temperature: float = defaults["temperature"], top_p: float = defaults["top_p"],
                                  top_k: int = defaults["top_k"], max_new_tokens: int = max_new,
                                  repetition_penalty: float = defaults["repetition_penalty"],
                                  images: list[FileData] | None = None, model: str = default_model,
                                  request: gr.Request = None) -> str:
            """Streams the assistant's answer to `message` from `model` (the text so far on each update).

            history: earlier messages, [{"role": "user" | "assistant", "content": "..."}] (oldest first).
            system_prompt: empty = the model's default. temperature: 0 = greedy. top_k: 0 = off.
            images: pictures for the message, each `gradio_client.handle_file(path or URL)`.
            model: a model this server serves (GET /v1/models); it loads on its first message.
            Conversations longer than the context lose their oldest turns (a warning says so).
            """
            async for text in run(message, history, system_prompt, temperature, top_p, top_k, max_new_tokens,
                                  repetition_penalty, request, model, images):
                yield text

        chat_with_model.__name__ = "chat"
        return chat_with_model

    @staticmethod
    def add_user_message(message, history):
        """Send: the message (a MultimodalTextbox's {"text", "files"} on a vision model's page) into the
        chat, its pictures shown before its text; the input emptied."""
        files, multimodal = [], isinstance(message, dict)
        if multimodal:  # the multimodal input
            files = [f if isinstance(f, str) else file_path(f) for f in message.get("files") or []]
            message = message.get("text") or ""
        if not files and (not message or not message.strip()):
            raise gr.Error("The message is empty: type something to send.")
        content = [{"path": path} for path in files if path] + ([escape_html(message)] if message.strip() else [])
        history = list(history or []) + [{"role": "user", "content": content if files else escape_html(message)}]
        empty = {"text": "", "files": []} if multimodal else ""
        return (history,) + GENERATING[:2] + (gr.update(value=empty, interactive=False),)

    @staticmethod
    def add_example(history, event: gr.SelectData):
        text = event.value.get("text", "") if isinstance(event.value, dict) else str(event.value)
        return (list(history or []) + [{"role": "user", "content": escape_html(text)}],) + GENERATING

    @staticmethod
    def pop_answer(history):
        """Retry: drop everything after the last user message."""
        history = list(history or [])
        while history and history[-1].get("role") != "user":
            history.pop()
        return (history,) + GENERATING

    def undo(self, history):
        """Undo: remove the last user message and its answer; its text (and its pictures, on a page
        that takes them) goes back to the input."""
        history = list(history or [])
        while history and history[-1].get("role") != "user":
            history.pop()
        message, files = "", []
        if history:
            last = history.pop()
            message = to_engine_messages([last], escaped=True)
            message = content_text(message[0]["content"]) if message else ""
            parts = last.get("content") if isinstance(last, dict) else None
            files = [file_path(p) for p in (parts if isinstance(parts, list) else [parts]) if file_path(p)]
        return history, {"text": message, "files": files} if self.takes_images else message, ""

    @staticmethod
    def after_answer(stats_text):
        """Send is back; an answer cut by Stop says so (its generator never yielded the end)."""
        return IDLE + ((stats_text or "").replace("Streaming:", "Stopped:", 1),)

    def refresh(self):
        return status.snapshot(self.engine, self.metrics)

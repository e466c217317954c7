"""What the page's events do, apart from its layout (ui/page.py wires them to components):
answering (the page's generator and the `/chat` API for gradio_client), the chat buttons' small
history edits, and the answers each browser session streams (a closed tab aborts them)."""

import hashlib
import hmac
import secrets
import threading

import gradio as gr

from frontend.telemetry import RequestMetrics
from frontend.tools import tool_format
from ui import status
from ui.chat import ChatSettings, answer_messages, stream_answer
from ui.history import ChatError, to_engine_messages
from ui.markup import escape_html

DEFAULTS = ChatSettings()
# (send, stop, textbox) while an answer streams and after
GENERATING = (gr.update(visible=False), gr.update(visible=True), gr.update(interactive=False))
IDLE = (gr.update(visible=True), gr.update(visible=False), gr.update(interactive=True))


class VisitorStreams:
    """The engine requests each browser session is streaming, so a closed tab aborts its answers."""

    def __init__(self):
        self._lock = threading.Lock()
        self._by_session: dict[str, set] = {}  # session hash -> streamers in flight

    def watcher(self, request: gr.Request | None):
        session = getattr(request, "session_hash", None)
        if session is None:
            return None

        def watch(streamer):
            with self._lock:
                self._by_session.setdefault(session, set()).add(streamer)

            def unwatch():
                with self._lock:
                    streams = self._by_session.get(session)
                    if streams is not None:
                        streams.discard(streamer)
                        if not streams:
                            del self._by_session[session]
            return unwatch

        return watch

    def abort_session(self, request: gr.Request) -> None:
        """Aborts every answer the session still streams (its tab was closed)."""
        session = getattr(request, "session_hash", None)
        with self._lock:
            streams = self._by_session.pop(session, set())
        for streamer in streams:
            streamer.abort()


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


class PageHandlers:
    """The page's event handlers for one engine; the page's requests are recorded under "gradio"."""

    def __init__(self, engine, metrics: RequestMetrics, default_max_new_tokens: int, defaults: ChatSettings = DEFAULTS,
                 salt_sessions: bool = False, served=None):
        self.engine, self.metrics = engine, metrics
        self.served = served  # ui/feedback.py ServedAnswers: what each session was streamed (kept for ratings)
        self.defaults = defaults  # the sliders' and the `/chat` API's defaults (the model's, where it has them)
        self.session_salt = session_salts() if salt_sessions else (lambda request: None)
        self.default_max_new_tokens = default_max_new_tokens
        self.visitors = VisitorStreams()
        self.thinks = engine.think_tags is not None  # a thinking model: its thought in its own box
        tokenizer = engine.tokenizer
        self.calls_format = tool_format(tokenizer).name if tokenizer is not None else None  # calls as tool messages

    def respond(self, history, system_prompt, temperature, top_p, top_k, max_new_tokens, repetition_penalty,
                output_format, json_schema, thinking_budget, request: gr.Request):
        """The page's generator: answers the last user message of `history`, streaming."""
        history = list(history or [])
        if not history or not isinstance(history[-1], dict) or history[-1].get("role") != "user":
            return
        try:
            messages = to_engine_messages(history, escaped=True)
        except ChatError as exc:
            raise gr.Error(str(exc)) from None
        if not messages or messages[-1]["role"] != "user":
            return
        message = messages.pop()["content"]
        chat_settings = ChatSettings(system_prompt or "", temperature, top_p, top_k, max_new_tokens,
                                     repetition_penalty, output_format or "Text", json_schema or "", self.thinks,
                                     thinking_budget or None, cache_salt=self.session_salt(request))
        fmt = self.calls_format if chat_settings.output_format == "Text" else None  # JSON mode: the JSON as it is
        shown: list[dict] = []
        try:
            for text, stats in stream_answer(self.engine, self.metrics, "gradio", messages, message, chat_settings,
                                             warn=gr.Warning, watch=self.visitors.watcher(request),
                                             client=page_client(request)):
                shown = answer_messages(text, stats, fmt)
                yield history + shown, stats.markdown()
        except ChatError as exc:
            raise gr.Error(str(exc)) from None
        finally:  # also when Stop closed it: what was streamed so far is what the visitor may rate
            if self.served is not None and shown:
                self.served.add(getattr(request, "session_hash", None), len(history), shown,
                                messages + [{"role": "user", "content": message}])

    def api_chat(self):
        """The `/chat` API function (its signature and docstring are what gradio_client shows)."""
        engine, metrics, defaults, session_salt = self.engine, self.metrics, self.defaults, self.session_salt

        def chat(message: str, history: list[dict] | None = None, system_prompt: str = defaults.system_prompt,
                 temperature: float = defaults.temperature, top_p: float = defaults.top_p,
                 top_k: int = defaults.top_k, max_new_tokens: int = self.default_max_new_tokens,
                 repetition_penalty: float = defaults.repetition_penalty, request: gr.Request = None) -> str:
            """Streams the assistant's answer to `message` (the text so far on each update).

            history: earlier messages, [{"role": "user" | "assistant", "content": "..."}] (oldest first).
            system_prompt: empty = the model's default. temperature: 0 = greedy. top_k: 0 = off.
            Conversations longer than the context lose their oldest turns (a warning says so).
            """
            chat_settings = ChatSettings(system_prompt or "", temperature, top_p, top_k, max_new_tokens,
                                         repetition_penalty, cache_salt=session_salt(request))
            try:
                messages = to_engine_messages(history, escaped=False)
                for text, _stats in stream_answer(engine, metrics, "gradio", messages, message, chat_settings,
                                                  warn=gr.Warning, client=page_client(request)):
                    yield text
            except ChatError as exc:
                raise gr.Error(str(exc)) from None

        return chat

    @staticmethod
    def add_user_message(message, history):
        if not message or not message.strip():
            raise gr.Error("The message is empty: type something to send.")
        history = list(history or []) + [{"role": "user", "content": escape_html(message)}]
        return (history,) + GENERATING[:2] + (gr.update(value="", interactive=False),)

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

    @staticmethod
    def undo(history):
        """Undo: remove the last user message and its answer; its text goes back to the input."""
        history = list(history or [])
        while history and history[-1].get("role") != "user":
            history.pop()
        message = ""
        if history:
            message = to_engine_messages([history.pop()], escaped=True)
            message = message[0]["content"] if message else ""
        return history, message, ""

    @staticmethod
    def after_answer(stats_text):
        """Send is back; an answer cut by Stop says so (its generator never yielded the end)."""
        return IDLE + ((stats_text or "").replace("Streaming:", "Stopped:", 1),)

    def refresh(self):
        return status.snapshot(self.engine, self.metrics)

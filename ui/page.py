"""The Gradio Blocks page: a chat tab and a status tab, plus the `/chat` API for gradio_client."""

import hashlib
import hmac
import secrets
import threading

import gradio as gr

from frontend.telemetry import RequestMetrics
from ui import status
from frontend.tools import tool_format
from ui.chat import (OUTPUT_FORMATS, ChatError, ChatSettings, answer_messages, escape_html, stream_answer,
                     to_engine_messages)

DEFAULTS = ChatSettings()
EXAMPLES = [
    "Explain continuous batching to a five-year-old.",
    "Write a Python function that checks whether a string is a palindrome.",
    "Give me three ideas for a rainy Sunday, as a markdown list.",
    "What is the capital of France, and why is it famous?",
]
STATUS_REFRESH_S = 2.0
CSS = """
#rill-answer-stats { color: var(--body-text-color-subdued); font-size: var(--text-sm); min-height: 1.5em; }
#rill-header p { color: var(--body-text-color-subdued); }
"""


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


def _session_salts():
    """--cache-salt-per-session: a page session's prefix-cache salt, from its session hash under a
    secret of this process (so no API client can send the same `cache_salt` and share its blocks)."""
    secret = secrets.token_bytes(32)

    def salt(request) -> str | None:
        session = getattr(request, "session_hash", None)
        if not session:
            return None
        return "page:" + hmac.new(secret, session.encode(), hashlib.sha256).hexdigest()

    return salt


def _header(engine, model_name: str) -> str:
    return (f"## rill chat · `{model_name}`\n"
            f"Context: **{engine.max_model_len} tokens** · continuous batching on a paged KV cache · "
            f"attention: {getattr(engine, 'attention_path', 'paged')}. "
            "Answers stream as they are generated; **Stop** aborts the request in the engine.")


def build_demo(engine, settings=None, metrics: RequestMetrics | None = None) -> gr.Blocks:
    """The page for `engine`; queue already enabled (this function calls `demo.queue(...)`).

    `settings` is app.py's settings object (read with getattr: `max_num_seqs`, `max_queue`,
    `default_max_new_tokens`, `model_id`). `metrics` is what `server.metrics.install_metrics`
    returned: the page's requests are recorded under route "gradio" and the status tab reads its
    recent window; without it the page keeps a private recorder (status then shows page traffic only).

    Mount with `gr.mount_gradio_app(app, demo, path="/", **ui.MOUNT_KWARGS)` after the other routes (the
    page CSS travels in MOUNT_KWARGS: Gradio 6 takes CSS at mount time); do not call
    `demo.queue()` again (it would reset the concurrency set here).
    """
    metrics = metrics if metrics is not None else RequestMetrics(engine)
    concurrency = int(getattr(settings, "max_num_seqs", 64) or 64)
    max_queue = int(getattr(settings, "max_queue", 256) or 256)
    default_max_new = int(getattr(settings, "default_max_new_tokens", DEFAULTS.max_new_tokens) or 512)
    context = int(engine.max_model_len)
    default_max_new = max(1, min(default_max_new, context // 2))
    model_name = getattr(engine, "model_name", None) or getattr(settings, "model_id", None) or "model"

    visitors = VisitorStreams()
    thinks = getattr(engine, "think_tags", None) is not None  # a thinking model: its thought in its own box
    tokenizer = getattr(engine, "tokenizer", None)
    calls_format = tool_format(tokenizer).name if tokenizer is not None else None  # calls shown as tool messages
    session_salt = _session_salts() if getattr(settings, "cache_salt_per_session", False) else (lambda request: None)

    def respond(history, system_prompt, temperature, top_p, top_k, max_new_tokens, repetition_penalty,
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
                                     repetition_penalty, output_format or "Text", json_schema or "", thinks,
                                     thinking_budget or None, cache_salt=session_salt(request))
        fmt = calls_format if chat_settings.output_format == "Text" else None  # JSON mode: the JSON as it is
        try:
            for text, stats in stream_answer(engine, metrics, "gradio", messages, message, chat_settings,
                                             warn=gr.Warning, watch=visitors.watcher(request)):
                yield history + answer_messages(text, stats, fmt), stats.markdown()
        except ChatError as exc:
            raise gr.Error(str(exc)) from None

    def chat(message: str, history: list[dict] | None = None, system_prompt: str = DEFAULTS.system_prompt,
             temperature: float = DEFAULTS.temperature, top_p: float = DEFAULTS.top_p,
             top_k: int = DEFAULTS.top_k, max_new_tokens: int = default_max_new,
             repetition_penalty: float = DEFAULTS.repetition_penalty, request: gr.Request = None) -> str:
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
                                              warn=gr.Warning):
                yield text
        except ChatError as exc:
            raise gr.Error(str(exc)) from None

    # delete_cache: files in Gradio's cache (uploads) older than an hour are deleted every hour
    with gr.Blocks(title=f"rill · {model_name}", fill_height=False, delete_cache=(3600, 3600)) as demo:
        gr.Markdown(_header(engine, model_name), elem_id="rill-header")
        with gr.Tabs():
            with gr.Tab("Chat", id="chat") as chat_tab:
                chatbot = gr.Chatbot(
                    label=model_name, elem_id="rill-chatbot", height=520, layout="bubble",
                    buttons=["copy", "copy_all"], feedback_options=None,
                    placeholder=f"**{model_name}** is ready. Ask anything, or pick an example.",
                    examples=[{"text": text} for text in EXAMPLES],
                    sanitize_html=True, render_markdown=True,
                )
                with gr.Row(equal_height=True):
                    textbox = gr.Textbox(show_label=False, placeholder="Type a message and press Enter",
                                         scale=8, lines=1, max_lines=8, autofocus=True, elem_id="rill-input",
                                         submit_btn=False)
                    send = gr.Button("Send", variant="primary", scale=1, min_width=80, elem_id="rill-send")
                    stop = gr.Button("Stop", variant="stop", scale=1, min_width=80, visible=False,
                                     elem_id="rill-stop")
                answer_stats = gr.Markdown("", elem_id="rill-answer-stats")
                with gr.Accordion("System prompt and sampling", open=False, elem_id="rill-settings"):
                    system_prompt = gr.Textbox(label="System prompt", value=DEFAULTS.system_prompt, lines=2,
                                               placeholder="Empty = the model's default system prompt")
                    with gr.Row():
                        temperature = gr.Slider(0.0, 2.0, value=DEFAULTS.temperature, step=0.05,
                                                label="Temperature", info="0 = greedy (deterministic)",
                                                elem_id="rill-temperature")
                        top_p = gr.Slider(0.05, 1.0, value=DEFAULTS.top_p, step=0.05, label="Top-p",
                                          info="nucleus: keep the smallest set with this probability mass")
                    with gr.Row():
                        top_k = gr.Slider(0, 200, value=DEFAULTS.top_k, step=1, label="Top-k",
                                          info="keep the k most likely tokens; 0 = off")
                        max_new_tokens = gr.Slider(1, max(1, min(context, 4096)), value=default_max_new, step=1,
                                                   label="Max new tokens", info=f"context: {context} tokens",
                                                   elem_id="rill-max-new-tokens")
                        repetition_penalty = gr.Slider(1.0, 2.0, value=DEFAULTS.repetition_penalty, step=0.05,
                                                       label="Repetition penalty", info="1 = off",
                                                       elem_id="rill-repetition-penalty")
                    with gr.Row():
                        output_format = gr.Radio(list(OUTPUT_FORMATS), value="Text", label="JSON mode / schema",
                                                 info="constrain the answer to JSON, or to a JSON schema",
                                                 elem_id="rill-output-format")
                        thinking_budget = gr.Slider(0, max(1, min(context, 4096)), value=0, step=1,
                                                    label="Thinking budget", visible=thinks,
                                                    info="tokens of thought before the answer; 0 = no limit",
                                                    elem_id="rill-thinking-budget")
                    json_schema = gr.Code(label="JSON schema", language="json", visible=False, lines=6,
                                          value='{"type": "object", "properties": {"answer": {"type": "string"}},'
                                                ' "required": ["answer"]}', elem_id="rill-json-schema")
                    output_format.change(lambda choice: gr.update(visible=choice == "JSON schema"), output_format,
                                         json_schema, api_visibility="private", queue=False)
            with gr.Tab("Status", id="status") as status_tab:
                status_md = gr.Markdown(elem_id="rill-status")
                with gr.Row():
                    throughput_plot = gr.LinePlot(x="time", y="tokens/s", title="Throughput (tokens/s, 5 s bins)",
                                                  height=240, y_lim=[0, None], elem_id="rill-throughput")
                    ttft_plot = gr.LinePlot(x="time", y="TTFT (s)", title="Time to first token per request",
                                            height=240, y_lim=[0, None], elem_id="rill-ttft")
                timer = gr.Timer(STATUS_REFRESH_S, active=False)

        settings_inputs = [system_prompt, temperature, top_p, top_k, max_new_tokens, repetition_penalty,
                           output_format, json_schema, thinking_budget]
        # (send, stop, textbox) while an answer streams and after
        generating = (gr.update(visible=False), gr.update(visible=True), gr.update(interactive=False))
        idle = (gr.update(visible=True), gr.update(visible=False), gr.update(interactive=True))

        def add_user_message(message, history):
            if not message or not message.strip():
                raise gr.Error("The message is empty: type something to send.")
            history = list(history or []) + [{"role": "user", "content": escape_html(message)}]
            return (history,) + generating[:2] + (gr.update(value="", interactive=False),)

        def add_example(history, event: gr.SelectData):
            text = event.value.get("text", "") if isinstance(event.value, dict) else str(event.value)
            return (list(history or []) + [{"role": "user", "content": escape_html(text)}],) + generating

        def pop_answer(history):
            """Retry: drop everything after the last user message."""
            history = list(history or [])
            while history and history[-1].get("role") != "user":
                history.pop()
            return (history,) + generating

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

        buttons = [send, stop, textbox]
        respond_kwargs = dict(fn=respond, inputs=[chatbot] + settings_inputs, outputs=[chatbot, answer_stats],
                              api_visibility="private", concurrency_limit=concurrency, concurrency_id="chat",
                              show_progress="hidden")
        def after_answer(stats_text):
            """Send is back; an answer cut by Stop says so (its generator never yielded the end)."""
            return idle + ((stats_text or "").replace("Streaming:", "Stopped:", 1),)

        restore = dict(fn=after_answer, inputs=[answer_stats], outputs=buttons + [answer_stats],
                       api_visibility="private", queue=False)

        submitted = gr.on([textbox.submit, send.click], add_user_message, [textbox, chatbot],
                          [chatbot] + buttons, api_visibility="private", queue=False)
        submit_answer = submitted.success(**respond_kwargs)
        submit_answer.then(**restore)
        example_answer = chatbot.example_select(add_example, [chatbot], [chatbot] + buttons,
                                                api_visibility="private", queue=False).success(**respond_kwargs)
        example_answer.then(**restore)
        retry_answer = chatbot.retry(pop_answer, [chatbot], [chatbot] + buttons, api_visibility="private",
                                     queue=False).success(**respond_kwargs)
        retry_answer.then(**restore)
        chatbot.undo(undo, [chatbot], [chatbot, textbox, answer_stats], api_visibility="private", queue=False)
        chatbot.clear(lambda: "", None, [answer_stats], api_visibility="private", queue=False)
        stop.click(lambda: idle, None, buttons, api_visibility="private", queue=False,
                   cancels=[submit_answer, example_answer, retry_answer])

        def refresh():
            return status.snapshot(engine, metrics)

        timer.tick(refresh, None, [status_md, throughput_plot, ttft_plot], api_visibility="private",
                   show_progress="hidden", concurrency_limit=None, concurrency_id="status")
        status_tab.select(lambda: gr.Timer(active=True), None, [timer], api_visibility="private",
                          queue=False).then(refresh, None, [status_md, throughput_plot, ttft_plot],
                                            api_visibility="private", show_progress="hidden",
                                            concurrency_limit=None, concurrency_id="status")
        chat_tab.select(lambda: gr.Timer(active=False), None, [timer], api_visibility="private", queue=False)

        gr.api(chat, api_name="chat", concurrency_limit=concurrency, concurrency_id="chat")
        demo.unload(visitors.abort_session)  # a closed tab stops generating what nobody will read

    demo.max_threads = max(40, concurrency + 16)  # each streaming answer holds a worker thread
    demo.queue(max_size=concurrency + max_queue, default_concurrency_limit=concurrency)
    return demo

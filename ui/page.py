"""The Gradio Blocks page: a chat tab and a status tab, plus the `/chat` API for gradio_client.
Layout only: what the events do is in ui/handlers.py."""

from types import SimpleNamespace

import gradio as gr

from dataclasses import replace

from frontend.images import ImageLimits
from frontend.request import RequestDefaults
from frontend.sampling_defaults import model_sampling_defaults
from frontend.telemetry import RequestMetrics
from ui.chat import OUTPUT_FORMATS
from ui.conversations import conversation_bar, drop_exports, edited, wire_conversations
from ui.feedback import FeedbackLog, feedback_folder
from ui.handlers import IDLE, PageHandlers
from ui.mcp_tools import hide_from_mcp, register_mcp_tools

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


def _header(engine, model_name: str) -> str:
    return (f"## rill chat · `{model_name}`\n"
            f"Context: **{engine.max_model_len} tokens** · continuous batching on a paged KV cache · "
            f"attention: {engine.attention_path}. "
            "Answers stream as they are generated; **Stop** aborts the request in the engine.")


def _chat_tab(model_name: str, context: int, default_max_new: int, thinks: bool,
              defaults: dict, feedback: bool, models=None, takes_images: bool = False) -> SimpleNamespace:
    """The chat tab's components (inside an open `gr.Tab`); thumbs on answers when `feedback` is kept;
    a model picker when `models` (frontend/models.py's registry) serves several; an input that takes
    pictures (upload, paste, drag) when the model takes images."""
    ui = SimpleNamespace(conversations=conversation_bar())
    ui.model = None  # one model: no picker, and the page's events take the inputs they always took
    if models is not None:  # each model with its state; the conversation goes to the one picked
        ui.model = gr.Dropdown(model_choices(models), value=models.default.name, label="Model", elem_id="rill-model",
                               info="loaded on its first message; the least recently used may be unloaded")
    ui.chatbot = gr.Chatbot(
        label=model_name, elem_id="rill-chatbot", height=520, layout="bubble", editable="user",
        buttons=["copy", "copy_all"], feedback_options=("Like", "Dislike") if feedback else None,
        placeholder=f"**{model_name}** is ready. Ask anything, or pick an example.",
        examples=[{"text": text} for text in EXAMPLES],
        sanitize_html=True, render_markdown=True,
    )
    with gr.Row(equal_height=True):
        if takes_images:  # its value: {"text", "files"}; the files uploaded to Gradio's upload folder
            ui.textbox = gr.MultimodalTextbox(show_label=False, file_types=["image"], file_count="multiple",
                                              placeholder="Type a message, attach pictures, press Enter",
                                              scale=8, lines=1, max_lines=8, autofocus=True, elem_id="rill-input",
                                              submit_btn=False, sources=["upload"])
        else:
            ui.textbox = gr.Textbox(show_label=False, placeholder="Type a message and press Enter",
                                    scale=8, lines=1, max_lines=8, autofocus=True, elem_id="rill-input",
                                    submit_btn=False)
        ui.send = gr.Button("Send", variant="primary", scale=1, min_width=80, elem_id="rill-send")
        ui.stop = gr.Button("Stop", variant="stop", scale=1, min_width=80, visible=False, elem_id="rill-stop")
    ui.answer_stats = gr.Markdown("", elem_id="rill-answer-stats")
    with gr.Accordion("System prompt and sampling", open=False, elem_id="rill-settings"):
        _settings(ui, context, default_max_new, thinks, defaults)
    return ui


def _settings(ui: SimpleNamespace, context: int, default_max_new: int, thinks: bool, defaults: dict) -> None:
    """The system prompt and sampling settings (in the order `PageHandlers.respond` takes them); the
    sliders start at the defaults every request's unset fields take (frontend/request.py)."""
    ui.system_prompt = gr.Textbox(label="System prompt", value="", lines=2,
                                  placeholder="Empty = the model's default system prompt")
    with gr.Row():
        ui.temperature = gr.Slider(0.0, 2.0, value=defaults["temperature"], step=0.05, label="Temperature",
                                   info="0 = greedy (deterministic)", elem_id="rill-temperature")
        ui.top_p = gr.Slider(0.05, 1.0, value=defaults["top_p"], step=0.05, label="Top-p",
                             info="nucleus: keep the smallest set with this probability mass")
    with gr.Row():
        ui.top_k = gr.Slider(0, 200, value=defaults["top_k"], step=1, label="Top-k",
                             info="keep the k most likely tokens; 0 = off")
        ui.max_new_tokens = gr.Slider(1, max(1, min(context, 4096)), value=default_max_new, step=1,
                                      label="Max new tokens", info=f"context: {context} tokens",
                                      elem_id="rill-max-new-tokens")
        ui.repetition_penalty = gr.Slider(1.0, 2.0, value=defaults["repetition_penalty"], step=0.05,
                                          label="Repetition penalty", info="1 = off",
                                          elem_id="rill-repetition-penalty")
    with gr.Row():
        ui.output_format = gr.Radio(list(OUTPUT_FORMATS), value="Text", label="JSON mode / schema",
                                    info="constrain the answer to JSON, or to a JSON schema",
                                    elem_id="rill-output-format")
        ui.thinking_budget = gr.Slider(0, max(1, min(context, 4096)), value=0, step=1, label="Thinking budget",
                                       visible=thinks, info="tokens of thought before the answer; 0 = no limit",
                                       elem_id="rill-thinking-budget")
    ui.json_schema = gr.Code(label="JSON schema", language="json", visible=False, lines=6,
                             value='{"type": "object", "properties": {"answer": {"type": "string"}},'
                                   ' "required": ["answer"]}', elem_id="rill-json-schema")
    ui.output_format.change(lambda choice: gr.update(visible=choice == "JSON schema"), ui.output_format,
                            ui.json_schema, api_visibility="private", queue=False)
    ui.settings_inputs = [ui.system_prompt, ui.temperature, ui.top_p, ui.top_k, ui.max_new_tokens,
                          ui.repetition_penalty, ui.output_format, ui.json_schema, ui.thinking_budget]
    if ui.model is not None:  # `PageHandlers.respond` takes it after the request (Gradio puts that by position)
        ui.settings_inputs.append(ui.model)


def model_choices(models) -> list[tuple[str, str]]:
    """(label, name) of each model: "qwen2 · loaded"."""
    return [(f"{m['id']} · {m['status']['value']}", m["id"]) for m in models.snapshot()]


def _status_tab() -> SimpleNamespace:
    """The status tab's components (inside an open `gr.Tab`)."""
    ui = SimpleNamespace(markdown=gr.Markdown(elem_id="rill-status"))
    with gr.Row():
        ui.throughput = gr.LinePlot(x="time", y="tokens/s", title="Throughput (tokens/s, 5 s bins)",
                                    height=240, y_lim=[0, None], elem_id="rill-throughput")
        ui.ttft = gr.LinePlot(x="time", y="TTFT (s)", title="Time to first token per request",
                              height=240, y_lim=[0, None], elem_id="rill-ttft")
    ui.timer = gr.Timer(STATUS_REFRESH_S, active=False)
    return ui


def _wire_chat(ui: SimpleNamespace, handlers: PageHandlers, concurrency: int, save: dict) -> None:
    """Send, examples, retry, edit, undo, clear and stop; an answer streams through `handlers.respond`;
    `save` (ui/conversations.py) keeps the conversation in the browser after each change."""
    chatbot, private = ui.chatbot, dict(api_visibility="private", queue=False)
    buttons = [ui.send, ui.stop, ui.textbox]
    respond = dict(fn=handlers.respond, inputs=[chatbot] + ui.settings_inputs, outputs=[chatbot, ui.answer_stats],
                   api_visibility="private", concurrency_limit=concurrency, concurrency_id="chat",
                   show_progress="hidden")
    restore = dict(fn=handlers.after_answer, inputs=[ui.answer_stats], outputs=buttons + [ui.answer_stats],
                   **private)
    answers = []
    for started in (
            gr.on([ui.textbox.submit, ui.send.click], handlers.add_user_message, [ui.textbox, chatbot],
                  [chatbot] + buttons, **private),
            chatbot.example_select(handlers.add_example, [chatbot], [chatbot] + buttons, **private),
            chatbot.retry(handlers.pop_answer, [chatbot], [chatbot] + buttons, **private),
            chatbot.edit(edited, [chatbot], [chatbot] + buttons, **private)):
        answer = started.success(**respond)
        answer.then(**restore).then(**save)
        answers.append(answer)
    chatbot.undo(handlers.undo, [chatbot], [chatbot, ui.textbox, ui.answer_stats], **private).then(**save)
    chatbot.clear(lambda: "", None, [ui.answer_stats], **private).then(**save)
    ui.stop.click(lambda: IDLE, None, buttons, cancels=answers, **private)


def _wire_status(chat_tab, status_tab, ui: SimpleNamespace, handlers: PageHandlers) -> None:
    """The status tab refreshes every STATUS_REFRESH_S while it is open."""
    outputs = [ui.markdown, ui.throughput, ui.ttft]
    refresh = dict(api_visibility="private", show_progress="hidden", concurrency_limit=None,
                   concurrency_id="status")
    ui.timer.tick(handlers.refresh, None, outputs, **refresh)
    status_tab.select(lambda: gr.Timer(active=True), None, [ui.timer], api_visibility="private",
                      queue=False).then(handlers.refresh, None, outputs, **refresh)
    chat_tab.select(lambda: gr.Timer(active=False), None, [ui.timer], api_visibility="private", queue=False)


def build_demo(engine, settings=None, metrics: RequestMetrics | None = None,
               defaults: RequestDefaults | None = None, models=None) -> gr.Blocks:
    """The page for `engine`; queue already enabled (this function calls `demo.queue(...)`).

    `settings` is app.py's settings object (read with getattr: `max_num_seqs`, `max_queue`,
    `default_max_new_tokens`, `model_id`, `request_timeout`). `defaults`: what unset fields take
    (server/app.py's `request_defaults`; the model's over rill's if not given). `metrics` is what `server.metrics.install_metrics`
    returned: the page's requests are recorded under route "gradio" and the status tab reads its
    recent window; without it the page keeps a private recorder (status then shows page traffic only).
    `models`: frontend/models.py's registry: each answer holds the default model (loaded again if it was unloaded).

    Mount with `gr.mount_gradio_app(app, demo, path="/", **ui.MOUNT_KWARGS)` after the other routes (the
    page CSS travels in MOUNT_KWARGS: Gradio 6 takes CSS at mount time); do not call
    `demo.queue()` again (it would reset the concurrency set here).
    """
    metrics = metrics if metrics is not None else RequestMetrics(engine)
    concurrency = int(getattr(settings, "max_num_seqs", 64) or 64)
    max_queue = int(getattr(settings, "max_queue", 256) or 256)
    default_max_new = int(getattr(settings, "default_max_new_tokens", 512) or 512)
    context = int(engine.max_model_len)
    default_max_new = max(1, min(default_max_new, context // 2))
    model_name = engine.model_name or getattr(settings, "model_id", None) or "model"
    if defaults is None:
        defaults = RequestDefaults(model_sampling_defaults(engine))
    defaults = replace(defaults, max_new_tokens=default_max_new)  # the page's answers fit half the context
    folder = feedback_folder(getattr(settings, "feedback_dir", None))
    feedback = FeedbackLog(folder, model_name) if folder is not None else None
    handlers = PageHandlers(engine, metrics, defaults, float(getattr(settings, "request_timeout", 0.0) or 0.0),
                            salt_sessions=bool(getattr(settings, "cache_salt_per_session", False)),
                            served=feedback.served if feedback is not None else None, models=models,
                            image_limits=ImageLimits.from_settings(settings))

    # delete_cache: files in Gradio's cache (uploads) older than an hour are deleted every hour
    with gr.Blocks(title=f"rill · {model_name}", fill_height=False, delete_cache=(3600, 3600)) as demo:
        gr.Markdown(_header(engine, model_name), elem_id="rill-header")
        with gr.Tabs():
            with gr.Tab("Chat", id="chat") as chat_tab:
                chat_ui = _chat_tab(model_name, context, default_max_new, handlers.thinks, defaults.resolved(),
                                    feedback is not None, models, handlers.takes_images)
            with gr.Tab("Status", id="status") as status_tab:
                status_ui = _status_tab()
        save = wire_conversations(demo, chat_ui.conversations, chat_ui.chatbot, chat_ui.answer_stats, chat_ui.model,
                                  served=(lambda: {e.name for e in models.entries}) if models is not None else None)
        _wire_chat(chat_ui, handlers, concurrency, save)
        if models is not None:  # the states as they are now whenever the list is opened
            chat_ui.model.focus(lambda: gr.Dropdown(choices=model_choices(models)), None, [chat_ui.model],
                                api_visibility="private", queue=False)
        if feedback is not None:
            # no history posted: the record is what the server streamed (ui/feedback.py ServedAnswers);
            # queued, so a refused rating's warning reaches the visitor
            chat_ui.chatbot.like(feedback.record, None, None, api_visibility="private", concurrency_limit=4,
                                 concurrency_id="feedback", show_progress="hidden")
        _wire_status(chat_tab, status_tab, status_ui, handlers)
        register_mcp_tools(handlers)  # first: the MCP tool `chat` is its
        gr.api(hide_from_mcp(handlers.api_chat()), api_name="chat", concurrency_limit=concurrency, concurrency_id="chat")

        def session_ended(request: gr.Request):
            handlers.visitors.abort_session(request)  # a closed tab stops generating what nobody will read
            if feedback is not None:
                feedback.served.forget(request.session_hash)  # its answers can no longer be rated
            drop_exports(request)  # nor its exports downloaded

        demo.unload(session_ended)

    demo.queue(max_size=concurrency + max_queue, default_concurrency_limit=concurrency)
    # Mounted (gr.mount_gradio_app), a Blocks never launches, and Gradio skips its check that a file an
    # input names was uploaded (processing_utils._check_allowed): any path a caller put in a chat
    # history or an API call's FileData was copied into its cache, then served. Marked launched, it checks.
    demo.has_launched = True
    return demo

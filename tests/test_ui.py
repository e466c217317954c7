"""The page's chat logic and its `/chat` Gradio API, against a scripted engine (no model, fast).

The browser tests (tests/test_browser.py) drive the real page on the embedded model; these check
what the page promises at the edges: text never becomes HTML, long conversations lose their
oldest turns, the API streams, a cancelled job aborts its engine request, answers run in parallel.
"""

import asyncio
import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
from hypothesis import given, settings as hyp_settings, strategies as st

from engine.request import FinishReason, InvalidRequest, RequestOutput, new_request_id
from engine.streams import RequestStream
from frontend.request import RequestDefaults, fit_to_context
from frontend.telemetry import RequestMetrics
from ui.chat import ChatSettings, stream_answer
from ui.history import ChatError, to_engine_messages
from ui.markup import _split_code, escape_html, unescape_html

XSS = "<img src=x onerror=alert(1)>"

# --------------------------------------------------------------------------- a scripted engine

@dataclass
class FakeStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    num_kv_blocks: int = 100
    num_free_kv_blocks: int = 100
    num_preemptions: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    num_steps: int = 0
    finished_total: dict = field(default_factory=dict)
    prefix_cache_queried_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0


class FakeRequest:
    """One scripted answer, written word by word into the request's stream by a thread (as the
    engine thread feeds a `RequestStream`)."""

    def __init__(self, engine, prompt_token_ids, params, request_id):
        self.engine = engine
        self.request_id = request_id
        self.params = params
        self.stream = RequestStream(engine, request_id, 1)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_output_tokens = 0
        self.finish_reason = None
        self.aborted = threading.Event()
        self.done = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _emit(self, text, finish_reason=None):
        self.stream._on_output(RequestOutput(self.request_id, 0, [1] if text else [], text,
                                             finished=finish_reason is not None, finish_reason=finish_reason,
                                             num_prompt_tokens=self.num_prompt_tokens,
                                             num_output_tokens=self.num_output_tokens))

    def _run(self):
        engine = self.engine
        with engine.lock:
            engine.running += 1
            engine.max_running = max(engine.max_running, engine.running)
        try:
            deadline = time.monotonic() + 10.0
            while engine.max_running < engine.start_together and time.monotonic() < deadline:
                time.sleep(0.01)  # hold until this many requests run at once (or give up)
            words = engine.reply.split(" ")
            self.finish_reason = FinishReason.LENGTH
            for i in range(self.params.max_tokens):
                if self.aborted.wait(engine.token_delay):
                    self.finish_reason = FinishReason.ABORT
                    break
                if i >= len(words):
                    self.finish_reason = FinishReason.STOP
                    break
                self.num_output_tokens += 1
                self._emit(words[i] if i == 0 else " " + words[i])
        finally:
            with engine.lock:
                engine.running -= 1
            self.done.set()
            self._emit("", self.finish_reason)


class FakeChatEngine:
    """Speaks the engine API the page uses; one token per word; answers `reply` word by word."""

    model_name = "fake-chat-model"
    attention_path = "paged"
    alive = True
    backend = "local"
    tokenizer = None
    think_tags = None
    generation_config = None

    def __init__(self, reply="Hello there, this is a scripted answer.", max_model_len=64, token_delay=0.0):
        self.reply = reply
        self.max_model_len = max_model_len
        self.token_delay = token_delay
        self.start_together = 1
        self.lock = threading.Lock()
        self.running = 0
        self.max_running = 0
        self.prompts = []  # the messages of each encode_chat call
        self.streamers = []  # every FakeRequest, in order of admission
        self.clients = []  # the client each add_request call named (the page: its address)

    def encode_chat(self, messages, add_generation_prompt=True):
        self.prompts.append([dict(m) for m in messages])
        words = []
        for message in messages:
            words.append(message["role"] + ":")
            words.extend(message["content"].split())
        return list(range(len(words)))

    grammars = None  # nothing to compile here

    def add_request(self, prompt_token_ids, params, request_id=None, prior_output_ids=(), client=None):
        self.clients.append(client)
        if len(prompt_token_ids) + params.max_tokens > self.max_model_len:
            raise InvalidRequest(f"prompt + max_tokens > {self.max_model_len}")
        request = FakeRequest(self, prompt_token_ids, params, request_id or new_request_id())
        self.streamers.append(request)
        return request.stream

    async def wait_admitted(self, stream, timeout):
        return None

    def abort(self, request_id):
        for request in self.streamers:
            if request.request_id == request_id:
                request.aborted.set()
                return True
        return False

    def unavailable_reason(self):
        return "The fake engine is not running."

    def stats(self):
        return FakeStats(num_running=self.running)


# --------------------------------------------------------------------------- text never becomes HTML

def test_escape_html_neutralises_tags_but_keeps_markdown_and_code():
    text = f"**bold** {XSS} & `a <b> c` and\n```html\n<script>x</script>\n```\n> quote <i>"
    escaped = escape_html(text)
    assert escaped == ("**bold** &lt;img src=x onerror=alert(1)> &amp; `a <b> c` and\n"
                       "```html\n<script>x</script>\n```\n> quote &lt;i>")
    assert unescape_html(escaped) == text


def test_unclosed_fence_streams_as_code():
    assert escape_html("see:\n```py\nif a < b:") == "see:\n```py\nif a < b:"
    assert escape_html("a lone ` backtick <b>") == "a lone ` backtick &lt;b>"


@hyp_settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(list("ab <>&`~\n;lt") + ["```", "&lt;", "&amp;", "\n```\n", "~~~"]),
                max_size=40).map("".join))
def test_escape_round_trips_and_leaves_no_tag_outside_code(text):
    escaped = escape_html(text)
    assert unescape_html(escaped) == text
    for is_code, piece in _split_code(escaped):
        if not is_code:
            assert "<" not in piece


# --------------------------------------------------------------------------- history and the context

def test_history_in_every_gradio_shape_becomes_plain_messages():
    history = [
        {"role": "user", "content": [{"type": "text", "text": "hi &lt;b>"}]},
        {"role": "assistant", "content": "hello", "metadata": None},
        {"role": "assistant", "content": "thinking...", "metadata": {"title": "Reasoning"}},
        {"role": "user", "content": {"type": "file", "file": {"path": "/x.png"}}},
        ["pair question", "pair answer"],
    ]
    assert to_engine_messages(history, escaped=True) == [
        {"role": "user", "content": "hi <b>"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "pair question"},
        {"role": "assistant", "content": "pair answer"},
    ]
    assert to_engine_messages([{"role": "user", "content": "a &lt; b"}], escaped=False)[0]["content"] == "a &lt; b"


def answer(engine, history, message, settings, metrics=None, warn=None):
    """Every (text so far, stats) the page's generator yields, run in an event loop of its own."""
    async def run():
        admission = dict(route="gradio", metrics=metrics, timeout=0.0, client=None)
        return [update async for update in stream_answer(engine, RequestDefaults(), history, message, settings,
                                                         admission=admission, warn=warn)]
    return asyncio.run(run())


def prompt(system, history, message):
    return [{"role": "system", "content": system}] * bool(system) + history + [{"role": "user", "content": message}]


def _turn(i):
    return [{"role": "user", "content": f"question {i} " + "w " * 6},
            {"role": "assistant", "content": f"answer {i} " + "w " * 6}]


def test_long_conversation_drops_oldest_turns_first():
    engine = FakeChatEngine(max_model_len=60)
    history = _turn(1) + _turn(2) + _turn(3)  # 9 tokens per message
    fitted = fit_to_context(engine, prompt("be brief", history, "last question"), max_new_tokens=20)
    assert fitted.dropped_turns == 2
    kept = ([{"role": "system", "content": "be brief"}] + history[2 * fitted.dropped_turns:]
            + [{"role": "user", "content": "last question"}])
    assert kept in engine.prompts and fitted.prompt_token_ids == engine.encode_chat(kept)  # what it tokenized
    assert [m["content"].split()[:2] for m in kept] == [["be", "brief"], ["question", "3"], ["answer", "3"],
                                                        ["last", "question"]]
    assert len(fitted.prompt_token_ids) + 20 <= 60


def test_a_message_longer_than_the_context_is_refused_with_the_numbers():
    engine = FakeChatEngine(max_model_len=10)
    with pytest.raises(InvalidRequest, match=r"takes 13 tokens, and the model's context holds 10 tokens"):
        fit_to_context(engine, prompt("", [], "w " * 12), max_new_tokens=4)
    fitted = fit_to_context(engine, prompt("", [], "w " * 6), max_new_tokens=8)  # 7 prompt tokens: 3 left
    assert fitted.max_tokens == 3


def test_trimming_warns_and_the_answer_streams():
    engine = FakeChatEngine(reply="one two three", max_model_len=40)
    warnings = []
    outputs = answer(engine, _turn(1) + _turn(2), "now?", ChatSettings(max_new_tokens=8), warn=warnings.append)
    assert [text for text, _ in outputs][-1] == "one two three"
    assert len(warnings) == 1 and "1 oldest turn(s) were left out" in warnings[0]
    assert "context (40 tokens)" in warnings[0]
    assert outputs[-1][1].finish_reason == "stop" and outputs[-1][1].num_output_tokens == 3


@pytest.mark.parametrize("field_, value, message", [
    ("temperature", -1.0, "`temperature` must be a number in [0, 100] (0 = greedy). Given: -1.0"),
    ("top_p", 0.0, "`top_p` must be in (0, 1]. Given: 0.0"),
    ("top_k", 2.5, "`top_k` must be an integer >= 0 (0 = off). Given: 2.5"),
    ("max_new_tokens", 0, "`max_new_tokens` must be an integer >= 1. Given: 0"),
    ("repetition_penalty", 0.0, "`repetition_penalty` must be a number in (0, 100] (1 = off). Given: 0.0"),
])
def test_bad_settings_are_refused_before_the_engine_sees_them(field_, value, message):
    engine = FakeChatEngine()
    settings = ChatSettings(**{field_: value})
    with pytest.raises((ChatError, InvalidRequest)) as info:
        answer(engine, [], "hi", settings)
    assert message in str(info.value)
    assert engine.streamers == []


# --------------------------------------------------------------------------- the page's /chat API

@pytest.fixture(scope="module")
def page():
    from gradio_client import Client

    from tests.servers import free_port
    from ui import build_demo

    engine = FakeChatEngine(max_model_len=400)
    metrics = RequestMetrics(engine)
    settings = SimpleNamespace(max_num_seqs=4, max_queue=8, default_max_new_tokens=64)
    demo = build_demo(engine, settings, metrics=metrics)
    port = free_port()
    demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True)
    try:
        client = Client(f"http://127.0.0.1:{port}/", verbose=False)
        yield SimpleNamespace(engine=engine, metrics=metrics, client=client, demo=demo)
    finally:
        demo.close()


def _value(metrics, name, **labels):
    return metrics.registry.get_sample_value(name, labels) or 0.0


def test_chat_api_lists_named_parameters_with_defaults(page):
    info = page.client.view_api(print_info=False, return_format="dict")["named_endpoints"]["/chat"]
    params = {p["parameter_name"]: p for p in info["parameters"]}
    assert list(params) == ["message", "history", "system_prompt", "temperature", "top_p", "top_k",
                            "max_new_tokens", "repetition_penalty", "images"]
    assert not params["message"]["parameter_has_default"]
    rill = RequestDefaults().resolved()  # the fake model has no sampling of its own: rill's, as on every route
    assert {name: params[name]["parameter_default"] for name in list(params)[2:]} == {
        "system_prompt": "", "temperature": rill["temperature"], "top_p": rill["top_p"], "top_k": rill["top_k"],
        "max_new_tokens": 64, "repetition_penalty": rill["repetition_penalty"], "images": None}
    assert info["returns"][0]["type"] == {"type": "string"}


def test_chat_api_streams_the_growing_text_and_counts_it(page):
    engine, metrics = page.engine, page.metrics
    engine.reply = "alpha beta gamma delta epsilon zeta eta theta"
    engine.token_delay = 0.02
    before_tokens = _value(metrics, "rill_generation_tokens_total", route="gradio")
    before_prompt = _value(metrics, "rill_prompt_tokens_total", route="gradio")
    before_stop = _value(metrics, "rill_requests_finished_total", route="gradio", finish_reason="stop")
    job = page.client.submit("hello there", [{"role": "user", "content": "hi"},
                                             {"role": "assistant", "content": "hey"}], api_name="/chat")
    final = job.result(timeout=60)
    outputs = job.outputs()
    assert final == engine.reply
    assert len(set(outputs)) >= 3
    assert all(engine.reply.startswith(text) for text in outputs)
    assert [m["content"] for m in engine.prompts[-1]] == ["hi", "hey", "hello there"]
    assert engine.clients[-1] == "addr:127.0.0.1"  # its address, not the session hash it chose: its fair share
    assert _value(metrics, "rill_generation_tokens_total", route="gradio") - before_tokens == 8
    assert _value(metrics, "rill_prompt_tokens_total", route="gradio") - before_prompt == 7  # 3 roles + 4 words
    assert _value(metrics, "rill_requests_finished_total", route="gradio", finish_reason="stop") - before_stop == 1


def test_cancelled_job_aborts_the_engine_request(page):
    engine, metrics = page.engine, page.metrics
    engine.reply = " ".join(f"w{i}" for i in range(300))
    engine.token_delay = 0.05
    before = _value(metrics, "rill_requests_finished_total", route="gradio", finish_reason="abort")
    job = page.client.submit("go on forever", api_name="/chat", max_new_tokens=300)
    deadline = time.monotonic() + 60
    while not job.outputs() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert job.outputs(), "no text streamed"
    streamer = engine.streamers[-1]
    job.cancel()
    assert streamer.done.wait(30), "the engine request kept running after the job was cancelled"
    assert streamer.finish_reason == FinishReason.ABORT
    assert streamer.num_output_tokens < 300
    deadline = time.monotonic() + 10
    while _value(metrics, "rill_requests_finished_total", route="gradio", finish_reason="abort") == before \
            and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _value(metrics, "rill_requests_finished_total", route="gradio", finish_reason="abort") == before + 1


def test_answers_run_side_by_side(page):
    engine = page.engine
    engine.reply = "side by side"
    engine.token_delay = 0.0
    engine.max_running = 0
    engine.start_together = 3  # each request holds its first token until three run at once
    try:
        jobs = [page.client.submit(f"q{i}", api_name="/chat") for i in range(3)]
        assert [job.result(timeout=60) for job in jobs] == ["side by side"] * 3
        assert engine.max_running == 3
    finally:
        engine.start_together = 1


def test_chat_api_answers_bad_input_with_a_clear_error(page):
    from gradio_client.exceptions import AppError

    with pytest.raises(AppError, match=r"`temperature` must be a number in \[0, 100\] \(0 = greedy\)\. Given: -1\.0"):
        page.client.predict("hi", None, "", -1.0, api_name="/chat")
    with pytest.raises(AppError, match="The message is empty"):
        page.client.predict("   ", api_name="/chat")


def test_status_panel_counts_what_the_page_streamed():
    from ui import status

    engine = FakeChatEngine(reply="one two three four", max_model_len=64)
    metrics = RequestMetrics(engine)
    answer(engine, [], "count", ChatSettings(max_new_tokens=8), metrics=metrics)
    markdown, throughput, ttft = status.snapshot(engine, metrics)
    assert "| Tokens generated (last minute) | 4 |" in markdown
    assert "| Requests finished (last minute) | 1 |" in markdown
    assert "| Running requests | 0 |" in markdown
    assert list(ttft.columns) == ["time", "TTFT (s)"] and len(ttft) == 1
    assert list(throughput.columns) == ["time", "tokens/s"] and len(throughput) == status.HISTORY_S / status.THROUGHPUT_BIN_S


def test_status_panel_shows_visitors_a_fixed_message_when_the_engine_cannot_be_read(caplog):
    from ui.status import ENGINE_UNAVAILABLE, status_markdown

    class BrokenEngine:
        alive = False

        def stats(self):
            raise RuntimeError("allocator state at /srv/rill/engine/kv_cache.py:88 is corrupt")

    text = status_markdown(BrokenEngine(), SimpleNamespace())
    assert text == ENGINE_UNAVAILABLE
    assert "RuntimeError" not in text and "/srv" not in text
    assert "/srv/rill/engine/kv_cache.py:88" in caplog.text  # the owner finds it in the log

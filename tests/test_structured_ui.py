"""The page's side of thinking, JSON mode and tool calls: what the chat shows (a "Thinking" box,
tool messages instead of markup, JSON that matches the schema), on the tiny thinking "qwen3"."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest

from engine.model.loading import load_model
from engine.request import InvalidRequest
from frontend.backends.local import LocalEngine
from frontend.request import RequestDefaults
from ui.chat import AnswerStats, ChatSettings, answer_messages, stream_answer
from ui.history import ChatError
from ui.page import build_demo

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                           "sunny": {"type": "boolean"}}, "required": ["city", "sunny"]}


@pytest.fixture(scope="module")
def engine(tiny_model):
    engine = LocalEngine(load_model(tiny_model("qwen3"))).start()  # the page needs the engine client
    yield engine
    engine.shutdown()


def test_thought_box_is_pending_then_done_with_its_duration():
    stats = AnswerStats(reasoning="Let me think <b>", thinking=True, reasoning_s=0.5)
    pending = answer_messages("", stats)
    assert pending[0]["metadata"] == {"title": "Thinking", "status": "pending"}
    assert pending[0]["content"] == "Let me think &lt;b>"  # escaped like any model text
    stats.thinking, stats.reasoning_s, stats.finish_reason = False, 1.234, "stop"
    done = answer_messages("The answer", stats)
    assert done[0]["metadata"] == {"title": "Thinking", "status": "done", "duration": 1.23}
    assert done[1] == {"role": "assistant", "content": "The answer"}


def test_a_tool_call_shows_as_a_tool_message_not_markup():
    text = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    shown = answer_messages(text, AnswerStats(finish_reason="stop"), "hermes")
    assert shown[0] == {"role": "assistant", "content": "Checking.\n"}
    assert shown[1]["metadata"] == {"title": "🛠️ Called tool `get_weather`", "status": "done"}
    assert json.loads(shown[1]["content"].strip("`").removeprefix("json")) == {"city": "Paris"}
    assert all("<tool_call>" not in m["content"] for m in shown)
    writing = answer_messages(text[:30], AnswerStats(), "hermes")  # while the call is being written
    assert writing[-1]["metadata"]["status"] == "pending" and "<tool_call>" not in json.dumps(writing)
    assert answer_messages(text, AnswerStats(), None)[0]["content"].count("&lt;tool_call>") == 1  # JSON mode: as is


def test_json_mode_settings_are_checked():
    with pytest.raises(ChatError, match="needs a schema"):
        ChatSettings(output_format="JSON schema").job([], "hi")
    with pytest.raises(InvalidRequest, match="not valid JSON"):
        ChatSettings(output_format="JSON schema", json_schema="{nope").job([], "hi")
    with pytest.raises(ChatError, match="output format must be one of"):
        ChatSettings(output_format="XML").job([], "hi")
    assert ChatSettings(output_format="JSON object").job([], "hi").constraint.kind == "json_object"


def test_page_streams_the_thought_apart_and_json_matches_the_schema(engine):
    settings = ChatSettings(temperature=0.0, max_new_tokens=60, max_reasoning_tokens=8, output_format="JSON schema",
                            json_schema=json.dumps(SCHEMA), top_k=0, repetition_penalty=1.0)

    async def answer():
        return [(text, AnswerStats(**{k: getattr(stats, k) for k in ("reasoning", "thinking", "finish_reason")}))
                async for text, stats in stream_answer(engine, RequestDefaults(), [], "Weather?", settings,
                                                       admission={"route": "gradio"})]

    steps = asyncio.run(answer())
    text, stats = steps[-1]
    assert stats.reasoning and "<think>" not in stats.reasoning and "</think>" not in text
    assert any(s.thinking for _, s in steps) and not stats.thinking
    assert stats.finish_reason == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)


def test_page_has_the_json_mode_setting(engine):
    demo = build_demo(engine)
    ids = {c.get("props", {}).get("elem_id") for c in demo.config["components"]}
    assert {"rill-output-format", "rill-json-schema", "rill-thinking-budget"} <= ids
    radio = next(c for c in demo.config["components"] if c.get("props", {}).get("elem_id") == "rill-output-format")
    assert radio["props"]["label"] == "JSON mode / schema"

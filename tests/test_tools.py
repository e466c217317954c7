"""Tool-call formats (frontend/tools.py): the parsers give the same content and calls whole or fed a
character at a time, hold back a tag being written, never put call text in content; each format's
constraint makes a random model write a valid call of a declared function."""

from __future__ import annotations

import json

import jsonschema
import pytest

from engine import LLM, SamplingParams
from engine.model.loading import load_model
from frontend.tool_parsers import GenericParser, HermesParser, Llama3Parser
from frontend.tools import TOOL_FORMATS, ToolRequest, tool_format

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
    "additionalProperties": False}}}
NOTE = {"type": "function", "function": {"name": "add_note", "strict": True, "parameters": {
    "type": "object", "properties": {"text": {"type": "string", "maxLength": 8}, "pinned": {"type": "boolean"}},
    "required": ["text", "pinned"], "additionalProperties": False}}}
LLAMA3_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>{% endfor %}"
                   "{% if tools %}Environment: ipython. Tools: {{ tools | tojson }}{% endif %}"
                   "<|im_start|>assistant\n")

CASES = [
    (HermesParser, 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
                   '<tool_call>\n{"name": "add_note", "arguments": {"text": "a<b", "pinned": true}}\n</tool_call>',
     "Let me check.\n", [("get_weather", {"city": "Oslo"}), ("add_note", {"text": "a<b", "pinned": True})]),
    (HermesParser, "a < b and <tool but no call", "a < b and <tool but no call", []),
    (Llama3Parser, '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}', "",
     [("get_weather", {"city": "Rome"})]),
    (Llama3Parser, "{not json at all", "{not json at all", []),
    (Llama3Parser, "Plain answer.", "Plain answer.", []),
    (GenericParser, '{"response":"h\\u00e9llo \\ud83d\\ude00 \\"q\\"\\nend"}', 'héllo 😀 "q"\nend', []),
    (GenericParser, '{"tool_call":{"name":"get_weather","arguments":{"city":"Lima"}}}', "",
     [("get_weather", {"city": "Lima"})]),
    (GenericParser, '{"tool_calls":[{"name":"get_weather","arguments":{"city":"A"}},'
                    '{"name":"add_note","arguments":{"text":"x","pinned":false}}]}', "",
     [("get_weather", {"city": "A"}), ("add_note", {"text": "x", "pinned": False})]),
]


def _parse(parser_class, pieces: list[str]):
    parser = parser_class()
    events = [e for piece in pieces for e in parser.feed(piece)] + parser.finish()
    content = "".join(v for k, v in events if k == "content")
    calls = [(v.name, json.loads(v.arguments)) for k, v in events if k == "call"]
    return content, calls, events


@pytest.mark.parametrize("parser_class, text, content, calls", CASES)
def test_parsers_give_the_same_whole_or_streamed(parser_class, text, content, calls):
    assert _parse(parser_class, [text])[:2] == (content, calls)
    streamed_content, streamed_calls, events = _parse(parser_class, list(text))
    assert (streamed_content, streamed_calls) == (content, calls)
    assert all("<tool_call>" not in v and '"tool_call' not in v for k, v in events if k == "content")


def test_a_tag_being_written_is_held_back_and_a_cut_call_dropped():
    parser = HermesParser()
    assert parser.feed("Hi <tool_") == [("content", "Hi ")]  # "<tool_" may begin a call
    assert parser.feed('call>\n{"name": "get_weather", "argu') == []
    assert parser.finish() == []  # cut by max_tokens: no call, and no call text as content


def test_formats_come_from_the_template(tiny_model):
    class Template:
        def __init__(self, chat_template):
            self.chat_template = chat_template

    assert tool_format(Template("{{ '<tool_call>' }}")).name == "hermes"
    assert tool_format(Template(LLAMA3_TEMPLATE)).name == "llama3_json"
    assert tool_format(load_model(tiny_model("llama")).tokenizer).name == "generic"
    assert tool_format(load_model(tiny_model("qwen3")).tokenizer).name == "hermes"


@pytest.fixture(scope="module")
def llama(tiny_model):
    return LLM(load_model(tiny_model("llama")))


@pytest.mark.parametrize("name", ["llama3_json", "generic"])
@pytest.mark.parametrize("choice", ["required", "add_note"])
def test_each_format_enforces_a_valid_call(llama, name, choice):
    fmt = TOOL_FORMATS[name]
    request = ToolRequest((WEATHER, NOTE), choice, parallel=False)
    constraint = fmt.constraint(request, llama.tokenizer)
    assert constraint is not None and constraint.strict  # NOTE is strict
    declared = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, NOTE)}
    for seed in range(2):
        result = llama.generate(["Call a tool:"], SamplingParams(max_tokens=120, temperature=1.0, seed=seed,
                                                                 constraint=constraint))[0]
        content, calls, _ = _parse(fmt.parser, [result.text])
        assert content == "" and len(calls) == 1, result.text
        (called, arguments), = calls
        assert called in declared and (choice == "required" or called == choice)
        jsonschema.validate(arguments, declared[called])


def test_generic_format_describes_tools_and_rewrites_history():
    fmt = TOOL_FORMATS["generic"]
    request = ToolRequest((WEATHER,), "auto")
    messages = fmt.messages([
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "cold"}, {"role": "assistant", "content": "It is cold."}],
        request)
    assert messages[0]["role"] == "system" and messages[0]["content"].startswith("Be brief.")
    assert '"get_weather"' in messages[0]["content"] and '{"response": "<your answer>"}' in messages[0]["content"]
    assert json.loads(messages[2]["content"]) == {"tool_call": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
    assert messages[3] == {"role": "user", "content": json.dumps({"tool_response": {"tool_call_id": "c1",
                                                                                    "content": "cold"}})}
    assert json.loads(messages[4]["content"]) == {"response": "It is cold."}
    assert TOOL_FORMATS["hermes"].constraint(request) is None  # auto, nothing strict: the model is free

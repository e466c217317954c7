"""Tool calling: how each kind of model writes a call, the constraint that enforces it, and the
parsers that turn the model's text back into content and `ToolCall`s, whole or while streaming.

Formats (`TOOL_FORMATS`, chosen from the chat template by `tool_format`):

- "hermes" (Hermes, Qwen2.5, Qwen3): the template lists the tools; the model writes
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block per call;
- "llama3_json" (Llama 3.1+): the template lists the tools; the model answers with
  `{"name": ..., "parameters": {...}}` (after `<|python_tag|>` sometimes);
- "generic" (templates without tool syntax, such as SmolLM2's; llama.cpp's "Generic"): a
  system message describes the tools, and the answer is constrained to one JSON object,
  `{"tool_call": {"name", "arguments"}}` (or `{"tool_calls": [...]}` with parallel calls) or
  `{"response": "..."}`.

`tool_choice` "required", a named function and strict tools are enforced with a constraint
(engine/grammar.py); "auto" with no strict tool leaves hermes and llama3 models free. Plain Python.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from engine.grammar import closed_objects
from frontend.tool_parsers import GenericParser, HermesParser, Llama3Parser, ToolParser
from engine.request import Constraint


@dataclass(frozen=True, slots=True)
class ToolRequest:
    """What the client asked: the tools (OpenAI's `{"type": "function", "function": {...}}` dicts),
    the choice ("auto", "required", or a function's name; "none" means no ToolRequest) and whether
    several calls may come in one answer (None: not said; the format's default)."""

    tools: tuple[dict, ...]
    choice: str = "auto"
    parallel: bool | None = None

    @property
    def functions(self) -> list[dict]:
        chosen = [t["function"] for t in self.tools]
        if self.choice not in ("auto", "required"):
            chosen = [f for f in chosen if f["name"] == self.choice]
        return chosen

    @property
    def strict(self) -> bool:
        return any(f.get("strict") for f in self.functions)

    @property
    def forced(self) -> bool:
        """A call must come: "required" or a named function."""
        return self.choice != "auto"


def _declared_parameters(function: dict) -> dict:
    return function.get("parameters") or {"type": "object", "properties": {}}


def _parameters(function: dict) -> dict:
    """The arguments' schema for the constraint: its objects closed where it does not say (only the
    declared keys, engine/grammar.closed_objects); the prompt shows the schema as declared."""
    return closed_objects(_declared_parameters(function))


def _call_schema(function: dict, arguments_key: str = "arguments") -> dict:
    return {"type": "object", "properties": {"name": {"const": function["name"]},
                                             arguments_key: _parameters(function)},
            "required": ["name", arguments_key], "additionalProperties": False}


def _any_of(schemas: list[dict]) -> dict:
    return schemas[0] if len(schemas) == 1 else {"anyOf": schemas}


def _compact(schema: dict) -> dict:
    """The schema with llguidance told to write JSON without optional whitespace."""
    return {**schema, "x-guidance": {"whitespace_flexible": False}}


def _template_call(call: dict) -> dict:
    """An OpenAI tool call for a chat template: arguments as an object (the HF convention)."""
    function = dict(call.get("function") or {})
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            function["arguments"] = json.loads(arguments)
        except ValueError:
            pass  # left as the text the client sent
    return {"id": call.get("id"), "type": "function", "function": function}


def _token_or_text(tokenizer, tag: str) -> str:
    """A tag in Lark: the token `<tag>` when the vocabulary has it as one token, else its text."""
    if tokenizer is not None and len(tokenizer.encode(tag, add_special_tokens=False)) == 1:
        return tag
    return json.dumps(tag)


class ToolFormat:
    """How one family of models is told about tools and writes its calls."""

    name = ""
    parser = ToolParser
    passes_tools = True  # the chat template takes `tools=` and lists them itself

    def messages(self, messages: list[dict], request: ToolRequest | None) -> list[dict]:
        """The conversation for the template (assistant calls with object arguments)."""
        out = []
        for m in messages:
            m = dict(m)
            if m.get("tool_calls"):
                m["tool_calls"] = [_template_call(c) for c in m["tool_calls"]]
            out.append(m)
        return out

    def constraint(self, request: ToolRequest, tokenizer=None) -> Constraint | None:
        raise NotImplementedError


class HermesFormat(ToolFormat):
    name = "hermes"
    parser = HermesParser

    def constraint(self, request: ToolRequest, tokenizer=None) -> Constraint | None:
        if not (request.forced or request.strict):
            return None
        start, end = (_token_or_text(tokenizer, t) for t in (HermesParser.START, HermesParser.END))
        schema = _compact(_any_of([_call_schema(f) for f in request.functions]))
        calls = "call" if request.parallel is False else 'call ("\\n" call)*'  # parallel unless told not
        top = calls if request.forced else f"TEXT | {calls}"
        lark = (f"start: {top}\nTEXT: /[^<](.|\\n)*/\n"
                f'call: {start} "\\n" %json {json.dumps(schema)} "\\n" {end}\n')
        return Constraint("grammar", lark, strict=request.strict)


class Llama3Format(ToolFormat):
    name = "llama3_json"
    parser = Llama3Parser

    def constraint(self, request: ToolRequest, tokenizer=None) -> Constraint | None:
        if not (request.forced or request.strict):
            return None
        schema = _compact(_any_of([_call_schema(f, "parameters") for f in request.functions]))
        if request.forced:
            return Constraint.json_schema(schema, strict=request.strict)
        lark = f"start: TEXT | call\nTEXT: /[^{{](.|\\n)*/\ncall: %json {json.dumps(schema)}\n"
        return Constraint("grammar", lark, strict=request.strict)


class GenericFormat(ToolFormat):
    """Several calls in one reply only with `parallel_tool_calls: true` said: a small model given a
    list goes on repeating its call until max_tokens."""

    name = "generic"
    parser = GenericParser
    passes_tools = False

    def _parallel(self, request: ToolRequest | None) -> bool:
        return request is not None and request.parallel is True

    def _call_key(self, request: ToolRequest) -> str:
        return "tool_calls" if self._parallel(request) else "tool_call"

    def messages(self, messages: list[dict], request: ToolRequest | None) -> list[dict]:
        """The tools described in the system message; calls and results written as the JSON the model
        answers with (a template with no tool syntax knows only text)."""
        out = []
        for m in messages:
            if m["role"] == "assistant" and m.get("tool_calls"):
                calls = [{"name": c["function"]["name"], "arguments": _template_call(c)["function"].get("arguments")}
                         for c in m["tool_calls"]]
                body = {"tool_calls": calls} if len(calls) > 1 or self._parallel(request) else {"tool_call": calls[0]}
                out.append({"role": "assistant", "content": json.dumps(body, ensure_ascii=False)})
            elif m["role"] == "assistant" and request is not None:
                out.append({"role": "assistant", "content": json.dumps({"response": m.get("content") or ""},
                                                                      ensure_ascii=False)})
            elif m["role"] == "tool":
                result = {"tool_response": {"tool_call_id": m.get("tool_call_id"), "content": m.get("content") or ""}}
                out.append({"role": "user", "content": json.dumps(result, ensure_ascii=False)})
            else:
                out.append({"role": m["role"], "content": m.get("content") or ""})
        if request is None:
            return out
        system = self._system_text(request)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{system}"}
        else:
            out.insert(0, {"role": "system", "content": system})
        return out

    def _system_text(self, request: ToolRequest) -> str:
        tools = "\n".join(json.dumps({"name": f["name"], "description": f.get("description", ""),
                                      "parameters": _declared_parameters(f)}, ensure_ascii=False)
                          for f in request.functions)
        key = self._call_key(request)
        call = '{"name": <tool name>, "arguments": <arguments object>}'
        shape = f'{{"{key}": [{call}, ...]}}' if self._parallel(request) else f'{{"{key}": {call}}}'
        how = f"To call a tool, answer with {shape}."
        if not request.forced:
            how += ' To answer the user directly, answer with {"response": "<your answer>"}.'
        return f"You can use these tools:\n{tools}\n\nReply with one JSON object only. {how}"

    def constraint(self, request: ToolRequest, tokenizer=None) -> Constraint | None:
        call = _any_of([_call_schema(f) for f in request.functions])
        key = self._call_key(request)
        value = {"type": "array", "items": call, "minItems": 1} if self._parallel(request) else call
        calls = {"type": "object", "properties": {key: value}, "required": [key], "additionalProperties": False}
        if request.forced:
            return Constraint.json_schema(_compact(calls), strict=request.strict)
        response = {"type": "object", "properties": {"response": {"type": "string"}}, "required": ["response"],
                    "additionalProperties": False}
        return Constraint.json_schema(_compact({"anyOf": [response, calls]}), strict=request.strict)


TOOL_FORMATS: dict[str, ToolFormat] = {f.name: f for f in (HermesFormat(), Llama3Format(), GenericFormat())}


def tool_format(tokenizer) -> ToolFormat:
    """The format of this model's chat template: hermes, llama3_json, or generic (no tool syntax)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):
        template = " ".join(str(t) for t in template.values())
    if "<tool_call>" in template:
        return TOOL_FORMATS["hermes"]
    if "<|python_tag|>" in template or ("ipython" in template and "tools" in template):
        return TOOL_FORMATS["llama3_json"]
    return TOOL_FORMATS["generic"]

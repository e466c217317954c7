"""Request bodies at the HTTP edge (pydantic): `/chat` and the OpenAI-compatible `/v1` routes.

A field is checked once: here where the API's own rule differs from the engine's (OpenAI's
temperature up to 2, `top_k` -1 for off, /chat's seed from 0) or where the edge needs it first (`n`
for the answer budget); the sampling ranges and stop strings by `SamplingParams` (a 400 naming the
field, in the API's own name: frontend/request.py).
"""

from __future__ import annotations

import re
from itertools import accumulate
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from engine.chat_template import TAKEN_TEMPLATE_NAMES, taken_names_message
from engine.request import (MAX_CACHE_SALT_CHARS, MAX_N, MAX_STOP_TOKEN_IDS,
                            Constraint, InvalidRequest, stop_token_ids_message)
from frontend.errors import ApiError
from frontend.tools import ToolRequest

Role = Literal["system", "user", "assistant"]
MAX_PROMPTS = 64  # prompts in one `/v1/completions` list
MAX_TOOLS = 128  # functions in one request's `tools`
MAX_TEMPLATE_KWARGS = 16  # entries of `chat_template_kwargs`
# JSON nesting (objects and arrays) of one schema or call's arguments. The routes walk them recursively on the
# event loop; llguidance's grammar parser stops near 125 levels (serde_json's 128, its wrapping included) and
# OpenAI's strict schemas at 10 levels of objects (about 20 of JSON), so 64 refuses nothing a model can follow.
MAX_SCHEMA_DEPTH = 64
# Token entries one answer may hold: choices x max_tokens x (1 + alternatives per token), past one choice of the
# whole context with 20 alternatives (always allowed). A token entry is about 70 bytes of JSON (measured on
# /v1/chat/completions), so this is ~18 MB; n=16 x top_logprobs 20 x an 8k context is 2.75 M entries, ~190 MB.
MAX_ANSWER_ENTRIES = 2**18
MAX_LOGPROB_ALTERNATIVES = 20
CACHE_SALT_DOC = ("the prefix cache shares blocks only between requests with the same salt (vLLM's "
                  "`cache_salt`): a private salt keeps other clients from learning whether this prompt is cached")


def json_depth(value: Any) -> int:
    """How deeply a parsed JSON value nests objects and arrays ({} and [] are 1, a scalar 0), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return deepest


# a JSON string, or an unclosed one to the end of the text (so that no quote is ever scanned from twice)
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*+"?', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_BRACKET_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}


def json_text_depth(text: str) -> int:
    """The same depth of JSON text (its brackets outside strings), without parsing it; text with few
    brackets is not scanned, their count (a bound on the depth within the limit) stands for it."""
    opening = text.count("[") + text.count("{")
    if opening <= MAX_SCHEMA_DEPTH:
        return opening
    brackets = _NOT_BRACKET.sub("", _JSON_STRING.sub("", text))
    return max(accumulate(map(_BRACKET_STEP.__getitem__, brackets)), default=0)


def check_depth(value: Any, where: str) -> None:
    """A 400 naming `where` when a schema (or a call's arguments, as text) nests past MAX_SCHEMA_DEPTH.
    Raised as an ApiError, which pydantic lets through: its own error would repr the whole value."""
    depth = json_text_depth(value) if isinstance(value, str) else json_depth(value)
    if depth > MAX_SCHEMA_DEPTH:
        raise ApiError(400, f"`{where}` nests objects and arrays {depth} levels deep; at most {MAX_SCHEMA_DEPTH} "
                            f"levels are allowed. Given: {depth} levels.", param=where)


def check_answer_budget(n: int, max_tokens: int | None, room: int, alternatives: int, *, prompts: int = 1,
                        max_tokens_field: str = "max_tokens", alternatives_field: str = "top_logprobs") -> None:
    """A 400 when one answer could hold more token entries than MAX_ANSWER_ENTRIES (or one choice of the
    whole context, `room` tokens, with 20 alternatives each, if that is more). `max_tokens` counts up to `room`
    (unset: `room`); past it the engine refuses the request for the context."""
    tokens = room if max_tokens is None else min(max_tokens, room)
    entries = n * prompts * tokens * (1 + alternatives)
    allowed = max(MAX_ANSWER_ENTRIES, room * (1 + MAX_LOGPROB_ALTERNATIVES))
    if entries <= allowed:
        return
    names = ["`n`"] + (["prompts"] if prompts > 1 else []) + [f"`{max_tokens_field}`", f"(1 + `{alternatives_field}`)"]
    values = [str(n)] + ([str(prompts)] if prompts > 1 else []) + [str(tokens), str(1 + alternatives)]
    given = [f"n={n}"] + ([f"prompts={prompts}"] if prompts > 1 else [])
    if max_tokens is None:
        given.append(f"{max_tokens_field} unset (up to the context left: {room})")
    else:
        past = f" (the context leaves {room})" if max_tokens > room else ""
        given.append(f"{max_tokens_field}={max_tokens}{past}")
    given.append(f"{alternatives_field}={alternatives}" if alternatives else f"{alternatives_field} unset")
    raise InvalidRequest(f"One answer would be too large: {' x '.join(names)} = {' x '.join(values)} = {entries:,} "
                         f"token entries, which exceeds this server's answer budget of {allowed:,} (one choice of the "
                         f"whole context with {MAX_LOGPROB_ALTERNATIVES} alternatives each always fits). Lower one of "
                         f"them. Given: {', '.join(given)}.", max_tokens_field)


class JsonSchemaFormat(BaseModel):
    """`response_format.json_schema`: OpenAI's {name, description, schema, strict}."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str = Field("response", max_length=64)
    description: str | None = None
    schema_: dict | bool = Field(..., alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """`response_format`: {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "json_schema": {...}}."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_when_asked(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError('`response_format` of type "json_schema" needs a `json_schema` object '
                             "with the schema: {\"name\": ..., \"schema\": {...}, \"strict\": true}")
        return self

    def constraint(self) -> Constraint | None:
        if self.type == "json_object":
            return Constraint("json_object")
        if self.type == "json_schema":
            return Constraint.json_schema(self.json_schema.schema_, strict=bool(self.json_schema.strict))
        return None


def _template_kwargs(value: dict | None) -> dict | None:
    if value is None:
        return None
    if len(value) > MAX_TEMPLATE_KWARGS:
        raise ValueError(f"at most {MAX_TEMPLATE_KWARGS} entries are allowed. Given: {len(value)}")
    taken = sorted(set(value) & TAKEN_TEMPLATE_NAMES)
    if taken:
        raise ValueError(taken_names_message(taken))
    return value


class _ConstraintFields(BaseModel):
    """Constrained output (engine/grammar.py) and the template's own switches; one constraint at most."""

    response_format: ResponseFormat | None = None
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="extra variables for the chat template, "
                                                        "e.g. {\"enable_thinking\": false}")
    max_reasoning_tokens: int | None = Field(None, ge=0, description="a thinking model's thought is closed after this "
                                             "many tokens")

    @field_validator("chat_template_kwargs")
    @classmethod
    def _check_template_kwargs(cls, value):
        return _template_kwargs(value)

    @model_validator(mode="after")
    def _bounded_schema(self):
        if self.response_format is not None and self.response_format.json_schema is not None:
            check_depth(self.response_format.json_schema.schema_, "response_format.json_schema.schema")
        return self

    def constraint(self) -> Constraint | None:
        return self.response_format.constraint() if self.response_format is not None else None


class ChatMessage(BaseModel):
    """One turn of a conversation for `/chat`."""

    model_config = ConfigDict(extra="forbid")
    role: Role
    content: str


def stop_list(value: str | list[str] | None) -> list[str]:
    """A body's `stop` as a list (its count and lengths are checked once, by `SamplingParams`)."""
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


class ChatBody(_ConstraintFields):
    """`POST /chat`: the seed's `{"prompt", "stream", "max_new_tokens", "temperature"}`, extended."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    model: str | None = Field(None, description="the model to answer (GET /v1/models); unset: the default")
    prompt: str | None = Field(None, description="one user message (sent through the chat template unless `raw`)")
    messages: list[ChatMessage] | None = Field(None, description="a whole conversation instead of `prompt`")
    system: str | None = Field(None, description="a system message put before the conversation")
    raw: bool = Field(False, description="send `prompt` to the model as is, without the chat template")
    images: list[str] | None = Field(None, description="data: URLs of images put before the last message's text "
                                                       "(a vision-language model)")
    stream: bool = True
    max_new_tokens: int | None = Field(None, ge=1, description="new tokens at most (default 512)")
    # unset: the model's generation config (or model card), else 0.7, 1.0, 0 and 1.0
    temperature: float | None = Field(None, description="0 = greedy; unset: the model's default")
    top_p: float | None = None
    top_k: int | None = Field(None, description="0 = off")
    repetition_penalty: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    ignore_eos: bool = Field(False, description="go on past the end-of-sequence token, up to max_new_tokens")
    regex: str | None = Field(None, description="the reply must match this regular expression (Rust regex syntax)")
    grammar: str | None = Field(None, description="the reply must match this Lark grammar (llguidance's dialect)")
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_CACHE_SALT_CHARS, description=CACHE_SALT_DOC)

    def constraint(self) -> Constraint | None:
        if self.regex is not None:
            return Constraint("regex", self.regex)
        if self.grammar is not None:
            return Constraint("grammar", self.grammar)
        return super().constraint()

    @model_validator(mode="after")
    def _one_constraint(self):
        given = [name for name in ("response_format", "regex", "grammar") if getattr(self, name) is not None]
        if len(given) > 1:
            raise ValueError(f"give at most one of `response_format`, `regex` or `grammar`. Given: {', '.join(given)}")
        return self

    @model_validator(mode="after")
    def _prompt_or_messages(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of `prompt` (a string) or `messages` (a list of {role, content})")
        if self.messages is not None and not self.messages:
            raise ValueError("`messages` must hold at least one message")
        if self.raw and self.prompt is None:
            raise ValueError("`raw` applies to `prompt` only")
        if self.raw and self.images:
            raise ValueError("`images` cannot be combined with `raw` (images go through the chat template)")
        if self.raw and self.system is not None:
            raise ValueError("`system` cannot be combined with `raw` (no chat template is applied)")
        return self

    def stop_list(self) -> list[str]:
        return stop_list(self.stop)


# --------------------------------------------------------------------------- OpenAI


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text"]
    text: str


class ImageUrl(BaseModel):
    model_config = ConfigDict(extra="allow")
    url: str  # data:image/...;base64,... (or an http(s) URL from --allowed-media-domains)
    detail: str | None = None


class ImageUrlPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["image_url"]
    image_url: ImageUrl


class FunctionCallIn(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    arguments: str = "{}"  # JSON text, as OpenAI sends it


class ToolCallIn(BaseModel):
    """An earlier assistant message's tool call, sent back in the conversation."""

    model_config = ConfigDict(extra="ignore")
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class OpenAIMessage(BaseModel):
    """A chat message as OpenAI clients send it (content may be a list of text parts)."""

    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[Annotated[TextPart | ImageUrlPart, Field(discriminator="type")]] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # assistant messages (content may then be null)
    tool_call_id: str | None = None  # tool messages: the call this is the result of

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content if part.type == "text")

    def template_message(self, role: str) -> dict:
        """The message as chat templates take it; with images, its parts as frontend/images.py takes them."""
        message = {"role": role, "content": self.text()}
        if isinstance(self.content, list) and any(part.type == "image_url" for part in self.content):
            message["content"] = [{"type": "text", "text": part.text} if part.type == "text" else
                                  {"type": "image_url", "url": part.image_url.url} for part in self.content]
        if self.tool_calls:
            message["content"] = self.text() or None
            message["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None and self.role == "tool":
            message["name"] = self.name
        return message


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(..., pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments
    strict: bool | None = None  # the arguments are enforced exactly by the grammar


class ToolDef(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: FunctionDef


class _NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: _NamedFunction


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class SamplingFields(_ConstraintFields):
    """The sampling settings both OpenAI routes share, with the common extensions."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)
    model: str | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = None
    n: int = Field(1, ge=1, le=MAX_N)  # here too: the answer budget counts it before the engine sees it
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # extensions (vLLM, TGI)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = None  # unset: the model's, else rill's
    repetition_penalty: float | None = None  # unset: the model's, else rill's
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_CACHE_SALT_CHARS, description=CACHE_SALT_DOC)

    @field_validator("stop_token_ids", mode="before")
    @classmethod
    def _check_stop_token_ids(cls, value):
        if isinstance(value, list) and len(value) > MAX_STOP_TOKEN_IDS:  # before 100,000 ids are validated
            raise ValueError(stop_token_ids_message(len(value)).split("` ", 1)[1])
        return value

    def stop_list(self) -> list[str]:
        return stop_list(self.stop)


def check_tool_choice(names: list[str], choice, named: str | None, format_given: bool, *, required: str = "required",
                      format_field: str = "response_format") -> None:
    """The tool rules of every API (/v1/chat/completions, /v1/responses, /v1/messages), each in its own
    words (`required`: its name of a forced call; `format_field`: its structured-output field)."""
    if len(set(names)) != len(names):
        raise ValueError(f"`tools` must have distinct function names. Given: {names}")
    if choice == required and not names:
        raise ValueError(f'`tool_choice` "{required}" needs `tools`')
    if named is not None and named not in names:
        raise ValueError(f"`tool_choice` names the function `{named}`, which is not in `tools`. Given tools: {names}")
    if names and choice != "none" and format_given:
        raise ValueError(f"`{format_field}` cannot be combined with `tools` here (unless `tool_choice` is "
                         '"none"): the tools decide the format of the reply')


class ChatCompletionRequest(SamplingFields):
    """`POST /v1/chat/completions`."""

    messages: list[OpenAIMessage] = Field(..., min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[ToolDef] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # None: the format's default (frontend/tools.py)

    @model_validator(mode="after")
    def _check_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("`top_logprobs` needs `logprobs: true`")
        return self

    @model_validator(mode="after")
    def _check_tools(self):
        for i, tool in enumerate(self.tools or ()):
            check_depth(tool.function.parameters, f"tools.{i}.function.parameters")
        for i, message in enumerate(self.messages):
            for j, call in enumerate(message.tool_calls or ()):
                check_depth(call.function.arguments, f"messages.{i}.tool_calls.{j}.function.arguments")
        choice = self.tool_choice
        check_tool_choice([t.function.name for t in self.tools or ()], choice,
                          choice.function.name if isinstance(choice, NamedToolChoice) else None,
                          self.response_format is not None and self.response_format.type != "text")
        return self

    def check_answer_budget(self, room: int) -> None:
        """The 400 of an answer too large (see `check_answer_budget`); `room`: the most tokens one answer can have."""
        field = "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"
        check_answer_budget(self.n, self.max_completion_tokens or self.max_tokens, room,
                            (self.top_logprobs or 0) if self.logprobs else 0, max_tokens_field=field)

    def tool_request(self) -> ToolRequest | None:
        """The tools the model may call, or None (no tools, or tool_choice "none")."""
        if not self.tools or self.tool_choice == "none":
            return None
        choice = self.tool_choice
        name = choice.function.name if isinstance(choice, NamedToolChoice) else (choice or "auto")
        return ToolRequest(tuple(t.model_dump(exclude_none=True) for t in self.tools), name,
                           self.parallel_tool_calls)


PromptType = str | list[str] | list[Annotated[int, Field(ge=0)]] | list[list[Annotated[int, Field(ge=0)]]]


class CompletionRequest(SamplingFields):
    """`POST /v1/completions`."""

    prompt: PromptType
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=16)

    @model_validator(mode="after")
    def _check(self):
        if self.echo:
            raise ValueError("`echo` is not supported by this server")
        if self.suffix:
            raise ValueError("`suffix` is not supported by this server")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"`best_of` must equal `n` ({self.n}) on this server. Given: {self.best_of}")
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("`prompt` must not be an empty list")
        num_prompts = len(self.prompts())
        if num_prompts > MAX_PROMPTS:
            raise ValueError(f"`prompt` may hold at most {MAX_PROMPTS} prompts in one request. "
                             f"Given: {num_prompts} prompts")
        return self

    def check_answer_budget(self, room: int) -> None:
        check_answer_budget(self.n, self.max_tokens, room, self.logprobs or 0, prompts=len(self.prompts()),
                            alternatives_field="logprobs")

    def prompts(self) -> list[Any]:
        """The prompts as a list: strings or token id lists."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [p]
        return list(p)

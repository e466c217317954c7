"""Request bodies of `POST /v1/responses` (OpenAI's Responses API), with their limits.

Unknown top-level fields are refused (400); input items keep only what the conversation needs
(the ids and statuses a client sends back with earlier output items are ignored).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator, model_validator

from engine.request import MAX_CACHE_SALT_CHARS, Constraint
from frontend.tools import ToolRequest
from frontend.request import Sampling
from server.schemas import (CACHE_SALT_DOC, MAX_TOOLS, _template_kwargs, check_depth,
                            check_tool_choice)

MAX_INPUT_ITEMS = 2048  # items in one request's `input`
MAX_METADATA = 16  # OpenAI's bound on `metadata` entries


class TextPart(BaseModel):
    """A message's text: `input_text` (the client's), `output_text` (an earlier answer sent back)."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["input_text", "output_text", "text"]
    text: str


class ImagePart(BaseModel):
    """`input_image`: an image for a vision-language model (a data: URL, or an --allowed-media-domains URL)."""

    model_config = ConfigDict(extra="ignore")  # detail
    type: Literal["input_image"]
    image_url: str


class MessageItem(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[Annotated[TextPart | ImagePart, Field(discriminator="type")]]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content
                                                                           if p.type != "input_image")

    def template_content(self) -> str | list[dict]:
        """The content as chat templates take it; with images, its parts as frontend/images.py takes them."""
        if isinstance(self.content, str) or all(p.type != "input_image" for p in self.content):
            return self.text()
        return [{"type": "image_url", "url": p.image_url} if p.type == "input_image" else {"type": "text", "text": p.text}
                for p in self.content]


class FunctionCallItem(BaseModel):
    """An earlier call of the model's, sent back with its result."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["function_call"]
    call_id: str = Field(..., min_length=1, max_length=128)
    name: str = Field(..., min_length=1, max_length=64)
    arguments: str


class FunctionCallOutputItem(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function_call_output"]
    call_id: str = Field(..., min_length=1, max_length=128)
    output: str | list[TextPart]

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


class ReasoningItem(BaseModel):
    """An earlier thought sent back: accepted, and left out of the prompt (as chat templates do)."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["reasoning"]


def _item_kind(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("type", "message")  # {"role", "content"} alone is a message
    return getattr(value, "type", None)


InputItem = Annotated[Union[Annotated[MessageItem, Tag("message")], Annotated[FunctionCallItem, Tag("function_call")],
                            Annotated[FunctionCallOutputItem, Tag("function_call_output")],
                            Annotated[ReasoningItem, Tag("reasoning")]], Discriminator(_item_kind)]


class FunctionTool(BaseModel):
    """`{"type": "function", "name", "description", "parameters", "strict"}` (the Responses API's flat form)."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    name: str = Field(..., pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def chat_tool(self) -> dict:
        """The tool as the chat path takes it (OpenAI chat's nested form)."""
        return {"type": "function", "function": self.model_dump(exclude={"type"}, exclude_none=True)}


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    """`text.format`: {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "name", "schema", "strict"}."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, max_length=64)
    description: str | None = None
    schema_: dict | bool | None = Field(None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_when_asked(self):
        if self.type == "json_schema" and (self.schema_ is None or not self.name):
            raise ValueError('`text.format` of type "json_schema" needs a `name` and a `schema`: '
                             '{"type": "json_schema", "name": ..., "schema": {...}, "strict": true}')
        return self


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(BaseModel):
    """`POST /v1/responses`."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    model: str | None = None
    input: str | list[InputItem] = Field(..., description="a user message, or a list of items")
    instructions: str | None = None
    tools: list[FunctionTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["auto", "none", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = None
    previous_response_id: str | None = Field(None, max_length=128)
    store: bool = True
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    include: list[str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    background: bool = False
    # extensions (as on /v1/chat/completions)
    top_k: int | None = Field(None, ge=-1)
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_CACHE_SALT_CHARS, description=CACHE_SALT_DOC)
    max_reasoning_tokens: int | None = Field(None, ge=0, description="a thinking model's thought is closed after "
                                             "this many tokens")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="extra variables for the chat template")

    @field_validator("chat_template_kwargs")
    @classmethod
    def _check_template_kwargs(cls, value):
        return _template_kwargs(value)

    @field_validator("input")
    @classmethod
    def _bounded_input(cls, value):
        if isinstance(value, list) and not value:
            raise ValueError("`input` must hold at least one item")
        if isinstance(value, list) and len(value) > MAX_INPUT_ITEMS:
            raise ValueError(f"at most {MAX_INPUT_ITEMS} items are allowed. Given: {len(value)}")
        return value

    @field_validator("metadata")
    @classmethod
    def _bounded_metadata(cls, value):
        if value is not None and len(value) > MAX_METADATA:
            raise ValueError(f"at most {MAX_METADATA} entries are allowed. Given: {len(value)}")
        return value

    @model_validator(mode="after")
    def _check(self):
        if self.background:
            raise ValueError("`background: true` is not supported by this server; stream instead")
        for i, tool in enumerate(self.tools or ()):
            check_depth(tool.parameters, f"tools.{i}.parameters")
        if self.text is not None and self.text.format is not None:
            check_depth(self.text.format.schema_, "text.format.schema")
        for i, item in enumerate(self.input if isinstance(self.input, list) else ()):
            if isinstance(item, FunctionCallItem):
                check_depth(item.arguments, f"input.{i}.arguments")
        choice = self.tool_choice
        check_tool_choice([t.name for t in self.tools or ()], choice,
                          choice.name if isinstance(choice, NamedFunction) else None,
                          self.format_type() not in (None, "text"), format_field="text.format")
        return self

    def format_type(self) -> str | None:
        return self.text.format.type if self.text is not None and self.text.format is not None else None

    def tool_request(self) -> ToolRequest | None:
        if not self.tools or self.tool_choice == "none":
            return None
        choice = self.tool_choice
        name = choice.name if isinstance(choice, NamedFunction) else (choice or "auto")
        return ToolRequest(tuple(t.chat_tool() for t in self.tools), name, self.parallel_tool_calls)

    def constraint(self) -> Constraint | None:
        kind = self.format_type()
        if kind == "json_object":
            return Constraint("json_object")
        if kind == "json_schema":
            return Constraint.json_schema(self.text.format.schema_, strict=bool(self.text.format.strict))
        return None

    def sampling(self) -> Sampling:
        return Sampling(temperature=self.temperature, top_p=self.top_p, top_k=0 if self.top_k == -1 else self.top_k,
                        seed=self.seed,
                        max_reasoning_tokens=self.max_reasoning_tokens, cache_salt=self.cache_salt)

    def template_kwargs(self) -> dict | None:
        """`chat_template_kwargs`, with `reasoning.effort: "none"` as `enable_thinking: false` unless it says."""
        kwargs = dict(self.chat_template_kwargs or {})
        if self.reasoning is not None and self.reasoning.effort == "none":
            kwargs.setdefault("enable_thinking", False)
        return kwargs or None

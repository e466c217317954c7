"""Request bodies of `POST /v1/messages` and `POST /v1/messages/count_tokens` (Anthropic's Messages
API), with their limits; unknown top-level fields are refused (400, in Anthropic's error shape)."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from engine.request import MAX_CACHE_SALT_CHARS, Constraint
from frontend.tools import ToolRequest
from frontend.request import Sampling
from server.schemas import (CACHE_SALT_DOC, MAX_TOOLS, check_depth,
                            check_tool_choice)

MAX_MESSAGES = 2048


class TextBlock(BaseModel):
    model_config = ConfigDict(extra="ignore")  # cache_control, citations
    type: Literal["text"]
    text: str


class ToolUseBlock(BaseModel):
    """An earlier call of the model's (assistant turns)."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["tool_use"]
    id: str = Field(..., min_length=1, max_length=128)
    name: str = Field(..., min_length=1, max_length=64)
    input: dict[str, Any]


class ToolResultBlock(BaseModel):
    """A call's result (user turns)."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["tool_result"]
    tool_use_id: str = Field(..., min_length=1, max_length=128)
    content: str | list[TextBlock] = ""
    is_error: bool = False

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(b.text for b in self.content)


class ThinkingBlock(BaseModel):
    """An earlier thought sent back: accepted, and left out of the prompt (as chat templates do)."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["thinking", "redacted_thinking"]


class ImageSource(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["base64", "url"]
    media_type: str | None = None  # base64: image/png, image/jpeg, image/webp, image/gif
    data: str | None = None  # base64
    url: str | None = None  # url: fetched only from --allowed-media-domains

    @model_validator(mode="after")
    def _data_or_url(self):
        if (self.data if self.type == "base64" else self.url) is None:
            raise ValueError(f"an image source of type {self.type!r} needs `{'data' if self.type == 'base64' else 'url'}`")
        return self


class ImageBlock(BaseModel):
    """An image for a vision-language model (user turns)."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["image"]
    source: ImageSource

    def part(self) -> dict:
        """The image as frontend/images.py takes it."""
        if self.source.type == "base64":
            return {"type": "image_base64", "data": self.source.data, "media_type": self.source.media_type}
        return {"type": "image_url", "url": self.source.url}


ContentBlock = Annotated[Union[TextBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock, ImageBlock],
                         Field(discriminator="type")]


class AnthropicMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]

    @model_validator(mode="after")
    def _blocks_fit_the_role(self):
        if isinstance(self.content, list):
            wrong = {"user": "tool_use", "assistant": "tool_result"}[self.role]
            if any(b.type == wrong for b in self.content):
                raise ValueError(f"a {self.role} message cannot hold `{wrong}` blocks "
                                 f"(tool_use: assistant turns; tool_result: user turns)")
        return self


class AnthropicTool(BaseModel):
    model_config = ConfigDict(extra="ignore")  # cache_control
    type: Literal["custom"] | None = None
    name: str = Field(..., pattern=r"^[A-Za-z0-9_\-]{1,64}$")
    description: str | None = None
    input_schema: dict[str, Any]

    @field_validator("input_schema")
    @classmethod
    def _object_schema(cls, value):
        if value.get("type") != "object":
            raise ValueError('must be the JSON schema of an object: {"type": "object", "properties": {...}}')
        return value

    def chat_tool(self) -> dict:
        function = {"name": self.name, "parameters": self.input_schema}
        if self.description is not None:
            function["description"] = self.description
        return {"type": "function", "function": function}


class ToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _name_for_tool(self):
        if (self.type == "tool") != (self.name is not None):
            raise ValueError('`tool_choice` names a tool with type "tool" only: {"type": "tool", "name": ...}')
        return self


class ThinkingConfig(BaseModel):
    """"enabled" (the thought closed after `budget_tokens`), "disabled", "adaptive" (the template's default)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(None, ge=1)
    display: Literal["summarized", "omitted"] | None = None

    @model_validator(mode="after")
    def _budget_when_enabled(self):
        if self.type == "enabled" and self.budget_tokens is None:
            raise ValueError('`thinking` of type "enabled" needs `budget_tokens`')
        return self


class OutputFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(..., alias="schema")


class OutputConfig(BaseModel):
    """`output_config`: `format` constrains the answer to a JSON schema; `effort` is accepted and ignored."""

    model_config = ConfigDict(extra="forbid")
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: OutputFormat | None = None


class CountTokensRequest(BaseModel):
    """`POST /v1/messages/count_tokens`: the conversation alone."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    model: str | None = None
    messages: list[AnthropicMessage] = Field(..., min_length=1, max_length=MAX_MESSAGES)
    system: str | list[TextBlock] | None = None
    tools: list[AnthropicTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None

    @model_validator(mode="after")
    def _check_tools(self):
        for i, tool in enumerate(self.tools or ()):
            check_depth(tool.input_schema, f"tools.{i}.input_schema")
        if self.output_config is not None and self.output_config.format is not None:
            check_depth(self.output_config.format.schema_, "output_config.format.schema")
        for i, message in enumerate(self.messages):
            for j, block in enumerate(message.content if isinstance(message.content, list) else ()):
                if isinstance(block, ToolUseBlock):
                    check_depth(block.input, f"messages.{i}.content.{j}.input")
        choice = self.tool_choice
        check_tool_choice([t.name for t in self.tools or ()], choice.type if choice else None,
                          choice.name if choice else None, self.constraint() is not None, required="any",
                          format_field="output_config.format")
        return self

    def constraint(self) -> Constraint | None:
        fmt = self.output_config.format if self.output_config is not None else None
        return Constraint.json_schema(fmt.schema_, strict=True) if fmt is not None else None

    def tool_request(self) -> ToolRequest | None:
        choice = self.tool_choice or ToolChoice(type="auto")
        if not self.tools or choice.type == "none":
            return None
        name = {"auto": "auto", "any": "required"}.get(choice.type, choice.name)
        parallel = None if choice.disable_parallel_tool_use is None else not choice.disable_parallel_tool_use
        return ToolRequest(tuple(t.chat_tool() for t in self.tools), name, parallel)

    def template_kwargs(self) -> dict | None:
        return {"enable_thinking": False} if self.thinking and self.thinking.type == "disabled" else None

    def chat_messages(self) -> list[dict]:
        """The conversation as chat messages: `system` first, tool_result blocks as tool messages
        (before the rest of their turn), tool_use blocks as the assistant's tool calls."""
        out: list[dict] = []
        if self.system:
            system = self.system if isinstance(self.system, str) else "\n".join(b.text for b in self.system)
            out.append({"role": "system", "content": system})
        names: dict[str, str] = {}
        for m in self.messages:
            if isinstance(m.content, str):
                out.append({"role": m.role, "content": m.content})
                continue
            texts = [b.text for b in m.content if isinstance(b, TextBlock)]
            calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
                     for b in m.content if isinstance(b, ToolUseBlock)]
            names.update((c["id"], c["function"]["name"]) for c in calls)
            for b in m.content:
                if isinstance(b, ToolResultBlock):
                    result = {"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()}
                    if b.tool_use_id in names:
                        result["name"] = names[b.tool_use_id]
                    out.append(result)
            if any(isinstance(b, ImageBlock) for b in m.content) and not calls:  # text and image parts in order
                out.append({"role": m.role, "content": [{"type": "text", "text": b.text} if isinstance(b, TextBlock)
                                                        else b.part() for b in m.content
                                                        if isinstance(b, (TextBlock, ImageBlock))]})
            elif calls:
                out.append({"role": m.role, "content": "".join(texts) or None, "tool_calls": calls})
            elif texts or not any(isinstance(b, ToolResultBlock) for b in m.content):
                out.append({"role": m.role, "content": "".join(texts)})
        return out


class MessagesRequest(CountTokensRequest):
    """`POST /v1/messages`."""

    max_tokens: int = Field(..., ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = None
    top_k: int | None = None
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_CACHE_SALT_CHARS, description=CACHE_SALT_DOC)
    metadata: dict[str, Any] | None = None
    # accepted and ignored (the SDK's fields about Anthropic's own service)
    service_tier: str | None = None
    cache_control: dict[str, Any] | None = None
    container: str | dict[str, Any] | None = None
    inference_geo: str | None = None
    speed: Literal["standard", "fast"] | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None

    def sampling(self) -> Sampling:
        budget = self.thinking.budget_tokens if self.thinking and self.thinking.type == "enabled" else None
        return Sampling(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                        stop=tuple(self.stop_sequences or ()), max_reasoning_tokens=budget, cache_salt=self.cache_salt)

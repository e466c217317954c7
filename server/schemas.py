"""Request bodies at the HTTP edge (pydantic): `/chat` and the OpenAI-compatible `/v1` routes.

Range checks live here so a 400 names the field as the client spelled it; `SamplingParams`
checks again inside the engine.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from engine.request import MAX_N, MAX_STOP_LENGTH, MAX_STOP_STRINGS

Role = Literal["system", "user", "assistant"]
MAX_STOP = MAX_STOP_STRINGS
MAX_PROMPTS = 64  # prompts in one `/v1/completions` list


class ChatMessage(BaseModel):
    """One turn of a conversation for `/chat`."""

    model_config = ConfigDict(extra="forbid")
    role: Role
    content: str


def _stop_list(value: str | list[str] | None) -> list[str]:
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else list(value)
    if len(stops) > MAX_STOP:
        raise ValueError(f"at most {MAX_STOP} stop strings are allowed, {len(stops)} given")
    if any(s == "" for s in stops):
        raise ValueError("stop strings must not be empty")
    for i, s in enumerate(stops):
        if len(s) > MAX_STOP_LENGTH:
            raise ValueError(f"each stop string must be at most {MAX_STOP_LENGTH} characters long; "
                             f"stop string {i} is {len(s)} characters")
    return stops


class ChatBody(BaseModel):
    """`POST /chat`: the seed's `{"prompt", "stream", "max_new_tokens", "temperature"}`, extended."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    prompt: str | None = Field(None, description="one user message (sent through the chat template unless `raw`)")
    messages: list[ChatMessage] | None = Field(None, description="a whole conversation instead of `prompt`")
    system: str | None = Field(None, description="a system message put before the conversation")
    raw: bool = Field(False, description="send `prompt` to the model as is, without the chat template")
    stream: bool = True
    max_new_tokens: int | None = Field(None, ge=1, description="new tokens at most (default 512)")
    temperature: float = Field(0.7, ge=0, le=100, description="0 = greedy")
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0, description="0 = off")
    repetition_penalty: float = Field(1.0, gt=0, le=100)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, le=2**63 - 1)

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value):
        _stop_list(value)
        return value

    @model_validator(mode="after")
    def _prompt_or_messages(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of `prompt` (a string) or `messages` (a list of {role, content})")
        if self.messages is not None and not self.messages:
            raise ValueError("`messages` must hold at least one message")
        if self.raw and self.prompt is None:
            raise ValueError("`raw` applies to `prompt` only")
        if self.raw and self.system is not None:
            raise ValueError("`system` cannot be combined with `raw` (no chat template is applied)")
        return self

    def stop_list(self) -> list[str]:
        return _stop_list(self.stop)


# --------------------------------------------------------------------------- OpenAI


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text"]
    text: str


class OpenAIMessage(BaseModel):
    """A chat message as OpenAI clients send it (content may be a list of text parts)."""

    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _SamplingFields(BaseModel):
    """The sampling settings both OpenAI routes share, with the common extensions."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)
    model: str | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # extensions (vLLM, TGI)
    top_k: int | None = Field(None, ge=-1)
    min_p: float = Field(0.0, ge=0, le=1)
    repetition_penalty: float = Field(1.0, gt=0, le=100)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value):
        _stop_list(value)
        return value

    def stop_list(self) -> list[str]:
        return _stop_list(self.stop)


class ChatCompletionRequest(_SamplingFields):
    """`POST /v1/chat/completions`."""

    messages: list[OpenAIMessage] = Field(..., min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)

    @model_validator(mode="after")
    def _check_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("`top_logprobs` needs `logprobs: true`")
        return self


PromptType = str | list[str] | list[Annotated[int, Field(ge=0)]] | list[list[Annotated[int, Field(ge=0)]]]


class CompletionRequest(_SamplingFields):
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

    def prompts(self) -> list[Any]:
        """The prompts as a list: strings or token id lists."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [p]
        return list(p)

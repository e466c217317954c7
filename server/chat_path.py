"""The one engine path of a conversation, shared by `/v1/chat/completions`, `/v1/responses` and
`/v1/messages`: each route turns its body into a `ChatJob` (OpenAI chat messages, tools, constraint,
sampling settings), and `start_chat` renders it through the model's chat template (with the tool
format the template implies), checks it, compiles the constraint and admits it (400/429/503 before
any response starts). `ReplyBlocks` cuts a reply into the ordered blocks (thought, text, calls) the
block-shaped APIs stream.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from fastapi import Request

from engine.request import Constraint, InvalidRequest, SamplingParams
from frontend.errors import ApiError
from frontend.admission import (Generation, admission, check_prompt_chars, client_of, compile_constraint, off_loop, request_id_from,
                                start_generation)
from frontend.sampling_defaults import SamplingDefaults
from frontend.tool_parsers import ToolCall
from frontend.tools import ToolFormat, ToolRequest, tool_format
from server.openai_choices import Reply
from server.schemas import SamplingFields


def model_defaults(state) -> SamplingDefaults:
    """The sampling the model's generation config asks for (read once at start; empty if none)."""
    return getattr(state, "sampling_defaults", None) or SamplingDefaults()


OPENAI_FALLBACKS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "repetition_penalty": 1.0}  # OpenAI's defaults


def sampling_params(body: SamplingFields, max_tokens: int, logprobs: int | None, constraint=None,
                    reasoning: bool = False, defaults: SamplingDefaults = SamplingDefaults()) -> SamplingParams:
    """The engine's parameters of an OpenAI-style body: unset fields take the model's generation
    config (`defaults`), as vLLM does, else OpenAI's defaults."""
    return SamplingParams(
        max_tokens=max_tokens,
        min_tokens=min(body.min_tokens, max_tokens),
        **defaults.filled(OPENAI_FALLBACKS, temperature=body.temperature, top_p=body.top_p,
                          top_k=0 if body.top_k == -1 else body.top_k, repetition_penalty=body.repetition_penalty),
        min_p=body.min_p,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        seed=body.seed,
        stop=tuple(body.stop_list()),
        stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=body.ignore_eos,
        logprobs=logprobs,
        n=body.n,
        constraint=constraint,
        reasoning=reasoning,
        max_reasoning_tokens=None if body.max_reasoning_tokens is None else min(body.max_reasoning_tokens, max_tokens),
        cache_salt=body.cache_salt,
    )


def default_max_tokens(engine, num_prompt_tokens: int) -> int:
    """OpenAI's default: whatever room the context (and the KV cache) leaves; at least 1, so that
    a prompt that fills the context gets check_prompt's message."""
    room = engine.max_model_len
    if engine.kv_cache_tokens is not None:
        room = min(room, engine.kv_cache_tokens)
    return max(1, room - num_prompt_tokens)


async def admit_all(request: Request, prompts: list[list[int]], params: SamplingParams, request_id: str,
                     route: str) -> list[Generation]:
    state = request.app.state
    gens: list[Generation] = []
    try:
        for i, ids in enumerate(prompts):
            rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
            gens.append(await start_generation(state.engine, ids, params, rid, **admission(request, route)))
    except BaseException:
        for gen in gens:
            gen.abort()
        raise
    return gens


@dataclass
class ChatJob:
    """A conversation to answer, in OpenAI chat terms whatever API it came through."""

    messages: list[dict]  # {"role", "content", "tool_calls"?, "tool_call_id"?, "name"?}, roles as templates take them
    tools: ToolRequest | None  # None: no tools (or tool choice "none")
    constraint: Constraint | None  # the body's own format (json_schema, json_object); tools take precedence
    sampling: SamplingFields  # temperature, top_p, stop, ... (n is 1 outside chat completions)
    max_tokens: int | None  # None: whatever room the context leaves
    template_kwargs: dict | None = None
    logprobs: int | None = None
    param: str = "messages"  # the field a prompt too long is blamed on
    format_param: str = "response_format"  # the field a constraint that cannot compile is blamed on


@dataclass
class Encoded:
    prompt_ids: list[int]
    fmt: ToolFormat | None  # the model's tool format when the job has tools


async def encode_job(engine, job: ChatJob) -> Encoded:
    """The job's prompt through the chat template (a 400 when it is too long in characters or the
    template refuses it)."""
    tools = job.tools
    fmt = tool_format(engine.tokenizer) if tools is not None else None
    messages = job.messages
    if fmt is not None or any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
        messages = (fmt or tool_format(engine.tokenizer)).messages(messages, tools)
    template_tools = [dict(t) for t in tools.tools] if fmt is not None and fmt.passes_tools else None
    check_prompt_chars(engine, sum(len(m.get("content") or "") + len(json.dumps(m.get("tool_calls") or ""))
                                   for m in messages) + len(json.dumps(template_tools or "")), job.param)
    prompt_ids = await off_loop(lambda: engine.encode_chat(messages, True, template_tools,
                                                           **(job.template_kwargs or {})))
    return Encoded(prompt_ids, fmt)


async def start_chat(request: Request, job: ChatJob, request_id: str, route: str) -> tuple[list[Generation], Encoded]:
    """The job admitted into the engine: its generations (one per prompt: one) and its encoding."""
    engine = request.app.state.engine
    encoded = await encode_job(engine, job)
    fmt = encoded.fmt
    max_tokens = job.max_tokens or default_max_tokens(engine, len(encoded.prompt_ids))
    constraint = fmt.constraint(job.tools, engine.tokenizer) if fmt is not None else job.constraint
    params = sampling_params(job.sampling, max_tokens, job.logprobs, constraint,
                             reasoning=engine.think_tags is not None,
                             defaults=model_defaults(request.app.state))
    try:
        await compile_constraint(engine, params, client=client_of(request))
    except InvalidRequest as exc:
        if exc.param != "response_format" or job.format_param == "response_format" or job.tools is not None:
            raise
        raise InvalidRequest(str(exc), param=job.format_param) from None
    gens = await admit_all(request, [encoded.prompt_ids], params, request_id, route)
    return gens, encoded


@dataclass
class Block:
    """One block of a reply: a thought, a text, or a tool call (its arguments in `text`)."""

    kind: str  # "reasoning", "text" or "call"
    index: int  # its place among the reply's blocks
    text: str = ""
    call: ToolCall | None = None


class ReplyBlocks:
    """A reply cut into ordered blocks as the block-shaped APIs show them. `feed` returns events:
    ("start", block), ("delta", block, piece), ("stop", block); a block stops when another starts,
    and at `finish`. The parsing is `Reply`'s (the model's tool format)."""

    def __init__(self, fmt: ToolFormat | None):
        self.reply = Reply(fmt)
        self.blocks: list[Block] = []
        self.token_ids: list[int] = []
        self.num_output_tokens = 0
        self.reasoning_tokens = 0  # the tokens of deltas that carried only thought
        self.finish_reason = None  # engine FinishReason once finished
        self._open: Block | None = None

    def _switch(self, kind: str, events: list, call: ToolCall | None = None) -> Block:
        if self._open is not None and self._open.kind == kind and call is None:
            return self._open
        if self._open is not None:
            events.append(("stop", self._open))
        self._open = Block(kind, len(self.blocks), call=call)
        self.blocks.append(self._open)
        events.append(("start", self._open))
        return self._open

    def feed(self, out) -> list[tuple]:
        events: list[tuple] = []
        self.token_ids.extend(out.token_ids)
        self.num_output_tokens = out.num_output_tokens
        if not self.reply.content and not out.text and (out.reasoning or self.reply.reasoning):
            self.reasoning_tokens += len(out.token_ids)  # the thought's, its end tag's and held-back bytes' tokens
        for delta in self.reply.feed(out):
            if "reasoning" in delta or "content" in delta:
                kind, piece = ("reasoning", delta["reasoning"]) if "reasoning" in delta else ("text", delta["content"])
                block = self._switch(kind, events)
            else:
                call = delta["tool_calls"][0]
                if "id" in call:
                    self._switch("call", events, self.reply.calls[call["index"]])
                    continue
                block, piece = self._open, call["function"]["arguments"]
            block.text += piece
            events.append(("delta", block, piece))
        if out.finished:
            self.finish_reason = out.finish_reason
            if self._open is not None:
                events.append(("stop", self._open))
                self._open = None
        return events

    @property
    def has_calls(self) -> bool:
        return bool(self.reply.calls)


def served_names(state) -> set[str]:
    names = {state.engine.model_name}
    if state.settings.model_id:
        names.add(state.settings.model_id)
    return names


def check_model(state, model: str | None) -> None:
    if model in (None, ""):
        return
    if model not in served_names(state):
        raise ApiError(404, f"The model `{model}` does not exist on this server. It serves "
                            f"`{state.engine.model_name}` (see GET /v1/models).", param="model",
                       code="model_not_found")


def route_start(request: Request, body, x_request_id: str | None):
    """What every generating route checks first: the model asked for, and the client's request id."""
    check_model(request.app.state, body.model)
    return request.app.state.engine, request_id_from(x_request_id)

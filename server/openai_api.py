"""The OpenAI-compatible API: `/v1/chat/completions`, `/v1/completions`, `/v1/models`.

Streams are `data: {json}\n\n` chunks ending with `data: [DONE]`; the first chat chunk of each
choice carries `role: assistant`, the last its `finish_reason`; `stream_options.include_usage`
adds a final chunk with the usage. Errors use OpenAI's shape (see server/errors.py); an error
after a stream started is an `event: error` chunk with that shape, then `[DONE]`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Header, Request
from fastapi.responses import JSONResponse

from engine.request import RequestOutput, SamplingParams
from frontend.sampling_defaults import SamplingDefaults
from frontend.tools import tool_format
from server.chat import run_while_connected
from server.errors import ApiError, error_body, internal_error_message
from frontend.admission import (Generation, RequestFailed, admission, compile_constraint, check_prompt_chars, off_loop, request_id_from,
                               start_generation)
from server.openai_choices import ChatChoices, CompletionChoices, TokenText
from server.schemas import ChatCompletionRequest, CompletionRequest, SamplingFields
from server.sse import event_stream_response

router = APIRouter(prefix="/v1")
log = logging.getLogger("rill.server")

_ROLE_MAP = {"developer": "system"}


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


def _defaults(state) -> SamplingDefaults:
    return getattr(state, "sampling_defaults", None) or SamplingDefaults()


def _params(body: SamplingFields, max_tokens: int, logprobs: int | None, constraint=None,
            reasoning: bool = False, defaults: SamplingDefaults = SamplingDefaults()) -> SamplingParams:
    """Unset fields take the model's generation config (`defaults`), as vLLM does, else OpenAI's."""
    return SamplingParams(
        max_tokens=max_tokens,
        min_tokens=min(body.min_tokens, max_tokens),
        temperature=defaults.get("temperature", 1.0) if body.temperature is None else body.temperature,
        top_p=defaults.get("top_p", 1.0) if body.top_p is None else body.top_p,
        top_k=defaults.get("top_k", 0) if body.top_k is None else 0 if body.top_k == -1 else body.top_k,
        min_p=body.min_p,
        repetition_penalty=defaults.get("repetition_penalty", 1.0) if body.repetition_penalty is None
        else body.repetition_penalty,
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
    )


def _default_max_tokens(engine, num_prompt_tokens: int) -> int:
    """OpenAI's default: whatever room the context (and the KV cache) leaves; at least 1, so that
    a prompt that fills the context gets check_prompt's message."""
    room = engine.max_model_len
    core = getattr(engine, "core", None)
    if core is not None and hasattr(core, "num_kv_blocks"):
        room = min(room, core.num_kv_blocks * engine.config.block_size)
    return max(1, room - num_prompt_tokens)


async def _merged(gens: list[Generation]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Deltas of several generations as (generation index, delta), in arrival order."""
    if len(gens) == 1:
        async for out in gens[0].deltas():
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def read(i: int, gen: Generation):
        try:
            async for out in gen.deltas():
                await queue.put((i, out))
            await queue.put((i, done))
        except BaseException as exc:  # hand failures to the reader
            await queue.put((i, exc))

    tasks = [asyncio.ensure_future(read(i, g)) for i, g in enumerate(gens)]
    try:
        remaining = len(gens)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        for gen in gens:
            if not gen.finished:
                gen.abort()


async def _admit_all(request: Request, prompts: list[list[int]], params: SamplingParams, request_id: str,
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


def _error_chunk(path: str, exc: Exception) -> dict:
    if isinstance(exc, RequestFailed):
        body = error_body(path, 500, exc.message, code=exc.code)
        if exc.code == "timeout":
            body["error"]["type"] = "timeout_error"
    else:
        body = error_body(path, 500, internal_error_message(), code="internal_error")  # the caller logged it
    return {"event": "error", "data": json.dumps(body)}


# --------------------------------------------------------------------------- routes


@router.get("/models")
async def list_models(request: Request):
    return {"object": "list", "data": [_model_card(request.app.state)]}


@router.get("/models/{model_id:path}")
async def get_model(model_id: str, request: Request):
    check_model(request.app.state, model_id)
    return _model_card(request.app.state)


def _model_card(state) -> dict:
    engine = state.engine
    return {"id": engine.model_name, "object": "model", "created": state.started_at, "owned_by": "rill",
            "max_model_len": engine.max_model_len}


@router.post("/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request, x_request_id: str | None = Header(None)):
    state = request.app.state
    engine = state.engine
    check_model(state, body.model)
    request_id = request_id_from(x_request_id)
    tools = body.tool_request()
    fmt = tool_format(engine.tokenizer) if tools is not None else None
    messages = [m.template_message(_ROLE_MAP.get(m.role, m.role)) for m in body.messages]
    if fmt is not None or any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
        messages = (fmt or tool_format(engine.tokenizer)).messages(messages, tools)
    template_tools = [dict(t) for t in tools.tools] if fmt is not None and fmt.passes_tools else None
    check_prompt_chars(engine, sum(len(m.get("content") or "") + len(json.dumps(m.get("tool_calls") or ""))
                                   for m in messages) + len(json.dumps(template_tools or "")), "messages")
    prompt_ids = await off_loop(lambda: engine.encode_chat(messages, True, template_tools,
                                                           **(body.chat_template_kwargs or {})))
    max_tokens = body.max_completion_tokens or body.max_tokens or _default_max_tokens(engine, len(prompt_ids))
    top_n = body.top_logprobs or 0
    constraint = fmt.constraint(tools, engine.tokenizer) if fmt is not None else body.constraint()
    params = _params(body, max_tokens, top_n if body.logprobs else None, constraint,
                     reasoning=getattr(engine, "think_tags", None) is not None, defaults=_defaults(state))
    await compile_constraint(engine, params)
    gens = await _admit_all(request, [prompt_ids], params, request_id, "v1_chat")
    choices = ChatChoices(body.n, fmt, TokenText(engine.tokenizer), top_n, bool(body.logprobs))
    return await _answer(request, gens, body, choices, f"chatcmpl-{request_id}", request_id)


@router.post("/completions")
async def completions(body: CompletionRequest, request: Request, x_request_id: str | None = Header(None)):
    state = request.app.state
    engine = state.engine
    check_model(state, body.model)
    request_id = request_id_from(x_request_id)
    raw_prompts = body.prompts()  # at most MAX_PROMPTS (schemas.py)
    for p in raw_prompts:
        if isinstance(p, str):
            check_prompt_chars(engine, len(p), "prompt")
    prompts = await off_loop(lambda: [engine.encode(p) if isinstance(p, str) else list(p) for p in raw_prompts])
    if body.max_tokens is not None:
        max_tokens = body.max_tokens
    else:
        max_tokens = _default_max_tokens(engine, max(len(p) for p in prompts))
    params = _params(body, max_tokens, body.logprobs, body.constraint(), defaults=_defaults(state))
    await compile_constraint(engine, params)
    gens = await _admit_all(request, prompts, params, request_id, "v1_completions")
    choices = CompletionChoices(body.n * len(gens), TokenText(engine.tokenizer), body.logprobs)
    return await _answer(request, gens, body, choices, f"cmpl-{request_id}", request_id)


async def _answer(request: Request, gens: list[Generation], body, choices, answer_id: str, request_id: str):
    """The answer of admitted generations (`body.n` choices each) in the route's `choices` layout:
    one JSON body, or a stream of chunks ending with `[DONE]` (an error after the start is an
    `event: error` chunk first). Choice k of generation g is choice g * n + k."""
    meta = {"id": answer_id, "created": int(time.time()), "model": request.app.state.engine.model_name}
    prompt_tokens = sum(g.num_prompt_tokens for g in gens)
    counts: dict[int, int] = {}  # choice -> its output tokens so far

    if not body.stream:
        async def read():
            async for g, out in _merged(gens):
                index = g * body.n + out.index
                counts[index] = out.num_output_tokens
                choices.add(index, out)

        await _run_or_500(read(), request, *gens)
        return JSONResponse({**meta, "object": choices.whole_object, "choices": choices.whole(),
                             "system_fingerprint": None, "usage": _usage(prompt_tokens, sum(counts.values()))},
                            headers={"x-request-id": request_id})

    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    path = request.url.path

    def chunk(chunk_choices: list[dict], usage=None) -> dict:
        payload = {**meta, "object": choices.chunk_object, "system_fingerprint": None, "choices": chunk_choices}
        if include_usage:
            payload["usage"] = usage
        return {"data": json.dumps(payload, ensure_ascii=False)}

    async def events():
        try:
            for opening in choices.opening():
                yield chunk([opening])
            async for g, out in _merged(gens):
                index = g * body.n + out.index
                counts[index] = out.num_output_tokens
                for choice in choices.stream(index, out):
                    yield chunk([choice])
            if include_usage:
                yield chunk([], _usage(prompt_tokens, sum(counts.values())))
        except Exception as exc:  # RequestFailed, or a bug: the client is told, never left hanging
            if not isinstance(exc, RequestFailed):
                log.exception("stream %s failed", request_id)
            yield _error_chunk(path, exc)
        yield {"data": "[DONE]"}

    return event_stream_response(events(), request_id)


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


async def _run_or_500(coro, request: Request, *gens: Generation):
    await run_while_connected(coro, request, gens[0] if len(gens) == 1 else _AbortAll(gens))


class _AbortAll:
    def __init__(self, gens):
        self.gens = gens

    def abort(self):
        for gen in self.gens:
            gen.abort()

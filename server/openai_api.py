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

from engine.request import FinishReason, RequestOutput, SamplingParams
from frontend.tools import ToolFormat, tool_format
from server.chat import run_while_connected
from server.errors import ApiError, error_body, internal_error_message
from frontend.admission import (Generation, RequestFailed, admission, compile_constraint, check_prompt_chars, off_loop, request_id_from,
                               start_generation)
from server.schemas import ChatCompletionRequest, CompletionRequest, _SamplingFields
from server.resume import slow_reader_message
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


def _finish(reason) -> str | None:
    if reason is None:
        return None
    value = reason.value if isinstance(reason, FinishReason) else str(reason)
    return value


def _params(body: _SamplingFields, max_tokens: int, logprobs: int | None, constraint=None,
            reasoning: bool = False) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens,
        min_tokens=min(body.min_tokens, max_tokens),
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=0 if body.top_k in (None, -1) else body.top_k,
        min_p=body.min_p,
        repetition_penalty=body.repetition_penalty,
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


class _Reply:
    """One choice's reply as the client sees it: the thought, the content and the tool calls parsed out
    of the text by the model's tool format (no call's text reaches `content`)."""

    def __init__(self, fmt: ToolFormat | None):
        self.parser = fmt.parser() if fmt is not None else None
        self.reasoning: list[str] = []
        self.content: list[str] = []
        self.calls: list = []  # frontend.tools.ToolCall

    def feed(self, out: RequestOutput) -> list[dict]:
        """The stream deltas this output adds (several for a tool call: its name, then its arguments)."""
        deltas = []
        if out.reasoning:
            self.reasoning.append(out.reasoning)
            deltas.append({"reasoning": out.reasoning, "reasoning_content": out.reasoning})
        if self.parser is None:
            events = [("content", out.text)] if out.text else []
        else:
            events = self.parser.feed(out.text) + (self.parser.finish() if out.finished else [])
        for kind, value in events:
            if kind == "content":
                self.content.append(value)
                deltas.append({"content": value})
                continue
            index = len(self.calls)
            self.calls.append(value)
            deltas.append({"tool_calls": [{"index": index, "id": value.id, "type": "function",
                                           "function": {"name": value.name, "arguments": ""}}]})
            deltas.append({"tool_calls": [{"index": index, "function": {"arguments": value.arguments}}]})
        return deltas

    def finish_reason(self, reason) -> str | None:
        reason = _finish(reason)
        return "tool_calls" if self.calls and reason == "stop" else reason

    def message(self) -> dict:
        content = "".join(self.content)
        message = {"role": "assistant", "content": content if content or not self.calls else None}
        if self.calls:
            message["tool_calls"] = [{"id": c.id, "type": "function",
                                      "function": {"name": c.name, "arguments": c.arguments}} for c in self.calls]
        if self.reasoning:
            message["reasoning"] = message["reasoning_content"] = "".join(self.reasoning)
        return message


def _default_max_tokens(engine, num_prompt_tokens: int) -> int:
    """OpenAI's default: whatever room the context (and the KV cache) leaves; at least 1, so that
    a prompt that fills the context gets check_prompt's message."""
    room = engine.max_model_len
    core = getattr(engine, "core", None)
    if core is not None and hasattr(core, "num_kv_blocks"):
        room = min(room, core.num_kv_blocks * engine.config.block_size)
    return max(1, room - num_prompt_tokens)


class _TokenText:
    """Token id -> its text and bytes, cached (for logprobs)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self.cache.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self.cache[token_id] = text
        return text


def _chat_logprobs(out: RequestOutput, token_text: _TokenText, top_n: int) -> dict | None:
    if out.logprobs is None:
        return None
    content = []
    for lp in out.logprobs:
        tok = token_text(lp.token_id)
        content.append({
            "token": tok, "logprob": lp.logprob, "bytes": list(tok.encode("utf-8")),
            "top_logprobs": [{"token": token_text(t), "logprob": p, "bytes": list(token_text(t).encode("utf-8"))}
                             for t, p in lp.top[:top_n]],
        })
    return {"content": content}


def _completion_logprobs(out: RequestOutput, token_text: _TokenText, top_n: int, offset: int) -> dict | None:
    if out.logprobs is None:
        return None
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for lp in out.logprobs:
        tok = token_text(lp.token_id)
        tokens.append(tok)
        token_logprobs.append(lp.logprob)
        tops.append({token_text(t): p for t, p in lp.top[:top_n]} if top_n else None)
        offsets.append(offset)
        offset += len(tok)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


def _merge_logprobs(acc: dict | None, new: dict | None, chat: bool) -> dict | None:
    if new is None:
        return acc
    if acc is None:
        return new
    if chat:
        acc["content"].extend(new["content"])
    else:
        for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            acc[key].extend(new[key])
    return acc


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
                     reasoning=getattr(engine, "think_tags", None) is not None)
    await compile_constraint(engine, params)
    gen = (await _admit_all(request, [prompt_ids], params, request_id, "v1_chat"))[0]
    token_text = _TokenText(engine.tokenizer)
    meta = {"id": f"chatcmpl-{request_id}", "created": int(time.time()), "model": engine.model_name}
    headers = {"x-request-id": request_id}

    replies = [_Reply(fmt) for _ in range(body.n)]
    if not body.stream:
        logprobs: list[dict | None] = [None] * body.n
        reasons: list[str | None] = [None] * body.n
        counts = [0] * body.n

        async def read():
            async for out in gen.deltas():
                replies[out.index].feed(out)
                logprobs[out.index] = _merge_logprobs(logprobs[out.index], _chat_logprobs(out, token_text, top_n), True)
                counts[out.index] = out.num_output_tokens
                if out.finished:
                    reasons[out.index] = replies[out.index].finish_reason(out.finish_reason)

        await _run_or_500(read(), request, gen)
        if body.logprobs:
            logprobs = [lp if lp is not None else {"content": []} for lp in logprobs]
        choices = [{"index": i, "message": replies[i].message(),
                    "logprobs": logprobs[i] if body.logprobs else None, "finish_reason": reasons[i]}
                   for i in range(body.n)]
        completion = sum(counts)
        return JSONResponse({**meta, "object": "chat.completion", "choices": choices, "system_fingerprint": None,
                             "usage": _usage(gen.num_prompt_tokens, completion)}, headers=headers)

    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    path = request.url.path

    def chunk(choices: list[dict], usage=None) -> dict:
        payload = {**meta, "object": "chat.completion.chunk", "system_fingerprint": None, "choices": choices}
        if include_usage:
            payload["usage"] = usage
        return {"data": json.dumps(payload, ensure_ascii=False)}

    async def events():
        counts = [0] * body.n
        try:
            for i in range(body.n):
                yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}])
            async for _, out in _merged([gen]):
                counts[out.index] = out.num_output_tokens
                lp = _chat_logprobs(out, token_text, top_n) if body.logprobs else None
                deltas = replies[out.index].feed(out)
                if lp and not any("content" in d for d in deltas):
                    deltas.append({"content": ""})  # the logprobs of text held back (a tool call's)
                for delta in deltas:
                    yield chunk([{"index": out.index, "delta": delta, "logprobs": lp if "content" in delta else None,
                                  "finish_reason": None}])
                    if "content" in delta:
                        lp = None
                if out.finished:
                    yield chunk([{"index": out.index, "delta": {}, "logprobs": None,
                                  "finish_reason": replies[out.index].finish_reason(out.finish_reason)}])
            if include_usage:
                yield chunk([], _usage(gen.num_prompt_tokens, sum(counts)))
        except Exception as exc:  # RequestFailed, or a bug: the client is told, never left hanging
            if not isinstance(exc, RequestFailed):
                log.exception("stream %s failed", request_id)
            yield _error_chunk(path, exc)
        yield {"data": "[DONE]"}

    return event_stream_response(events(), request_id, on_backlog=_slow_reader_end(path))


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
    top_n = body.logprobs or 0
    params = _params(body, max_tokens, body.logprobs, body.constraint())
    await compile_constraint(engine, params)
    gens = await _admit_all(request, prompts, params, request_id, "v1_completions")
    token_text = _TokenText(engine.tokenizer)
    n = body.n
    meta = {"id": f"cmpl-{request_id}", "created": int(time.time()), "model": engine.model_name}
    headers = {"x-request-id": request_id}
    num_choices = n * len(gens)
    prompt_tokens = sum(g.num_prompt_tokens for g in gens)

    if not body.stream:
        texts = [[] for _ in range(num_choices)]
        logprobs: list[dict | None] = [None] * num_choices
        reasons: list[str | None] = [None] * num_choices
        counts = [0] * num_choices
        offsets = [0] * num_choices

        async def read():
            async for g, out in _merged(gens):
                idx = g * n + out.index
                lp = _completion_logprobs(out, token_text, top_n, offsets[idx]) if body.logprobs is not None else None
                if lp:
                    offsets[idx] = lp["text_offset"][-1] + len(lp["tokens"][-1]) if lp["tokens"] else offsets[idx]
                texts[idx].append(out.text)
                logprobs[idx] = _merge_logprobs(logprobs[idx], lp, False)
                counts[idx] = out.num_output_tokens
                if out.finished:
                    reasons[idx] = _finish(out.finish_reason)

        await _run_or_500(read(), request, *gens)
        choices = [{"index": i, "text": "".join(texts[i]), "logprobs": logprobs[i], "finish_reason": reasons[i]}
                   for i in range(num_choices)]
        return JSONResponse({**meta, "object": "text_completion", "choices": choices, "system_fingerprint": None,
                             "usage": _usage(prompt_tokens, sum(counts))}, headers=headers)

    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    path = request.url.path

    def chunk(choices: list[dict], usage=None) -> dict:
        payload = {**meta, "object": "text_completion", "system_fingerprint": None, "choices": choices}
        if include_usage:
            payload["usage"] = usage
        return {"data": json.dumps(payload, ensure_ascii=False)}

    async def events():
        counts = [0] * num_choices
        offsets = [0] * num_choices
        try:
            async for g, out in _merged(gens):
                idx = g * n + out.index
                counts[idx] = out.num_output_tokens
                lp = _completion_logprobs(out, token_text, top_n, offsets[idx]) if body.logprobs is not None else None
                if lp and lp["tokens"]:
                    offsets[idx] = lp["text_offset"][-1] + len(lp["tokens"][-1])
                if out.text or lp or out.finished:
                    yield chunk([{"index": idx, "text": out.text, "logprobs": lp,
                                  "finish_reason": _finish(out.finish_reason) if out.finished else None}])
            if include_usage:
                yield chunk([], _usage(prompt_tokens, sum(counts)))
        except Exception as exc:  # RequestFailed, or a bug: the client is told, never left hanging
            if not isinstance(exc, RequestFailed):
                log.exception("stream %s failed", request_id)
            yield _error_chunk(path, exc)
        yield {"data": "[DONE]"}

    return event_stream_response(events(), request_id, on_backlog=_slow_reader_end(path))


def _slow_reader_end(path: str):
    """What a stream cut off for its unread backlog ends with (server/sse.py): the error, then [DONE]."""
    def end(limit: int) -> list[dict]:
        body = error_body(path, 400, slow_reader_message(limit), code="slow_reader")
        return [{"event": "error", "data": json.dumps(body)}, {"data": "[DONE]"}]
    return end


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

"""The OpenAI-compatible API: `/v1/chat/completions`, `/v1/completions`, `/v1/models`.

Streams are `data: {json}\n\n` chunks ending with `data: [DONE]`; the first chat chunk of each
choice carries `role: assistant`, the last its `finish_reason`; `stream_options.include_usage`
adds a final chunk with the usage. Errors use OpenAI's shape (see server/errors.py); an error
after a stream started is an `event: error` chunk with that shape, then `[DONE]`.
"""

from __future__ import annotations

import json
import logging
import time

from fastapi import APIRouter, Header, Request
from fastapi.responses import JSONResponse

from frontend.admission import Generation, RequestFailed
from frontend.images import take_images
from frontend.request import ChatJob, Sampling, default_max_tokens
from server.errors import error_body, internal_error_message, slow_reader_end
from server.openai_choices import ChatChoices, CompletionChoices, TokenText
from server.schemas import ChatCompletionRequest, CompletionRequest, SamplingFields
from server.sse import event_stream_response
from server.streaming import merged, route_start, run_while_connected, start

router = APIRouter(prefix="/v1")
log = logging.getLogger("rill.server")

_ROLE_MAP = {"developer": "system"}


def sampling_of(body: SamplingFields) -> Sampling:
    """The sampling fields of an OpenAI-style body (a `top_k` of -1 is vLLM's "off")."""
    return Sampling(temperature=body.temperature, top_p=body.top_p, top_k=0 if body.top_k == -1 else body.top_k,
                    min_p=body.min_p, repetition_penalty=body.repetition_penalty,
                    presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
                    min_tokens=body.min_tokens, seed=body.seed, stop=body.stop_list(),
                    stop_token_ids=tuple(body.stop_token_ids or ()), ignore_eos=body.ignore_eos, n=body.n,
                    max_reasoning_tokens=body.max_reasoning_tokens, cache_salt=body.cache_salt)


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
    state = request.app.state
    return {"object": "list", "data": [_model_card(state, model) for model in state.models.snapshot()]}


@router.get("/models/{model_id:path}")
async def get_model(model_id: str, request: Request):
    state = request.app.state
    name = state.models.resolve(model_id).name
    return next(_model_card(state, model) for model in state.models.snapshot() if model["id"] == name)


def _model_card(state, model: dict) -> dict:
    """A model as OpenAI lists it, with llama-server's router `status` ({"value": "loaded"|"loading"|
    "unloaded"|"failed"}), its size on disk and the memory --models-memory counts for it (weights + KV pool)."""
    return {"id": model["id"], "object": "model", "created": state.started_at, "owned_by": "rill",
            "max_model_len": model["max_model_len"], "status": model["status"], "size_bytes": model["size_bytes"],
            "estimated_memory_bytes": model["estimated_memory_bytes"], "kv_cache_bytes": model["kv_cache_bytes"],
            **({"settings": model["settings"]} if "settings" in model else {})}  # its own (--models-preset)


@router.post("/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request, x_request_id: str | None = Header(None)):
    engine, request_id = await route_start(request, body, x_request_id)
    body.check_answer_budget(default_max_tokens(engine, 0))  # n x max_tokens x logprobs: a 400 before any work
    top_n = body.top_logprobs or 0
    messages, images = take_images([m.template_message(_ROLE_MAP.get(m.role, m.role)) for m in body.messages],
                                   request.app.state.image_limits, exact_paths=True)
    job = ChatJob(messages, sampling=sampling_of(body),
                  max_tokens=body.max_completion_tokens or body.max_tokens, open_ended=True, tools=body.tool_request(),
                  constraint=body.constraint(), template_kwargs=body.chat_template_kwargs,
                  logprobs=top_n if body.logprobs else None, images=images or None)
    gens, prepared = await start(request, job, request_id, "v1_chat")
    choices = ChatChoices(body.n, prepared.fmt, TokenText(engine.tokenizer), top_n, bool(body.logprobs))
    return await _answer(request, gens, body, choices, f"chatcmpl-{request_id}", request_id)


@router.post("/completions")
async def completions(body: CompletionRequest, request: Request, x_request_id: str | None = Header(None)):
    engine, request_id = await route_start(request, body, x_request_id)
    body.check_answer_budget(default_max_tokens(engine, 0))
    job = ChatJob(prompts=body.prompts(), sampling=sampling_of(body), max_tokens=body.max_tokens, open_ended=True,
                  constraint=body.constraint(), logprobs=body.logprobs, param="prompt")
    gens, _ = await start(request, job, request_id, "v1_completions")
    choices = CompletionChoices(body.n * len(gens), TokenText(engine.tokenizer), body.logprobs)
    return await _answer(request, gens, body, choices, f"cmpl-{request_id}", request_id)


async def _answer(request: Request, gens: list[Generation], body, choices, answer_id: str, request_id: str):
    """The answer of admitted generations (`body.n` choices each) in the route's `choices` layout:
    one JSON body, or a stream of chunks ending with `[DONE]` (an error after the start is an
    `event: error` chunk first). Choice k of generation g is choice g * n + k."""
    meta = {"id": answer_id, "created": int(time.time()), "model": request.state.model.name}
    prompt_tokens = sum(g.num_prompt_tokens for g in gens)
    counts: dict[int, int] = {}  # choice -> its output tokens so far

    if not body.stream:
        async def read():
            async for g, out in merged(gens):
                index = g * body.n + out.index
                counts[index] = out.num_output_tokens
                choices.add(index, out)

        await run_while_connected(read(), request, *gens)
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
            async for g, out in merged(gens):
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

    return event_stream_response(events(), request_id, on_backlog=slow_reader_end(path, done=True))


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}

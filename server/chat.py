"""`POST /chat` (the seed's SSE protocol, extended) and `GET /chat/{request_id}` (resume).

Wire format of a stream: one event per text piece (`id: k`, `data: <piece>`; a thinking model's
thought as `event: reasoning` pieces before them), then
`event: usage` (JSON: prompt_tokens, completion_tokens, finish_reason), then `event: end` with
`data: [DONE]`. A failure after the stream started is `event: error` (JSON `{"error": ...}`)
followed by the end event. Every event has an increasing `id:`; a client that lost the
connection reconnects to `GET /chat/{request_id}` with `Last-Event-ID` and the
`x-resume-token` its stream's response carried, and gets the rest. Anyone else gets 404.
"""

from __future__ import annotations

import asyncio
import contextlib
import json

from fastapi import APIRouter, Header, Query, Request
from fastapi.responses import JSONResponse

from engine.request import FinishReason
from frontend.admission import Generation, RequestFailed, compile_constraint, start_generation
from frontend.images import ImageLimits, take_images
from frontend.request import ChatJob, Sampling
from server.errors import BODY_FIELDS, ApiError, internal_error_message, log_internal_error
from server.headers import admission, client_of
from server.resume import ResumableStream
from server.schemas import ChatBody
from server.sse import event_stream_response
from server.streaming import route_start, run_while_connected, start, use_model

RESUME_TOKEN_HEADER = "x-resume-token"  # in a stream's response, and in the request that resumes it

router = APIRouter()
BODY_FIELDS["/chat"] = list(ChatBody.model_fields)


def _job(body: ChatBody, image_limits: ImageLimits) -> ChatJob:
    """The body as the one request record: `prompt` (through the chat template unless `raw`) or
    `messages`, after `system`; unset sampling fields take the defaults."""
    sampling = Sampling(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                        repetition_penalty=body.repetition_penalty, seed=body.seed, stop=body.stop_list(),
                        ignore_eos=body.ignore_eos, max_reasoning_tokens=body.max_reasoning_tokens,
                        cache_salt=body.cache_salt)
    job = ChatJob(sampling=sampling, max_tokens=body.max_new_tokens, constraint=body.constraint(),
                  template_kwargs=body.chat_template_kwargs, param="prompt" if body.messages is None else "messages",
                  max_tokens_param="max_new_tokens")
    if body.raw:
        job.prompts = [body.prompt]
        return job
    messages = ([m.model_dump() for m in body.messages] if body.messages is not None
                else [{"role": "user", "content": body.prompt}])
    if body.images:  # before the last message's text, as image parts (frontend/images.py)
        last = messages[-1]
        messages[-1] = {**last, "content": [{"type": "image_url", "url": url} for url in body.images]
                        + [{"type": "text", "text": last["content"]}]}
    job.messages = ([{"role": "system", "content": body.system}] if body.system is not None else []) + messages
    if body.images:
        job.messages, job.images = take_images(job.messages, image_limits, "images")
    return job


def _usage(gen: Generation, completion_tokens: int, finish_reason) -> dict:
    reason = finish_reason.value if isinstance(finish_reason, FinishReason) else finish_reason
    return {"prompt_tokens": gen.num_prompt_tokens, "completion_tokens": completion_tokens,
            "finish_reason": reason}


async def _pump(gen: Generation, record: ResumableStream) -> None:
    """Read the engine request into the resumable record, whatever the HTTP connection does."""
    completion_tokens = 0
    finish_reason = None
    try:
        async for out in gen.deltas():
            record.add_output(out.token_ids)
            if out.reasoning:
                record.append("reasoning", out.reasoning)
            if out.text:
                record.append(None, out.text)
            completion_tokens = out.num_output_tokens
            if out.finished:
                finish_reason = out.finish_reason
                if finish_reason == FinishReason.ABORT and record.suspending:
                    record.suspend()  # nobody reads it: a reader who comes back continues it
                    return
        if record.stop_error is not None:  # the server stopped it (its reader fell too far behind)
            record.append("error", json.dumps({"error": record.stop_error, "code": "slow_reader"}))
        else:
            record.append("usage", json.dumps(_usage(gen, completion_tokens, finish_reason)))
    except RequestFailed as exc:
        record.append("error", json.dumps({"error": exc.message, "code": exc.code}))
    except asyncio.CancelledError:
        record.append("error", json.dumps({"error": "The server is shutting down; the request was stopped.",
                                           "code": "shutdown"}))
        record.append("end", "[DONE]")
        record.finish()
        raise
    except Exception as exc:  # never a silently dropped stream
        reference = log_internal_error(f"the /chat stream {record.request_id!r} failed", exc)
        record.append("error", json.dumps({"error": internal_error_message(reference), "code": "internal"}))
    record.append("end", "[DONE]")
    record.finish()


def _start_pump(state, gen: Generation, record: ResumableStream) -> None:
    record.engine_request_id = gen.request_id  # what the registry aborts when nobody reads
    record.pump = state.spawn(_pump(gen, record))


async def _continue(request: Request, record: ResumableStream) -> None:
    """A reader came back to a suspended stream: continue its generation from the last token."""
    if record.suspending and record.pump is not None:
        await asyncio.shield(record.pump)  # the abort lands within one engine step
    if not record.suspended or record.expired:
        return
    engine = await use_model(request, record.model)  # unloaded meanwhile: loaded again
    if record.suspended and not record.expired:  # compiled again if the cache dropped it: 400 before admission
        await compile_constraint(engine, record.params, client=client_of(request))
    if not record.suspended or record.expired:
        return
    record.suspended = False  # before any await: a second reader must not continue it twice
    try:
        images = {"images": record.images} if record.images is not None else {}
        gen = await start_generation(engine, record.prompt_ids, record.params, record.request_id,
                                     prior_output_ids=record.output_ids, **admission(request, "chat"), **images)
    except BaseException:
        record.suspended = True
        raise
    # The window's timer must not end the continuation before this reader attaches (which
    # happens once the response starts); it waits for a reader as a new stream does.
    record.await_first_reader()
    _start_pump(request.app.state, gen, record)


async def _collect(gen: Generation, request: Request) -> tuple[str, str, int, object]:
    """All text (and thought) of a non-streaming request; aborts it when the client goes away."""
    pieces: list[str] = []
    thought: list[str] = []
    completion_tokens = 0
    finish_reason = None

    async def read():
        nonlocal completion_tokens, finish_reason
        async for out in gen.deltas():
            pieces.append(out.text)
            thought.append(out.reasoning)
            completion_tokens = out.num_output_tokens
            if out.finished:
                finish_reason = out.finish_reason

    await run_while_connected(read(), request, gen)
    return "".join(pieces), "".join(thought), completion_tokens, finish_reason


@router.post("/chat", summary="Generate a reply (SSE stream by default)")
async def chat(body: ChatBody, request: Request, x_request_id: str | None = Header(None)):
    state = request.app.state
    _, request_id = await route_start(request, body, x_request_id)  # the id: a label; resuming needs the token too
    gens, prepared = await start(request, _job(body, state.image_limits), request_id, "chat")
    gen = gens[0]
    if not body.stream:
        text, thought, completion_tokens, finish_reason = await _collect(gen, request)
        reply = {"response": text, "usage": _usage(gen, completion_tokens, finish_reason), "request_id": request_id}
        if thought:
            reply["reasoning"] = thought
        return JSONResponse(reply, headers={"x-request-id": request_id})
    record = state.resume.create(request_id, prepared.prompts[0], prepared.params)
    record.model = request.state.model.name  # a resume continues on the same model
    record.images = prepared.images
    _start_pump(state, gen, record)
    headers = {RESUME_TOKEN_HEADER: record.token} if record.token is not None else None
    return event_stream_response(_follow(record, 0), request_id, headers=headers)


async def _follow(record: ResumableStream, after: int):
    async with contextlib.aclosing(record.follow(after)) as events:
        async for event in events:
            yield event


@router.api_route("/chat", methods=["GET", "PUT", "PATCH", "DELETE"], include_in_schema=False)
async def chat_wrong_method(request: Request):
    """Without this the Gradio app mounted at "/" would answer other methods on /chat."""
    raise ApiError(405, f"Method {request.method} is not allowed on /chat: use POST (or GET /chat/{{request_id}} "
                        "to resume a stream).", headers={"Allow": "POST"})


@router.get("/chat/{request_id}", summary="Resume a /chat stream after `Last-Event-ID` (with its `x-resume-token`)")
async def resume_chat(request_id: str, request: Request,
                      last_event_id: str | None = Header(None),
                      last_event_id_query: str | None = Query(None, alias="last_event_id"),
                      x_resume_token: str | None = Header(None),
                      resume_token_query: str | None = Query(None, alias="resume_token")):
    token = x_resume_token if x_resume_token is not None else resume_token_query
    record = request.app.state.resume.lookup(request_id, token)
    if record is None:  # one answer for an unknown id and a wrong or missing token: it tells nothing
        window = request.app.state.settings.resume_window
        raise ApiError(404, "No resumable stream for this request id and resume token. Only the client that "
                            f"started a stream can resume it: send the `{RESUME_TOKEN_HEADER}` header its "
                            "POST /chat response carried, within the resume window "
                            f"({window:g} s after its last reader left).", code="not_found")
    given = last_event_id if last_event_id is not None else last_event_id_query
    after = 0
    if given not in (None, ""):
        try:
            after = int(given)
        except ValueError:
            raise ApiError(400, f"`Last-Event-ID` must be an event id (an integer >= 0). Given: {given!r}",
                           param="Last-Event-ID") from None
        if after < 0:
            raise ApiError(400, f"`Last-Event-ID` must be >= 0. Given: {after}", param="Last-Event-ID")
    await _continue(request, record)
    return event_stream_response(_follow(record, after), request_id)

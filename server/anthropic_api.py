"""`POST /v1/messages` and `POST /v1/messages/count_tokens`: Anthropic's Messages API over the one
request path (frontend/request.py: the same template, tools, constraint, admission and engine as
`/v1/chat/completions`).

The answer's content is a list of blocks: `thinking` (a thinking model's thought), `text`,
`tool_use` (the model's calls, `stop_reason: "tool_use"`). A stream is `event: <type>` /
`data: {json}`: message_start, then per block content_block_start, content_block_delta
(text_delta, thinking_delta, input_json_delta) and content_block_stop, then message_delta (the
stop reason and the output tokens) and message_stop; `ping` events keep it alive. Errors use
Anthropic's shape (server/errors.py), a failure after the start an `error` event.
"""

from __future__ import annotations

import json
import logging

from fastapi import APIRouter, Header, Request
from fastapi.responses import JSONResponse

from engine.request import FinishReason
from frontend.admission import RequestFailed
from frontend.images import ImageLimits, take_images
from frontend.request import ChatJob, Sampling, encode
from server.reply_blocks import Block, ReplyBlocks
from server.streaming import route_start, run_while_connected, start
from server.errors import BODY_FIELDS, error_body, internal_error_message, slow_reader_end
from server.anthropic_schemas import CountTokensRequest, MessagesRequest
from server.sse import event_stream_response

router = APIRouter(prefix="/v1")
log = logging.getLogger("rill.server")
BODY_FIELDS["/v1/messages"] = list(MessagesRequest.model_fields)
BODY_FIELDS["/v1/messages/count_tokens"] = list(CountTokensRequest.model_fields)


def _job(body: CountTokensRequest, image_limits: ImageLimits, sampling: Sampling | None = None,
         max_tokens: int | None = None) -> ChatJob:
    messages, images = take_images(body.chat_messages(), image_limits)
    return ChatJob(messages, sampling=sampling or Sampling(), max_tokens=max_tokens,
                   tools=body.tool_request(), constraint=body.constraint(), template_kwargs=body.template_kwargs(),
                   format_param="output_config.format", stop_param="stop_sequences", images=images or None)


def matched_stop(tokenizer, token_ids: list[int], stops: list[str]) -> str | None:
    """Which stop sequence ended the answer: the one found latest in its last tokens' text (the
    engine removed it from the text; a stop string ends within the tokens that wrote it)."""
    if not stops or not token_ids:
        return None
    tail = tokenizer.decode(token_ids[-(max(len(s) for s in stops) + 1):], skip_special_tokens=False)
    found = [(tail.rfind(s) + len(s), s) for s in stops if s in tail]
    return max(found)[1] if found else None


def _tool_input(arguments: str) -> dict:
    try:
        value = json.loads(arguments)
    except ValueError:
        value = arguments
    return value if isinstance(value, dict) else {"arguments": value}


class MessageBuilder:
    """One answer's message and stream events, from its reply's blocks."""

    def __init__(self, body: MessagesRequest, request_id: str, model: str, blocks: ReplyBlocks, tokenizer):
        self.body, self.blocks, self.model, self.tokenizer = body, blocks, model, tokenizer
        self.id = request_id if request_id.startswith("msg_") else f"msg_{request_id}"
        self.num_prompt_tokens = 0

    @staticmethod
    def tool_id(block: Block) -> str:
        call_id = block.call.id
        return f"toolu_{call_id[5:]}" if call_id.startswith("call_") else call_id

    def content(self, block: Block, done: bool = True) -> dict:
        if block.kind == "reasoning":
            return {"type": "thinking", "thinking": block.text if done else "", "signature": ""}
        if block.kind == "text":
            return {"type": "text", "text": block.text if done else ""}
        return {"type": "tool_use", "id": self.tool_id(block), "name": block.call.name,
                "input": _tool_input(block.text) if done else {}}

    def stop(self) -> tuple[str, str | None]:
        """The stop reason and the stop sequence."""
        if self.blocks.has_calls:
            return "tool_use", None
        if self.blocks.finish_reason == FinishReason.LENGTH:
            return "max_tokens", None
        sequence = matched_stop(self.tokenizer, self.blocks.token_ids, self.body.stop_sequences or [])
        return ("stop_sequence", sequence) if sequence is not None else ("end_turn", None)

    def usage(self, output_tokens: int) -> dict:
        return {"input_tokens": self.num_prompt_tokens, "output_tokens": output_tokens,
                "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}

    def message(self, done: bool = True) -> dict:
        reason, sequence = self.stop() if done else (None, None)
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": [self.content(b) for b in self.blocks.blocks] if done else [],
                "stop_reason": reason, "stop_sequence": sequence,
                "usage": self.usage(self.blocks.num_output_tokens if done else 0)}

    @staticmethod
    def event(kind: str, **fields) -> dict:
        return {"event": kind, "data": json.dumps({"type": kind, **fields}, ensure_ascii=False)}

    def block_event(self, event: tuple) -> dict:
        what, block = event[0], event[1]
        if what == "start":
            return self.event("content_block_start", index=block.index, content_block=self.content(block, False))
        if what == "stop":
            return self.event("content_block_stop", index=block.index)
        piece = event[2]
        delta = {"reasoning": {"type": "thinking_delta", "thinking": piece},
                 "text": {"type": "text_delta", "text": piece},
                 "call": {"type": "input_json_delta", "partial_json": piece}}[block.kind]
        return self.event("content_block_delta", index=block.index, delta=delta)


@router.post("/messages")
async def create_message(body: MessagesRequest, request: Request, x_request_id: str | None = Header(None)):
    engine, request_id = await route_start(request, body, x_request_id)
    gens, prepared = await start(request, _job(body, request.app.state.image_limits, body.sampling(), body.max_tokens),
                                 request_id, "v1_messages")
    gen = gens[0]
    blocks = ReplyBlocks(prepared.fmt)
    builder = MessageBuilder(body, request_id, engine.model_name, blocks, engine.tokenizer)
    builder.num_prompt_tokens = gen.num_prompt_tokens

    if not body.stream:
        async def read():
            async for out in gen.deltas():
                blocks.feed(out)

        await run_while_connected(read(), request, gen)
        return JSONResponse(builder.message(), headers={"x-request-id": request_id})

    async def events():
        yield builder.event("message_start", message=builder.message(done=False))
        yield builder.event("ping")
        try:
            async for out in gen.deltas():
                for event in blocks.feed(out):
                    yield builder.block_event(event)
        except Exception as exc:  # RequestFailed, or a bug: the client is told, never left hanging
            if not isinstance(exc, RequestFailed):
                log.exception("stream %s failed", request_id)
            message = exc.message if isinstance(exc, RequestFailed) else internal_error_message()
            yield {"event": "error", "data": json.dumps(error_body(request.url.path, 500, message))}
            return
        reason, sequence = builder.stop()
        yield builder.event("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence},
                            usage={"output_tokens": blocks.num_output_tokens})
        yield builder.event("message_stop")

    return event_stream_response(events(), request_id, on_backlog=slow_reader_end(request.url.path, done=False))


@router.post("/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, request: Request):
    engine, _ = await route_start(request, body, None)
    prompts, *_ = await encode(engine, _job(body, request.app.state.image_limits))
    return {"input_tokens": len(prompts[0])}

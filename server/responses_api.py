"""`POST /v1/responses` and `GET /v1/responses/{id}`: OpenAI's Responses API over the chat path
(frontend/request.py: the same template, tools, constraint, admission and engine as
`/v1/chat/completions`).

The input (a string, or message / function_call / function_call_output / reasoning items) becomes a
chat conversation after `instructions`; the output is a list of items (a `reasoning` item for a
thinking model's thought, a `message` with one `output_text` part, `function_call`s). A stream is
`event: <type>` / `data: {json}` with OpenAI's semantic events (response.created, ...output_item.added,
...output_text.delta, ..., response.completed, or response.incomplete at `max_output_tokens`); a
failure after the start is an `error` event, then `response.failed`. A stored response (`store`,
the default) is kept in a bounded in-memory store for `GET`, `DELETE`, `GET .../input_items` and a
later `previous_response_id`, whose conversation (not its instructions) then comes before the new input.

A response id is a capability, as OpenAI's are: 192 random bits from the OS's CSPRNG, never derived
from the request id or any header, and the only thing that finds a stored response. Storing never
replaces an entry; anything but a stored id is a 404.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Literal

from fastapi import APIRouter, Header, Query, Request
from fastapi.responses import JSONResponse, Response

from engine.request import FinishReason
from frontend.admission import RequestFailed
from frontend.images import take_images
from frontend.request import ChatJob
from server.reply_blocks import Block, ReplyBlocks
from server.errors import ApiError, BODY_FIELDS, internal_error_message, slow_reader_end
from server.responses_schemas import FunctionCallItem, FunctionCallOutputItem, MessageItem, ResponsesRequest
from server.sse import event_stream_response
from server.streaming import route_start, run_while_connected, start

router = APIRouter(prefix="/v1")
log = logging.getLogger("rill.server")
BODY_FIELDS["/v1/responses"] = list(ResponsesRequest.model_fields)

MAX_STORED_RESPONSES = 512
MAX_STORED_BYTES = 32 * 2**20  # their JSON (response, conversation, input items) together; the oldest go first
_ENTRY_BYTES = 512  # an entry's own objects and its key, beside its three JSON strings
_ID_BYTES = 24  # a response id's randomness: 192 bits


def new_response_id() -> str:
    return f"resp_{secrets.token_hex(_ID_BYTES)}"


@dataclass
class Stored:
    """One stored response, kept as JSON: its size in memory is its size here."""

    response: bytes  # what GET returns
    history: bytes  # the conversation up to and with this response's output (no instructions)
    items: bytes  # its input items, as GET .../input_items lists them
    nbytes: int


class ResponseStore:
    """The stored responses by id, oldest dropped first past `max_count` entries or `max_bytes`
    (`nbytes` is always the sum of the live entries' sizes)."""

    def __init__(self, max_count: int = MAX_STORED_RESPONSES, max_bytes: int = MAX_STORED_BYTES):
        self.max_count, self.max_bytes = max_count, max_bytes
        self.items: OrderedDict[str, Stored] = OrderedDict()
        self.nbytes = 0

    def put(self, response: dict, history: list[dict], items: list[dict]) -> bool:
        """Store `response` under its id; False (nothing changed) if that id is taken or it alone is
        larger than the store."""
        response_id = response["id"]
        if response_id in self.items:
            return False
        parts = [json.dumps(value, ensure_ascii=False).encode() for value in (response, history, items)]
        nbytes = _ENTRY_BYTES + sum(len(part) for part in parts)
        if nbytes > self.max_bytes:
            return False
        self.items[response_id] = Stored(*parts, nbytes)
        self.nbytes += nbytes
        while len(self.items) > self.max_count or self.nbytes > self.max_bytes:
            self.evict_oldest()
        return True

    def evict_oldest(self) -> str | None:
        if not self.items:
            return None
        response_id, dropped = self.items.popitem(last=False)
        self.nbytes -= dropped.nbytes
        return response_id

    def get(self, response_id: str, param: str | None = None) -> Stored:
        stored = self.items.get(response_id)
        if stored is None:
            raise self.not_found(response_id, param)
        return stored

    def delete(self, response_id: str) -> None:
        stored = self.items.pop(response_id, None)
        if stored is None:
            raise self.not_found(response_id)
        self.nbytes -= stored.nbytes

    def not_found(self, response_id: str, param: str | None = None) -> ApiError:
        shown = response_id if len(response_id) <= 128 else response_id[:125] + "..."
        return ApiError(404, f"No response `{shown}` is stored on this server. A stored response is found by the "
                             f"exact id its answer carried; responses made with `store: false` are not kept, and past "
                             f"{self.max_count} responses or {self.max_bytes} bytes the oldest are dropped.",
                        param=param, code="response_not_found")


def _store(request: Request) -> ResponseStore:
    state = request.app.state
    if getattr(state, "responses", None) is None:
        state.responses = ResponseStore()
    return state.responses


def input_items(body: ResponsesRequest) -> list[dict]:
    """The request's input as OpenAI lists a response's input items (each with an id of its own)."""
    def item_id(prefix: str) -> str:
        return f"{prefix}_{secrets.token_hex(12)}"

    if isinstance(body.input, str):
        return [{"type": "message", "id": item_id("msg"), "role": "user", "status": "completed",
                 "content": [{"type": "input_text", "text": body.input}]}]
    out = []
    for item in body.input:
        if isinstance(item, MessageItem):
            kind = "output_text" if item.role == "assistant" else "input_text"
            out.append({"type": "message", "id": item_id("msg"), "role": item.role, "status": "completed",
                        "content": [{"type": kind, "text": item.text()}]})
        elif isinstance(item, FunctionCallItem):
            out.append({"type": "function_call", "id": item_id("fc"), "call_id": item.call_id, "name": item.name,
                        "arguments": item.arguments, "status": "completed"})
        elif isinstance(item, FunctionCallOutputItem):
            out.append({"type": "function_call_output", "id": item_id("fco"), "call_id": item.call_id,
                        "output": item.text(), "status": "completed"})
        else:
            out.append({"type": "reasoning", "id": item_id("rs"), "summary": []})
    return out


def input_messages(body: ResponsesRequest, history: list[dict]) -> list[dict]:
    """The input items as chat messages (after `history`'s, whose calls name the results' functions)."""
    if isinstance(body.input, str):
        return [{"role": "user", "content": body.input}]
    names = {c["id"]: c["function"]["name"] for m in history for c in m.get("tool_calls") or ()}
    out: list[dict] = []
    for item in body.input:
        if isinstance(item, MessageItem):
            out.append({"role": "system" if item.role == "developer" else item.role, "content": item.template_content()})
        elif isinstance(item, FunctionCallItem):
            names[item.call_id] = item.name
            call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
                out[-1]["content"] = out[-1]["content"] or None
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            message = {"role": "tool", "tool_call_id": item.call_id, "content": item.text()}
            if item.call_id in names:
                message["name"] = names[item.call_id]
            out.append(message)
    return out


class ResponseBuilder:
    """One response's object and stream events, from its reply's blocks."""

    def __init__(self, body: ResponsesRequest, model: str, blocks: ReplyBlocks):
        self.body, self.blocks, self.model = body, blocks, model
        self.id = new_response_id()  # never the request id: that one is a label the client may choose
        self.created_at = int(time.time())
        self.item_ids: dict[int, str] = {}
        self.sequence = 0
        self.num_prompt_tokens = 0

    def item(self, block: Block, done: bool = True) -> dict:
        prefix = {"reasoning": "rs", "text": "msg", "call": "fc"}[block.kind]
        item_id = self.item_ids.setdefault(block.index, f"{prefix}_{secrets.token_hex(12)}")
        status = "completed" if done else "in_progress"
        if block.kind == "reasoning":
            return {"type": "reasoning", "id": item_id, "summary": [], "status": status,
                    "content": [{"type": "reasoning_text", "text": block.text}] if done else []}
        if block.kind == "text":
            return {"type": "message", "id": item_id, "status": status, "role": "assistant",
                    "content": [self.part(block)] if done else []}
        return {"type": "function_call", "id": item_id, "call_id": block.call.id, "name": block.call.name,
                "arguments": block.text if done else "", "status": status}

    @staticmethod
    def part(block: Block) -> dict:
        return {"type": "output_text", "text": block.text, "annotations": [], "logprobs": []}

    def status(self) -> str:
        if self.blocks.finish_reason is None:
            return "in_progress"
        return "incomplete" if self.blocks.finish_reason == FinishReason.LENGTH else "completed"

    def response(self, status: str | None = None, error: dict | None = None) -> dict:
        body, status = self.body, status or self.status()
        usage = None
        if status != "in_progress":
            output = self.blocks.num_output_tokens
            usage = {"input_tokens": self.num_prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
                     "output_tokens": output, "output_tokens_details": {"reasoning_tokens": self.blocks.reasoning_tokens},
                     "total_tokens": self.num_prompt_tokens + output}
        choice = body.tool_choice
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens, "model": self.model,
            "output": [self.item(b) for b in self.blocks.blocks] if status != "in_progress" else [],
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "reasoning": (body.reasoning.model_dump() if body.reasoning else {"effort": None, "summary": None}),
            "store": body.store, "temperature": 1.0 if body.temperature is None else body.temperature,
            "text": {"format": body.text.format.model_dump(by_alias=True, exclude_none=True)
                     if body.text and body.text.format else {"type": "text"}},
            "tool_choice": choice.model_dump() if hasattr(choice, "model_dump") else (choice or "auto"),
            "tools": [t.model_dump() for t in body.tools or ()], "top_p": 1.0 if body.top_p is None else body.top_p,
            "truncation": body.truncation or "disabled", "usage": usage, "user": body.user,
            "metadata": body.metadata or {},
        }

    def event(self, kind: str, **fields) -> dict:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return {"event": kind, "data": json.dumps(payload, ensure_ascii=False)}

    def block_events(self, event: tuple) -> list[dict]:
        """The stream events of one ReplyBlocks event (start, delta or stop of a block)."""
        what, block = event[0], event[1]
        if what == "start":
            events = [self.event("response.output_item.added", output_index=block.index, item=self.item(block, False))]
            if block.kind == "text":
                events.append(self.event("response.content_part.added", **self._at(block), content_index=0,
                                         part={**self.part(block), "text": ""}))
            return events
        where = self._at(block)
        if what == "delta":
            piece = event[2]
            if block.kind == "reasoning":
                return [self.event("response.reasoning_text.delta", **where, content_index=0, delta=piece)]
            if block.kind == "text":
                return [self.event("response.output_text.delta", **where, content_index=0, delta=piece, logprobs=[])]
            return [self.event("response.function_call_arguments.delta", **where, delta=piece)]
        if block.kind == "reasoning":
            events = [self.event("response.reasoning_text.done", **where, content_index=0, text=block.text)]
        elif block.kind == "text":
            events = [self.event("response.output_text.done", **where, content_index=0, text=block.text, logprobs=[]),
                      self.event("response.content_part.done", **where, content_index=0, part=self.part(block))]
        else:
            events = [self.event("response.function_call_arguments.done", **where, name=block.call.name,
                                 arguments=block.text)]
        return events + [self.event("response.output_item.done", output_index=block.index, item=self.item(block))]

    def _at(self, block: Block) -> dict:
        return {"item_id": self.item(block, False)["id"], "output_index": block.index}

    def history(self, conversation: list[dict]) -> list[dict]:
        """The conversation with this response's answer (its thought left out, as templates do)."""
        text = "".join(b.text for b in self.blocks.blocks if b.kind == "text")
        calls = [{"id": b.call.id, "type": "function", "function": {"name": b.call.name, "arguments": b.text}}
                 for b in self.blocks.blocks if b.kind == "call"]
        answer = {"role": "assistant", "content": text if text or not calls else None}
        if calls:
            answer["tool_calls"] = calls
        return [*conversation, answer]


@router.post("/responses")
async def create_response(body: ResponsesRequest, request: Request, x_request_id: str | None = Header(None)):
    engine, request_id = await route_start(request, body, x_request_id)
    store = _store(request)
    history = json.loads(store.get(body.previous_response_id, "previous_response_id").history) \
        if body.previous_response_id else []
    conversation = [*history, *input_messages(body, history)]
    instructions = [{"role": "system", "content": body.instructions}] if body.instructions else []
    messages, images = take_images([*instructions, *conversation], request.app.state.image_limits, "input")
    job = ChatJob(messages, sampling=body.sampling(), max_tokens=body.max_output_tokens,
                  open_ended=True, tools=body.tool_request(), constraint=body.constraint(),
                  template_kwargs=body.template_kwargs(), param="input", format_param="text.format",
                  images=images or None)
    gens, prepared = await start(request, job, request_id, "v1_responses")
    gen = gens[0]
    blocks = ReplyBlocks(prepared.fmt)
    builder = ResponseBuilder(body, engine.model_name, blocks)
    builder.num_prompt_tokens = gen.num_prompt_tokens

    def keep(response: dict) -> None:
        if body.store:
            store.put(response, builder.history(conversation), input_items(body))

    if not body.stream:
        async def read():
            async for out in gen.deltas():
                blocks.feed(out)

        await run_while_connected(read(), request, gen)
        response = builder.response()
        keep(response)
        return JSONResponse(response, headers={"x-request-id": request_id})

    async def events():
        yield builder.event("response.created", response=builder.response("in_progress"))
        yield builder.event("response.in_progress", response=builder.response("in_progress"))
        try:
            async for out in gen.deltas():
                for event in blocks.feed(out):
                    for sse in builder.block_events(event):
                        yield sse
        except Exception as exc:  # RequestFailed, or a bug: the client is told, never left hanging
            if not isinstance(exc, RequestFailed):
                log.exception("stream %s failed", request_id)
            message = exc.message if isinstance(exc, RequestFailed) else internal_error_message()
            code = exc.code if isinstance(exc, RequestFailed) else "internal_error"
            yield builder.event("error", code=code, message=message, param=None)
            yield builder.event("response.failed", response=builder.response(
                "failed", {"code": "server_error", "message": message}))
            return
        response = builder.response()
        keep(response)
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        yield builder.event(kind, response=response)

    return event_stream_response(events(), request_id, on_backlog=slow_reader_end(request.url.path, done=False))


@router.get("/responses/{response_id}")
async def get_response(response_id: str, request: Request):
    return Response(_store(request).get(response_id).response, media_type="application/json")


@router.delete("/responses/{response_id}")
async def delete_response(response_id: str, request: Request):
    _store(request).delete(response_id)
    return {"id": response_id, "object": "response", "deleted": True}


@router.get("/responses/{response_id}/input_items")
async def list_input_items(response_id: str, request: Request, limit: int = Query(20, ge=1, le=100),
                           order: Literal["asc", "desc"] = "desc", after: str | None = None,
                           before: str | None = None):
    """OpenAI's cursor list of a stored response's input items (`after` / `before`: an item id)."""
    items = json.loads(_store(request).get(response_id).items)
    if order == "desc":
        items.reverse()
    ids = [item["id"] for item in items]
    for cursor, name in ((after, "after"), (before, "before")):
        if cursor is not None and cursor not in ids:
            raise ApiError(400, f"`{name}` must be the id of one of this response's input items. "
                                f"Given: {cursor[:128]!r}", param=name)
    start = ids.index(after) + 1 if after is not None else 0
    stop = ids.index(before) if before is not None else len(items)
    page = items[start:stop][:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": start + len(page) < stop}

"""The chat logic behind the page, free of Gradio layout: the page's settings and history in, the
streamed answer out, through the same path as every HTTP route.

`stream_answer` fills the one request record (frontend/request.py `ChatJob`), prepares and admits it
and reads its `Generation` (deadline, abort when closed, metrics), yielding the growing text; closing
it (Stop in the page, a cancelled gradio_client job, a closed tab) aborts the engine request.
`answer_messages` is what the page shows of an answer (a "Thinking" box, tool calls as tool
messages). The conversation's shapes and bounds are in ui/history.py, the escaping in ui/markup.py.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from engine.request import Constraint, new_request_id
from frontend.images import ImageLimits, take_images
from frontend.request import ChatJob, RequestDefaults, Sampling, prepare, start_job
from frontend.tool_parsers import HermesParser, Llama3Parser
from ui.history import ChatError, check_history, content_text
from ui.markup import escape_html

OUTPUT_FORMATS = ("Text", "JSON object", "JSON schema")  # the page's "JSON mode / schema" choice


@dataclass(frozen=True, slots=True)
class ChatSettings:
    """What the page, its `/chat` API and its MCP tools send besides the conversation; a sampling
    field left None takes the one set of defaults (the model's, then rill's), as on every route."""

    system_prompt: str = ""
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # 0 = off
    max_new_tokens: int | None = None  # None: --max-new-tokens
    repetition_penalty: float | None = None
    output_format: str = "Text"  # one of OUTPUT_FORMATS
    json_schema: str = ""  # the schema (JSON text) when output_format is "JSON schema"
    max_reasoning_tokens: int | None = None  # the thought's budget (None or 0: no limit but max_new_tokens)
    cache_salt: str | None = None  # the page session's prefix-cache salt (--cache-salt-per-session)
    image_limits: ImageLimits = ImageLimits()  # --limit-images, --max-image-bytes, ... (frontend/images.py)

    def constraint(self) -> Constraint | None:
        if self.output_format not in OUTPUT_FORMATS:
            raise ChatError(f"The output format must be one of {', '.join(OUTPUT_FORMATS)}. "
                            f"Given: {self.output_format!r}")
        if self.output_format == "JSON object":
            return Constraint("json_object")
        if self.output_format == "JSON schema":
            if not isinstance(self.json_schema, str) or not self.json_schema.strip():
                raise ChatError("JSON schema output needs a schema: paste one into the schema box "
                                '(for example {"type": "object", "properties": {"name": {"type": "string"}}}).')
            return Constraint("json_schema", self.json_schema, strict=True)  # InvalidRequest: not a schema
        return None

    def job(self, history: list[dict], message) -> ChatJob:
        """The one request record of `message` after `history` (the page's own fields checked here;
        the sampling fields by `SamplingParams`, once, before any tokenizing). `message`: its text, or
        a list of parts with images (ui/history.py); images anywhere in the conversation go through
        frontend/images.py's `take_images`, as every route's do (its limits, its 400s)."""
        parts = message if isinstance(message, list) else None
        if parts is not None:
            message = content_text(parts)
        if not isinstance(message, str):
            raise ChatError(f"`message` must be a string. Given: {type(message).__name__}")
        if not message.strip() and not parts:
            raise ChatError("The message is empty: type something to send.")
        if not isinstance(self.system_prompt, str):
            raise ChatError(f"`system_prompt` must be a string. Given: {type(self.system_prompt).__name__}")
        check_history(history)
        max_new_tokens = self.max_new_tokens
        if max_new_tokens is not None:
            try:
                whole = int(max_new_tokens)
            except (TypeError, ValueError, OverflowError):
                whole = None
            if whole is None or whole < 1 or whole != max_new_tokens:
                raise ChatError(f"`max_new_tokens` must be an integer >= 1. Given: {max_new_tokens!r}")
            max_new_tokens = whole
        budget = _whole(self.max_reasoning_tokens) or None
        sampling = Sampling(temperature=self.temperature, top_p=self.top_p, top_k=_whole(self.top_k),
                            repetition_penalty=self.repetition_penalty, max_reasoning_tokens=budget,
                            cache_salt=self.cache_salt)
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt.strip() else []
        messages = system + [m for m in history if m["role"] != "system"] + [{"role": "user", "content": parts or message}]
        job = ChatJob(messages, sampling=sampling, max_tokens=max_new_tokens, constraint=self.constraint(),
                      fit_context=True, param="message", max_tokens_param="max_new_tokens")
        if any(isinstance(m["content"], list) for m in messages):
            job.messages, job.images = take_images(messages, self.image_limits, "message")
        return job


def _whole(value):
    """50.0 -> 50 (a slider's value); anything else unchanged."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


@dataclass(slots=True)
class AnswerStats:
    """What the page shows under the chat about the answer being (or last) generated."""

    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    ttft_s: float | None = None  # arrival to first text
    elapsed_s: float = 0.0  # arrival to now (or to the end)
    decode_tokens_per_s: float | None = None  # tokens after the first, per second after the first
    finish_reason: str | None = None  # None while streaming
    dropped_turns: int = 0
    reasoning: str = ""  # the thought so far (a thinking model)
    thinking: bool = False  # the thought is still being written
    reasoning_s: float | None = None  # how long the thought took (from its first piece to the answer's)
    thought_start: float | None = None  # when its first piece came (monotonic)

    def markdown(self) -> str:
        if self.num_output_tokens == 0 and self.finish_reason is None:
            return f"Waiting for the first token… (prompt: {self.num_prompt_tokens} tokens)"
        parts = [f"**{self.num_output_tokens} tokens**"]
        if self.decode_tokens_per_s is not None:
            parts.append(f"**{self.decode_tokens_per_s:.1f} tokens/s**")
        if self.ttft_s is not None:
            parts.append(f"first token after {self.ttft_s:.2f} s")
        parts.append(f"{self.elapsed_s:.1f} s in all")
        parts.append(f"prompt {self.num_prompt_tokens} tokens")
        if self.dropped_turns:
            parts.append(f"{self.dropped_turns} oldest turn(s) trimmed to fit the context")
        state = "Streaming" if self.finish_reason is None else f"Last answer ({self.finish_reason})"
        return f"{state}: " + " · ".join(parts)

    def add(self, out, arrival: float, first: list, now: float) -> None:
        """One delta of the answer (`first`: [time of the first token], filled here)."""
        if out.num_output_tokens and not first:
            first.append(now)
            self.ttft_s = max(0.0, now - arrival)
        self.num_output_tokens = max(self.num_output_tokens, out.num_output_tokens)
        self.elapsed_s = now - arrival
        if first and self.num_output_tokens > 1 and now > first[0]:
            self.decode_tokens_per_s = (self.num_output_tokens - 1) / (now - first[0])
        if out.reasoning:
            if self.thought_start is None:
                self.thought_start = now
            self.thinking = True
            self.reasoning += out.reasoning
        if self.thinking:
            self.reasoning_s = now - self.thought_start
            self.thinking = not (out.text or out.finished)
        if out.finished:
            self.finish_reason = out.finish_reason.value


async def stream_answer(engine, defaults: RequestDefaults, history: list[dict], message, settings: ChatSettings, *,
                        admission: dict, warn: Callable[[str], None] | None = None,
                        watch: Callable[[object], Callable[[], None]] | None = None
                        ) -> AsyncIterator[tuple[str, AnswerStats]]:
    """Yields (text so far, stats) as the engine streams the answer to `message` after `history`.

    `admission`: `Generation`'s keywords (route, metrics, timeout, client), as a route passes them.
    Raises what the request path raises (ChatError, InvalidRequest, ApiError before the answer,
    RequestFailed during it); ui/handlers.py `page_error` turns each into what the page shows.
    `watch(generation)` is called once the request is admitted (to abort it when the visitor's tab
    closes); what it returns is called when the request ends.
    """
    job = settings.job(history, message)
    arrival = time.monotonic()
    prepared = await prepare(engine, job, defaults, client=admission.get("client"))
    if prepared.dropped_turns and warn is not None:
        warn(f"The conversation is longer than the model's context ({engine.max_model_len} tokens): "
             f"the {prepared.dropped_turns} oldest turn(s) were left out of this answer's prompt.")
    if prepared.params.max_tokens < prepared.asked_max_tokens and warn is not None:
        warn(f"Only {prepared.params.max_tokens} tokens of the context are left for the answer "
             f"(asked: {prepared.asked_max_tokens}); it may be cut short.")
    gen = (await start_job(engine, job, prepared, new_request_id(), **admission))[0]
    unwatch = watch(gen) if watch is not None else None
    stats = AnswerStats(num_prompt_tokens=gen.num_prompt_tokens, dropped_turns=prepared.dropped_turns)
    text, first = "", []
    try:
        async with contextlib.aclosing(gen.deltas()) as deltas:
            async for out in deltas:
                stats.add(out, arrival, first, time.monotonic())
                text += out.text
                yield text, stats
    finally:
        if unwatch is not None:
            unwatch()


# --- what the page shows of an answer ------------------------------------------------------------

_PARSERS = {"hermes": HermesParser, "llama3_json": Llama3Parser}  # formats a model writes calls in unasked


def answer_messages(text: str, stats: AnswerStats, tool_format: str | None = None) -> list[dict]:
    """The chat messages of one answer: a collapsible "Thinking" message (pending while the thought
    is written, then done with its duration), the answer, and each tool call the model wrote (in
    `tool_format`, hermes or llama3_json) as a tool message with its arguments, never raw markup.
    Text is HTML-escaped (see `escape_html`)."""
    messages = []
    if stats.reasoning:
        metadata = {"title": "Thinking", "status": "pending" if stats.thinking else "done"}
        if stats.reasoning_s is not None and not stats.thinking:
            metadata["duration"] = round(stats.reasoning_s, 2)
        messages.append({"role": "assistant", "content": escape_html(stats.reasoning), "metadata": metadata})
    parser_class = _PARSERS.get(tool_format or "")
    if parser_class is None:
        return messages + [{"role": "assistant", "content": escape_html(text)}]
    parser = parser_class()
    events = parser.feed(text) + (parser.finish() if stats.finish_reason is not None else [])
    content = "".join(value for kind, value in events if kind == "content")
    if content or not any(kind == "call" for kind, _ in events):
        messages.append({"role": "assistant", "content": escape_html(content)})
    for kind, call in events:
        if kind == "call":
            try:
                arguments = json.dumps(json.loads(call.arguments), indent=2, ensure_ascii=False)
            except ValueError:
                arguments = call.arguments
            messages.append({"role": "assistant", "content": f"```json\n{arguments}\n```",
                             "metadata": {"title": f"🛠️ Called tool `{call.name}`", "status": "done"}})
    if isinstance(parser, HermesParser) and parser.inside:  # a call being written
        messages.append({"role": "assistant", "content": "", "metadata": {"title": "🛠️ Calling a tool…",
                                                                         "status": "pending"}})
    return messages

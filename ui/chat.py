"""The chat logic behind the page, free of Gradio layout: settings and history in, streamed answer out.

`stream_answer` is the generator: it admits the request through the front end's one admission
path (a threaded `TextIteratorStreamer`, frontend/admission.py `admit_text`) and yields the
growing text; closing it (Stop in the page, a cancelled gradio_client job) aborts the engine
request. `answer_messages` is what the page shows of an answer (a "Thinking" box, tool calls as
tool messages). The conversation's bounds and trimming are in ui/history.py, the escaping in
ui/markup.py.
"""

from __future__ import annotations

import json
import queue
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from engine.request import Constraint, InvalidRequest, SamplingParams
from engine.streamers import ReasoningPiece
from frontend.admission import admit_text
from frontend.errors import ApiError
from frontend.telemetry import queue_time_of
from frontend.tool_parsers import HermesParser, Llama3Parser
from ui.history import ChatError, check_history, fit_to_context
from ui.markup import escape_html

WAIT_POLL_S = 0.25  # while no token comes, the generator wakes this often so Stop can close it
OUTPUT_FORMATS = ("Text", "JSON object", "JSON schema")  # the page's "JSON mode / schema" choice
@dataclass(frozen=True, slots=True)
class ChatSettings:
    """The sampling settings the page and the `/chat` API take."""

    system_prompt: str = ""
    temperature: float = 0.7
    top_p: float = 0.9
    top_k: int = 50
    max_new_tokens: int = 512
    repetition_penalty: float = 1.1
    output_format: str = "Text"  # one of OUTPUT_FORMATS
    json_schema: str = ""  # the schema (JSON text) when output_format is "JSON schema"
    reasoning: bool = False  # split a thinking model's thought from its answer
    max_reasoning_tokens: int | None = None  # the thought's budget (None or 0: no limit but max_new_tokens)
    cache_salt: str | None = None  # the page session's prefix-cache salt (--cache-salt-per-session)

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
            try:
                return Constraint("json_schema", self.json_schema, strict=True)
            except InvalidRequest as exc:
                raise ChatError(str(exc)) from exc
        return None

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        """Raises `ChatError` with the engine's message (what was wrong, allowed, given). Values go
        to `SamplingParams` as they came (it checks type, finiteness and range), except that a
        whole float such as a slider's 50.0 counts as the integer it is."""
        constraint = self.constraint()
        budget = _whole(self.max_reasoning_tokens) or None
        try:
            return SamplingParams(max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
                                  top_k=_whole(self.top_k), repetition_penalty=self.repetition_penalty,
                                  constraint=constraint, reasoning=self.reasoning,
                                  max_reasoning_tokens=min(budget, max_tokens) if isinstance(budget, int) else budget,
                                  cache_salt=self.cache_salt)
        except InvalidRequest as exc:
            raise ChatError(str(exc)) from exc


def _whole(value):
    """50.0 -> 50; anything else unchanged."""
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


def _checked_max_new_tokens(message, settings: ChatSettings, history: list[dict]) -> int:
    """The request's checks before any tokenizing; returns max_new_tokens as an int."""
    if not isinstance(message, str):
        raise ChatError(f"`message` must be a string. Given: {type(message).__name__}")
    if not message.strip():
        raise ChatError("The message is empty: type something to send.")
    if not isinstance(settings.system_prompt, str):
        raise ChatError(f"`system_prompt` must be a string. Given: {type(settings.system_prompt).__name__}")
    check_history(history)
    try:
        max_new_tokens = int(settings.max_new_tokens)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ChatError(f"`max_new_tokens` must be an integer >= 1. Given: {settings.max_new_tokens!r}") from exc
    if max_new_tokens < 1 or max_new_tokens != settings.max_new_tokens:
        raise ChatError(f"`max_new_tokens` must be an integer >= 1. Given: {settings.max_new_tokens!r}")
    settings.sampling_params(max_new_tokens)  # the parameters are checked before any tokenizing
    return max_new_tokens


class _Progress:
    """One answer's stats as its pieces arrive (what the page shows under the chat), and its
    metrics record (tokens as they come, the end with its finish reason)."""

    def __init__(self, streamer, stats: AnswerStats, arrival: float, tracker):
        self.streamer, self.stats, self.arrival, self.tracker = streamer, stats, arrival, tracker
        self.first_time: float | None = None
        self.thought_start = arrival

    def produced(self) -> int:
        return int(getattr(self.streamer, "num_output_tokens", 0) or 0)

    def _rate(self, now: float) -> None:
        self.stats.elapsed_s = now - self.arrival
        if self.first_time is not None and self.stats.num_output_tokens > 1 and now > self.first_time:
            self.stats.decode_tokens_per_s = (self.stats.num_output_tokens - 1) / (now - self.first_time)

    def piece(self, piece: str, now: float) -> bool:
        """Records a piece; True when the page has something new to show."""
        stats, produced = self.stats, self.produced()
        first_token_time = getattr(self.streamer, "first_token_time", None)
        if self.first_time is None and (piece or produced):
            self.first_time = first_token_time or now
            stats.ttft_s = max(0.0, self.first_time - self.arrival)
        if self.tracker is not None and produced > self.tracker.num_output_tokens:
            self.tracker.tokens(produced - self.tracker.num_output_tokens, now=now, first_token_time=first_token_time)
        stats.num_output_tokens = max(produced, self.tracker.num_output_tokens if self.tracker else 0,
                                      stats.num_output_tokens)
        self._rate(now)
        if isinstance(piece, ReasoningPiece):
            if not stats.thinking:
                stats.thinking, self.thought_start = True, now
            stats.reasoning += piece
            stats.reasoning_s = now - self.thought_start
            return True
        if piece and stats.thinking:
            stats.thinking = False
            stats.reasoning_s = now - self.thought_start
        return bool(piece)

    def end(self, finished: bool) -> str:
        """The answer ended (`finished`: it reached its end, else it was closed); returns the finish reason."""
        now, stats, streamer = time.monotonic(), self.stats, self.streamer
        reason = getattr(streamer, "finish_reason", None)
        reason = str(getattr(reason, "value", reason)) if reason is not None and finished else "abort"
        produced = self.produced()
        stats.num_output_tokens = max(produced, stats.num_output_tokens)
        stats.finish_reason = reason
        if stats.thinking:
            stats.thinking = False
            stats.reasoning_s = now - self.thought_start
        self._rate(now)
        if self.tracker is not None:
            queue_time = queue_time_of(streamer)
            if queue_time is None and getattr(streamer, "scheduled_time", None) is not None:
                queue_time = max(0.0, streamer.scheduled_time - self.arrival)
            self.tracker.finish(reason, num_output_tokens=produced if finished else None, now=now,
                                error=getattr(streamer, "error", None), queue_time=queue_time)
        return reason


def stream_answer(engine, metrics, route: str, history: list[dict], message: str, settings: ChatSettings,
                  warn: Callable[[str], None] | None = None,
                  watch: Callable[[object], Callable[[], None]] | None = None,
                  client: str | None = None) -> Iterator[tuple[str, AnswerStats]]:
    """Yields (text so far, stats) as the engine streams the answer to `message` after `history`.

    The engine request is aborted when the generator is closed before the end (Stop, a cancelled
    client job, a dropped connection). Raises `ChatError` for requests the engine refuses.
    `watch(streamer)` is called once the request is admitted (e.g. to abort it when the visitor's
    tab closes); what it returns is called when the request ends. `client`: the visitor, for the
    engine's fair shares (ui/handlers.py `page_client`).
    """
    max_new_tokens = _checked_max_new_tokens(message, settings, history)
    arrival = time.monotonic()
    fitted = fit_to_context(engine, history, message, settings.system_prompt or "", max_new_tokens)
    if fitted.dropped_turns and warn is not None:
        warn(f"The conversation is longer than the model's context ({engine.max_model_len} tokens): "
             f"the {fitted.dropped_turns} oldest turn(s) were left out of this answer's prompt.")
    if fitted.max_tokens < max_new_tokens and warn is not None:
        warn(f"Only {fitted.max_tokens} tokens of the context are left for the answer "
             f"(asked: {max_new_tokens}); it may be cut short.")
    params = settings.sampling_params(fitted.max_tokens)
    try:
        streamer = admit_text(engine, fitted.prompt_token_ids, params, metrics=metrics, route=route, client=client)
    except ApiError as exc:
        raise ChatError(exc.message) from exc
    streamer.timeout = WAIT_POLL_S  # TextIteratorStreamer raises queue.Empty past it; we wait again
    unwatch = watch(streamer) if watch is not None else None
    tracker = metrics.start(route, num_prompt_tokens=len(fitted.prompt_token_ids),
                            request_id=getattr(streamer, "request_id", None), arrival_time=arrival) \
        if metrics is not None else None
    stats = AnswerStats(num_prompt_tokens=len(fitted.prompt_token_ids), dropped_turns=fitted.dropped_turns)
    progress = _Progress(streamer, stats, arrival, tracker)
    text = ""
    finished = False
    try:
        iterator = iter(streamer)
        while True:
            try:
                piece = next(iterator)
            except StopIteration:
                break
            except queue.Empty:
                stats.elapsed_s = time.monotonic() - arrival
                yield text, stats  # nothing new: a chance for Stop to close the generator
                continue
            if progress.piece(piece, time.monotonic()):
                if not isinstance(piece, ReasoningPiece):
                    text += piece
                yield text, stats
        finished = True
    finally:
        if not finished:
            streamer.abort()
        if unwatch is not None:
            unwatch()
        reason = progress.end(finished)
    if reason == "error":
        raise ChatError(f"The engine failed while answering: {getattr(streamer, 'error', None) or 'unknown error'}")
    yield text, stats  # the final stats (finish reason, totals)


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

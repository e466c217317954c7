"""The chat logic behind the page, free of Gradio layout: history in, streamed answer out.

- `to_engine_messages` turns a Gradio history (any of its message shapes) into plain
  `{"role", "content"}` dicts;
- `check_history` bounds a client-given conversation (messages and characters);
- `fit_to_context` drops the oldest turns until prompt + answer fit the model's context (a binary
  search over the number dropped: a few template renders, not one per turn);
- `escape_html` / `unescape_html` keep model and user text from ever becoming HTML in the page
  (markdown and code still render; `<img src=x onerror=...>` shows as text);
- `stream_answer` is the generator: it feeds the engine's threaded `TextIteratorStreamer`
  (`engine.text_streamer`) and yields the growing text; closing it (Stop in the page, a cancelled
  gradio_client job) aborts the engine request.
"""

from __future__ import annotations

import json
import queue
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from engine.request import (MAX_CHARS_PER_TOKEN, Constraint, InvalidRequest, SamplingParams,
                            prompt_char_limit)
from engine.streamers import ReasoningPiece
from frontend.telemetry import queue_time_of
from frontend.admission import admit_text
from frontend.errors import ApiError
from frontend.tools import HermesParser, Llama3Parser

WAIT_POLL_S = 0.25  # while no token comes, the generator wakes this often so Stop can close it
OUTPUT_FORMATS = ("Text", "JSON object", "JSON schema")  # the page's "JSON mode / schema" choice
MAX_HISTORY_MESSAGES = 1000  # messages of a conversation the page or its API takes
MAX_HISTORY_CHARS = 1_000_000  # characters of all its messages together


class ChatError(Exception):
    """A chat request the page cannot serve; the message is shown to the user as is."""


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


# --- HTML escaping outside code -------------------------------------------------------------------

_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
_BACKTICKS = re.compile(r"`+")


def _split_code(text: str) -> list[tuple[bool, str]]:
    """Cuts markdown `text` into (is_code, piece): fenced blocks and inline code spans are code.

    An unclosed fence runs to the end, as markdown renders it (so a streaming code block stays code).
    """
    pieces: list[tuple[bool, str]] = []
    prose: list[str] = []
    fence: str | None = None
    block: list[str] = []
    for line in text.splitlines(keepends=True):
        match = _FENCE.match(line)
        if fence is None:
            if match:
                if prose:
                    pieces.extend(_split_inline("".join(prose)))
                    prose = []
                fence = match.group(1)
                block = [line]
            else:
                prose.append(line)
        else:
            block.append(line)
            if match and match.group(1)[0] == fence[0] and len(match.group(1)) >= len(fence) \
                    and not line.strip()[len(match.group(1)):].strip():
                pieces.append((True, "".join(block)))
                fence, block = None, []
    if block:
        pieces.append((True, "".join(block)))
    if prose:
        pieces.extend(_split_inline("".join(prose)))
    return pieces


def _split_inline(text: str) -> list[tuple[bool, str]]:
    """Inline code spans: a run of n backticks up to the next run of exactly n backticks."""
    pieces: list[tuple[bool, str]] = []
    position = 0
    search_from = 0
    while True:
        opener = _BACKTICKS.search(text, search_from)
        if opener is None:
            break
        width = len(opener.group(0))
        closer = None
        for candidate in _BACKTICKS.finditer(text, opener.end()):
            if len(candidate.group(0)) == width:
                closer = candidate
                break
        if closer is None:
            search_from = opener.end()  # a lone backtick run is plain text
            continue
        if opener.start() > position:
            pieces.append((False, text[position:opener.start()]))
        pieces.append((True, text[opener.start():closer.end()]))
        position = search_from = closer.end()
    if position < len(text):
        pieces.append((False, text[position:]))
    return pieces


def escape_html(text: str) -> str:
    """`&` and `<` outside code become entities: no tag can form, markdown still renders."""
    return "".join(piece if is_code else piece.replace("&", "&amp;").replace("<", "&lt;")
                   for is_code, piece in _split_code(text))


def unescape_html(text: str) -> str:
    """The inverse of `escape_html` (the same pieces are code in the escaped text)."""
    return "".join(piece if is_code else piece.replace("&lt;", "<").replace("&amp;", "&")
                   for is_code, piece in _split_code(text))


# --- history ---------------------------------------------------------------------------------------

def content_text(content) -> str:
    """The text of one message's content: a string, a list of parts, or a dict part."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, dict):
        if content.get("type", "text") == "text" and isinstance(content.get("text"), str):
            return content["text"]
        return ""  # files and components carry no text for a text model
    if isinstance(content, (list, tuple)):
        return "".join(content_text(part) for part in content)
    text = getattr(content, "text", None)
    return text if isinstance(text, str) else ""


def to_engine_messages(history, *, escaped: bool) -> list[dict]:
    """Gradio history -> [{"role": "user" | "assistant" | "system", "content": str}].

    `escaped`: the history comes from the page's Chatbot (its text went through `escape_html`).
    Also takes gradio's older pair format [[user, assistant], ...]. Messages with no text are dropped.
    Raises `ChatError` when `history` is not a list, or longer than `check_history` allows.
    """
    if history is None:
        return []
    if not isinstance(history, (list, tuple)):
        raise ChatError("`history` must be a list of messages, [{\"role\": \"user\" | \"assistant\", "
                        f"\"content\": \"...\"}}, ...]. Given: {type(history).__name__}")
    _check_history_size(len(history), 0)  # before any per-message work
    texts: list[tuple[str, str]] = []  # (role, text), checked against the bounds before unescaping
    for item in history:
        if isinstance(item, (list, tuple)) and len(item) == 2 and not isinstance(item, dict):
            pairs = (("user", item[0]), ("assistant", item[1]))
        else:
            role = item.get("role") if isinstance(item, dict) else getattr(item, "role", None)
            content = item.get("content") if isinstance(item, dict) else getattr(item, "content", None)
            metadata = item.get("metadata") if isinstance(item, dict) else getattr(item, "metadata", None)
            if metadata and (metadata.get("title") if isinstance(metadata, dict) else None):
                continue  # tool/thought bubbles are not part of the conversation
            pairs = ((role, content),)
        for role, content in pairs:
            if role not in ("user", "assistant", "system"):
                continue
            text = content_text(content)
            if text:
                texts.append((role, text))
    _check_history_size(len(texts), sum(len(text) for _, text in texts))
    return [{"role": role, "content": unescape_html(text) if escaped else text} for role, text in texts]


def check_history(messages: list[dict]) -> None:
    """Raises `ChatError` for a conversation beyond MAX_HISTORY_MESSAGES messages or
    MAX_HISTORY_CHARS characters (what was wrong, what is allowed, what was given)."""
    _check_history_size(len(messages), sum(len(m["content"]) for m in messages))


def _check_history_size(num_messages: int, chars: int) -> None:
    if num_messages > MAX_HISTORY_MESSAGES:
        raise ChatError(f"The conversation is too long: at most {MAX_HISTORY_MESSAGES} messages are allowed. "
                        f"Given: {num_messages} messages. Start a new conversation (Clear).")
    if chars > MAX_HISTORY_CHARS:
        raise ChatError(f"The conversation is too long: at most {MAX_HISTORY_CHARS} characters are allowed in all "
                        f"its messages. Given: {chars} characters. Start a new conversation (Clear).")


@dataclass(slots=True)
class FittedPrompt:
    """A prompt that fits the context: its tokens, how many old turns were dropped, the answer budget."""

    prompt_token_ids: list[int]
    dropped_turns: int
    max_tokens: int  # the answer's token budget (max_new_tokens, or less where the context is short)


def _turns(messages: list[dict]) -> list[list[dict]]:
    """Groups messages into turns, each starting at a user message."""
    turns: list[list[dict]] = []
    for message in messages:
        if message["role"] == "user" or not turns:
            turns.append([message])
        else:
            turns[-1].append(message)
    return turns


def fit_to_context(engine, history: list[dict], message: str, system_prompt: str,
                   max_new_tokens: int) -> FittedPrompt:
    """Tokens of [system] + history + message, dropping the oldest turns until the answer fits.

    The fewest turns dropped is found by binary search (the prompt only shrinks as turns go), so a
    conversation of T turns costs about log2(T) + 2 template renders; turns that alone exceed the
    character bound of the context are dropped before any render. Raises `ChatError` when even the
    message alone leaves no room for an answer.
    """
    context = int(engine.max_model_len)
    system = [{"role": "system", "content": system_prompt}] if system_prompt.strip() else []
    history = [m for m in history if m["role"] != "system"]  # the page's system prompt wins
    user = [{"role": "user", "content": message}]
    char_limit = prompt_char_limit(context)
    fixed_chars = len(message) + (len(system_prompt) if system else 0)
    if fixed_chars > char_limit:
        raise ChatError(f"The message is too long: with the system prompt it has {fixed_chars} characters, and "
                        f"the model's context of {context} tokens takes at most {char_limit} characters "
                        f"({MAX_CHARS_PER_TOKEN} per token). Shorten the message or the system prompt.")
    turns = _turns(history)
    turn_chars = [sum(len(m["content"]) for m in turn) for turn in turns]
    first, chars = 0, fixed_chars + sum(turn_chars)
    while chars > char_limit:  # these oldest turns cannot fit whatever they tokenize to
        chars -= turn_chars[first]
        first += 1
    rendered: dict[int, list[int]] = {}  # turns dropped -> the prompt's token ids

    def render(dropped: int) -> list[int]:
        if dropped not in rendered:
            messages = system + [m for turn in turns[dropped:] for m in turn] + user
            try:
                rendered[dropped] = engine.encode_chat(messages)
            except InvalidRequest as exc:  # the chat template refused the conversation: say why
                raise ChatError(str(exc)) from None
        return rendered[dropped]

    def fits(dropped: int) -> bool:
        return len(render(dropped)) + max_new_tokens <= context

    if fits(first):
        dropped = first
    elif first == len(turns) or not fits(len(turns)):
        dropped = len(turns)
        ids = render(dropped)
        room = context - len(ids)
        if room < 1:
            raise ChatError(f"The message is too long: with the system prompt it takes {len(ids)} tokens, "
                            f"and the model's context holds {context} tokens in all (prompt and answer). "
                            "Shorten the message or the system prompt.")
        return FittedPrompt(ids, dropped, room)  # the answer is cut short to fit
    else:
        too_few, enough = first, len(turns)  # fits(too_few) is false, fits(enough) true
        while enough - too_few > 1:
            middle = (too_few + enough) // 2
            if fits(middle):
                enough = middle
            else:
                too_few = middle
        dropped = enough
    return FittedPrompt(rendered[dropped], dropped, max_new_tokens)


# --- streaming -------------------------------------------------------------------------------------

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


def stream_answer(engine, metrics, route: str, history: list[dict], message: str, settings: ChatSettings,
                  warn: Callable[[str], None] | None = None,
                  watch: Callable[[object], Callable[[], None]] | None = None) -> Iterator[tuple[str, AnswerStats]]:
    """Yields (text so far, stats) as the engine streams the answer to `message` after `history`.

    The engine request is aborted when the generator is closed before the end (Stop, a cancelled
    client job, a dropped connection). Raises `ChatError` for requests the engine refuses.
    `watch(streamer)` is called once the request is admitted (e.g. to abort it when the visitor's
    tab closes); what it returns is called when the request ends.
    """
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
        streamer = admit_text(engine, fitted.prompt_token_ids, params, metrics=metrics, route=route)
    except ApiError as exc:
        raise ChatError(exc.message) from exc
    streamer.timeout = WAIT_POLL_S  # TextIteratorStreamer raises queue.Empty past it; we wait again
    unwatch = watch(streamer) if watch is not None else None
    tracker = metrics.start(route, num_prompt_tokens=len(fitted.prompt_token_ids),
                            request_id=getattr(streamer, "request_id", None), arrival_time=arrival) \
        if metrics is not None else None
    stats = AnswerStats(num_prompt_tokens=len(fitted.prompt_token_ids), dropped_turns=fitted.dropped_turns)
    text = ""
    first_time: float | None = None
    thought_start = arrival
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
            now = time.monotonic()
            produced = int(getattr(streamer, "num_output_tokens", 0) or 0)
            if first_time is None and (piece or produced):
                first_time = getattr(streamer, "first_token_time", None) or now
                stats.ttft_s = max(0.0, first_time - arrival)
            if tracker is not None:
                new = produced - tracker.num_output_tokens
                if new > 0:
                    tracker.tokens(new, now=now, first_token_time=getattr(streamer, "first_token_time", None))
            stats.num_output_tokens = max(produced, tracker.num_output_tokens if tracker else 0, stats.num_output_tokens)
            stats.elapsed_s = now - arrival
            if first_time is not None and stats.num_output_tokens > 1 and now > first_time:
                stats.decode_tokens_per_s = (stats.num_output_tokens - 1) / (now - first_time)
            if isinstance(piece, ReasoningPiece):
                if not stats.thinking:
                    stats.thinking, thought_start = True, now
                stats.reasoning += piece
                stats.reasoning_s = now - thought_start
                yield text, stats
            elif piece:
                if stats.thinking:
                    stats.thinking = False
                    stats.reasoning_s = now - thought_start
                text += piece
                yield text, stats
        finished = True
    finally:
        now = time.monotonic()
        if not finished:
            streamer.abort()
        if unwatch is not None:
            unwatch()
        reason = getattr(streamer, "finish_reason", None)
        reason = str(getattr(reason, "value", reason)) if reason is not None and finished else "abort"
        produced = int(getattr(streamer, "num_output_tokens", 0) or 0)
        stats.num_output_tokens = max(produced, stats.num_output_tokens)
        stats.finish_reason = reason
        if stats.thinking:
            stats.thinking = False
            stats.reasoning_s = now - thought_start
        stats.elapsed_s = now - arrival
        if first_time is not None and stats.num_output_tokens > 1 and now > first_time:
            stats.decode_tokens_per_s = (stats.num_output_tokens - 1) / (now - first_time)
        if tracker is not None:
            error = getattr(streamer, "error", None)
            queue_time = queue_time_of(streamer)
            if queue_time is None and getattr(streamer, "scheduled_time", None) is not None:
                queue_time = max(0.0, streamer.scheduled_time - arrival)
            tracker.finish(reason, num_output_tokens=produced if finished else None, now=now, error=error,
                           queue_time=queue_time)
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

"""The chat logic behind the page, free of Gradio layout: history in, streamed answer out.

- `to_engine_messages` turns a Gradio history (any of its message shapes) into plain
  `{"role", "content"}` dicts;
- `fit_to_context` drops the oldest turns until prompt + answer fit the model's context;
- `escape_html` / `unescape_html` keep model and user text from ever becoming HTML in the page
  (markdown and code still render; `<img src=x onerror=...>` shows as text);
- `stream_answer` is the generator: it feeds the engine's threaded `TextIteratorStreamer`
  (`engine.text_streamer`) and yields the growing text; closing it (Stop in the page, a cancelled
  gradio_client job) aborts the engine request.
"""

from __future__ import annotations

import queue
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from engine.request import InvalidRequest, QueueFull, SamplingParams
from server.metrics import queue_time_of

WAIT_POLL_S = 0.25  # while no token comes, the generator wakes this often so Stop can close it


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

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        """Raises `ChatError` with the engine's message (what was wrong, allowed, given)."""
        try:
            top_k = int(self.top_k)
            if top_k != self.top_k:
                raise InvalidRequest(f"`top_k` must be an integer >= 0 (0 = off). Given: {self.top_k!r}")
            return SamplingParams(max_tokens=max_tokens, temperature=float(self.temperature),
                                  top_p=float(self.top_p), top_k=top_k,
                                  repetition_penalty=float(self.repetition_penalty))
        except (InvalidRequest, TypeError, ValueError) as exc:
            raise ChatError(str(exc)) from exc


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
    """
    messages: list[dict] = []
    for item in history or []:
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
            if not text:
                continue
            messages.append({"role": role, "content": unescape_html(text) if escaped else text})
    return messages


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

    Raises `ChatError` when even the message alone leaves no room for an answer.
    """
    context = int(engine.max_model_len)
    system = [{"role": "system", "content": system_prompt}] if system_prompt.strip() else []
    history = [m for m in history if m["role"] != "system"]  # the page's system prompt wins
    user = [{"role": "user", "content": message}]
    turns = _turns(history)
    dropped = 0
    while True:
        kept = [m for turn in turns[dropped:] for m in turn]
        ids = engine.encode_chat(system + kept + user)
        if len(ids) + max_new_tokens <= context:
            return FittedPrompt(ids, dropped, max_new_tokens)
        if dropped < len(turns):
            dropped += 1
            continue
        room = context - len(ids)
        if room >= 1:
            return FittedPrompt(ids, dropped, room)  # the answer is cut short to fit
        raise ChatError(f"The message is too long: with the system prompt it takes {len(ids)} tokens, "
                        f"and the model's context holds {context} tokens in all (prompt and answer). "
                        "Shorten the message or the system prompt.")


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
    if not isinstance(message, str) or not message.strip():
        raise ChatError("The message is empty: type something to send.")
    try:
        max_new_tokens = int(settings.max_new_tokens)
    except (TypeError, ValueError) as exc:
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
        streamer = engine.text_streamer(fitted.prompt_token_ids, params)
    except QueueFull as exc:
        if metrics is not None:
            metrics.error(route, 429)
        raise ChatError(f"The server is busy ({exc}). Try again in a moment.") from exc
    except InvalidRequest as exc:
        if metrics is not None:
            metrics.error(route, 400)
        raise ChatError(str(exc)) from exc
    except RuntimeError as exc:  # the engine is not running (rebuilding after a fault, or shutting down)
        if metrics is not None:
            metrics.error(route, 503)
        raise ChatError(str(exc)) from exc
    streamer.timeout = WAIT_POLL_S  # TextIteratorStreamer raises queue.Empty past it; we wait again
    unwatch = watch(streamer) if watch is not None else None
    tracker = metrics.start(route, num_prompt_tokens=len(fitted.prompt_token_ids),
                            request_id=getattr(streamer, "request_id", None), arrival_time=arrival) \
        if metrics is not None else None
    stats = AnswerStats(num_prompt_tokens=len(fitted.prompt_token_ids), dropped_turns=fitted.dropped_turns)
    text = ""
    first_time: float | None = None
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
            if piece:
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

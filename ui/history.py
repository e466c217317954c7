"""A conversation as the page and its API take it: Gradio's message shapes to plain messages,
bounds on its size, and the oldest turns dropped until prompt and answer fit the context."""

from __future__ import annotations

from dataclasses import dataclass

from engine.request import MAX_CHARS_PER_TOKEN, InvalidRequest, prompt_char_limit
from ui.markup import unescape_html

MAX_HISTORY_MESSAGES = 1000  # messages of a conversation the page or its API takes
MAX_HISTORY_CHARS = 1_000_000  # characters of all its messages together


class ChatError(Exception):
    """A chat request the page cannot serve; the message is shown to the user as is."""


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



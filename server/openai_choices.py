"""What the OpenAI routes say of each choice: the chat reply (thought, content, tool calls), the
logprobs in each API's layout, and one `Choices` per route that turns engine deltas into the
stream's chunk choices or the whole answer's choices (server/openai_api.py drives both).
"""

from __future__ import annotations

from engine.request import FinishReason, RequestOutput
from frontend.tools import ToolFormat


def finish_value(reason) -> str | None:
    """A finish reason as the API writes it (None while running)."""
    if reason is None:
        return None
    return reason.value if isinstance(reason, FinishReason) else str(reason)


class Reply:
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
        reason = finish_value(reason)
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


class TokenText:
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


def chat_logprobs(out: RequestOutput, token_text: TokenText, top_n: int) -> dict | None:
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


def completion_logprobs(out: RequestOutput, token_text: TokenText, top_n: int, offset: int) -> dict | None:
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


def merge_logprobs(acc: dict | None, new: dict | None, chat: bool) -> dict | None:
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


class ChatChoices:
    """The choices of a /v1/chat/completions answer: `n` replies of one prompt."""

    whole_object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def __init__(self, n: int, fmt: ToolFormat | None, token_text: TokenText, top_logprobs: int, logprobs: bool):
        self.replies = [Reply(fmt) for _ in range(n)]
        self.token_text, self.top_n, self.logprobs = token_text, top_logprobs, logprobs
        self.merged: list[dict | None] = [None] * n  # the whole answer's logprobs per choice
        self.reasons: list[str | None] = [None] * n

    def opening(self) -> list[dict]:
        """Each choice's first chunk choice: the assistant's role."""
        return [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                for i in range(len(self.replies))]

    def stream(self, index: int, out: RequestOutput) -> list[dict]:
        """The chunk choices this delta adds (a tool call's name and arguments apart, the end apart)."""
        reply = self.replies[index]
        lp = chat_logprobs(out, self.token_text, self.top_n) if self.logprobs else None
        deltas = reply.feed(out)
        if lp and not any("content" in d for d in deltas):
            deltas.append({"content": ""})  # the logprobs of text held back (a tool call's)
        choices = []
        for delta in deltas:
            choices.append({"index": index, "delta": delta, "logprobs": lp if "content" in delta else None,
                            "finish_reason": None})
            if "content" in delta:
                lp = None
        if out.finished:
            choices.append({"index": index, "delta": {}, "logprobs": None,
                            "finish_reason": reply.finish_reason(out.finish_reason)})
        return choices

    def add(self, index: int, out: RequestOutput) -> None:
        """A delta of the whole answer."""
        reply = self.replies[index]
        reply.feed(out)
        self.merged[index] = merge_logprobs(self.merged[index], chat_logprobs(out, self.token_text, self.top_n), True)
        if out.finished:
            self.reasons[index] = reply.finish_reason(out.finish_reason)

    def whole(self) -> list[dict]:
        return [{"index": i, "message": reply.message(),
                 "logprobs": (self.merged[i] or {"content": []}) if self.logprobs else None,
                 "finish_reason": self.reasons[i]} for i, reply in enumerate(self.replies)]


class CompletionChoices:
    """The choices of a /v1/completions answer: `n` texts for each of its prompts."""

    whole_object = chunk_object = "text_completion"

    def __init__(self, num_choices: int, token_text: TokenText, logprobs: int | None):
        self.token_text, self.logprobs, self.top_n = token_text, logprobs, logprobs or 0
        self.texts: list[list[str]] = [[] for _ in range(num_choices)]
        self.merged: list[dict | None] = [None] * num_choices
        self.reasons: list[str | None] = [None] * num_choices
        self.offsets = [0] * num_choices  # text offset of each choice's next token (logprobs)

    def opening(self) -> list[dict]:
        return []

    def _logprobs(self, index: int, out: RequestOutput) -> dict | None:
        if self.logprobs is None:
            return None
        lp = completion_logprobs(out, self.token_text, self.top_n, self.offsets[index])
        if lp and lp["tokens"]:
            self.offsets[index] = lp["text_offset"][-1] + len(lp["tokens"][-1])
        return lp

    def stream(self, index: int, out: RequestOutput) -> list[dict]:
        lp = self._logprobs(index, out)
        if not (out.text or lp or out.finished):
            return []
        return [{"index": index, "text": out.text, "logprobs": lp,
                 "finish_reason": finish_value(out.finish_reason) if out.finished else None}]

    def add(self, index: int, out: RequestOutput) -> None:
        self.texts[index].append(out.text)
        self.merged[index] = merge_logprobs(self.merged[index], self._logprobs(index, out), False)
        if out.finished:
            self.reasons[index] = finish_value(out.finish_reason)

    def whole(self) -> list[dict]:
        return [{"index": i, "text": "".join(text), "logprobs": self.merged[i], "finish_reason": self.reasons[i]}
                for i, text in enumerate(self.texts)]

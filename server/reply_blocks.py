"""A reply cut into the ordered blocks (thought, text, tool calls) the block-shaped APIs stream:
`/v1/responses` and `/v1/messages`. The parsing is `Reply`'s (server/openai_choices.py)."""

from __future__ import annotations

from dataclasses import dataclass

from frontend.tool_parsers import ToolCall
from frontend.tools import ToolFormat
from server.openai_choices import Reply


@dataclass
class Block:
    """One block of a reply: a thought, a text, or a tool call (its arguments in `text`)."""

    kind: str  # "reasoning", "text" or "call"
    index: int  # its place among the reply's blocks
    text: str = ""
    call: ToolCall | None = None


class ReplyBlocks:
    """A reply cut into ordered blocks as the block-shaped APIs show them. `feed` returns events:
    ("start", block), ("delta", block, piece), ("stop", block); a block stops when another starts,
    and at `finish`. The parsing is `Reply`'s (the model's tool format)."""

    def __init__(self, fmt: ToolFormat | None):
        self.reply = Reply(fmt)
        self.blocks: list[Block] = []
        self.token_ids: list[int] = []
        self.num_output_tokens = 0
        self.reasoning_tokens = 0  # the tokens of deltas that carried only thought
        self.finish_reason = None  # engine FinishReason once finished
        self._open: Block | None = None

    def _switch(self, kind: str, events: list, call: ToolCall | None = None) -> Block:
        if self._open is not None and self._open.kind == kind and call is None:
            return self._open
        if self._open is not None:
            events.append(("stop", self._open))
        self._open = Block(kind, len(self.blocks), call=call)
        self.blocks.append(self._open)
        events.append(("start", self._open))
        return self._open

    def feed(self, out) -> list[tuple]:
        events: list[tuple] = []
        self.token_ids.extend(out.token_ids)
        self.num_output_tokens = out.num_output_tokens
        if not self.reply.content and not out.text and (out.reasoning or self.reply.reasoning):
            self.reasoning_tokens += len(out.token_ids)  # the thought's, its end tag's and held-back bytes' tokens
        for delta in self.reply.feed(out):
            if "reasoning" in delta or "content" in delta:
                kind, piece = ("reasoning", delta["reasoning"]) if "reasoning" in delta else ("text", delta["content"])
                block = self._switch(kind, events)
            else:
                call = delta["tool_calls"][0]
                if "id" in call:
                    self._switch("call", events, self.reply.calls[call["index"]])
                    continue
                block, piece = self._open, call["function"]["arguments"]
            block.text += piece
            events.append(("delta", block, piece))
        if out.finished:
            self.finish_reason = out.finish_reason
            if self._open is not None:
                events.append(("stop", self._open))
                self._open = None
        return events

    @property
    def has_calls(self) -> bool:
        return bool(self.reply.calls)

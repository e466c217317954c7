"""Thinking models: the thought between `<think>` and `</think>` kept apart from the answer.

A model thinks this way when its chat template mentions the tags and each tag is one token of
its vocabulary (Qwen3, DeepSeek-R1 distills, SmolLM3). A sequence of a request that asks for it
(`SamplingParams.reasoning`) carries a `ReasoningState`: its thought tokens go to their own
detokenizer (`RequestOutput.reasoning`), the tags to neither text. A thought is open from the
start when the prompt ends inside one (templates that write `<think>` into the generation
prompt); otherwise the first output token may open one. `max_reasoning_tokens` forces the end
tag once that many thought tokens exist. A constraint applies once the thought is over.
Plain Python.
"""

from __future__ import annotations

from dataclasses import dataclass

START_TAG, END_TAG = "<think>", "</think>"
PROMPT_TAIL = 8  # tokens at the end of a prompt searched for an opened thought (the generation prompt)


@dataclass(frozen=True, slots=True)
class ThinkTags:
    """A thinking model's tags, each one token."""

    start_id: int
    end_id: int


def _template_text(tokenizer) -> str:
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):  # named templates
        template = " ".join(str(t) for t in template.values())
    return str(template)


def think_tags(tokenizer) -> ThinkTags | None:
    """The model's think tags, or None when it does not think between them."""
    if END_TAG not in _template_text(tokenizer):
        return None
    ids = [tokenizer.encode(tag, add_special_tokens=False) for tag in (START_TAG, END_TAG)]
    if any(len(i) != 1 for i in ids):
        return None
    return ThinkTags(ids[0][0], ids[1][0])


def _last(ids: list[int], token_id: int) -> int:
    for position in range(len(ids) - 1, -1, -1):
        if ids[position] == token_id:
            return position
    return -1


class ReasoningState:
    """Where one sequence is: thinking or answering, and the thought's own detokenizer."""

    __slots__ = ("tags", "thinking", "may_open", "num_tokens", "budget", "detokenizer", "strip_answer")

    def __init__(self, tags: ThinkTags, prompt_token_ids: list[int], budget: int | None, detokenizer):
        tail = prompt_token_ids[-PROMPT_TAIL:]
        self.tags = tags
        self.thinking = _last(tail, tags.start_id) > _last(tail, tags.end_id)  # the prompt opened a thought
        self.may_open = not self.thinking  # the first output token may open one
        self.num_tokens = 0  # thought tokens so far
        self.budget = budget  # max_reasoning_tokens, or None
        self.detokenizer = detokenizer  # engine.detokenizer.IncrementalDetokenizer of the thought
        self.strip_answer = False  # after a thought: the answer's leading whitespace is dropped

    def forced_token(self) -> int | None:
        """The end tag once the thought used its budget, else None."""
        if self.thinking and self.budget is not None and self.num_tokens >= self.budget:
            return self.tags.end_id
        return None

    def on_token(self, token_id: int) -> str:
        """What the new token is: "thought", "start" or "end" (a tag), or "answer"."""
        if self.thinking:
            if token_id == self.tags.end_id:
                self.thinking = False
                self.strip_answer = True
                return "end"
            self.num_tokens += 1
            return "thought"
        if self.may_open and token_id == self.tags.start_id:
            self.may_open = False
            self.thinking = True
            return "start"
        self.may_open = False
        return "answer"

    def answer_text(self, text: str) -> str:
        """The answer's text with the whitespace that follows the end tag dropped."""
        if self.strip_answer:
            text = text.lstrip()
            if text:
                self.strip_answer = False
        return text

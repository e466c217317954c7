"""Chat encoding: a conversation -> prompt token ids, through the model's chat template."""

from __future__ import annotations


def encode_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
    """Token ids of a conversation through the model's chat template ("role: content" lines without one)."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    else:
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        if add_generation_prompt:
            text += "assistant:"
    return tokenizer.encode(text, add_special_tokens=False)

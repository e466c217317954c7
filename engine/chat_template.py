"""Chat encoding: a conversation -> prompt token ids, through the model's chat template."""

from __future__ import annotations

from jinja2.exceptions import TemplateError, TemplateSyntaxError

from engine.request import InvalidRequest

# Names a client's template variables (`chat_template_kwargs`) cannot take: the arguments of
# encode_chat and of the backends' encode_chat, of the tokenizer's `apply_chat_template` and of
# transformers' `render_jinja_template` (passed there they collide, make it raise, or set a
# tokenizer option: truncation and max_length would cut the prompt silently), of the tokenizer call
# itself, and the template globals the server provides. tests/test_hostile_bodies.py checks this
# list against the installed transformers' signatures.
TAKEN_TEMPLATE_NAMES = frozenset({
    "self", "tokenizer", "messages", "add_generation_prompt", "tools", "template_kwargs",
    "conversation", "conversations", "documents", "chat_template", "continue_final_message", "tokenize",
    "sanitize_control_tokens", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "kwargs",
    "text", "text_pair", "text_target", "text_pair_target", "add_special_tokens", "stride", "is_split_into_words",
    "pad_to_multiple_of", "padding_side", "return_token_type_ids", "return_attention_mask",
    "return_overflowing_tokens", "return_special_tokens_mask", "return_offsets_mapping", "return_length",
    "verbose", "split_special_tokens",
    "bos_token", "eos_token", "raise_exception", "tools_in_user_message", "strftime_now",
})


def check_template_kwargs(template_kwargs: dict) -> None:
    """Refuse names the server or the tokenizer takes for itself (InvalidRequest naming the first)."""
    taken = sorted(set(template_kwargs) & TAKEN_TEMPLATE_NAMES)
    if taken:
        raise InvalidRequest(taken_names_message(taken), "chat_template_kwargs")


def taken_names_message(taken: list[str]) -> str:
    return (f"`chat_template_kwargs.{taken[0]}` cannot be passed: it is set by the server or is an argument of the "
            f"tokenizer, not a template variable (names that cannot be passed: {', '.join(taken)}; any other "
            f"name reaches the template, e.g. enable_thinking)")


def encode_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None,
                **template_kwargs) -> list[int]:
    """Token ids of a conversation through the model's chat template ("role: content" lines without one).
    `tools` (OpenAI function tools) and `template_kwargs` (e.g. enable_thinking) go to the template.

    Raises InvalidRequest with the template's own message when the template refuses the
    conversation (its `raise_exception(...)`, e.g. roles that do not alternate). A template that
    does not even parse is the server's fault and raises as it is."""
    check_template_kwargs(template_kwargs)
    if getattr(tokenizer, "chat_template", None):
        try:
            text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                 add_generation_prompt=add_generation_prompt, **template_kwargs)
        except TemplateSyntaxError:
            raise
        except (TemplateError, TypeError, ValueError) as exc:  # TypeError: e.g. a template adding None content
            raise InvalidRequest(f"The model's chat template refused this conversation: {exc}", "messages") from None
    else:
        text = "".join(f"{m['role']}: {m.get('content') or ''}\n" for m in messages)
        if add_generation_prompt:
            text += "assistant:"
    return tokenizer.encode(text, add_special_tokens=False)

"""Chat encoding: a conversation -> prompt token ids, through the model's chat template."""

from __future__ import annotations

from jinja2.exceptions import TemplateError, TemplateSyntaxError

from engine.request import InvalidRequest


def encode_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None,
                **template_kwargs) -> list[int]:
    """Token ids of a conversation through the model's chat template ("role: content" lines without one).
    `tools` (OpenAI function tools) and `template_kwargs` (e.g. enable_thinking) go to the template.

    Raises InvalidRequest with the template's own message when the template refuses the
    conversation (its `raise_exception(...)`, e.g. roles that do not alternate). A template that
    does not even parse is the server's fault and raises as it is."""
    if getattr(tokenizer, "chat_template", None):
        try:
            text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                 add_generation_prompt=add_generation_prompt, **template_kwargs)
        except TemplateSyntaxError:
            raise
        except (TemplateError, TypeError) as exc:  # TypeError: e.g. a template adding None content
            raise InvalidRequest(f"The model's chat template refused this conversation: {exc}", "messages") from None
    else:
        text = "".join(f"{m['role']}: {m.get('content') or ''}\n" for m in messages)
        if add_generation_prompt:
            text += "assistant:"
    return tokenizer.encode(text, add_special_tokens=False)

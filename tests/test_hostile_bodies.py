"""Hostile request bodies over real HTTP (issue 32, second hardening pass): names the tokenizer's
`apply_chat_template` takes for itself are refused in `chat_template_kwargs` with a 400 naming the
entry (they answered 500 with two tracebacks), and `stop_token_ids` has a length cap (one body of
120,000 ids slowed every other stream on the engine thread)."""

from __future__ import annotations

import httpx
import pytest

from engine.request import MAX_STOP_TOKEN_IDS
from tests.servers import error_text, wait_idle


@pytest.fixture(scope="module")
def url(tiny_server):
    yield tiny_server.url
    assert httpx.get(f"{tiny_server.url}/health", timeout=10).status_code == 200
    wait_idle(tiny_server.url, timeout=60)


HI = [{"role": "user", "content": "Hi"}]
# the tokenizer's own arguments (tokenizer, self: the call's; the rest: apply_chat_template's and the
# tokenizer call's, which would change or cut the prompt rather than reach the template)
TAKEN_NAMES = [("tokenizer", 1), ("self", 1), ("return_assistant_tokens_mask", True), ("truncation", True),
               ("max_length", 2), ("sanitize_control_tokens", True), ("conversation", []), ("documents", 5),
               ("padding", "max_length"), ("tokenizer_kwargs", {"truncation": True})]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/chat"])
@pytest.mark.parametrize("name, value", TAKEN_NAMES)
def test_a_template_kwarg_the_tokenizer_takes_for_itself_is_a_400_naming_it(url, path, name, value):
    body = {"messages": HI, "max_tokens": 2} if path.startswith("/v1") else {"prompt": "Hi", "max_new_tokens": 2,
                                                                             "stream": False}
    body["chat_template_kwargs"] = {"enable_thinking": False, name: value}
    response = httpx.post(url + path, json=body, timeout=30)
    assert response.status_code == 400, response.text
    text = error_text(response)
    assert f"`chat_template_kwargs.{name}`" in text and "cannot be passed" in text, text
    if path.startswith("/v1"):
        assert response.json()["error"]["param"] == "chat_template_kwargs"


def test_the_taken_names_cover_the_installed_tokenizers_arguments():
    """Every named argument of apply_chat_template, render_jinja_template and the tokenizer call
    (as this transformers has them) is refused: a new one in an upgrade fails here, not as a 500."""
    import inspect

    from transformers import PreTrainedTokenizerBase
    from transformers.utils.chat_template_utils import render_jinja_template

    from engine.chat_template import TAKEN_TEMPLATE_NAMES
    names = set()
    for function in (PreTrainedTokenizerBase.apply_chat_template, render_jinja_template,
                     PreTrainedTokenizerBase.__call__):
        names |= {p.name for p in inspect.signature(function).parameters.values()
                  if p.kind is not inspect.Parameter.VAR_KEYWORD}
    assert names - TAKEN_TEMPLATE_NAMES == set()


@pytest.mark.parametrize("thinking", [True, False])
def test_a_plain_template_variable_still_reaches_the_template(server_with, tiny_model, thinking):
    """The tiny Qwen3's template reads `enable_thinking` (off: an empty thought after the generation
    prompt): the prompt the server counts is the one the template renders with the body's variables,
    beside a name no template reads."""
    from transformers import AutoTokenizer

    path = tiny_model("qwen3")  # its server is shared with the other modules that use this model
    kwargs = {"enable_thinking": thinking, "custom_flag": [1, 2]}
    response = httpx.post(f"{server_with(model=path).url}/v1/chat/completions", timeout=30, json={
        "messages": HI, "max_tokens": 2, "chat_template_kwargs": kwargs})
    assert response.status_code == 200, response.text
    tokenizer = AutoTokenizer.from_pretrained(path)
    rendered = {on: tokenizer.apply_chat_template(HI, add_generation_prompt=True, tokenize=True,
                                                  enable_thinking=on)["input_ids"] for on in (True, False)}
    assert len(rendered[True]) != len(rendered[False])  # the variable changes what the model reads
    assert response.json()["usage"]["prompt_tokens"] == len(rendered[thinking])


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_stop_token_ids_past_the_cap_are_a_400_saying_the_limit_and_the_count(url, path):
    ids = list(range(MAX_STOP_TOKEN_IDS + 1))
    body = {"prompt": "Hi"} if path == "/v1/completions" else {"messages": HI}
    response = httpx.post(url + path, timeout=30, json={**body, "max_tokens": 4, "n": 16, "min_tokens": 4,
                                                        "stop_token_ids": ids})
    assert response.status_code == 400, response.text
    text = error_text(response)
    assert f"at most {MAX_STOP_TOKEN_IDS}" in text and f"{MAX_STOP_TOKEN_IDS + 1} given" in text, text
    assert response.json()["error"]["param"] == "stop_token_ids"


def test_stop_token_ids_at_the_cap_are_served_banned_until_min_tokens_then_stopping(url):
    """The whole tiny vocabulary (1024 ids, the cap) as stop ids, min_tokens 3: every sample of
    n=16 is held to exactly 3 tokens, then the next, whatever it is, ends it."""
    response = httpx.post(f"{url}/v1/completions", timeout=60, json={
        "prompt": "Once upon a time", "max_tokens": 8, "temperature": 1.0, "seed": 1, "n": 16, "min_tokens": 3,
        "stop_token_ids": list(range(MAX_STOP_TOKEN_IDS))})
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    assert len(choices) == 16 and all(c["finish_reason"] == "stop" for c in choices), choices
    assert response.json()["usage"]["completion_tokens"] == 16 * 3  # the stop token ends it, as EOS does, uncounted

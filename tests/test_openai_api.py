"""The OpenAI-compatible API through the official `openai` client and raw httpx, against a real
app.py process: chat and completions, streaming and not, n, stop, seed, logprobs, usage, errors."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest
from transformers import AutoTokenizer


CAPITAL = "What is the capital of France?"


@pytest.fixture(scope="module")
def client(tiny_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tiny_server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_path):
    return AutoTokenizer.from_pretrained(tiny_llama_path)


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def streamed_chat(client, **kwargs):
    """(texts by choice index, finish reasons by index, usage, chunks) of a streamed chat completion."""
    texts, reasons, usage, chunks = {}, {}, None, []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        chunks.append(chunk)
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason:
                reasons[choice.index] = choice.finish_reason
    return texts, reasons, usage, chunks


# --------------------------------------------------------------------------- models


def test_models_lists_the_served_model_and_unknown_models_are_404(client, model, tiny_llama_path):
    assert model == tiny_llama_path.name
    assert client.models.retrieve(model).id == model
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="gpt-4o", messages=user("Hi"), max_tokens=2)
    error = caught.value.body
    assert caught.value.status_code == 404
    assert "gpt-4o" in error["message"] and model in error["message"]
    assert error["type"] and error["param"] == "model" and error["code"] == "model_not_found"


# --------------------------------------------------------------------------- chat


def test_chat_streamed_equals_non_streamed_with_role_first_and_exact_usage(client, model, tokenizer):
    kwargs = dict(model=model, messages=user("Tell me about the sea."), max_tokens=30, temperature=0)
    plain = client.chat.completions.create(**kwargs)
    texts, reasons, usage, chunks = streamed_chat(client, stream_options={"include_usage": True}, **kwargs)
    assert texts[0] == plain.choices[0].message.content
    assert plain.choices[0].message.role == "assistant"
    assert chunks[0].choices[0].delta.role == "assistant"
    assert reasons[0] == plain.choices[0].finish_reason == "length"
    expected_prompt = len(tokenizer.apply_chat_template(user("Tell me about the sea."), add_generation_prompt=True,
                                                        tokenize=True)["input_ids"])
    assert plain.usage.prompt_tokens == usage.prompt_tokens == expected_prompt
    assert plain.usage.completion_tokens == usage.completion_tokens == 30
    assert usage.total_tokens == expected_prompt + 30
    assert chunks[-1].choices == [] and chunks[-1].usage is not None  # usage rides its own final chunk


def test_chat_stream_wire_format(tiny_server, model):
    body = {"model": model, "messages": user("Hi"), "max_tokens": 5, "temperature": 0, "stream": True}
    raw = httpx.post(f"{tiny_server.url}/v1/chat/completions", json=body, timeout=120).content
    assert b"\r" not in raw
    blocks = raw.decode().split("\n\n")
    assert blocks[-1] == "" and blocks[-2] == "data: [DONE]"
    payloads = [json.loads(b[len("data: "):]) for b in blocks[:-2] if not b.startswith(":")]
    assert all(p["object"] == "chat.completion.chunk" for p in payloads)
    assert payloads[-1]["choices"][0]["finish_reason"] == "length"
    assert all(p["choices"][0]["finish_reason"] is None for p in payloads[:-1])
    assert "usage" not in payloads[0]  # only with stream_options.include_usage


def test_chat_n_2_with_seed_is_repeatable_and_streams_the_same(client, model):
    kwargs = dict(model=model, messages=user("Make up a name."), max_tokens=16, temperature=1.0, seed=42, n=2)
    first = client.chat.completions.create(**kwargs)
    again = client.chat.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.message.content for c in first.choices] == [c.message.content for c in again.choices]
    assert first.choices[0].message.content != first.choices[1].message.content  # two samples, not one twice
    texts, reasons, usage, _ = streamed_chat(client, stream_options={"include_usage": True}, **kwargs)
    assert [texts[0], texts[1]] == [c.message.content for c in first.choices]
    assert usage.completion_tokens == first.usage.completion_tokens == 32


def test_chat_stop_string(client, model):
    kwargs = dict(model=model, messages=user("Write a long sentence."), max_tokens=40, temperature=0)
    full = client.chat.completions.create(**kwargs).choices[0].message.content
    stop = full[len(full) // 2: len(full) // 2 + 3]
    cut = client.chat.completions.create(stop=[stop], **kwargs).choices[0]
    assert cut.message.content == full[: full.index(stop)]
    assert cut.finish_reason == "stop"
    texts, reasons, _, _ = streamed_chat(client, stop=stop, **kwargs)
    assert texts[0] == cut.message.content and reasons[0] == "stop"


def test_chat_logprobs_are_greedy_argmax_with_top_alternatives(client, model):
    result = client.chat.completions.create(model=model, messages=user("Hi"), max_tokens=6, temperature=0,
                                            logprobs=True, top_logprobs=3)
    content = result.choices[0].logprobs.content
    assert len(content) == result.usage.completion_tokens == 6
    for item in content:
        assert len(item.top_logprobs) == 3
        assert item.logprob <= 0
        assert item.logprob == pytest.approx(max(t.logprob for t in item.top_logprobs), abs=1e-5)
        assert bytes(item.bytes).decode("utf-8", errors="replace") == item.token
    texts, _, _, chunks = streamed_chat(client, model=model, messages=user("Hi"), max_tokens=6, temperature=0,
                                        logprobs=True, top_logprobs=3)
    streamed = [i for c in chunks for ch in c.choices if ch.logprobs for i in ch.logprobs.content]
    assert [i.token for i in streamed] == [i.token for i in content]


def test_chat_extensions_top_k_min_p_and_ignore_eos(client, model):
    kwargs = dict(model=model, messages=user("Say something."), max_tokens=20)
    greedy = client.chat.completions.create(temperature=0, **kwargs).choices[0].message.content
    top1 = client.chat.completions.create(temperature=1.0, extra_body={"top_k": 1}, **kwargs)
    assert top1.choices[0].message.content == greedy
    min_p1 = client.chat.completions.create(temperature=1.0, extra_body={"min_p": 1.0}, **kwargs)
    assert min_p1.choices[0].message.content == greedy
    long = client.chat.completions.create(temperature=0, extra_body={"ignore_eos": True, "min_tokens": 20,
                                                                     "repetition_penalty": 1.1}, **kwargs)
    assert long.usage.completion_tokens == 20 and long.choices[0].finish_reason == "length"


def test_stop_token_ids_end_the_answer(client, model, tokenizer):
    everything = list(range(len(tokenizer)))
    result = client.chat.completions.create(model=model, messages=user("Hi"), max_tokens=20, temperature=0,
                                            extra_body={"stop_token_ids": everything})
    assert result.usage.completion_tokens == 1  # the first token is a stop token
    assert result.choices[0].finish_reason == "stop"


def test_max_completion_tokens_is_honoured(client, model):
    result = client.chat.completions.create(model=model, messages=user("Hi"), max_completion_tokens=3, temperature=0)
    assert result.usage.completion_tokens == 3


# --------------------------------------------------------------------------- completions


def test_completions_streamed_equals_non_streamed_n_2_and_logprobs(client, model):
    kwargs = dict(model=model, prompt="The capital of France is", max_tokens=12, temperature=0)
    plain = client.completions.create(logprobs=2, **kwargs)
    text = plain.choices[0].text
    assert plain.usage.completion_tokens == 12 and plain.choices[0].finish_reason == "length"
    logprobs = plain.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 12
    assert all(len(top) <= 2 for top in logprobs.top_logprobs)
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs) if c.choices)
    assert streamed == text
    two = client.completions.create(n=2, seed=7, **{**kwargs, "temperature": 1.0})
    assert sorted(c.index for c in two.choices) == [0, 1]
    assert two.usage.completion_tokens == 24


def test_completions_several_prompts_and_token_ids(client, model, tokenizer):
    prompts = ["Once upon a time", "def add(a, b):"]
    result = client.completions.create(model=model, prompt=prompts, max_tokens=5, temperature=0)
    assert [c.index for c in sorted(result.choices, key=lambda c: c.index)] == [0, 1]
    singles = [client.completions.create(model=model, prompt=p, max_tokens=5, temperature=0).choices[0].text
               for p in prompts]
    assert [c.text for c in sorted(result.choices, key=lambda c: c.index)] == singles
    ids = tokenizer.encode(prompts[0], add_special_tokens=False)
    by_ids = client.completions.create(model=model, prompt=ids, max_tokens=5, temperature=0)
    assert by_ids.choices[0].text == singles[0]
    assert by_ids.usage.prompt_tokens == len(ids)


def test_completions_stream_with_usage(client, model):
    chunks = list(client.completions.create(model=model, prompt="Hello", max_tokens=4, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens == 4
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize("kwargs, param, words", [
    ({"temperature": -1}, "temperature", ["temperature", "-1"]),
    ({"top_p": 0}, "top_p", ["top_p", "0"]),
    ({"max_tokens": 0}, "max_tokens", ["max_tokens", "0"]),
    ({"max_tokens": 5000}, "max_tokens", ["5000", "1024"]),
    ({"n": 99}, "n", ["n", "99"]),
    ({"presence_penalty": 3}, "presence_penalty", ["presence_penalty", "3"]),
])
def test_bad_values_are_400_in_openai_shape(client, model, kwargs, param, words):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=model, messages=user("Hi"), **kwargs)
    body = caught.value.body
    assert body["type"] == "invalid_request_error"
    assert body["param"] == param
    for word in words:
        assert word in body["message"], body["message"]


def test_malformed_bodies_are_400_in_openai_shape(tiny_server):
    url = f"{tiny_server.url}/v1/chat/completions"
    for body in ({"messages": []}, {"messages": "hi"}, {"model": "tiny-llama"}, [1, 2]):
        response = httpx.post(url, json=body, timeout=30)
        assert response.status_code == 400, (body, response.text)
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
    response = httpx.post(f"{tiny_server.url}/v1/completions", json={"prompt": "Hi", "echo": True}, timeout=30)
    assert response.status_code == 400 and "echo" in response.json()["error"]["message"]


# --------------------------------------------------------------------------- the embedded model


def test_embedded_model_answers_paris_on_chat_and_completions(embedded_server):
    client = openai.OpenAI(base_url=f"{embedded_server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    chat = client.chat.completions.create(model=model, messages=user(CAPITAL), max_tokens=48, temperature=0)
    assert "Paris" in chat.choices[0].message.content
    texts, _, _, _ = streamed_chat(client, model=model, messages=user(CAPITAL), max_tokens=48, temperature=0)
    assert texts[0] == chat.choices[0].message.content
    chat_endpoint = httpx.post(f"{embedded_server.url}/chat", timeout=120,
                               json={"prompt": CAPITAL, "temperature": 0, "max_new_tokens": 48, "stream": False})
    assert chat_endpoint.json()["response"] == chat.choices[0].message.content
    completion = client.completions.create(model=model, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert "Paris" in completion.choices[0].text


def test_embedded_min_tokens_and_chinese_without_replacement_characters(embedded_server):
    client = openai.OpenAI(base_url=f"{embedded_server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    short = client.chat.completions.create(model=model, messages=user("Say hi."), max_tokens=40, temperature=0)
    assert short.choices[0].finish_reason == "stop" and short.usage.completion_tokens < 30  # 24 with its EOS
    padded = client.chat.completions.create(model=model, messages=user("Say hi."), max_tokens=30, temperature=0,
                                            extra_body={"min_tokens": 30})
    assert padded.usage.completion_tokens == 30 and padded.choices[0].finish_reason == "length"
    texts, _, _, chunks = streamed_chat(client, model=model, messages=user("法国的首都是哪里？请用中文回答。"),
                                        max_tokens=32, temperature=0)
    assert "\ufffd" not in texts[0]
    assert any("\u4e00" <= ch <= "\u9fff" for ch in texts[0]), texts[0]
    completion = "".join(c.choices[0].text for c in client.completions.create(
        model=model, prompt="北京是中国的首都。上海是", max_tokens=16, temperature=0, stream=True) if c.choices)
    assert "\ufffd" not in completion


def test_the_readme_one_liners_run_against_the_embedded_model(embedded_server):
    """The quickstart's `python -c` lines as a new user pastes them (the URL pointed at this server):
    each runs, and both (greedy) answer Paris."""
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    lines = [line.strip() for line in readme.splitlines() if line.strip().startswith("python -c '")]
    assert any("openai" in line for line in lines) and any("gradio_client" in line for line in lines)
    for line in lines:
        code = shlex.split(line)[2].replace("http://127.0.0.1:7860", embedded_server.url)
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
        assert run.returncode == 0, f"{line}\n{run.stderr[-2000:]}"
        assert run.stdout.strip(), line
        assert "Paris" in run.stdout, run.stdout


"""`POST /chat` over real HTTP against a real app.py process: the seed's wire format, the
extensions, the usage event, request ids, errors; the embedded model's answers."""

from __future__ import annotations

import json

import httpx
import pytest
from transformers import AutoTokenizer

from tests.servers import SSEReader, chat_text, parse_sse, slow_steps, usage_of

CAPITAL = "What is the capital of France?"


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_path):
    return AutoTokenizer.from_pretrained(tiny_llama_path)


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def post_chat(url: str, body: dict, **kwargs) -> httpx.Response:
    return httpx.post(f"{url}/chat", json=body, timeout=120, **kwargs)


def stream_chat(url: str, body: dict, headers: dict | None = None) -> tuple[httpx.Response, bytes]:
    with httpx.stream("POST", f"{url}/chat", json=body, headers=headers, timeout=120) as response:
        raw = response.read()
    return response, raw


def greedy(url: str, prompt: str, max_new_tokens: int = 24, **extra) -> str:
    response = post_chat(url, {"prompt": prompt, "stream": False, "temperature": 0,
                               "max_new_tokens": max_new_tokens, **extra})
    assert response.status_code == 200, response.text
    return response.json()["response"]


# --------------------------------------------------------------------------- the seed's protocol


def test_seed_body_streams_pieces_framed_by_blank_lines_then_usage_then_end(tiny_server):
    response, raw = stream_chat(tiny_server.url, {"prompt": "Tell me a story.", "stream": True,
                                                  "max_new_tokens": 12, "temperature": 0.7})
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert b"\r" not in raw  # events end with "\n\n", not sse-starlette's default "\r\n"
    assert raw.endswith(b"\n\n")
    events = parse_sse(raw)
    pieces = [e for e in events if e.event == "message"]
    assert len(pieces) >= 2 and all(p.data for p in pieces)
    assert [e.event for e in events[-2:]] == ["usage", "end"]
    assert events[-1].data == "[DONE]"
    assert [int(e.id) for e in events] == list(range(1, len(events) + 1))  # every event has an id
    usage = usage_of(events)
    assert usage["completion_tokens"] == 12 and usage["finish_reason"] == "length"


def test_seed_defaults_apply_without_optional_fields(tiny_server):
    """Only `prompt`: streams (stream defaults to true) and stops at 512 tokens at most."""
    response, raw = stream_chat(tiny_server.url, {"prompt": "Hi"})
    events = parse_sse(raw)
    assert response.status_code == 200 and events[-1].event == "end"
    assert usage_of(events)["completion_tokens"] <= 512


def test_first_piece_arrives_while_the_request_still_runs(tiny_server):
    url = tiny_server.url
    body = {"prompt": "Count to one hundred.", "max_new_tokens": 400, "temperature": 0}
    # steps of at least 10 ms (a 4 s stream): the tiny model writes 400 tokens in under 0.1 s,
    # sooner than /health answers on a busy machine
    with slow_steps(url, 0.01), httpx.stream("POST", f"{url}/chat", json=body, timeout=120) as response:
        events = iter(SSEReader(response))
        first = next(events)
        assert first.event == "message" and first.data
        running = httpx.get(f"{url}/health", timeout=10).json()["engine"]["num_running"]
        rest = list(events)
    assert running >= 1  # the request was still generating when its first piece had arrived
    assert rest[-1].event == "end"
    assert usage_of(rest)["completion_tokens"] > 1


def test_streamed_text_equals_non_streaming_answer(tiny_server):
    body = {"prompt": "Describe the sea at night.", "max_new_tokens": 40, "temperature": 0}
    _, raw = stream_chat(tiny_server.url, body)
    streamed = chat_text(parse_sse(raw))
    plain = post_chat(tiny_server.url, {**body, "stream": False})
    assert plain.status_code == 200
    assert plain.json()["response"] == streamed
    assert plain.json()["usage"] == usage_of(parse_sse(raw))


def test_usage_counts_match_the_prompt_and_the_generated_tokens(tiny_server, tokenizer):
    body = {"prompt": "What is a paged KV cache?", "max_new_tokens": 9, "temperature": 0, "stream": False}
    usage = post_chat(tiny_server.url, body).json()["usage"]
    expected_prompt = len(chat_ids(tokenizer, [{"role": "user", "content": body["prompt"]}]))
    assert usage == {"prompt_tokens": expected_prompt, "completion_tokens": 9, "finish_reason": "length"}


# --------------------------------------------------------------------------- extensions


def test_a_prompt_longer_than_one_engine_step_gets_its_answer(tiny_server, tokenizer):
    """700 prompt tokens are more than one step's budget (512): the first chunk samples nothing."""
    prompt = " ".join(f"w{i % 50}" for i in range(2000))
    ids = tokenizer.encode(prompt, add_special_tokens=False)[:700]
    prompt = tokenizer.decode(ids)
    body = {"prompt": prompt, "raw": True, "max_new_tokens": 16, "temperature": 0, "stream": False}
    response = httpx.post(f"{tiny_server.url}/chat", json=body, timeout=120)
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    assert usage["prompt_tokens"] > 512 and usage["completion_tokens"] >= 1
    assert usage["finish_reason"] in ("stop", "length")


def test_a_conversation_continued_reuses_the_cached_prefix(tiny_server):
    """The second turn resends the first: its tokens come from the prefix cache, the answer is
    the same as the one computed from scratch, and /health counts the reused tokens."""
    system = {"role": "system", "content": " ".join(f"rule {i}: be brief." for i in range(30))}
    first = [system, {"role": "user", "content": "Say something about rivers."}]
    health = lambda: httpx.get(f"{tiny_server.url}/health", timeout=10).json()["engine"]  # noqa: E731
    before = health()["prefix_cache_hit_tokens"]
    body = {"messages": first, "stream": False, "temperature": 0, "max_new_tokens": 8}
    answer = post_chat(tiny_server.url, body).json()["response"]
    assert post_chat(tiny_server.url, body).json()["response"] == answer  # all but the tail was cached
    second = first + [{"role": "assistant", "content": answer}, {"role": "user", "content": "And lakes?"}]
    post_chat(tiny_server.url, {**body, "messages": second})
    assert health()["prefix_cache_hit_tokens"] - before >= 2 * 16 * 4  # both repeats found >= 4 blocks


def test_messages_equal_the_same_prompt_and_system_adds_its_tokens(tiny_server, tokenizer):
    url = tiny_server.url
    prompt = "Name three colours."
    by_prompt = greedy(url, prompt)
    by_messages = post_chat(url, {"messages": [{"role": "user", "content": prompt}], "temperature": 0,
                                  "max_new_tokens": 24, "stream": False}).json()["response"]
    assert by_messages == by_prompt
    history = [{"role": "user", "content": "Hello!"}, {"role": "assistant", "content": "Hi, how can I help?"},
               {"role": "user", "content": prompt}]
    with_system = post_chat(url, {"messages": history, "system": "You are terse.", "temperature": 0,
                                  "max_new_tokens": 4, "stream": False}).json()
    expected = chat_ids(tokenizer, [{"role": "system", "content": "You are terse."}, *history])
    assert with_system["usage"]["prompt_tokens"] == len(expected)


def test_raw_prompt_skips_the_chat_template(tiny_server, tokenizer):
    prompt = "The capital of France is"
    usage = post_chat(tiny_server.url, {"prompt": prompt, "raw": True, "temperature": 0, "max_new_tokens": 3,
                                        "stream": False}).json()["usage"]
    templated = len(chat_ids(tokenizer, [{"role": "user", "content": prompt}]))
    assert usage["prompt_tokens"] < templated
    assert usage["prompt_tokens"] in (len(tokenizer.encode(prompt, add_special_tokens=False)),
                                      len(tokenizer.encode(prompt)))


def test_stop_string_ends_the_answer_before_it(tiny_server):
    url = tiny_server.url
    full = greedy(url, "Write a long sentence.", max_new_tokens=40)
    stop = full[len(full) // 2: len(full) // 2 + 3]
    assert stop.strip(), f"answer too uniform to pick a stop string: {full!r}"
    cut = post_chat(url, {"prompt": "Write a long sentence.", "temperature": 0, "max_new_tokens": 40,
                          "stop": [stop], "stream": False}).json()
    assert cut["response"] == full[: full.index(stop)]
    assert cut["usage"]["finish_reason"] == "stop"


def test_seed_makes_sampling_repeatable_and_top_k_1_is_greedy(tiny_server):
    url = tiny_server.url
    body = {"prompt": "Invent a word.", "temperature": 1.0, "max_new_tokens": 24, "stream": False}
    first = post_chat(url, {**body, "seed": 1234}).json()["response"]
    again = post_chat(url, {**body, "seed": 1234}).json()["response"]
    assert first == again
    others = {post_chat(url, {**body, "seed": s}).json()["response"] for s in (1, 2, 3)}
    assert len(others | {first}) > 1  # different seeds, different samples
    top1 = post_chat(url, {**body, "top_k": 1, "top_p": 0.9, "repetition_penalty": 1.0}).json()["response"]
    assert top1 == greedy(url, body["prompt"])


def test_request_id_is_honoured_and_echoed(tiny_server):
    response, raw = stream_chat(tiny_server.url, {"prompt": "Hi", "max_new_tokens": 2},
                                headers={"x-request-id": "my-request.42"})
    assert response.headers["x-request-id"] == "my-request.42"
    plain = post_chat(tiny_server.url, {"prompt": "Hi", "max_new_tokens": 2, "stream": False},
                      headers={"x-request-id": "plain-7"})
    assert plain.headers["x-request-id"] == "plain-7" and plain.json()["request_id"] == "plain-7"
    generated = post_chat(tiny_server.url, {"prompt": "Hi", "max_new_tokens": 2, "stream": False})
    assert generated.headers["x-request-id"]
    bad = post_chat(tiny_server.url, {"prompt": "Hi"}, headers={"x-request-id": "has spaces/and slashes"})
    assert bad.status_code == 400 and "x-request-id" in bad.json()["error"]


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize("body, words", [
    ({"prompt": "Hi", "temperature": -1}, ["temperature", "-1"]),
    ({"prompt": "Hi", "top_p": 0}, ["top_p", "0"]),
    ({"prompt": "Hi", "top_p": 1.5}, ["top_p", "1.5"]),
    ({"prompt": "Hi", "max_new_tokens": 0}, ["max_new_tokens", "0"]),
    ({"prompt": "Hi", "top_k": -3}, ["top_k", "-3"]),
    ({"prompt": "Hi", "max_new_tokens": "many"}, ["max_new_tokens", "many"]),
    ({"temperature": 0}, ["prompt", "messages"]),
    ({"prompt": "Hi", "messages": [{"role": "user", "content": "Hi"}]}, ["prompt", "messages"]),
    ({"prompt": "Hi", "max_tokens": 5}, ["max_tokens", "max_new_tokens"]),
    ({"messages": [{"role": "robot", "content": "Hi"}]}, ["role", "robot"]),
    ({"prompt": "Hi", "stop": [""]}, ["stop"]),
])
def test_bad_values_get_400_naming_the_field_and_the_value(tiny_server, body, words):
    response = post_chat(tiny_server.url, body)
    assert response.status_code == 400
    message = response.json()["error"]
    assert isinstance(message, str)
    for word in words:
        assert word in message, message
    assert "Traceback" not in message


def test_prompt_plus_max_tokens_beyond_the_context_says_the_numbers(tiny_server):
    response = post_chat(tiny_server.url, {"prompt": "Hi", "max_new_tokens": 5000})
    assert response.status_code == 400
    message = response.json()["error"]
    assert "5000" in message and "1024" in message, message


def test_body_that_is_not_json_gets_400(tiny_server):
    response = httpx.post(f"{tiny_server.url}/chat", content=b"{not json", timeout=30,
                          headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert "JSON" in response.json()["error"]


def test_unknown_route_method_is_a_clear_error(tiny_server):
    response = httpx.put(f"{tiny_server.url}/chat", json={"prompt": "Hi"}, timeout=30)
    assert response.status_code == 405
    assert "PUT" in response.json()["error"]


# --------------------------------------------------------------------------- the embedded model


def test_embedded_model_answers_paris_streaming_and_not(embedded_server):
    url = embedded_server.url
    _, raw = stream_chat(url, {"prompt": CAPITAL, "stream": True, "temperature": 0, "max_new_tokens": 48})
    events = parse_sse(raw)
    assert events[-1].event == "end"
    streamed = chat_text(events)
    assert "Paris" in streamed
    assert greedy(url, CAPITAL, max_new_tokens=48) == streamed


def test_health_says_which_activations_route_is_faster_on_this_cpu(embedded_server):
    """The GGUF's blocks timed both ways at load: the route in use, int8's speed over the exact one at
    one row and at a prompt's rows, and what to pick with what int8 costs in exactness."""
    routes = httpx.get(f"{embedded_server.url}/health", timeout=10).json()["activations"]
    assert routes["in_use"] == "float32" and routes["timed"].startswith("q4_1 tensors of 1536 rows")
    assert 0.05 < routes["one_row"] < 20 and 0.05 < routes["prefill"] < 20, routes
    assert routes["advice"].startswith(f"int8 activations run one visitor's linears {routes['one_row']:.2f}x and "
                                       f"a prompt's {routes['prefill']:.2f}x the exact route's speed on this CPU")
    if max(routes["one_row"], routes["prefill"]) > 1.1:
        assert "--activations int8 is faster here, lossy as llama.cpp" in routes["advice"]
        assert "96.9%" in routes["advice"] and "python -m bench.divergence" in routes["advice"]
    else:
        assert routes["advice"].endswith("the exact default is as fast here")


def test_ignore_eos_goes_past_the_end_of_the_answer_to_max_new_tokens(embedded_server):
    body = {"prompt": CAPITAL, "stream": False, "temperature": 0, "max_new_tokens": 40}
    ended = post_chat(embedded_server.url, body).json()
    going = post_chat(embedded_server.url, {**body, "ignore_eos": True}).json()
    assert ended["usage"]["finish_reason"] == "stop" and ended["usage"]["completion_tokens"] < 40, ended
    assert going["usage"]["finish_reason"] == "length" and going["usage"]["completion_tokens"] == 40, going
    assert going["response"].startswith(ended["response"]) and len(going["response"]) > len(ended["response"])
    refused = post_chat(embedded_server.url, {**body, "ignore_eos": "sometimes"})
    assert refused.status_code == 400 and "ignore_eos" in refused.json()["error"], refused.text


def test_chinese_prompt_streams_without_replacement_characters(embedded_server):
    body = {"prompt": "法国的首都是哪里？请用中文回答。", "temperature": 0, "max_new_tokens": 48}
    with httpx.stream("POST", f"{embedded_server.url}/chat", json=body, timeout=120) as response:
        events = list(SSEReader(response))
    text = chat_text(events)
    assert "\ufffd" not in text
    assert all("\ufffd" not in e.data for e in events)
    assert any("\u4e00" <= ch <= "\u9fff" for ch in text), text  # the answer has Chinese characters


def test_conversation_longer_than_the_context_is_a_400_with_the_numbers(tiny_server):
    history = [{"role": "user" if i % 2 == 0 else "assistant", "content": "the quick brown fox " * 40}
               for i in range(9)]
    response = post_chat(tiny_server.url, {"messages": history, "max_new_tokens": 16})
    assert response.status_code == 400
    message = response.json()["error"]
    assert "1024" in message and "tokens" in message, message


def test_cors_is_off_by_default(tiny_server):
    preflight = httpx.options(f"{tiny_server.url}/chat", timeout=30, headers={
        "Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in preflight.headers
    response = post_chat(tiny_server.url, {"prompt": "Hi", "max_new_tokens": 1, "stream": False},
                         headers={"Origin": "https://evil.example"})
    assert response.status_code == 200 and "access-control-allow-origin" not in response.headers


def test_health_says_which_weights_linears_and_decode_attention_the_model_got(tiny_server):
    """The tiny Llama in float32 on the CPU: float weights, the C linears, decode steps in C."""
    health = httpx.get(f"{tiny_server.url}/health", timeout=10).json()
    assert (health["weights"], health["linears"], health["decode_attention"]) == \
        ("float", "C kernel", "C (the native decode step)")

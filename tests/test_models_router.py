"""Several models behind one server (frontend/models.py), over HTTP against one real app.py:
`--models-dir` with two tiny random-weight models, a bad .gguf and one too large for the budget,
`--models-memory` that holds one tiny model but not two (every switch unloads the other), a short
`--model-ttl`, an API key, and a `--models-preset` file serving the tiny llama twice with its own
context and KV pool each (`short`, `long`). Each model loads on its first request, answers as it does alone (greedy
tokens), makes room by unloading the least recently used idle one, never while a stream of it runs;
a bad file's error reaches its callers while the other model serves."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.servers import SSEReader, run_server, slow_steps

KEY = "models-router-key-3f9a"
AUTH = {"Authorization": f"Bearer {KEY}"}
TTL_S = 8  # --model-ttl: long beside one test's requests, short for the test that waits for it
PROMPT = [5, 6, 7, 8, 9]  # token ids: the same prompt for the server and the reference
MAX_TOKENS = 8
KV_BLOCKS = 64  # --num-kv-blocks: each model's KV pool, of 16-token blocks


def estimate(folder) -> int:
    """What --models-memory counts for a float32 model folder: its files plus its KV pool
    (keys and values of every layer, float32, for KV_BLOCKS blocks of 16 tokens)."""
    config = json.loads((folder / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 4
    return sum(p.stat().st_size for p in folder.resolve().iterdir()) + KV_BLOCKS * 16 * per_token


def budget(models_dir) -> int:
    """--models-memory: one tiny model fits, two do not."""
    sizes = [estimate(models_dir / name) for name in ("llama", "qwen2")]
    return max(sizes) + min(sizes) // 2


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory, tiny_model):
    folder = tmp_path_factory.mktemp("models")
    (folder / "llama").symlink_to(tiny_model("llama"), target_is_directory=True)
    (folder / "qwen2").symlink_to(tiny_model("qwen2"), target_is_directory=True)
    (folder / "broken.gguf").write_bytes(b"this is not a GGUF file")
    big = folder / "big"  # a model whose weights alone are past the budget (a sparse file: no disk taken)
    big.mkdir()
    (big / "config.json").write_bytes((tiny_model("llama") / "config.json").read_bytes())
    with open(big / "model.safetensors", "wb") as weights:
        weights.truncate(budget(folder) + 1)
    return folder


SHORT, LONG = 24, 64  # the preset models' contexts (--max-model-len of each)


@pytest.fixture(scope="module")
def preset(tmp_path_factory, models_dir):
    """Two models of one preset file, the same tiny llama with its own context and KV pool each (the model
    paths relative to the file's folder)."""
    folder = tmp_path_factory.mktemp("preset")
    (folder / "weights").symlink_to(models_dir / "llama", target_is_directory=True)
    path = folder / "models.toml"
    path.write_text(f'[short]\nmodel = "weights"\nmax-model-len = {SHORT}\nnum-kv-blocks = 4\n\n'
                    f'[long]\nmodel = "weights"\nmax-model-len = {LONG}\nnum-kv-blocks = 16\n')
    return path


@pytest.fixture(scope="module")
def server(models_dir, preset):
    with run_server("--models-dir", str(models_dir), "--models-preset", str(preset), "--default-model", "llama",
                    "--models-max", "3",
                    "--models-memory", str(budget(models_dir)), "--num-kv-blocks", str(KV_BLOCKS),
                    "--model-ttl", str(TTL_S), "--api-key", KEY) as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def alone(models_dir):
    """Each model's greedy answer to PROMPT served alone (engine.LLM in this process), by model name."""
    from engine import LLM, SamplingParams

    answers = {}
    for name in ("llama", "qwen2"):
        llm = LLM(str(models_dir / name))
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        answers[name] = llm.generate([PROMPT], params)[0].outputs[0].text
        llm20 = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
        answers[name + "/20"] = llm.generate([PROMPT], llm20)[0].outputs[0].text
    return answers


def states(client) -> dict[str, str]:
    return {m["id"]: m["status"]["value"] for m in client.get("/v1/models").json()["data"]}


def loads(client) -> dict[str, int]:
    return {m["id"]: m["loads"] for m in client.get("/health").json()["models"]}


def complete(client, model: str, max_tokens: int = MAX_TOKENS) -> httpx.Response:
    return client.post("/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": max_tokens,
                                                "temperature": 0, "ignore_eos": True})


def test_models_are_listed_with_state_and_size(client, models_dir):
    listed = {m["id"]: m for m in client.get("/v1/models").json()["data"]}
    assert set(listed) == {"llama", "qwen2", "broken", "big", "short", "long"}
    assert listed["llama"]["status"] == {"value": "loaded"}  # the default, loaded at start
    assert listed["qwen2"]["status"] == {"value": "unloaded"}
    assert listed["qwen2"]["size_bytes"] == sum(p.stat().st_size for p in (models_dir / "qwen2").resolve().iterdir())
    assert listed["broken"]["size_bytes"] == len(b"this is not a GGUF file")
    one = client.get("/v1/models/qwen2")
    assert one.status_code == 200 and one.json()["id"] == "qwen2"
    # the memory estimate: weights file plus KV pool, loaded (measured) or not (from its config)
    for name in ("llama", "qwen2"):
        assert listed[name]["estimated_memory_bytes"] == estimate(models_dir / name), name


def test_a_model_too_large_for_the_budget_even_alone_is_a_503_saying_why(client, models_dir):
    complete(client, "llama")
    refused = complete(client, "big")
    assert refused.status_code == 503 and "retry-after" not in refused.headers  # waiting would not help
    message = refused.json()["error"]["message"]
    need = next(m for m in client.get("/v1/models").json()["data"] if m["id"] == "big")["estimated_memory_bytes"]
    assert need > budget(models_dir)
    assert "`big` cannot be loaded" in message and f"{need:,} bytes" in message, message
    assert f"--models-memory is {budget(models_dir):,} bytes" in message, message
    assert states(client)["llama"] == "loaded"  # nothing was unloaded for it


def test_each_model_loads_on_its_first_request_and_answers_as_it_does_alone(client, alone):
    assert complete(client, "llama").json()["choices"][0]["text"] == alone["llama"]
    assert states(client)["qwen2"] == "unloaded"
    before = loads(client)["qwen2"]
    answer = complete(client, "qwen2")
    assert answer.status_code == 200, answer.text
    assert answer.json()["model"] == "qwen2"
    assert answer.json()["choices"][0]["text"] == alone["qwen2"]
    assert alone["qwen2"] != alone["llama"]  # the two models answer differently: routing shows
    now = states(client)
    # --models-memory holds one: loading qwen2 unloaded llama, the least recently used idle model
    assert (now["qwen2"], now["llama"]) == ("loaded", "unloaded")
    assert loads(client)["qwen2"] == before + 1
    # a request naming no model goes to the default, loaded again
    body = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
                                                "ignore_eos": True}).json()
    assert body["choices"][0]["text"] == alone["llama"] and body["model"] == "llama"
    assert states(client)["llama"] == "loaded"


def test_unknown_model_is_a_404_naming_the_models_served_on_every_route(client):
    bodies = {
        "/chat": {"model": "nope", "prompt": "hi", "stream": False},
        "/v1/chat/completions": {"model": "nope", "messages": [{"role": "user", "content": "hi"}]},
        "/v1/completions": {"model": "nope", "prompt": "hi"},
        "/v1/responses": {"model": "nope", "input": "hi"},
        "/v1/messages": {"model": "nope", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
        "/v1/messages/count_tokens": {"model": "nope", "messages": [{"role": "user", "content": "hi"}]},
        "/models/load": {"model": "nope"},
    }
    for path, body in bodies.items():
        response = client.post(path, json=body)
        assert response.status_code == 404, (path, response.text)
        assert "`nope` does not exist" in response.text, path
        assert "`short`, `long`, `big`, `broken`, `llama`, `qwen2`" in response.text, path
    assert client.get("/v1/models/nope").status_code == 404


def test_every_generating_route_answers_with_the_model_it_names(client):
    chat = client.post("/chat", json={"model": "qwen2", "prompt": "hi", "max_new_tokens": 3, "stream": False})
    assert chat.status_code == 200 and states(client)["qwen2"] == "loaded"
    messages = client.post("/v1/messages", json={"model": "llama", "max_tokens": 3,
                                                 "messages": [{"role": "user", "content": "hi"}]})
    assert messages.status_code == 200 and states(client)["llama"] == "loaded"
    count = client.post("/v1/messages/count_tokens", json={"model": "qwen2",
                                                           "messages": [{"role": "user", "content": "hi"}]})
    assert count.status_code == 200 and states(client)["qwen2"] == "loaded"
    responses = client.post("/v1/responses", json={"model": "llama", "input": "hi", "max_output_tokens": 3})
    assert responses.status_code == 200 and states(client)["llama"] == "loaded"


def test_load_and_unload_over_http_need_the_key(server, client):
    for path in ("/models/load", "/models/unload"):
        refused = httpx.post(f"{server.url}{path}", json={"model": "qwen2"}, timeout=30)
        assert refused.status_code == 401, (path, refused.text)
    complete(client, "llama")
    unloaded = client.post("/models/unload", json={"model": "llama"})
    assert unloaded.status_code == 200 and unloaded.json()["model"]["status"] == {"value": "unloaded"}
    assert states(client)["llama"] == "unloaded"
    loaded = client.post("/models/load", json={"model": "qwen2"})
    assert loaded.status_code == 200 and loaded.json()["model"]["status"] == {"value": "loaded"}
    assert states(client)["qwen2"] == "loaded"
    wrong = client.post("/models/load", json={"name": "qwen2"})
    assert wrong.status_code == 400 and "`name` is not a known field. Allowed: model" in wrong.text


def scrape(client) -> dict[tuple, float]:
    """{(sample name, sorted labels): value} of GET /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(client.get("/metrics").text) for sample in family.samples}


def test_metrics_count_each_models_requests_under_its_name_and_health_says_each_state(client):
    def tokens(samples, model):
        return samples.get(("rill_generation_tokens_total", (("model", model), ("route", "v1_completions"))), 0.0)

    def finished(samples, model):
        key = ("rill_requests_finished_total", (("finish_reason", "length"), ("model", model),
                                                ("route", "v1_completions")))
        return samples.get(key, 0.0)

    complete(client, "llama")
    before = scrape(client)
    assert complete(client, "qwen2").status_code == 200
    after = scrape(client)
    assert tokens(after, "qwen2") - tokens(before, "qwen2") == MAX_TOKENS
    assert tokens(after, "llama") == tokens(before, "llama")  # the other model's count stays
    assert finished(after, "qwen2") - finished(before, "qwen2") == 1
    assert after[("rill_request_generation_tokens_count", (("model", "qwen2"),))] - before.get(
        ("rill_request_generation_tokens_count", (("model", "qwen2"),)), 0.0) == 1
    # the engine's gauges come per loaded model: qwen2's pool, nothing of the unloaded llama
    assert after[("rill_kv_cache_blocks", (("model", "qwen2"),))] == KV_BLOCKS
    assert ("rill_kv_cache_blocks", (("model", "llama"),)) not in after
    health = {m["id"]: m["status"]["value"] for m in client.get("/health").json()["models"]}
    assert (health["qwen2"], health["llama"], health["big"]) == ("loaded", "unloaded", "unloaded")


def test_a_bad_file_answers_its_callers_with_the_load_error_while_the_other_model_serves(client, alone):
    before = loads(client)["broken"]
    for attempt in (1, 2):  # a later request tries the load again
        failed = complete(client, "broken")
        assert failed.status_code == 500, failed.text
        error = failed.json()["error"]
        assert error["code"] == "model_load_failed" and error["param"] == "model"
        assert "The model `broken` failed to load" in error["message"] and "GGUF" in error["message"]
        listed = {m["id"]: m for m in client.get("/v1/models").json()["data"]}
        assert listed["broken"]["status"]["value"] == "failed" and "GGUF" in listed["broken"]["status"]["error"]
        assert loads(client)["broken"] == before + attempt
        assert complete(client, "qwen2").json()["choices"][0]["text"] == alone["qwen2"]


def test_concurrent_first_requests_load_the_model_once(client, alone):
    complete(client, "llama")  # qwen2 unloaded to make room (--models-memory)
    assert states(client)["qwen2"] == "unloaded"
    before = loads(client)["qwen2"]
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda _: complete(client, "qwen2"), range(4)))
    assert [a.status_code for a in answers] == [200] * 4
    assert {a.json()["choices"][0]["text"] for a in answers} == {alone["qwen2"]}
    assert loads(client)["qwen2"] == before + 1


def test_a_model_is_not_unloaded_while_its_stream_runs(server, client, alone):
    complete(client, "llama")
    other: dict = {}

    def ask_other():
        other["response"] = complete(client, "qwen2")
        other["done_at"] = time.monotonic()

    with slow_steps(server.url, 0.1, headers=AUTH):  # llama's 20 tokens take 2 s at least
        body = {"model": "llama", "prompt": PROMPT, "max_tokens": 20, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            events = SSEReader(response)
            chunks = iter(events)
            first = next(chunks)
            thread = threading.Thread(target=ask_other)
            thread.start()
            time.sleep(0.5)
            now = states(client)
            assert (now["llama"], now["qwen2"]) == ("loaded", "loading")
            listed = {m["id"]: m for m in client.get("/v1/models").json()["data"]}
            assert listed["qwen2"]["status"] == {"value": "loading", "waiting": 1}  # the request of ask_other
            rest = list(chunks)
            ended_at = time.monotonic()
        thread.join(120)
    payloads = [json.loads(e.data) for e in [first, *rest] if e.data != "[DONE]"]
    assert not [p for p in payloads if "error" in p], payloads
    text = "".join(c["text"] for p in payloads for c in p["choices"])
    assert text == alone["llama/20"]  # every token, none cut
    assert payloads[-1]["usage"]["completion_tokens"] == 20
    assert other["response"].status_code == 200, other["response"].text
    assert other["response"].json()["choices"][0]["text"] == alone["qwen2"]
    assert other["done_at"] >= ended_at - 0.5  # it waited for the stream, then made room
    assert states(client)["llama"] == "unloaded"


def test_an_idle_model_is_unloaded_after_the_ttl(client):
    complete(client, "qwen2")
    assert states(client)["qwen2"] == "loaded"
    deadline = time.monotonic() + TTL_S + 30
    while states(client)["qwen2"] == "loaded":
        assert time.monotonic() < deadline, "--model-ttl did not unload the idle model"
        time.sleep(0.5)
    assert states(client)["qwen2"] == "unloaded"


def test_gradio_client_picks_the_model_by_its_model_argument(server, client):
    from gradio_client import Client

    page = Client(server.url + "/", auth=("any-user-name", KEY), verbose=False)
    parameters = page.view_api(return_format="dict", print_info=False)["named_endpoints"]["/chat"]["parameters"]
    model = parameters[-1]
    assert model["parameter_name"] == "model" and model["parameter_default"] == "llama"
    complete(client, "llama")  # qwen2 unloaded: the page's message loads it
    greedy = dict(system_prompt="", temperature=0.0, top_p=1.0, top_k=0, repetition_penalty=1.0)
    answer = page.predict(message="Tell me a joke.", history=[], **greedy, max_new_tokens=6, model="qwen2",
                          api_name="/chat")
    chat = client.post("/chat", json={"model": "qwen2", "prompt": "Tell me a joke.", "temperature": 0,
                                      "max_new_tokens": 6, "stream": False}).json()["response"]
    default = client.post("/chat", json={"prompt": "Tell me a joke.", "temperature": 0, "max_new_tokens": 6,
                                         "stream": False}).json()["response"]
    assert answer == chat and answer != default
    assert page.predict(message="Tell me a joke.", history=[], **greedy, max_new_tokens=6,
                        api_name="/chat") == default  # no model: the default


def test_each_preset_model_is_built_with_its_own_context_and_kv_pool(client, models_dir):
    listed = {m["id"]: m for m in client.get("/v1/models").json()["data"]}
    assert listed["short"]["settings"] == {"max-model-len": SHORT, "num-kv-blocks": 4}
    assert (listed["short"]["max_model_len"], listed["long"]["max_model_len"]) == (SHORT, LONG)  # before loading
    prompt = list(range(5, 35))  # 30 tokens: past short's context, within long's
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    refused = client.post("/v1/completions", json={**body, "model": "short"})
    assert refused.status_code == 400, refused.text
    assert f"beyond this model's context of {SHORT} tokens" in refused.json()["error"]["message"]
    answered = client.post("/v1/completions", json={**body, "model": "long"})
    assert answered.status_code == 200, answered.text
    assert answered.json()["usage"] == {"prompt_tokens": 30, "completion_tokens": 4, "total_tokens": 34}
    assert complete(client, "short").status_code == 200  # its own prompts fit
    listed = {m["id"]: m for m in client.get("/v1/models").json()["data"]}
    per_block = (estimate(models_dir / "llama") - sum(p.stat().st_size for p in (models_dir / "llama").resolve()
                                                        .iterdir())) // KV_BLOCKS  # --num-kv-blocks 64 elsewhere
    assert (listed["short"]["kv_cache_bytes"], listed["long"]["kv_cache_bytes"]) == (4 * per_block, 16 * per_block)
    assert (listed["short"]["max_model_len"], listed["long"]["max_model_len"]) == (SHORT, LONG)  # the engines'

"""Several models on `--backend ray` (frontend/backends/ray_backend.py): one replica set per model,
each its own Serve application, deployed when the model loads and deleted when it unloads. One
app.py with two tiny random-weight models (`--model` twice, one replica each): each answers by name
as it does alone (greedy tokens), /health shows the default model's own replica only, and an
unloaded model is deployed again by its next request."""

from __future__ import annotations

import httpx
import pytest

from tests.servers import run_server

pytest.importorskip("ray.serve", reason="--backend ray needs requirements-ray.txt")
pytestmark = [pytest.mark.ray, pytest.mark.server]

PROMPT = [5, 6, 7, 8, 9]  # token ids: the same prompt for the server and the reference
MAX_TOKENS = 8


def test_each_model_gets_its_own_replicas_and_answers_as_it_does_alone(tiny_model):
    from engine import LLM, SamplingParams

    paths = {"llama": tiny_model("llama"), "qwen2": tiny_model("qwen2")}
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    alone = {name: LLM(str(path)).generate([PROMPT], params)[0].outputs[0].text for name, path in paths.items()}
    assert alone["llama"] != alone["qwen2"]  # the two models answer differently: routing shows

    def complete(client, model: str) -> httpx.Response:
        return client.post("/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS,
                                                     "temperature": 0, "ignore_eos": True})

    with run_server("--model", str(paths["llama"]), "--model", str(paths["qwen2"]), "--backend", "ray",
                    "--replicas", "1", "--replica-cpus", "0.5", "--models-max", "2") as server, \
            httpx.Client(base_url=server.url, timeout=300) as client:
        for name in ("qwen2", "llama", "qwen2"):
            answer = complete(client, name)
            assert answer.status_code == 200, answer.text
            assert (answer.json()["model"], answer.json()["choices"][0]["text"]) == (name, alone[name])
        states = {m["id"]: m["status"]["value"] for m in client.get("/v1/models").json()["data"]}
        assert states == {"llama": "loaded", "qwen2": "loaded"}
        health = client.get("/health").json()
        assert health["backend"] == "ray" and len([r for r in health["replicas"] if r["alive"]]) == 1, health
        # unloaded: its replica set deleted; its next request deploys it again
        assert client.post("/models/unload", json={"model": "qwen2"}).status_code == 200
        assert {m["id"]: m["status"]["value"] for m in client.get("/v1/models").json()["data"]}["qwen2"] == "unloaded"
        again = complete(client, "qwen2")
        assert again.status_code == 200 and again.json()["choices"][0]["text"] == alone["qwen2"], again.text

"""`--kv-cache-dtype auto|float32|bfloat16|float16`: a 16-bit KV cache holds twice the tokens in the
same memory, its decode attention on the torch path (the C kernels read float32 caches); auto keeps
the model's dtype. A bad value is a startup error that names the allowed ones."""

from __future__ import annotations

import subprocess

import httpx
import pytest
import torch

import app
from engine import LLM, EngineConfig
from engine.model.loading import load_model
from tests.servers import ROOT, clean_env, python
from tests.test_engine_parity import engine_outputs, prompts_and_refs

MEMORY = 4 * 2**20  # the KV pool's bytes in the tests below


@pytest.mark.parametrize("dtype, equal", [("float16", 16), ("bfloat16", 12)])
def test_a_16_bit_cache_holds_twice_the_tokens_and_stays_near_generate(tiny_model, dtype, equal):
    """float16 keeps 10 bits of mantissa: every sequence of the tiny Llama equals `generate`; bfloat16
    keeps 7: every first token does and most whole sequences of 24 tokens (13 of 16 measured)."""
    path, prompts, refs = prompts_and_refs(tiny_model, "llama")
    full = LLM(load_model(str(path)), EngineConfig(kv_cache_memory=MEMORY))
    half = LLM(load_model(str(path)), EngineConfig(kv_cache_memory=MEMORY, kv_cache_dtype=dtype,
                                                   max_num_batched_tokens=128))
    assert half.core.num_kv_blocks == 2 * full.core.num_kv_blocks
    assert half.core.kv_cache_bytes == full.core.kv_cache_bytes
    assert {t.dtype for t in (*half.core.runner.cache.keys, *half.core.runner.cache.values)} == {getattr(torch, dtype)}
    assert half.core.runner.decode_kernel is None and half.core.runner.native is None
    assert half.core.decode_attention == f"torch (gathered per step): a {dtype} KV cache, which the decode kernels do not read"
    got = engine_outputs(half, prompts)
    assert [g[0] for g in got] == [r[0] for r in refs]
    assert sum(g == r for g, r in zip(got, refs)) >= equal


def test_auto_is_the_models_dtype_and_float32_keeps_the_kernels(tiny_model):
    path = tiny_model("llama")
    for name in ("auto", "float32"):
        llm = LLM(load_model(str(path)), EngineConfig(kv_cache_dtype=name))
        assert llm.core.kv_cache_dtype == torch.float32 and llm.core.runner.cache.keys[0].dtype == torch.float32
        assert llm.core.decode_attention == "C (the native decode step)"


def test_a_bad_kv_cache_dtype_is_refused_with_the_allowed_values(capsys):
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of auto, float32, bfloat16, float16. Given: 'int8'"):
        EngineConfig(kv_cache_dtype="int8")
    with pytest.raises(SystemExit) as caught:
        app.parse_settings([], environ={"KV_CACHE_DTYPE": "fp8"})
    assert caught.value.code == 2
    assert ("--kv-cache-dtype must be one of auto, float32, bfloat16, float16. Given: 'fp8'"
            in capsys.readouterr().err.strip().splitlines()[-1])
    assert app.parse_settings([], environ={"KV_CACHE_DTYPE": "bfloat16"}).kv_cache_dtype == "bfloat16"
    assert app.parse_settings(["--kv-cache-dtype", "float16"], environ={"KV_CACHE_DTYPE": "bfloat16"}).kv_cache_dtype == "float16"
    result = subprocess.run([python(), "app.py", "--kv-cache-dtype", "int4"], cwd=ROOT, env=clean_env(),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "--kv-cache-dtype must be one of auto, float32, bfloat16, float16. Given: 'int4'" in result.stderr


def test_a_server_with_a_bfloat16_cache_answers_and_says_so(server_with, tiny_llama_path):
    server = server_with("--kv-cache-dtype", "bfloat16", "--kv-cache-memory", str(MEMORY))
    response = httpx.post(f"{server.url}/v1/completions", timeout=120,
                          json={"prompt": "Hello, world!", "max_tokens": 8, "temperature": 0})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] >= 1
    health = server.health()
    assert health["kv_cache_dtype"] == "bfloat16" and health["runner"] == "paged"
    assert health["runner_reason"] is None
    assert health["decode_attention"] == "torch (gathered per step): a bfloat16 KV cache, which the decode kernels do not read"
    full = LLM(load_model(str(tiny_llama_path)), EngineConfig(kv_cache_memory=MEMORY))
    assert health["engine"]["num_kv_blocks"] == 2 * full.core.num_kv_blocks  # twice the tokens in the same bytes

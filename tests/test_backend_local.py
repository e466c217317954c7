"""The backend settings and the local backend's independence from Ray (no model server needed)."""

from __future__ import annotations

import subprocess

import app
from tests.servers import ROOT, clean_env, python


def test_backend_flags_and_their_environment_variables():
    settings = app.parse_settings([], environ={"BACKEND": "ray", "REPLICAS": "3", "MAX_REPLICAS": "6",
                                               "REPLICA_CPUS": "2", "RAY_ADDRESS": "auto"})
    assert (settings.backend, settings.replicas, settings.max_replicas, settings.replica_cpus,
            settings.ray_address) == ("ray", 3, 6, 2.0, "auto")
    settings = app.parse_settings(["--ray-address", "10.0.0.5:6379"], environ={"RAY_AUTH_TOKEN": "t0k"})
    assert (settings.ray_address, settings.ray_auth_token) == ("10.0.0.5:6379", "t0k")  # Ray's own variable
    assert app.parse_settings(["--ray-auth-token", "t1"], environ={"RAY_AUTH_TOKEN": "t0k"}).ray_auth_token == "t1"
    settings = app.parse_settings(["--backend", "openai", "--backend-url", "http://10.0.0.2:8000",
                                   "--backend-key", "k1"], environ={"BACKEND": "ray"})
    assert (settings.backend, settings.backend_url, settings.backend_key) == ("openai", "http://10.0.0.2:8000", "k1")
    assert app.parse_settings([], environ={}).backend == "local"


def run_app(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([python(), "app.py", *flags], cwd=ROOT, env=clean_env(), capture_output=True, text=True,
                          timeout=120)


def test_bad_backend_settings_exit_2_with_one_line_saying_what_is_allowed():
    cases = [
        (("--backend", "kubernetes"), "--backend must be one of local, ray, openai. Given: 'kubernetes'"),
        (("--backend", "openai"), "--backend openai needs --backend-url"),
        (("--backend", "openai", "--backend-url", "10.0.0.2:8000"), "starting with http:// or https://"),
        (("--backend", "ray", "--replicas", "0"), "--replicas must be >= 1. Given: 0"),
        (("--backend", "ray", "--replicas", "3", "--max-replicas", "2"), "--max-replicas must be 0"),
        (("--backend", "ray", "--ray-address", "127.0.0.1:6379", "--ray-auth-token", " "),
         "--ray-auth-token is empty; give the Ray cluster's token"),
    ]
    for flags, message in cases:
        result = run_app(*flags)
        assert result.returncode == 2, (flags, result.stderr)
        assert message in result.stderr, (flags, result.stderr)


def test_the_local_backend_never_imports_ray(tiny_llama_path):
    """The app and the page built on the local backend, a request through it: 'ray' is never imported."""
    script = (
        "import sys, asyncio\n"
        "import app\n"
        f"settings = app.parse_settings(['--model', {str(tiny_llama_path)!r}])\n"
        "from frontend.backends import create_engine\n"
        "engine = create_engine(settings)\n"
        "web = app.build_app(engine, settings)\n"
        "from engine.request import SamplingParams\n"
        "async def one():\n"
        "    return [o.text async for o in engine.generate(engine.encode('hi'), SamplingParams(max_tokens=3))]\n"
        "assert len(asyncio.run(one())) >= 1\n"
        "engine.shutdown()\n"
        "print('ray' in sys.modules, type(engine).__name__)\n")
    result = subprocess.run([python(), "-c", script], cwd=ROOT, env=clean_env(), capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split()[-2:] == ["False", "LocalEngine"]

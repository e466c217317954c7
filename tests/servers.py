"""Real server processes for the API tests (a pytest plugin, listed in the top-level conftest.py).

`run_server(*flags)` starts `.venv/bin/python app.py --port <free> ...`, waits for /health and
yields a `ServerProcess` (base `url`, the process, its log). Session fixtures share processes:

- `tiny_server`: a tiny random Llama (tests/tiny_models.py), test hooks on.
- `embedded_server`: the embedded SmolLM2-135M-Instruct (tests using it are marked `embedded`).
- `server_with(*flags)`: a tiny-Llama server with extra flags, started once per distinct flag set.
- `feedback_server`: a tiny-Llama server keeping the page's likes in a folder of the session's.

Also the wire helpers the tests share: an SSE parser that keeps the raw bytes, and `health()`.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]
PYTHON = ROOT / ".venv" / "bin" / "python"
START_TIMEOUT_S = float(os.environ.get("RILL_TEST_START_TIMEOUT", "600"))  # first embedded start converts a GGUF
_SETTING_VARIABLES = ("MODEL_ID", "API_KEY", "DTYPE", "DEVICE", "MAX_NUM_SEQS", "MAX_QUEUE", "KV_CACHE_MEMORY",
                      "NUM_KV_BLOCKS", "GRADIO_SERVER_NAME", "GRADIO_SERVER_PORT", "HOST", "PORT", "UI_AUTH",
                      "REQUEST_TIMEOUT", "RESUME_WINDOW", "MAX_BODY_BYTES", "SHUTDOWN_TIMEOUT", "MAX_MODEL_LEN",
                      "CORS_ORIGINS", "RILL_TEST_HOOKS", "MAX_NEW_TOKENS", "LOG_LEVEL", "LOG_FORMAT", "SEED",
                      "TRUST_REMOTE_CODE", "MAX_NUM_BATCHED_TOKENS", "BLOCK_SIZE", "RESUME_MAX_STREAMS",
                      "RESUME_MAX_BYTES", "MAX_ENGINE_RESTARTS", "QUANTIZE", "KV_CACHE_DTYPE",
                      "CACHE_SALT_PER_SESSION", "FEEDBACK_DIR", "FORWARDED_ALLOW_IPS")


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """`count` free ports, all different: each socket stays bound until every port is drawn (one
    `free_port()` after another can hand out the same port twice, and a Ray node given one port
    for two of its components refuses to start)."""
    sockets = []
    try:
        for _ in range(count):
            sockets.append(socket.socket())
            sockets[-1].bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def clean_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The test process's environment without any rill setting, offline, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if k not in _SETTING_VARIABLES}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", GRADIO_ANALYTICS_ENABLED="False",
               PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    env.update(extra or {})
    return env


def python() -> str:
    return str(PYTHON) if PYTHON.exists() else sys.executable


@dataclass
class ServerProcess:
    """A running `app.py`."""

    url: str
    port: int
    process: subprocess.Popen
    log_path: Path
    args: tuple[str, ...] = field(default_factory=tuple)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def health(self) -> dict:
        return httpx.get(f"{self.url}/health", timeout=10).json()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        """Signal the process and wait for it; kill it if it does not exit in `timeout` s."""
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        return self.process.returncode


def _wait_ready(server: ServerProcess, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"app.py {' '.join(server.args)} exited with {server.process.returncode} before "
                               f"answering /health:\n{server.log()[-4000:]}")
        try:
            if httpx.get(f"{server.url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise RuntimeError(f"app.py {' '.join(server.args)} did not answer /health within {timeout:g} s:\n"
                       f"{server.log()[-4000:]}")


@contextlib.contextmanager
def run_server(*flags: str, env: dict[str, str] | None = None, test_hooks: bool = True,
               timeout: float = START_TIMEOUT_S, port_from_env: bool = False) -> Iterator[ServerProcess]:
    """A fresh `app.py` process with `flags`; stopped (SIGTERM, then kill) on exit.

    `port_from_env`: the port goes through GRADIO_SERVER_PORT instead of --port (as on a Space)."""
    port = free_port()
    env = dict(env or {})
    if port_from_env:
        env["GRADIO_SERVER_PORT"] = str(port)
        where = ()
    else:
        where = ("--host", "127.0.0.1", "--port", str(port))
    args = (*where, *(("--test-hooks",) if test_hooks else ()), *flags)
    log_file = tempfile.NamedTemporaryFile(prefix="rill-server-", suffix=".log", delete=False)
    process = subprocess.Popen([python(), "app.py", *args], cwd=ROOT, env=clean_env(env),
                               stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
    server = ServerProcess(f"http://127.0.0.1:{port}", port, process, Path(log_file.name), args)
    try:
        _wait_ready(server, timeout)
        yield server
    finally:
        server.stop(signal.SIGTERM, timeout=30)
        log_file.close()


# --------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="session")
def tiny_llama_path(request) -> Path:
    """The tiny Llama folder (RILL_TEST_TINY_LLAMA reuses one built before, for quick reruns)."""
    prebuilt = os.environ.get("RILL_TEST_TINY_LLAMA")
    if prebuilt:
        return Path(prebuilt)
    return request.getfixturevalue("tiny_model")("llama")


@pytest.fixture(scope="session")
def _server_pool():
    stack = contextlib.ExitStack()
    pool: dict[tuple, ServerProcess] = {}
    yield stack, pool
    stack.close()


@pytest.fixture(scope="session")
def server_with(_server_pool, tiny_llama_path):
    """`server_with(*flags)`: a tiny-Llama server with `flags`, shared by every test asking the same flags.

    `server_with.retire(server)`: a test that breaks a server on purpose (kills its engine, sends
    SIGTERM) retires it first, so that a later request for the same flags starts a fresh one."""
    stack, pool = _server_pool

    def get(*flags: str, model: str | os.PathLike | None = None) -> ServerProcess:
        key = (str(model or tiny_llama_path), *flags)
        server = pool.get(key)
        if server is None or server.process.poll() is not None:
            server = stack.enter_context(run_server("--model", key[0], *flags))
            pool[key] = server
        return server

    def retire(server: ServerProcess) -> None:
        for key, known in list(pool.items()):
            if known is server:
                del pool[key]

    get.retire = retire
    return get


TINY_SERVER_FLAGS = ("--resume-window", "5")


@pytest.fixture(scope="session")
def tiny_server(server_with) -> ServerProcess:
    """The shared tiny-Llama server (default settings, short resume window, test hooks).

    RILL_TEST_TINY_URL points the tests at a server already running with the same flags
    (`app.py --model $RILL_TEST_TINY_LLAMA --test-hooks --resume-window 5`), for quick reruns."""
    url = os.environ.get("RILL_TEST_TINY_URL")
    if url:
        return ServerProcess(url.rstrip("/"), int(url.rsplit(":", 1)[1].strip("/")), None, Path(os.devnull))
    return server_with(*TINY_SERVER_FLAGS)


# a resume window of a minute (a reader away that long), records within 200,000 bytes (tests/test_security_limits.py)
LONG_RESUME_FLAGS = ("--resume-max-bytes", "200000", "--resume-window", "60")


@pytest.fixture(scope="session")
def feedback_server(server_with, tmp_path_factory) -> tuple[ServerProcess, Path]:
    """A tiny-Llama server that keeps the page's likes in a folder of the session's (`--feedback-dir`),
    answers of 12 tokens at most; and that folder. Shared by the modules that read what the page writes."""
    folder = tmp_path_factory.mktemp("feedback")
    return server_with("--feedback-dir", str(folder), "--max-new-tokens", "12"), folder


@pytest.fixture(scope="session")
def embedded_server(_server_pool) -> ServerProcess:
    """The embedded SmolLM2-135M-Instruct, default settings."""
    stack, pool = _server_pool
    key = ("<embedded>",)
    if key not in pool:  # started as a Space starts it: no flags, the port from GRADIO_SERVER_PORT
        pool[key] = stack.enter_context(run_server(port_from_env=True))
    return pool[key]


def pytest_collection_modifyitems(config, items):
    for item in items:
        names = getattr(item, "fixturenames", ())
        if "embedded_server" in names:
            item.add_marker(pytest.mark.embedded)
        if any(n in names for n in ("embedded_server", "tiny_server", "server_with", "feedback_server")):
            item.add_marker(pytest.mark.server)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test shows the end of its servers' logs, with every server thread's stack (app.py
    dumps them on SIGUSR1): what a stuck or failing server was doing, in CI's output too."""
    outcome = yield
    report = outcome.get_result()
    if report.when != "call" or not report.failed:
        return
    servers = {id(v): v for v in getattr(item, "funcargs", {}).values() if isinstance(v, ServerProcess)}
    for server in servers.values():
        if server.process is None:
            continue
        if server.process.poll() is None:
            server.process.send_signal(signal.SIGUSR1)
            time.sleep(1.0)
        report.sections.append((f"server log (app.py {' '.join(server.args)})", server.log()[-8000:]))


# --------------------------------------------------------------------------- wire helpers

@dataclass
class SSEEvent:
    """One server-sent event as a client sees it."""

    data: str
    event: str = "message"
    id: str | None = None


def parse_sse(raw: bytes) -> list[SSEEvent]:
    """Events of a complete `text/event-stream` body, framed by blank lines ("\\n\\n")."""
    return list(iter_sse_blocks(raw.decode("utf-8").split("\n\n")))


def iter_sse_blocks(blocks) -> Iterator[SSEEvent]:
    for block in blocks:
        if not block.strip("\n"):
            continue
        data_lines, event, event_id, seen = [], "message", None, False
        for line in block.split("\n"):
            if line.startswith(":"):
                continue  # comment (keep-alive ping)
            name, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if name == "data":
                data_lines.append(value)
                seen = True
            elif name == "event":
                event, seen = value, True
            elif name == "id":
                event_id, seen = value, True
        if seen:
            yield SSEEvent("\n".join(data_lines), event, event_id)


class SSEReader:
    """Reads events from a streaming httpx response as they arrive, keeping the raw bytes."""

    def __init__(self, response: httpx.Response):
        self.response = response
        self.raw = b""
        self._buffer = ""
        self._chunks = response.iter_raw()

    def __iter__(self) -> Iterator[SSEEvent]:
        decoder_pending = b""
        for chunk in self._chunks:
            self.raw += chunk
            decoder_pending += chunk
            try:
                text = decoder_pending.decode("utf-8")
                decoder_pending = b""
            except UnicodeDecodeError:
                continue  # a character split across chunks: wait for the rest
            self._buffer += text
            while "\n\n" in self._buffer:
                block, self._buffer = self._buffer.split("\n\n", 1)
                yield from iter_sse_blocks([block])


def chat_text(events: list[SSEEvent]) -> str:
    """The joined text pieces of a /chat stream."""
    return "".join(e.data for e in events if e.event == "message")


def usage_of(events: list[SSEEvent]) -> dict:
    usage = [e for e in events if e.event == "usage"]
    assert len(usage) == 1, f"expected one usage event, got {events}"
    return json.loads(usage[0].data)


def error_text(response: httpx.Response) -> str:
    """The message of an error response in either shape (`/chat`: {"error": msg}, `/v1`: OpenAI's)."""
    error = response.json()["error"]
    return error["message"] if isinstance(error, dict) else error


def wait_idle(url: str, timeout: float = 30.0, headers: dict | None = None) -> dict:
    """Poll /health until the engine runs and waits for nothing and the KV cache is free; returns it.
    `headers`: the key, on a server that has one (/health shows its counters only to key holders)."""
    deadline = time.monotonic() + timeout
    engine = {}
    while time.monotonic() < deadline:
        engine = httpx.get(f"{url}/health", timeout=10, headers=headers).json()["engine"]
        if engine["num_running"] == 0 and engine["num_waiting"] == 0 and engine["num_free_kv_blocks"] == engine["num_kv_blocks"]:
            return engine
        time.sleep(0.05)
    raise AssertionError(f"the engine did not become idle within {timeout:g} s: {engine}")


@contextlib.contextmanager
def slow_steps(url: str, seconds: float, headers: dict[str, str] | None = None):
    """Every engine step of the server at `url` sleeps `seconds` first (its `/_test/slow-steps` hook)
    while the block runs: a request outlives what the test does beside it however fast the machine."""
    response = httpx.post(f"{url}/_test/slow-steps", params={"seconds": seconds}, headers=headers, timeout=10)
    assert response.status_code == 200, response.text
    try:
        yield
    finally:
        httpx.post(f"{url}/_test/slow-steps", params={"seconds": 0}, headers=headers, timeout=10)

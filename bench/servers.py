"""The processes a benchmark starts and what it writes: a server to start (`Server`), its running
process (`ServerProcess`), a free port, the checkout's commit, and the results folder.

Shared by the suite (bench/suite.py), the peer table (bench/peers.py) and the one-off benchmarks,
so none of them imports another's entry point. `RILL_BENCH_RESULTS` moves the results folder (the
tests write theirs into a temporary one)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(os.environ.get("RILL_BENCH_RESULTS") or ROOT / "bench" / "results")


@dataclass
class Run:
    """One load-client pass against a started server."""

    label: str  # as shown in tables and the plot
    api: str  # chat | openai | gradio
    levels: list[int] | None = None  # None = the suite's levels


@dataclass
class Server:
    """A server to start, how to tell it is ready, and the runs to make against it."""

    name: str
    command: list[str]  # with {model} and {port} placeholders
    ready_path: str
    runs: list[Run] = field(default_factory=list)
    model_name: bool = False  # send the model folder as the OpenAI `model` field
    env: dict[str, str] = field(default_factory=dict)  # set on top of the suite's environment


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A server started in its own process group; stopped with SIGTERM, then SIGKILL."""

    def __init__(self, server: Server, model_dir: Path, log_path: Path, port: int | None = None):
        self.server = server
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [part.format(model=model_dir, port=self.port) for part in server.command]
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", GRADIO_ANALYTICS_ENABLED="False",
                   PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        env.update(server.env)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.started = time.perf_counter()

    def wait_ready(self, timeout: float) -> float:
        import httpx

        deadline = time.perf_counter() + timeout
        while time.perf_counter() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.server.name} exited with {self.proc.returncode} before it was ready:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + self.server.ready_path, timeout=2.0).status_code == 200:
                    return time.perf_counter() - self.started
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.server.name} not ready after {timeout:.0f} s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 15) -> str:
        self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=20)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait()
        self._log.close()


def git_commit() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        return sha + ("+dirty" if dirty else "")
    except OSError:
        return "unknown"

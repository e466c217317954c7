"""Every `python -m bench.<name>` entry point, run once on the smallest input it takes, so that a
benchmark that breaks fails here instead of rotting unseen.

Each runs in this process through its `main(argv)` where it can (torch and transformers are
imported once), on the shared tiny Llama (tests/tiny_models.py) or a tiny random GGUF with SmolLM2's
tokenizer (bench/gguf_file.py), a few tokens, one client, peers (llama-server, vLLM) left out. The
entry points that start servers start their own, as they do for a measurement. Results go to a
temporary folder (`RILL_BENCH_RESULTS`, and each module's `RESULTS`), never to bench/results/.

Left out, each for a reason of its own (LEFT_OUT): a check asserts that every other entry point
is run here, so a new one cannot be forgotten.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.servers import clean_env, python

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"

LEFT_OUT: dict[str, str] = {}  # name -> why it is not run here (none today)
RUN_HERE = {"__main__", "plot", "profile_summary", "sampler", "divergence", "structured", "speculative",
            "spec_bound", "verify_cost", "stop_strings", "memory_bound", "quant_kinds", "peak_rates", "model",
            "suite", "fair_share", "server_share", "weights", "scaleout", "sse_cost", "peers", "gpu_check",
            "qlinear_ab", "models_switch", "avx512_check", "compile_check", "vision"}
TINY_SHAPE = "hidden=64,layers=2,ffn=128,heads=4,kv_heads=2,context=1024"


def test_every_entry_point_is_run_here_or_left_out_for_a_reason():
    """A module of bench/ with a `__main__` block (and bench/__main__.py) is an entry point."""
    found = {path.stem for path in BENCH.glob("*.py") if re.search(r'^if __name__ == "__main__":', path.read_text(), re.M)}
    found.add("__main__")
    assert found == RUN_HERE | set(LEFT_OUT), (f"not run here: {sorted(found - RUN_HERE - set(LEFT_OUT))}; "
                                               f"run here but gone: {sorted((RUN_HERE | set(LEFT_OUT)) - found)}")


@pytest.fixture(autouse=True)
def results(tmp_path, monkeypatch) -> Path:
    """Results and server logs into a temporary folder, here and in the processes started from here."""
    folder = tmp_path / "results"
    monkeypatch.setenv("RILL_BENCH_RESULTS", str(folder))
    import bench.peers
    import bench.scaleout
    import bench.servers
    import bench.suite
    import bench.weights

    for module in (bench.servers, bench.suite, bench.peers, bench.weights, bench.scaleout):
        monkeypatch.setattr(module, "RESULTS", folder)
    return folder


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    """A random GGUF of a tiny Llama (hidden 64, 2 layers) in Q8_0, with SmolLM2's tokenizer."""
    from bench.gguf_file import parse_shape, write_random_gguf

    return write_random_gguf(parse_shape(TINY_SHAPE), tmp_path_factory.mktemp("gguf") / "tiny-q8_0.gguf", "q8_0")


def run_module(*argv: str, timeout: float = 300) -> str:
    """`python -m ARGV...` in the checkout; its stdout, after a zero exit status."""
    done = subprocess.run([python(), "-m", *argv], cwd=ROOT, env=clean_env(), capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, f"python -m {' '.join(argv)} exited with {done.returncode}:\n{done.stderr[-4000:]}"
    return done.stdout


def table_rows(text: str) -> list[list[str]]:
    """The data rows of the markdown tables in `text`, cells stripped."""
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in text.splitlines()
            if line.startswith("| ") and not line.startswith("|---")]


# ------------------------------------------------------------------ clients of a running server


def test_load_client_then_plot_then_profile_summary(tiny_server, tiny_llama_path, tmp_path, capsys):
    """`python -m bench` against the shared tiny server, its results drawn by bench.plot; and
    bench.profile_summary over a speedscope profile of two threads."""
    out = tmp_path / "run.json"
    run_module("bench", "--url", tiny_server.url, "--api", "openai", "--concurrency", "1", "--requests", "2",
               "--warmup", "0", "--max-tokens", "4", "--prompt-tokens", "8", "--ignore-eos", "--tokenizer",
               str(tiny_llama_path), "--label", "tiny", "--out", str(out), "--no-progress")
    level, = json.loads(out.read_text())["levels"]
    assert (level["concurrency"], level["requests"], level["errors"], level["completed"]) == (1, 2, 0, 2)
    assert level["output_tokens_per_s"] > 0

    from bench import plot, profile_summary

    png = tmp_path / "plot.png"
    assert plot.main([str(png), str(out)]) == 0
    assert png.read_bytes().startswith(b"\x89PNG")

    frames = [{"name": "step", "file": "engine/core.py", "line": 10}, {"name": "sample", "file": "engine/sampler.py"},
              {"name": "poll", "file": "ui/queue.py", "line": 3}]
    profile = {"shared": {"frames": frames}, "profiles": [
        {"name": "engine", "samples": [[0, 1], [0, 1], [0]], "weights": [1, 1, 2]},
        {"name": "MainThread", "samples": [[2]], "weights": [1]}]}
    path = tmp_path / "profile.speedscope.json"
    path.write_text(json.dumps(profile))
    capsys.readouterr()
    profile_summary.main([str(path), "--thread", "engine"])
    text = capsys.readouterr().out
    assert f"{path}: 2 threads, 5 samples" in text and "## engine: 4 samples (80% of all)" in text
    assert "100.0%  step (engine/core.py:10)" in text and "50.0%  step (engine/core.py:10)" in text.split("self:")[1]
    assert "MainThread" not in text


# ------------------------------------------------------------------ the engine alone, in this process


def test_sampler(monkeypatch, capsys):
    from bench import sampler

    monkeypatch.setattr(sys, "argv", ["bench.sampler", "--repeat", "1"])
    sampler.main()
    doc = json.loads(capsys.readouterr().out)
    cells = {f"{name} x{rows}" for name in sampler.SETTINGS for rows in sampler.ROWS}
    assert set(doc["ms_per_step"]) == {"C kernel", "numpy reference"}
    assert all(set(by_setting) == cells and all(ms > 0 for ms in by_setting.values())
               for by_setting in doc["ms_per_step"].values())


def test_divergence_of_the_kv_cache_dtypes(tiny_llama_path, capsys):
    """(`--model M`, the checkpoint's paths, runs in tests/test_hub_checkpoints.py.)"""
    from bench import divergence

    divergence.main(["--kv-cache", "--model", str(tiny_llama_path), "--tokens", "24"])
    rows = table_rows(capsys.readouterr().out)[1:]
    assert [row[0] for row in rows] == ["float32", "bfloat16", "float16"]
    assert rows[0][2] == "100.00%" and float(rows[0][3]) == 0.0  # float32 against itself
    assert all(float(row[3]) < 0.1 for row in rows)


def test_structured(tiny_llama_path, capsys):
    from bench import structured

    assert structured.main(["--model", str(tiny_llama_path), "--streams", "2", "--tokens", "4", "--rounds", "1"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["streams"] == 2 and doc["median_none"] > 0 and doc["median_half"] > 0 and doc["mask_fill_ms_16_rows"] > 0


def test_speculative_spec_bound_and_verify_cost(tiny_llama_path, capsys):
    from bench import spec_bound, speculative, verify_cost

    model = str(tiny_llama_path)
    assert speculative.main(["--model", model, "--modes", "off,ngram", "--max-tokens", "8", "--text-tokens", "32",
                             "--tasks", "repeat"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("repeat ")]
    assert [row[2:4] for row in rows] == [["rill", "off"], ["rill", "ngram"]] and rows[1][-1] == "yes"  # same tokens

    assert spec_bound.main(["--model", model, "--text-tokens", "32", "--max-tokens", "8", "--tasks", "repeat",
                            "--layers", "1"]) == 0
    text = capsys.readouterr().out
    assert re.search(r"^repeat 32 +\d+ +[\d.]+x", text, re.M), text

    assert verify_cost.main(["--model", model, "--ks", "0,2", "--max-tokens", "8", "--prompt-tokens", "16",
                             "--rounds", "1"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if re.match(r"^ +\d+ +\d+ ", line)]
    assert [row[0] for row in rows] == ["0", "2"] and all(row[-1] == "yes" for row in rows)


def test_stop_strings(tiny_llama_path, capsys):
    from bench import stop_strings

    stop_strings.main(["--model", str(tiny_llama_path), "--tokens", "4", "--rounds", "1"])
    text = capsys.readouterr().out
    assert text.count(" ms ") >= 4 and "beside the hostile request:" in text


def test_memory_bound_of_rill_alone(tiny_gguf, capsys):
    from bench import memory_bound

    assert memory_bound.main([str(tiny_gguf), "--tokens", "4", "--servers", "rill", "--read-gib", "0.0625"]) == 0
    rows = table_rows(capsys.readouterr().out)[1:]
    assert [row[:2] for row in rows] == [[tiny_gguf.name, "rill"]] and float(rows[0][4]) > 0


def test_quant_kinds(capsys):
    from bench import quant_kinds

    quant_kinds.main(["--types", "q8_0", "--shapes", "64x256", "--rounds", "2", "--repack-size", "256",
                      "--no-numpy"])
    text = capsys.readouterr().out
    assert re.search(r"^ +q8_0 +\S+ +[\d.]+ +[\d.]+", text, re.M) and re.search(r"^q4_1 +[\d.]+ +[\d.]+$", text, re.M)


def test_peak_rates(capsys):
    from bench import peak_rates

    assert peak_rates.main(["--iterations", "100000"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("CPU: ") and "float32 multiply-add:" in text and "int8 (vpmaddubsw" in text


def test_qlinear_ab_against_head():
    """The block kernels of HEAD against the working tree's in one binary (HEAD's entry points
    renamed), one small shape, 3 alternations. Built at -O1: the optimization level changes the
    speeds it measures, not what it compiles, renames and links, which is what can break here
    (the -O3 build of csrc/qlinear.c alone takes about 20 CPU seconds, twice)."""
    text = run_module("bench.qlinear_ab", "HEAD", "--shapes", "64x256", "--rows", "1,3", "--alternations", "3",
                      "--opt-level", "1", "--kinds", "2:5")
    assert "; HEAD -> working tree, kinds 2:5, float32 activations, -O1" in text.splitlines()[0], text
    rows = re.findall(r"^64 x 256, (\d+) rows, 2 threads: ([\d.]+) -> ([\d.]+) us \(([\d.]+)x\)$", text, re.M)
    assert [row[0] for row in rows] == ["1", "3"], text
    assert all(float(a) > 0 and float(b) > 0 and float(ratio) > 0 for _, a, b, ratio in rows), text


def test_avx512_check_emulated_on_this_cpu():
    """The AVX-512 paths of the block kernels, emulated on AVX2, against F.linear: one K-quant type,
    the one-row path and a tile with a remainder, built at -O0 (the emulated 512-bit vectors take
    about 100 CPU seconds to compile at -O1; -O0 compiles the same code, which is what can break)."""
    text = run_module("bench.avx512_check", "--types", "q4_k", "--rows", "1,9", "--opt-level", "0")
    if text.startswith("This CPU lacks AVX2"):
        pytest.skip(text.strip())
    assert "AVX-512: the start-up probe agrees" in text, text
    assert text.splitlines()[-1] == "AVX-512 emulated: 0 disagreements in 4 checks", text


def test_compile_check_on_a_one_layer_llama(tmp_path):
    """Inductor's compiled `generate` beside rill's step, on a one-layer Llama (its compile, the
    slowest part, grows with the graph): every number is there and no graph compiles while timed."""
    from bench.gguf_file import parse_shape, write_random_gguf

    model = write_random_gguf(parse_shape("hidden=64,layers=1,ffn=128,heads=4,kv_heads=2,context=256"),
                              tmp_path / "one-layer-q8_0.gguf", "q8_0")
    doc = json.loads(run_module("bench.compile_check", "--model", str(model), "--tokens", "6", timeout=600))
    assert doc["model"] == str(model) and doc["tokens"] == 6
    assert set(doc["ms_per_token"]) == {"rill native step (q8_0 blocks from the GGUF (8 linears))",
                                        "transformers generate, static cache, eager (float32)",
                                        "transformers generate, static cache, torch.compile (float32)"}, doc
    assert doc["graphs_compiled"] >= 1 and doc["graphs_compiled_while_timed"] == 0 and doc["compile_s"] > 0, doc


def test_the_benchmark_model_is_built_once(tmp_path, capsys):
    from bench import model

    assert model.main([str(tmp_path / "bench-llama")]) == 0
    assert capsys.readouterr().out.strip().endswith(str(tmp_path / "bench-llama"))
    config = json.loads((tmp_path / "bench-llama" / "config.json").read_text())
    assert {k: config[k] for k in ("hidden_size", "num_hidden_layers", "vocab_size")} == {
        "hidden_size": 512, "num_hidden_layers": 8, "vocab_size": 4096}
    model.main([str(tmp_path / "bench-llama")])  # built: found, not built again
    assert "building" not in capsys.readouterr().out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bench.gpu_check measures a CUDA GPU")
def test_gpu_check(tiny_llama_path, tmp_path, capsys):
    from bench import gpu_check

    out = tmp_path / "gpu.json"  # the tokenizer serves only the sweep, not run here
    assert gpu_check.main(["--tokenizer", str(tiny_llama_path), "--out", str(out), "--sections",
                           "bf16_agreement,attention"]) == 0
    report = json.loads(out.read_text())
    assert [row["arch"] for row in report["bf16_agreement"]] == ["llama", "mistral", "qwen2", "gemma2", "gpt2"]
    assert not str(report["attention"]).startswith("failed"), report["attention"]


# ------------------------------------------------------------------ entry points that start servers


def test_suite_on_rill_alone(tiny_llama_path, tmp_path, results, capsys):
    from bench import suite

    out = tmp_path / "suite.json"
    code = suite.main(["--servers", "rill", "--concurrency", "1", "--requests", "1", "--max-tokens", "4",
                       "--prompt-tokens", "8", "--model", str(tiny_llama_path), "--no-peers", "--no-progress",
                       "--out", str(out), "--plot", str(tmp_path / "suite.png")])
    doc = json.loads(out.read_text())
    assert code == 0, doc["failures"]
    assert [run["label"] for run in doc["runs"]] == ["rill /chat", "rill /v1", "rill page (gradio)"]
    assert all(run["levels"][0]["completed"] == 1 and run["levels"][0]["errors"] == 0 for run in doc["runs"])
    assert (results / "logs" / "rill.log").exists() and out.with_suffix(".md").exists()


def test_fair_share(tiny_llama_path, capsys):
    from bench import fair_share

    fair_share.main(["--model", str(tiny_llama_path), "--tries", "1"])
    text = capsys.readouterr().out
    assert re.search(r"B's TTFT idle: +[\d.]+ ms \(median of 1\)", text), text
    flood = re.search(r"B's TTFT under flood: +([\d.]+|nan) ms \(median of (\d+); 429s: (\d+)\)", text)
    assert flood and int(flood[2]) + int(flood[3]) == 1, text  # B was served or refused at once, in the flood


def test_server_share(tiny_llama_path, capsys):
    from bench import server_share

    server_share.main(["--model", str(tiny_llama_path), "--rounds", "1", "--concurrency", "1"])
    text = capsys.readouterr().out
    doc = json.loads(text[text.index("\n{") + 1:])
    assert doc["rounds"] == 1 and set(doc["by_clients"]["1"]) == {"engine alone", "over HTTP", "http_over_engine"}
    assert doc["by_clients"]["1"]["engine alone"]["tok_s"] > 0 and doc["by_clients"]["1"]["over HTTP"]["tok_s"] > 0


def test_weights(tiny_gguf, results, capsys):
    from bench import weights

    assert weights.main(["--model", str(tiny_gguf), "--concurrency", "1", "--requests", "1", "--max-tokens", "4"]) == 0
    rows = table_rows(capsys.readouterr().out)[1:]
    assert len(rows) == 1 and rows[0][0] == "1" and rows[0][3].endswith("x")
    doc = json.loads((results / "weights-short.json").read_text())
    assert doc["none"]["weights"] == "float" and doc["auto"]["weights"].startswith("q8_0 blocks from the GGUF")


def test_models_switch(results, capsys):
    from bench import models_switch

    assert models_switch.main(["--shape", TINY_SHAPE, "--recipe", "q8_0", "--tokens", "6", "--idle-s", "0.5"]) == 0
    text = capsys.readouterr().out
    assert re.search(r"^\| switch to the unloaded model, first token \| [\d.]+ s \([\d.]+x cold\) \| <= 1.5x \|$",
                     text, re.M), text
    doc = json.loads(next(results.glob("models_switch-*.json")).read_text())
    assert doc["cold"]["first_token_s"] > 0 and doc["switch"]["ttft_s"] > 0
    assert doc["rss"]["loaded_mb"] > 0 and doc["rss"]["before_load_mb"] > 0
    # the switch loaded the second model, the unload unloaded it
    assert doc["states"] == {"before_switch": "unloaded", "after_switch": "loaded", "after_unload": "unloaded"}
    assert len(doc["busy"]) == 2 and all(row["alone_tok_s"] and row["both_tok_s"] for row in doc["busy"].values())


@pytest.mark.ray
def test_scaleout(tiny_llama_path, results, capsys):
    from bench import scaleout

    assert scaleout.main(["--model", str(tiny_llama_path), "--concurrency", "1", "--replicas", "1", "--requests", "1",
                          "--max-tokens", "4"]) == 0
    text = capsys.readouterr().out
    assert re.search(r"^\| 1 \| [\d.]+ \(\d+ ms\) \| [\d.]+ \(\d+ ms\) \| [\d.]+x \|$", text, re.M), text
    assert json.loads((results / "scaleout-short.json").read_text())["replicas"] == 1


def test_sse_cost(capsys):
    from bench import sse_cost

    sse_cost.main(["--streams", "1", "--events", "5", "--rounds", "1"])
    doc = json.loads(capsys.readouterr().out)
    assert set(doc["server_cpu_us_per_event"]) == {"server/sse.py", "sse-starlette"}
    ratio = doc["ratio_sse_starlette_over_lean"]  # None when 5 events stayed under one clock tick of CPU
    assert ratio is None or ratio > 0


def test_peers_status_and_large_on_rill_alone(results, capsys):
    """`status` names each peer; `table` on rill alone says it has nothing to compare with; `large`
    on a tiny shape measures rill alone (peers are not built here)."""
    from bench import peers

    assert peers.main(["status"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == list(peers.PEERS)
    assert peers.main(["table", "--servers", "rill", "--workloads", "short", "--clients", "1"]) == 0
    assert "peer table skipped: no peer is ready" in capsys.readouterr().out
    out = results / "large.json"
    assert peers.main(["large", "--shape", TINY_SHAPE, "--servers", "rill", "--clients", "1", "--max-tokens", "4",
                       "--ttft-prompts", "none", "--requests-per-client", "1", "--out", str(out)]) == 0
    rill = json.loads(out.read_text())["results"]["rill"]
    assert "error" not in rill and rill["ready_s"] > 0
    level, = rill["runs"]["decode"]["levels"]
    assert (level["concurrency"], level["completed"], level["errors"]) == (1, level["requests"], 0)


def test_vision_on_the_shared_vlm_server(server_with, tiny_vlm, results, monkeypatch, capsys):
    """bench.vision against the tiny Idefics3 server tests/test_images.py starts (the same flags: one
    server), its pictures small enough for that server's byte limit, beside the usual Space's engine;
    and the checkpoint it writes at bench time, on the tiny shape."""
    import httpx

    from bench import vision
    from tests.test_images import IMAGE_BYTES_LIMIT

    monkeypatch.setattr(vision, "RESULTS", results)
    server = server_with("--max-image-bytes", str(IMAGE_BYTES_LIMIT), model=tiny_vlm)
    misses = lambda: httpx.get(f"{server.url}/health").json()["images"]["encoder_cache"]["misses"]  # noqa: E731
    before = misses()
    assert vision.main(["--url", server.url, "--model", str(tiny_vlm), "--picture", "64x48", "--tokens", "2",
                        "--clients", "1,2"]) == 0
    text = capsys.readouterr().out
    assert misses() - before == 5  # pictures never seen: the warm-up, the first, one at 1 client, two at 2
    rows = {row[0]: row for row in table_rows(text)[1:]}
    assert set(rows) == {"rill /v1/chat/completions", "the usual Space (generate, one at a time)"}, text
    assert re.search(r"^repeated picture: [\d.]+x the first TTFT \(target <= 0.3x\)$", text, re.M), text
    doc = json.loads((results / f"vision-{tiny_vlm.name}.json").read_text())
    assert doc["rill"]["family"] == "idefics3" and doc["image_tokens"] == 20  # 2x2 tiles and the global view
    for name in ("rill", "space"):
        levels = doc[name]["levels"]
        assert [(level["clients"], level["requests"]) for level in levels] == [(1, 1), (2, 2)]
        assert doc[name]["ttft_new_s"] > 0 and all(level["requests_per_s"] > 0 for level in levels)

    folder = vision.write_checkpoint("tiny", results / "tiny-smolvlm")
    assert vision.image_tokens(folder) == 4  # one 32-pixel tile of 16 patches, shuffled by 2
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "idefics3" and config["text_config"]["hidden_size"] == 64

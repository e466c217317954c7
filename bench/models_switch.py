"""Several models behind one server (issue 52's targets), on two random-weight GGUFs of one shape:

    .venv/bin/python -m bench.models_switch [--shape smollm2-1.7b] [--recipe q4_k_m] [--tokens 64]

1. Cold start: `app.py --model B.gguf` alone, from its launch to the first token of one request
   (ready time + that request's time to first token).
2. Switching: a server of both (`--model A.gguf --model B.gguf`, A the default and loaded), then
   one request naming the unloaded B: its time to first token (B's load included), against (1).
   The server's RSS before B is loaded, with it loaded, and after `POST /models/unload` of it.
3. Two models busy at once: one stream of `--tokens` tokens on each model alone, then both at the
   same time: each one's decode tokens/s, and its ratio to alone. Then the server's CPU time over
   `--idle-s` seconds with both loaded and nothing asked (an idle loaded model should cost none).

Targets (issue 52): switch within 1.5x of the cold start, each busy model at least 0.45x of its
tokens/s alone, RSS after the unload within 200 MB of before the load. Prints a table and writes
bench/results/models_switch-<shape>.json. The files are written by bench/gguf_file.py into a
temporary folder (a few seconds for the 1.7B shape's 1.06 GB each) and removed after.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from bench.gguf_file import parse_shape, write_random_gguf
from bench.servers import RESULTS, Server, ServerProcess, git_commit

READY_TIMEOUT_S = 900.0
PROMPT = "Write a long story about a lighthouse keeper and the sea, in many chapters."


def rss_bytes(pid: int) -> int:
    """The process's resident set (VmRSS of /proc/PID/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time the process has used (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def stream(url: str, model: str | None, max_tokens: int) -> dict:
    """One streamed /v1/completions request (greedy, `ignore_eos`): time to first token, and the decode
    rate after it (tokens after the first over the time after the first)."""
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    if model is not None:
        body["model"] = model
    started = time.perf_counter()
    first = last = None
    tokens = 0
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=READY_TIMEOUT_S) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{model}: {response.status_code} {response.read().decode()[:300]}")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if any(c.get("text") for c in chunk.get("choices", ())):
                last = time.perf_counter()
                first = first or last
    if first is None:
        raise RuntimeError(f"{model}: no token came back")
    decode_s = last - first
    return {"ttft_s": round(first - started, 3), "tokens": tokens,
            "decode_tok_s": round((tokens - 1) / decode_s, 2) if tokens > 1 and decode_s > 0 else None}


def state_of(url: str, name: str) -> str:
    """The model's state as GET /v1/models lists it."""
    models = httpx.get(f"{url}/v1/models", timeout=30).json()["data"]
    return next(m["status"]["value"] for m in models if m["id"] == name)


def start(name: str, flags: list[str], log_folder: Path) -> tuple[ServerProcess, float]:
    server = Server(name, [sys.executable, "app.py", "--port", "{port}", *flags], "/health")
    process = ServerProcess(server, Path("."), log_folder / f"models_switch-{name}.log")
    return process, process.wait_ready(READY_TIMEOUT_S)


def both_at_once(url: str, names: list[str], max_tokens: int) -> dict[str, dict]:
    results: dict[str, dict] = {}
    errors: list[BaseException] = []

    def run(name: str):
        try:
            results[name] = stream(url, name, max_tokens)
        except BaseException as exc:  # noqa: BLE001 - raised in the main thread below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(name,)) for name in names]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results


def measure(args, folder: Path) -> dict:
    shape = parse_shape(args.shape)
    files = [write_random_gguf(shape, folder / f"{letter}-{shape.key}.gguf", args.recipe, seed=seed)
             for letter, seed in (("a", 0), ("b", 1))]
    names = [path.stem for path in files]
    logs = RESULTS / "logs"
    doc: dict = {"shape": shape.key, "recipe": args.recipe, "tokens": args.tokens, "file_bytes": files[1].stat().st_size,
                 "commit": git_commit()}

    launched = time.perf_counter()
    alone, ready_s = start("cold", ["--model", str(files[1])], logs)
    try:
        first = stream(alone.url, None, args.tokens)
        doc["cold"] = {"ready_s": round(ready_s, 3), "ttft_s": first["ttft_s"],
                       "first_token_s": round(time.perf_counter() - launched - (first["tokens"] - 1) /
                                              (first["decode_tok_s"] or float("inf")), 3)}
    finally:
        alone.stop()

    router, _ = start("router", ["--model", str(files[0]), "--model", str(files[1]), "--models-max", "2"], logs)
    try:
        pid, url = router.proc.pid, router.url
        stream(url, names[0], 4)  # the default answered once: its first-request costs paid
        states = {"before_switch": state_of(url, names[1])}
        before = rss_bytes(pid)
        switch = stream(url, names[1], args.tokens)
        loaded = rss_bytes(pid)
        states["after_switch"] = state_of(url, names[1])
        doc["switch"] = {"ttft_s": switch["ttft_s"],
                         "ratio_to_cold": round(switch["ttft_s"] / doc["cold"]["first_token_s"], 3)}

        solo = {name: stream(url, name, args.tokens) for name in names}
        busy = both_at_once(url, names, args.tokens)
        doc["busy"] = {name: {"alone_tok_s": solo[name]["decode_tok_s"], "both_tok_s": busy[name]["decode_tok_s"],
                              "ratio": round(busy[name]["decode_tok_s"] / solo[name]["decode_tok_s"], 3)
                              if solo[name]["decode_tok_s"] and busy[name]["decode_tok_s"] else None}
                       for name in names}
        cpu = cpu_seconds(pid)
        time.sleep(args.idle_s)
        doc["idle"] = {"seconds": args.idle_s, "server_cpu_s": round(cpu_seconds(pid) - cpu, 3)}

        unloaded = httpx.post(f"{url}/models/unload", json={"model": names[1]}, timeout=120)
        if unloaded.status_code != 200:
            raise RuntimeError(f"unload: {unloaded.status_code} {unloaded.text[:300]}")
        time.sleep(1.0)  # the engine thread ends and its memory goes back
        after = rss_bytes(pid)
        states["after_unload"] = state_of(url, names[1])
        doc["states"] = states  # the switched-to model's, as /v1/models said them
        doc["rss"] = {"before_load_mb": round(before / 2**20, 1), "loaded_mb": round(loaded / 2**20, 1),
                      "after_unload_mb": round(after / 2**20, 1), "kept_mb": round((after - before) / 2**20, 1)}
    finally:
        router.stop()
    return doc


def report(doc: dict) -> str:
    cold, switch, rss = doc["cold"], doc["switch"], doc["rss"]
    lines = [f"models_switch: shape {doc['shape']} ({doc['recipe']}, {doc['file_bytes'] / 2**20:.0f} MiB a file), "
             f"{doc['tokens']} tokens a stream, commit {doc['commit']}", "",
             "| measure | value | target |", "|---|---|---|",
             f"| cold start to first token | {cold['first_token_s']:.2f} s (ready {cold['ready_s']:.2f} s + TTFT "
             f"{cold['ttft_s']:.2f} s) | |",
             f"| switch to the unloaded model, first token | {switch['ttft_s']:.2f} s ({switch['ratio_to_cold']:.2f}x "
             "cold) | <= 1.5x |",
             f"| RSS before load / loaded / after unload | {rss['before_load_mb']:.0f} / {rss['loaded_mb']:.0f} / "
             f"{rss['after_unload_mb']:.0f} MiB (kept {rss['kept_mb']:+.0f} MiB) | kept <= 200 MB |"]
    for name, row in doc["busy"].items():
        ratio = "n/a" if row["ratio"] is None else f"{row['ratio']:.2f}x"
        lines.append(f"| {name} tok/s alone / both busy | {row['alone_tok_s']} / {row['both_tok_s']} ({ratio}) "
                     "| >= 0.45x |")
    lines.append(f"| server CPU, both loaded and idle | {doc['idle']['server_cpu_s']:.2f} s over "
                 f"{doc['idle']['seconds']:g} s | ~0 |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.models_switch", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="smollm2-1.7b", help="a shape of bench/gguf_file.py's SHAPES, or "
                        "key=value pairs (e.g. hidden=64,layers=2,ffn=128,heads=4,kv_heads=2)")
    parser.add_argument("--recipe", default="q4_k_m", help="the GGUF's types (bench/gguf_file.py tensor_types)")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per stream")
    parser.add_argument("--idle-s", type=float, default=3.0, help="seconds the idle server's CPU is measured")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="rill-models-switch-") as folder:
        doc = measure(args, Path(folder))
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"models_switch-{doc['shape'].replace('/', '_')}.json"
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print(report(doc))
    print(f"\nwritten: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

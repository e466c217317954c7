"""The embedded SmolLM2 over HTTP with its GGUF blocks kept (`--quantize auto`) against the same
model de-quantized to float32 (`--quantize none`), side by side in one run.

    .venv/bin/python -m bench.weights [--concurrency 1,8,32] [--workload short] [--model GGUF]
                                      [--requests N] [--max-tokens N]

Each server in turn: `app.py --quantize MODE` on a free port, the load client (bench/run.py) on
`/v1/completions` with `ignore_eos` (every request writes its max tokens), its peak RSS, stop.
Prints tokens/s, ITL p50 and TTFT p50 per level, and the ratio of the blocks to float32.
Writes bench/results/weights-<workload>.json. The load client counts tokens with the GGUF's
tokenizer, from its float32 folder (bench/model.py's `gguf_folder`, written once into $RILL_CACHE).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.model import embedded_model, transformers_folder
from bench.run import machine_info
from bench.servers import RESULTS, ROOT, free_port

PYTHON = sys.executable


def serve_and_load(mode: str, args, gguf: Path, tokenizer: Path) -> dict:
    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix=f"rill-{mode}-", suffix=".log", delete=False)
    server = subprocess.Popen([PYTHON, "app.py", "--port", str(port), "--model", str(gguf), "--quantize", mode],
                              cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 600
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"rill --quantize {mode} did not start; see {log.name}")
            time.sleep(0.5)
        health = httpx.get(f"{url}/health", timeout=5).json()
        out = RESULTS / f"weights-{mode}.json"
        sizes = [*(("--requests", str(args.requests)) if args.requests else ()),
                 *(("--max-tokens", str(args.max_tokens)) if args.max_tokens else ())]
        subprocess.run([PYTHON, "-m", "bench", "--url", url, "--api", "openai", "--concurrency", args.concurrency,
                        "--workload", args.workload, *sizes, "--ignore-eos", "--tokenizer", str(tokenizer),
                        "--server-pid", str(server.pid), "--label", f"rill {mode}", "--out", str(out),
                        "--no-progress"], cwd=ROOT, check=True)
        doc = json.loads(out.read_text())
        doc["weights"], doc["linears"] = health.get("weights"), health.get("linears")
        return doc
    finally:
        server.terminate()
        server.wait(60)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--workload", default="short")
    parser.add_argument("--model", type=Path, help="a GGUF file (default: the embedded SmolLM2-135M-Instruct's)")
    parser.add_argument("--requests", type=int, help="requests per level (default: the load client's)")
    parser.add_argument("--max-tokens", type=int, help="tokens out per request (default: the workload's)")
    args = parser.parse_args(argv)
    RESULTS.mkdir(parents=True, exist_ok=True)
    gguf, tokenizer = (args.model, transformers_folder(args.model)) if args.model else embedded_model()
    docs = {mode: serve_and_load(mode, args, gguf, tokenizer) for mode in ("none", "auto")}
    machine = machine_info()
    print(f"\n{gguf.name}, /v1/completions, workload {args.workload}, ignore_eos; {machine.get('cpu')}, "
          f"{machine.get('cpus')} CPUs")
    for mode, doc in docs.items():
        print(f"  --quantize {mode}: weights {doc['weights']}; linears {doc['linears']}")
    print("| clients | float32 tok/s (ITL p50, TTFT p50) | GGUF blocks tok/s (ITL p50, TTFT p50) | ratio | peak RSS float32 / blocks |")
    print("|---|---|---|---|---|")
    for base, fast in zip(docs["none"]["levels"], docs["auto"]["levels"]):
        def cell(s):
            return (f"{s['output_tokens_per_s']:.1f} ({s['itl_s']['p50'] * 1e3:.1f} ms, "
                    f"{s['ttft_s']['p50'] * 1e3:.0f} ms)")

        rss = "/".join(f"{(s.get('peak_rss_bytes') or 0) / 2**20:.0f}" for s in (base, fast))
        print(f"| {base['concurrency']} | {cell(base)} | {cell(fast)} | "
              f"{fast['output_tokens_per_s'] / base['output_tokens_per_s']:.2f}x | {rss} MiB |")
    (RESULTS / f"weights-{args.workload}.json").write_text(json.dumps({"machine": machine, **docs}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

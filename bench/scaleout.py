"""What the ray backend costs and how far it scales: side by side in one run, the same total cores.

    .venv/bin/python -m bench.scaleout [--concurrency 8,32] [--workload short] [--model DIR] [--requests N]
                                       [--max-tokens N]

1. `app.py --backend local`: one engine, torch's threads on every core;
2. `app.py --backend ray --replicas N --replica-cpus 1`: the front end and N replicas of one thread
   each on a local Ray instance (N = the machine's cores, so both runs have the same cores);

each loaded by the load client (bench/run.py) on `/v1/completions` with `ignore_eos`. Prints
tokens/s and TTFT p50 per level with their ratio, and the front end's own CPU time per relayed
token in the ray run (its process alone: no model runs there), hence how many tokens per second
one front process can relay on one core. Then a model of throughput against replicas:
min(R x one replica's measured tokens/s, the front's relay capacity). Writes
bench/results/scaleout-<workload>.json. The benchmark Llama (bench/model.py) is the model unless `--model`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.model import ensure_bench_model
from bench.run import machine_info
from bench.servers import RESULTS, ROOT, free_port

PYTHON = sys.executable
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of the process itself (not its children: the Ray processes)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def wait_healthy(url: str, server: subprocess.Popen, log_path: str, timeout: float = 900) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        try:
            response = httpx.get(f"{url}/health", timeout=2)
            if response.status_code == 200:
                return response.json()
        except httpx.HTTPError:
            pass
        if server.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the server did not start; see {log_path}")
        time.sleep(0.5)


def serve_and_load(name: str, flags: list[str], args, model: Path) -> dict:
    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix=f"rill-scaleout-{name}-", suffix=".log", delete=False)
    server = subprocess.Popen([PYTHON, "app.py", "--port", str(port), "--model", str(model), *flags], cwd=ROOT,
                              stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        health = wait_healthy(url, server, log.name)
        out = RESULTS / f"scaleout-{name}.json"
        cpu_before = cpu_seconds(server.pid)
        tokens_before = health["engine"]["generation_tokens_total"]
        sizes = [*(("--requests", str(args.requests)) if args.requests else ()),
                 *(("--max-tokens", str(args.max_tokens)) if args.max_tokens else ())]
        subprocess.run([PYTHON, "-m", "bench", "--url", url, "--api", "openai", "--concurrency", args.concurrency,
                        "--workload", args.workload, *sizes, "--ignore-eos", "--tokenizer", str(model), "--label", name,
                        "--out", str(out), "--no-progress"], cwd=ROOT, check=True)
        if "ray" in flags:
            time.sleep(1.5)  # the replicas post their counters every 0.5 s (the local engine counts as it goes)
        tokens = httpx.get(f"{url}/health", timeout=10).json()["engine"]["generation_tokens_total"] - tokens_before
        doc = json.loads(out.read_text())
        doc["front_cpu_s"] = cpu_seconds(server.pid) - cpu_before
        doc["tokens_generated"] = tokens
        return doc
    finally:
        server.terminate()
        server.wait(120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", default="8,32")
    parser.add_argument("--workload", default="short")
    parser.add_argument("--replicas", type=int, default=os.cpu_count() or 2,
                        help="replicas of one thread each (default: the cores, as the local run uses)")
    parser.add_argument("--model", type=Path, help="a model folder (default: the benchmark Llama, built once)")
    parser.add_argument("--requests", type=int, help="requests per level (default: the load client's)")
    parser.add_argument("--max-tokens", type=int, help="tokens out per request (default: the workload's)")
    args = parser.parse_args(argv)
    if Path("/work/BENCH_LOCK").exists():
        print("/work/BENCH_LOCK exists: someone is measuring; run this later", file=sys.stderr)
        return 1
    RESULTS.mkdir(parents=True, exist_ok=True)
    model = args.model or ensure_bench_model()
    docs = {
        "local": serve_and_load("local", ["--backend", "local"], args, model),
        "ray": serve_and_load("ray", ["--backend", "ray", "--replicas", str(args.replicas), "--replica-cpus", "1"],
                              args, model),
    }
    machine = machine_info()
    print(f"\n{model.name}, /v1/completions, workload {args.workload}, ignore_eos; "
          f"{machine.get('cpu')}, {machine.get('cpus')} CPUs; ray: {args.replicas} replicas x 1 thread")
    print("| clients | local tok/s (TTFT p50) | ray tok/s (TTFT p50) | ray / local |")
    print("|---|---|---|---|")
    for local, ray in zip(docs["local"]["levels"], docs["ray"]["levels"]):
        def cell(s):
            return f"{s['output_tokens_per_s']:.1f} ({s['ttft_s']['p50'] * 1e3:.0f} ms)"

        print(f"| {local['concurrency']} | {cell(local)} | {cell(ray)} | "
              f"{ray['output_tokens_per_s'] / local['output_tokens_per_s']:.2f}x |")
    ray = docs["ray"]
    per_token = ray["front_cpu_s"] / max(1, ray["tokens_generated"])
    relay = 1.0 / per_token if per_token else float("inf")
    best = max(level["output_tokens_per_s"] for level in ray["levels"])
    per_replica = best / args.replicas
    print(f"\nfront end (ray run): {ray['front_cpu_s']:.1f} CPU s for {ray['tokens_generated']} tokens = "
          f"{per_token * 1e6:.0f} us per relayed token -> one front process on one core relays ~{relay:.0f} tok/s")
    print(f"one replica (1 core): ~{per_replica:.0f} tok/s at {ray['levels'][-1]['concurrency']} clients")
    print("\n| replicas (1 core each) | modelled tok/s = min(R x replica, front) | limited by |")
    print("|---|---|---|")
    model_rows = []
    for replicas in (1, 2, 4, 8, 16, 32, 64):
        throughput = min(replicas * per_replica, relay)
        model_rows.append({"replicas": replicas, "tokens_per_s": throughput})
        print(f"| {replicas} | {throughput:.0f} | {'replicas' if replicas * per_replica < relay else 'the front end'} |")
    (RESULTS / f"scaleout-{args.workload}.json").write_text(json.dumps(
        {"machine": machine, "replicas": args.replicas, "front_cpu_us_per_token": per_token * 1e6,
         "front_relay_tokens_per_s": relay, "replica_tokens_per_s": per_replica, "model": model_rows, **docs},
        indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

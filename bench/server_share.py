"""The server's share: the same workload through the engine alone (an `AsyncEngine` in a process
of its own, no HTTP) and through `app.py` over `/v1/completions` with `python -m bench`, rounds
interleaved, medians.

    python -m bench.server_share [--rounds 3] [--concurrency 1,8] [--app-args "--activations int8"] [--model M]

The workload is `python -m bench`'s default (`short`: ~20-token prompts from its own prompt maker,
64 tokens out with ignore_eos, greedy, closed loop, max(2 per client, 8) requests per level, after
a warm-up), so the two sides differ only by the HTTP server: the event loop, SSE, JSON, the route.
An engine-alone figure from `LLM.generate` with a one-line prompt is not this workload: it leaves
out the prompts, 20 tokens each, which arrive together in a closed loop (8 x 20 = 160 prompt tokens
in one step: about as much work as 5 decode steps of 8). The embedded SmolLM2-135M unless `--model`
(a folder or a GGUF file, for both sides).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _engine_alone(levels: list[int], app_args: list[str], model: str | None) -> list[dict]:
    """One process: load as app.py would (its weight flags), then each level through AsyncEngine."""
    from engine import AsyncEngine, SamplingParams
    from engine.model.loading import load_model
    from bench.run import make_prompts

    kwargs = {}
    if "--activations" in app_args:
        kwargs["activations"] = app_args[app_args.index("--activations") + 1]
    loaded = load_model(model, **kwargs)
    engine = AsyncEngine(loaded).start()
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)

    async def one(prompt: str, record: list) -> None:
        start, times = time.perf_counter(), []
        async for out in engine.generate(engine.encode(prompt), params):
            times.extend([time.perf_counter()] * len(out.token_ids))
        record.append((start, times))

    async def level(prompts: list[str], concurrency: int) -> dict:
        queue, records = list(prompts), []

        async def worker() -> None:
            while queue:
                await one(queue.pop(0), records)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
        tokens = sum(len(t) for _, t in records)
        return {"concurrency": concurrency, "output_tokens_per_s": tokens / wall,
                "ttft_s": statistics.median(t[0] - s for s, t in records),
                "itl_s": statistics.median((t[-1] - t[0]) / (len(t) - 1) for _, t in records if len(t) > 1)}

    async def run() -> list[dict]:
        await level(make_prompts(loaded.tokenizer, 2, 20, seed=999), 1)  # warm-up
        return [await level(make_prompts(loaded.tokenizer, max(2 * c, 8), 20, seed=1000 * i), c)
                for i, c in enumerate(levels)]

    try:
        return asyncio.run(run())
    finally:
        engine.shutdown()


def _over_http(levels: list[int], app_args: list[str], model: str | None) -> list[dict]:
    from bench.model import gguf_folder
    from bench.servers import free_port
    from engine.model.loading import embedded_gguf_path

    port = free_port()
    chosen = ("--model", model) if model else ()
    server = subprocess.Popen([sys.executable, "app.py", "--port", str(port), "--log-level", "warning", *chosen,
                               *app_args], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        import urllib.request

        for _ in range(300):
            try:
                if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status == 200:
                    break
            except OSError:
                time.sleep(0.5)
        if model is None:
            tokenizer = gguf_folder(embedded_gguf_path())
        else:
            tokenizer = Path(model) if Path(model).is_dir() else gguf_folder(Path(model))
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "r.json"
            subprocess.run([sys.executable, "-m", "bench", "--url", f"http://127.0.0.1:{port}", "--api", "openai",
                            "--concurrency", ",".join(map(str, levels)), "--ignore-eos", "--no-progress",
                            "--tokenizer", str(tokenizer), "--out", str(out)],
                           cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
            doc = json.loads(out.read_text())
        return [{"concurrency": lv["concurrency"], "output_tokens_per_s": lv["output_tokens_per_s"],
                 "ttft_s": lv["ttft_s"]["p50"], "itl_s": lv["itl_s"]["p50"]} for lv in doc["levels"]]
    finally:
        server.terminate()
        server.wait()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", default="1,8")
    parser.add_argument("--app-args", default="", help="flags for app.py (and the engine's weights)")
    parser.add_argument("--model", help="a model folder or GGUF file (default: the embedded SmolLM2-135M)")
    parser.add_argument("--side", choices=["engine"], help=argparse.SUPPRESS)  # the child process
    args = parser.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    app_args = shlex.split(args.app_args)
    if args.side == "engine":
        print(json.dumps(_engine_alone(levels, app_args, args.model)))
        return
    runs: dict[str, list[list[dict]]] = {"engine alone": [], "over HTTP": []}
    for round_ in range(args.rounds):
        chosen = ["--model", args.model] if args.model else []
        child = subprocess.run([sys.executable, "-m", "bench.server_share", "--side", "engine", "--concurrency",
                                args.concurrency, "--app-args", args.app_args, *chosen], cwd=ROOT, check=True,
                               capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        runs["engine alone"].append(json.loads(child.stdout.strip().splitlines()[-1]))
        runs["over HTTP"].append(_over_http(levels, app_args, args.model))
        for side, results in runs.items():
            print(f"round {round_}: {side}: " + ", ".join(
                f"c={r['concurrency']} {r['output_tokens_per_s']:.1f} tok/s ITL {r['itl_s'] * 1000:.1f} ms"
                for r in results[-1]), flush=True)
    summary = {}
    for i, c in enumerate(levels):
        med = {side: {key: statistics.median(run[i][key] for run in results)
                      for key in ("output_tokens_per_s", "ttft_s", "itl_s")} for side, results in runs.items()}
        summary[c] = {**{side: {"tok_s": round(m["output_tokens_per_s"], 1), "itl_ms": round(m["itl_s"] * 1000, 1),
                                "ttft_ms": round(m["ttft_s"] * 1000)} for side, m in med.items()},
                      "http_over_engine": round(med["over HTTP"]["output_tokens_per_s"]
                                                / med["engine alone"]["output_tokens_per_s"], 2)}
    print(json.dumps({"rounds": args.rounds, "app_args": args.app_args, "by_clients": summary}, indent=1))


if __name__ == "__main__":
    main()

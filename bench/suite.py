"""`make bench`: rill side by side with its baselines, on one model and one workload, in one go.

    .venv/bin/python -m bench.suite [--workload short|long-prompt|long-output|shared-prefix]
        [--concurrency 1,8,32,64] [--requests-per-client 2] [--servers rill,seed,tf-cb,tf,space]

Builds the benchmark model (bench/model.py) once, then for each server in turn: starts it as a
subprocess on a free port, waits until it answers, runs the load client (bench/run.py) over
each of its APIs, samples its peak RSS (process and children), stops it. Servers:

- `rill`: this app (`app.py --model DIR`), over `/chat` (raw prompt), `/v1/completions` and
  the page's Gradio API (`gradio_client`, `api_name="/chat"`);
- `seed`: the seed recipe (bench/baselines/seed_recipe.py), over `/chat`;
- `tf-cb`: `transformers serve --continuous-batching`, over `/v1/completions`;
- `tf`: plain `transformers serve`, over `/v1/completions` (1 and 8 clients: it is the
  single-client reference);
- `space`: the usual chat Space (bench/baselines/usual_space.py), over `gradio_client`.

Writes bench/results/suite-<workload>.json (every run, every level), the same name with .md
(the tables) and one plot (docs/bench.png for the default workload), and prints the ratios of
rill to each baseline per concurrency level. Server logs go to bench/results/logs/.

Then the peer table on the embedded SmolLM2 (bench/peers.py: rill against llama-server and
vLLM CPU, each one that is built; `--peers-only` runs just that, `--no-peers` skips it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from bench.run import WORKLOADS, machine_info, make_api, run_benchmark
from bench.servers import RESULTS, ROOT, Run, Server, ServerProcess, git_commit


def servers(python: str, max_levels: list[int]) -> dict[str, Server]:
    transformers_cli = str(Path(python).parent / "transformers")
    low = [c for c in max_levels if c <= 8] or max_levels[:1]
    # Baselines that do not batch make every client wait for all the others: at 64 clients the
    # seed recipe alone would take 9 minutes to tell what 32 already shows, so it stops at 32.
    # The usual Space runs one message at a time (Gradio's default concurrency 1): its tokens/s
    # is flat from 1 client on, and 32 clients would take 11 minutes; it stops at 8.
    unbatched = [c for c in max_levels if c <= 32] or max_levels[:1]
    return {
        "rill": Server(
            "rill",
            [python, str(ROOT / "app.py"), "--model", "{model}", "--port", "{port}", "--host", "127.0.0.1",
             "--dtype", "float32", "--device", "cpu", "--log-level", "warning"],
            "/health",
            [Run("rill /chat", "chat"), Run("rill /v1", "openai"), Run("rill page (gradio)", "gradio")],
        ),
        "seed": Server(
            "seed",
            [python, "-m", "bench.baselines.seed_recipe", "--model", "{model}", "--port", "{port}"],
            "/health",
            [Run("seed recipe", "chat", levels=unbatched)],
        ),
        "tf-cb": Server(
            "tf-cb",
            [transformers_cli, "serve", "{model}", "--continuous-batching", "--device", "cpu", "--dtype", "float32",
             "--host", "127.0.0.1", "--port", "{port}", "--log-level", "warning"],
            "/health",
            [Run("transformers serve --cb", "openai")],
            model_name=True,
        ),
        "tf": Server(
            "tf",
            [transformers_cli, "serve", "{model}", "--device", "cpu", "--dtype", "float32",
             "--host", "127.0.0.1", "--port", "{port}", "--log-level", "warning"],
            "/health",
            [Run("transformers serve", "openai", levels=low)],
            model_name=True,
        ),
        "space": Server(
            "space",
            [python, "-m", "bench.baselines.usual_space", "--model", "{model}", "--port", "{port}"],
            "/config",
            [Run("usual Space (gradio)", "gradio", levels=low)],
        ),
    }


def client_args(args, url: str, api: str, levels: list[int], tokenizer_dir: Path, model_name: str | None, pid: int,
                seed: int = 0):
    """The load client's argument namespace for one run."""
    from bench.run import build_parser

    argv = ["--url", url, "--api", api, "--concurrency", ",".join(map(str, levels)), "--tokenizer", str(tokenizer_dir),
            "--seed", str(seed),
            "--workload", args.workload, "--requests-per-client", str(args.requests_per_client),
            "--min-requests", str(args.min_requests), "--server-pid", str(pid), "--timeout", str(args.timeout)]
    if args.requests:
        argv += ["--requests", str(args.requests)]
    if args.max_tokens:
        argv += ["--max-tokens", str(args.max_tokens)]
    if args.prompt_tokens:
        argv += ["--prompt-tokens", str(args.prompt_tokens)]
    if args.dataset:
        argv += ["--dataset", args.dataset]
    if model_name:
        argv += ["--model-name", model_name]
    if args.no_progress:
        argv += ["--no-progress"]
    # no --ignore-eos: transformers serve refuses unknown fields, and the benchmark model never
    # emits EOS under greedy decoding (bench/model.py), so every server writes max_tokens tokens
    return build_parser().parse_args(argv)


# ---------------------------------------------------------------------------------------------
# Reporting
# ---------------------------------------------------------------------------------------------


def _level(run: dict, concurrency: int) -> dict | None:
    for level in run["levels"]:
        if level["concurrency"] == concurrency and level["completed"]:
            return level
    return None


def _find(runs: list[dict], label: str) -> dict | None:
    return next((r for r in runs if r["label"] == label), None)


def _ms(v) -> str:
    return "-" if v is None else f"{v * 1000:,.0f}"


def markdown_tables(runs: list[dict], levels: list[int]) -> str:
    out = ["| server / API | clients | output tok/s | req/s | TTFT p50 (ms) | TTFT p99 (ms) | ITL p50 (ms) | e2e p50 (ms) | errors | peak RSS (MiB) |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for run in runs:
        for level in run["levels"]:
            rss = level.get("peak_rss_bytes")
            out.append(
                f"| {run['label']} | {level['concurrency']} | {level['output_tokens_per_s']:,.1f} | {level['requests_per_s']:.2f} "
                f"| {_ms(level['ttft_s']['p50'])} | {_ms(level['ttft_s']['p99'])} | {_ms(level['itl_s']['p50'])} "
                f"| {_ms(level['e2e_s']['p50'])} | {level['errors']}/{level['requests']} | {'-' if not rss else f'{rss / 2**20:,.0f}'} |")
    out.append("")
    out.append(ratio_table(runs, levels))
    return "\n".join(out)


COMPARISONS = [
    # (rill run, baseline run, what it answers)
    ("rill /chat", "transformers serve --cb", "vs transformers serve --continuous-batching"),
    ("rill /v1", "transformers serve --cb", "vs transformers serve --continuous-batching (both OpenAI /v1/completions)"),
    ("rill /chat", "transformers serve", "vs plain transformers serve"),
    ("rill /chat", "seed recipe", "vs the seed recipe"),
    ("rill page (gradio)", "usual Space (gradio)", "Gradio path vs the usual Space"),
]


def ratio_table(runs: list[dict], levels: list[int]) -> str:
    head = "| rill run | baseline | " + " | ".join(f"{c} clients: tok/s ratio (TTFT p50 rill / base ms)" for c in levels) + " |"
    out = [head, "|---|---|" + "---:|" * len(levels)]
    for ours_label, base_label, _ in COMPARISONS:
        ours, base = _find(runs, ours_label), _find(runs, base_label)
        if not ours or not base:
            continue
        cells = []
        for c in levels:
            a, b = _level(ours, c), _level(base, c)
            if a and b and b["output_tokens_per_s"] > 0:
                cells.append(f"**{a['output_tokens_per_s'] / b['output_tokens_per_s']:.2f}x** "
                             f"({_ms(a['ttft_s']['p50'])} / {_ms(b['ttft_s']['p50'])})")
            else:
                cells.append("-")
        out.append(f"| {ours_label} | {base_label} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def targets(runs: list[dict]) -> list[str]:
    """The issue's targets, each with the measured value and whether it is met."""
    lines = []

    def ratio(ours_label, base_label, c):
        a, b = _level(_find(runs, ours_label) or {"levels": []}, c), _level(_find(runs, base_label) or {"levels": []}, c)
        if not a or not b or not b["output_tokens_per_s"]:
            return None, a, b
        return a["output_tokens_per_s"] / b["output_tokens_per_s"], a, b

    for c, want in ((64, 2.0), (32, 1.6)):
        r, a, b = ratio("rill /chat", "transformers serve --cb", c)
        if r is not None:
            ttft_ok = a["ttft_s"]["p50"] < b["ttft_s"]["p50"]
            lines.append(f"{'MET ' if r >= want and ttft_ok else 'MISSED'} {c} clients: rill /chat {r:.2f}x transformers serve --cb "
                         f"tok/s (target >= {want}x); TTFT p50 {_ms(a['ttft_s']['p50'])} vs {_ms(b['ttft_s']['p50'])} ms (target lower)")
    r, a, b = ratio("rill /chat", "transformers serve", 1)
    if r is not None:
        lines.append(f"{'MET ' if r >= 1.0 else 'MISSED'} 1 client: rill /chat {r:.2f}x plain transformers serve tok/s (target >= 1x)")
    gradio = _find(runs, "rill page (gradio)")
    if gradio:
        for level in gradio["levels"]:
            if level["concurrency"] >= 8:
                r, a, b = ratio("rill page (gradio)", "usual Space (gradio)", level["concurrency"])
                if r is not None:
                    lines.append(f"{'MET ' if r >= 4.0 else 'MISSED'} {level['concurrency']} users: rill page {r:.2f}x the usual Space "
                                 f"tok/s over gradio_client (target >= 4x)")
    return lines


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------


def run_one(args, run: Run, server: Server, proc: ServerProcess, startup: float, model_dir: Path, levels: list[int], tokenizer) -> dict:
    """One load-client pass (all its levels) against a started server; optionally profiled."""
    run_levels = [c for c in (run.levels or levels) if c in levels] or (run.levels or levels)
    # each run on one server gets prompts of its own: with the same prompts, a server with a
    # prefix cache would answer the second run's prompts from the first run's cache
    seed = 100_000 * server.runs.index(run)
    cargs = client_args(args, proc.url, run.api, run_levels, model_dir, str(model_dir) if server.model_name else None,
                        proc.proc.pid, seed)
    api = make_api(cargs)
    profiler = None
    if args.profile and run.label == "rill /chat":
        profiler = subprocess.Popen([str(Path(sys.executable).parent / "py-spy"), "record", "-p", str(proc.proc.pid),
                                     "--format", "speedscope", "-o", str(RESULTS / "rill-chat.speedscope.json"),
                                     "--rate", "50", "--nonblocking"],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    load_before = os.getloadavg()
    try:
        doc = asyncio.run(run_benchmark(cargs, tokenizer, api, label=run.label))
    finally:
        if profiler is not None:
            profiler.send_signal(signal.SIGINT)
            profiler.wait(timeout=60)
    doc["server"] = {"name": server.name, "command": " ".join(server.command), "startup_s": startup}
    doc["load_average_before"] = load_before
    doc["load_average_after"] = os.getloadavg()
    return doc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.suite", description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="short")
    p.add_argument("--concurrency", default="1,8,32,64")
    p.add_argument("--servers", default="rill,seed,tf-cb,tf,space", help="which servers, in order (rill,seed,tf-cb,tf,space)")
    p.add_argument("--apis", default="chat,openai,gradio", help="only runs over these APIs (chat,openai,gradio); a server left with no run is skipped")
    p.add_argument("--requests-per-client", type=int, default=2, help="requests per level = max(R * clients, --min-requests); raise for longer, steadier runs")
    p.add_argument("--min-requests", type=int, default=8)
    p.add_argument("--requests", type=int, default=None, help="fixed requests per level (overrides the two above)")
    p.add_argument("--max-tokens", type=int, default=None, help="override the workload's output tokens")
    p.add_argument("--prompt-tokens", type=int, default=None, help="override the workload's prompt tokens")
    p.add_argument("--dataset", help="JSONL prompts instead of generated ones (see python -m bench --help)")
    p.add_argument("--model", help="model folder (default: build the benchmark Llama under $RILL_CACHE)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per request before it counts as an error")
    p.add_argument("--ready-timeout", type=float, default=300.0)
    p.add_argument("--nice", type=int, default=0, help="run servers and this client at this nice value (negative = ahead of other work; needs root)")
    p.add_argument("--profile", action="store_true", help="record a py-spy profile of the rill server during its /chat run (bench/results/rill-chat.speedscope.json)")
    p.add_argument("--out", help="results JSON (default bench/results/suite-<workload>.json)")
    p.add_argument("--plot", help="plot PNG (default docs/bench.png for the short workload, else bench/results/<workload>.png)")
    p.add_argument("--no-progress", action="store_true")
    peers = p.add_argument_group("the peer table (bench/peers.py: llama-server and vLLM CPU on the embedded SmolLM2)")
    peers.add_argument("--peers-only", action="store_true", help="run only the peer table")
    peers.add_argument("--no-peers", action="store_true", help="skip the peer table")
    peers.add_argument("--peer-servers", default="rill,llama-server,vllm")
    peers.add_argument("--peer-workloads", default="short,long-prompt,shared-prefix")
    peers.add_argument("--peer-clients", help="only these client counts in the peer table (e.g. 1,8; default 1,8,32)")
    args = p.parse_args(argv)

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.peers_only:
        return peer_table(args)
    if args.nice:
        os.nice(args.nice)  # the servers inherit it
    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    from bench.model import ensure_bench_model

    t_start = time.perf_counter()
    model_dir = Path(args.model) if args.model else ensure_bench_model()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    table = servers(sys.executable, levels)
    chosen = [s.strip() for s in args.servers.split(",") if s.strip()]
    unknown = [s for s in chosen if s not in table]
    if unknown:
        p.error(f"--servers: unknown {unknown}; allowed: {', '.join(table)}")

    apis = {a.strip() for a in args.apis.split(",") if a.strip()}
    for server in table.values():
        server.runs = [run for run in server.runs if run.api in apis]
    chosen = [name for name in chosen if table[name].runs]
    runs: list[dict] = []
    failures: list[str] = []
    commit = git_commit()
    print(f"rill bench: workload {args.workload}, clients {levels}, model {model_dir}, commit {commit}", flush=True)
    out = Path(args.out) if args.out else RESULTS / f"suite-{args.workload}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    document = {
        "workload": args.workload,
        "concurrency": levels,
        "commit": commit,
        "command": " ".join([Path(sys.executable).name, "-m", "bench.suite"] + (argv if argv is not None else sys.argv[1:])),
        "model": str(model_dir),
        "machine": machine_info(),
        "elapsed_s": 0.0,
        "failures": failures,
        "runs": runs,
    }

    def save() -> None:  # after every run, so that an interrupted suite keeps what it measured
        document["elapsed_s"] = time.perf_counter() - t_start
        out.write_text(json.dumps(document, indent=2))

    try:
        for name in chosen:
            server = table[name]
            proc = ServerProcess(server, model_dir, RESULTS / "logs" / f"{name}.log")
            try:
                startup = proc.wait_ready(args.ready_timeout)
                print(f"== {name}: ready in {startup:.1f} s at {proc.url} (pid {proc.proc.pid})", flush=True)
                for run in server.runs:
                    runs.append(run_one(args, run, server, proc, startup, model_dir, levels, tokenizer))
                    save()
            except Exception as exc:  # noqa: BLE001 - one failed server must not lose the others' results
                failures.append(f"{name}: {exc}")
                print(f"!! {name} failed: {exc}", flush=True)
            finally:
                proc.stop()
    except KeyboardInterrupt:
        failures.append("interrupted")
        print("!! interrupted: reporting what was measured", flush=True)
    save()
    elapsed = document["elapsed_s"]
    plot = Path(args.plot) if args.plot else (ROOT / "docs" / "bench.png" if args.workload == "short" and not args.dataset else RESULTS / f"{args.workload}.png")
    from bench.plot import plot_results

    plot_results(runs, str(plot), title=f"workload {args.workload}, commit {commit}, {document['machine'].get('cpu', '')} x{document['machine'].get('cpus')}")
    md = markdown_tables(runs, levels)
    md_path = out.with_suffix(".md")
    md_path.write_text(md + "\n\n" + "\n".join(f"- {line}" for line in targets(runs)) + "\n")

    print()
    print(ratio_table(runs, levels))
    print()
    for line in targets(runs):
        print(line)
    for failure in failures:
        print(f"FAILED {failure.splitlines()[0]}")
    print(f"\nwrote {out}, {plot}, {md_path} in {elapsed / 60:.1f} min")
    peers_code = 0 if args.no_peers else peer_table(args)
    return 1 if failures or peers_code else 0


def peer_table(args) -> int:
    """bench/peers.py's table; builds the peers first only when RILL_BENCH_PEERS_SETUP=1."""
    from bench import peers

    setup = os.environ.get("RILL_BENCH_PEERS_SETUP", "") not in ("", "0")  # else a peer not built is skipped
    clients = [int(c) for c in args.peer_clients.split(",")] if args.peer_clients else None
    return peers.run_table(peers.parse_names(args.peer_servers, ("rill", *peers.PEERS), "--peer-servers"),
                           peers.parse_names(args.peer_workloads, tuple(peers.WORKLOADS), "--peer-workloads"),
                           clients, setup=setup, progress=not args.no_progress)


if __name__ == "__main__":
    sys.exit(main())

"""One PNG: output tokens/s and TTFT (p50 solid, p99 dashed) against concurrency, per run.

    python -m bench.plot out.png results1.json [results2.json ...]

A results file is what `python -m bench --out` writes (one run) or what `bench.suite` writes
(`{"runs": [...]}`, several runs).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def load_runs(paths: list[str]) -> list[dict]:
    runs = []
    for path in paths:
        doc = json.loads(Path(path).read_text())
        runs.extend(doc["runs"] if "runs" in doc else [doc])
    return runs


def plot_results(runs: list[dict], out: str, title: str | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_tps, ax_ttft) = plt.subplots(1, 2, figsize=(12, 4.8))
    for i, run in enumerate(runs):
        levels = [lv for lv in run["levels"] if lv["completed"]]
        if not levels:
            continue
        color = f"C{i % 10}"
        xs = [lv["concurrency"] for lv in levels]
        label = run.get("label") or run.get("api", "run")
        ax_tps.plot(xs, [lv["output_tokens_per_s"] for lv in levels], "o-", color=color, label=label)
        p50 = [lv["ttft_s"]["p50"] for lv in levels]
        p99 = [lv["ttft_s"]["p99"] for lv in levels]
        ax_ttft.plot(xs, [v * 1000 for v in p50], "o-", color=color, label=label)
        ax_ttft.plot(xs, [v * 1000 for v in p99], "x--", color=color, alpha=0.5)
    for ax in (ax_tps, ax_ttft):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.grid(True, which="both", alpha=0.3)
    all_levels = sorted({lv["concurrency"] for run in runs for lv in run["levels"]})
    if all_levels:
        for ax in (ax_tps, ax_ttft):
            ax.set_xticks(all_levels)
            ax.set_xticklabels([str(c) for c in all_levels])
    ax_tps.set_ylabel("output tokens/s (all clients)")
    ax_tps.set_title("throughput")
    ax_tps.legend(fontsize=8)
    ax_ttft.set_yscale("log")
    ax_ttft.set_ylabel("time to first token (ms)")
    ax_ttft.set_title("TTFT p50 (solid) and p99 (dashed)")
    ax_ttft.legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def plot_files(paths: list[str], out: str, title: str | None = None) -> None:
    plot_results(load_runs(paths), out, title)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 2:
        sys.exit("usage: python -m bench.plot OUT.png RESULTS.json [RESULTS.json ...]")
    plot_files(argv[1:], argv[0])
    print(f"wrote {argv[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

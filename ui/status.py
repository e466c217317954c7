"""The status panel: what the engine is doing now and over the last minutes.

Numbers come from `engine.stats()` (running, waiting, KV cache) and from the `RequestMetrics`
recent window (tokens/s over the last minute, throughput and time to first token over time),
which every route and the page feed.
"""

from __future__ import annotations

import logging

import pandas as pd

log = logging.getLogger("rill.ui")
ENGINE_UNAVAILABLE = ("**Engine unavailable**: its statistics cannot be read now. "
                      "The server log has the reason.")

THROUGHPUT_BIN_S = 5.0  # one point of the throughput plot per this many seconds
HISTORY_S = 300.0  # the plots show the last five minutes


def status_markdown(engine, recent) -> str:
    """The panel's numbers as a markdown table."""
    alive = engine.alive
    try:
        stats = engine.stats()
    except Exception:  # the panel still answers when the engine is gone; visitors get no exception text
        log.warning("the status panel could not read the engine's statistics", exc_info=True)
        return ENGINE_UNAVAILABLE
    used_blocks = stats.num_kv_blocks - stats.num_free_kv_blocks
    ttft = "–" if recent.mean_ttft_s is None else f"{recent.mean_ttft_s:.2f} s"
    backend = engine.backend
    kv = (f"{stats.kv_usage * 100:.1f} % ({used_blocks} / {stats.num_kv_blocks} blocks)" if stats.num_kv_blocks
          else "– (the backend does not report it)")
    rows = [
        ("Engine", "running" if alive else "**stopped** (the engine thread died)" if backend == "local"
         else "**unavailable** (" + engine.unavailable_reason() + ")"),
        *_backend_rows(engine, backend),
        ("Running requests", f"{stats.num_running}"),
        ("Waiting requests", f"{stats.num_waiting}"),
        ("KV cache", kv),
        ("Tokens/s (last minute)", f"{recent.tokens_per_s:.1f}"),
        ("Tokens generated (last minute)", f"{recent.tokens}"),
        ("Requests finished (last minute)", f"{recent.requests_finished}"),
        ("Mean time to first token (last minute)", ttft),
        ("Preemptions (since start)", f"{stats.num_preemptions}"),
        ("Prompt tokens served from the prefix cache (since start)",
         f"{stats.prefix_cache_hit_tokens} of {stats.prefix_cache_queried_tokens}"),
        ("Guessed tokens the model accepted (speculative decoding, since start)",
         f"{stats.spec_accepted_tokens} of {stats.spec_draft_tokens}"),
    ]
    lines = ["| | now |", "|---|---|"] + [f"| {name} | {value} |" for name, value in rows]
    return "\n".join(lines)


def _backend_rows(engine, backend: str) -> list[tuple[str, str]]:
    """Where the engines run, for the ray and openai backends (nothing for the local one)."""
    if backend == "local":
        return []
    rows = [("Backend", backend)]
    replicas = engine.replica_stats() if hasattr(engine, "replica_stats") else []
    if replicas:
        up = sum(1 for r in replicas if r.get("alive"))
        rows.append(("Replicas", f"{up} running of {len(replicas)}: " + ", ".join(
            f"{r['replica']} ({(r.get('engine') or {}).get('num_running', 0)} running)" if r.get("alive")
            else f"{r['replica']} (down)" for r in replicas)))
    return rows


def throughput_frame(recent) -> pd.DataFrame:
    """Tokens/s per bin over the last minutes (x: local time)."""
    times = pd.to_datetime([at for at, _ in recent.throughput], unit="s")
    return pd.DataFrame({"time": times, "tokens/s": [rate for _, rate in recent.throughput]})


def ttft_frame(recent) -> pd.DataFrame:
    """One point per request: when its first token came and how long it took."""
    times = pd.to_datetime([at for at, _ in recent.ttft], unit="s")
    return pd.DataFrame({"time": times, "TTFT (s)": [ttft for _, ttft in recent.ttft]})


def snapshot(engine, metrics) -> tuple[str, pd.DataFrame, pd.DataFrame]:
    """(markdown, throughput frame, TTFT frame): one refresh of the panel."""
    recent = metrics.recent(window_s=60.0, bin_s=THROUGHPUT_BIN_S, history_s=HISTORY_S)
    return status_markdown(engine, recent), throughput_frame(recent), ttft_frame(recent)

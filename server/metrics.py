"""`GET /metrics`: the app's request metrics (frontend/telemetry.py) in the Prometheus text format,
(a `model` label with several models), and, with several engine replicas (--backend ray), each
replica's numbers under a `replica` label."""

from __future__ import annotations

import logging

from fastapi import Response
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from frontend.telemetry import RequestMetrics

# (name, type, help, how to read it from a replica's entry) of the per-replica series.
REPLICA_METRICS = (
    ("rill_replica_up", "gauge", "1 while the replica posts its statistics and its engine runs",
     lambda e: 1.0 if e.get("alive") else 0.0),
    ("rill_replica_requests_running", "gauge", "requests the replica's engine runs now",
     lambda e: e["engine"]["num_running"]),
    ("rill_replica_requests_waiting", "gauge", "requests waiting in the replica's engine",
     lambda e: e["engine"]["num_waiting"]),
    ("rill_replica_kv_cache_usage_ratio", "gauge", "fraction of the replica's KV cache blocks in use",
     lambda e: e["engine"]["kv_usage"]),
    ("rill_replica_requests_total", "counter", "requests the replica admitted",
     lambda e: e.get("requests_total", 0)),
    ("rill_replica_prompt_tokens_total", "counter", "prompt tokens the replica computed",
     lambda e: e["engine"]["prompt_tokens_total"]),
    ("rill_replica_generation_tokens_total", "counter", "tokens the replica generated",
     lambda e: e["engine"]["generation_tokens_total"]),
)


class _ReplicaCollector:
    """Reads `engine.replica_stats()` at scrape time: one series per replica and metric."""

    def __init__(self, engine):
        self.engine = engine

    def describe(self):
        return []

    def collect(self):
        try:
            entries = [e for e in self.engine.replica_stats() if e.get("engine")]
        except Exception:  # noqa: BLE001 - a scrape never fails on the backend's account
            logging.getLogger("rill.server").warning("replica statistics unavailable", exc_info=True)
            return
        for name, kind, text, read in REPLICA_METRICS:
            if kind == "counter":
                family = CounterMetricFamily(name.removesuffix("_total"), text, labels=["replica"])
            else:
                family = GaugeMetricFamily(name, text, labels=["replica"])
            for entry in entries:
                family.add_metric([str(entry["replica"])], float(read(entry)))
            yield family


def install_metrics(app, engine, *, log_format: str = "text", logger: logging.Logger | None = None,
                    path: str = "/metrics", models=None) -> RequestMetrics:
    """Adds `GET /metrics` (Prometheus text format) to the FastAPI `app`; returns the recorder.
    `models`: the app's ModelRegistry (several models: a `model` label on every request series).

    The recorder is also kept as `app.state.metrics`. Call it before mounting Gradio at "/".
    """
    metrics = RequestMetrics(engine, log_format=log_format, logger=logger, models=models)
    if engine.backend == "ray":
        metrics.registry.register(_ReplicaCollector(engine))

    async def metrics_endpoint() -> Response:
        return Response(content=metrics.render(), media_type=CONTENT_TYPE_LATEST)

    app.add_api_route(path, metrics_endpoint, methods=["GET"], include_in_schema=False)
    app.state.metrics = metrics
    return metrics

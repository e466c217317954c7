"""`GET /metrics`: the app's request metrics (engine/telemetry.py) in the Prometheus text format."""

from __future__ import annotations

import logging

from fastapi import Response
from prometheus_client import CONTENT_TYPE_LATEST

from engine.telemetry import RequestMetrics


def install_metrics(app, engine, *, log_format: str = "text", logger: logging.Logger | None = None,
                    path: str = "/metrics") -> RequestMetrics:
    """Adds `GET /metrics` (Prometheus text format) to the FastAPI `app`; returns the recorder.

    The recorder is also kept as `app.state.metrics`. Call it before mounting Gradio at "/".
    """
    metrics = RequestMetrics(engine, log_format=log_format, logger=logger)

    async def metrics_endpoint() -> Response:
        return Response(content=metrics.render(), media_type=CONTENT_TYPE_LATEST)

    app.add_api_route(path, metrics_endpoint, methods=["GET"], include_in_schema=False)
    app.state.metrics = metrics
    return metrics

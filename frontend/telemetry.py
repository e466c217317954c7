"""Request metrics: the Prometheus families (`rill_*`), the per-request log line, and the
recent-activity window the status panel plots.

Both the HTTP routes (server/) and the page (ui/) record here, and neither imports the other:
this module sits in the engine package, the one both may import, because what it measures comes
from the engine (its outputs' arrival, scheduled and first-token times, `engine.stats()`), and it
needs no web framework. `server/metrics.py` only serves the registry as `GET /metrics`.

Wiring (app.py), before the Gradio page is mounted at "/" so that /metrics stays reachable:

    metrics = server.metrics.install_metrics(app, engine, log_format=...)  # adds GET /metrics
    demo = ui.build_demo(engine, settings, metrics=metrics)                # the page records too

Routes record each request one of three ways, all ending in the same counters, histograms and
one log line per finished request:

- wrap the engine's delta iterator (the simplest; aborted/cancelled streams are recorded too):

      async for out in metrics.track("chat", engine.generate(ids, params), request_id=rid):
          ...

- or drive a tracker by hand: `t = metrics.start("v1_chat", num_prompt_tokens=n, request_id=rid)`,
  `t.tokens(k)` when k new tokens arrive, `t.finish("stop")` once at the end;
- or record a request that already ended in one call: `metrics.observe(route, arrival_time=...,
  first_token_time=..., finish_time=..., num_prompt_tokens=..., num_output_tokens=...,
  finish_reason=...)`.

Refused requests are counted with `metrics.error(route, status)` (e.g. 400, 429, 503).

With several models (frontend/models.py) every request series carries a `model` label (the name
`/v1/models` lists) and the engine's gauges come once per loaded model; one model keeps the
series unlabelled, as before. Refusals (`rill_request_errors_total`) stay by route and status: many
are refused before any model is picked.

All times are `time.monotonic()` seconds, like the engine's `RequestOutput.first_token_time`.
Every metric lives in a `CollectorRegistry` of its own, so several apps in one process (tests)
never clash. Gauges (running, waiting, KV usage) and the preemption counter are read from
`engine.stats()` at scrape time.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from prometheus_client import (CollectorRegistry, Counter, Histogram, disable_created_metrics,
                               generate_latest)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from frontend.recent import RecentActivity, RecentWindow

if TYPE_CHECKING:
    from engine.request import RequestOutput

disable_created_metrics()  # no `*_created` series: a scrape shows only what docs/operations.md lists

request_logger = logging.getLogger("rill.request")

TIME_TO_FIRST_TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
INTER_TOKEN_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)
REQUEST_LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)
TOKEN_COUNT_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 4000, 8000, 16000, 32000)

# (name, type, help) of every series /metrics exposes (exactly these: tests/test_metrics.py), as docs/operations.md lists them.
METRICS_DOC: tuple[tuple[str, str, str], ...] = (
    ("rill_requests_running", "gauge", "requests the engine is running now (in the batch)"),
    ("rill_requests_waiting", "gauge", "requests waiting for a batch slot or KV blocks"),
    ("rill_kv_cache_usage_ratio", "gauge", "fraction of KV cache blocks in use, 0..1"),
    ("rill_kv_cache_blocks", "gauge", "KV cache blocks allocated in all"),
    ("rill_engine_alive", "gauge", "1 while the engine thread runs, 0 after it died"),
    ("rill_preemptions_total", "counter", "running requests preempted (KV blocks freed, recomputed later)"),
    ("rill_engine_steps_total", "counter", "engine steps (batched forwards) run"),
    ("rill_prefix_cache_queried_tokens_total", "counter", "prompt tokens looked up in the prefix cache"),
    ("rill_prefix_cache_hit_tokens_total", "counter", "prompt tokens found in the prefix cache (K/V reused, not computed)"),
    ("rill_spec_draft_tokens_total", "counter", "tokens guessed by speculative decoding and verified"),
    ("rill_spec_accepted_tokens_total", "counter", "guessed tokens the model agreed with (each one a token without a step)"),
    ("rill_prompt_tokens_total", "counter", "prompt tokens of requests, by route"),
    ("rill_generation_tokens_total", "counter", "tokens generated, by route (counted as they stream)"),
    ("rill_requests_finished_total", "counter", "finished requests by route and finish_reason (stop, length, abort, error)"),
    ("rill_request_errors_total", "counter", "requests refused or failed with an HTTP status, by route and status"),
    ("rill_time_to_first_token_seconds", "histogram", "arrival to first generated token"),
    ("rill_inter_token_latency_seconds", "histogram", "gap between consecutive generated tokens"),
    ("rill_e2e_request_latency_seconds", "histogram", "arrival to the last token (finish, abort or error)"),
    ("rill_request_queue_time_seconds", "histogram", "time a request waited before the engine first scheduled it"),
    ("rill_request_prompt_tokens", "histogram", "prompt length per request, in tokens"),
    ("rill_request_generation_tokens", "histogram", "output length per request, in tokens"),
)


def _reason_name(finish_reason) -> str:
    if finish_reason is None:
        return "abort"
    return str(getattr(finish_reason, "value", finish_reason))


def log_request(*, request_id: str | None, route: str, prompt_tokens: int, output_tokens: int,
                ttft_s: float | None, total_s: float, finish_reason: str, log_format: str = "text",
                logger: logging.Logger | None = None, **extra) -> str:
    """Write the one log line of a finished request (JSON when `log_format == "json"`); returns it."""
    record = {
        "event": "request_finished",
        "request_id": request_id,
        "route": route,
        "prompt_tokens": int(prompt_tokens),
        "output_tokens": int(output_tokens),
        "ttft_s": None if ttft_s is None else round(ttft_s, 4),
        "total_s": round(total_s, 4),
        "finish_reason": finish_reason,
        **extra,
    }
    if log_format == "json":
        line = json.dumps(record, separators=(",", ":"))
    else:
        line = " ".join(f"{key}={value}" for key, value in record.items() if key != "event")
        line = f"request finished: {line}"
    (logger or request_logger).info(line)
    return line


class _EngineCollector:
    """Reads `engine.stats()` at scrape time: gauges and the engine's own counters; with several
    models (`models`, a ModelRegistry), each loaded model's under its `model` label."""

    def __init__(self, engine, models=None):
        self.engine = engine
        self.models = models

    def describe(self):
        return []  # registered without a describe pass: collect() is only called on scrape

    def collect(self):
        if self.models is None:
            yield from self._engine_families([((), self.engine)], ())
            return
        loaded = [((entry.name,), entry.engine) for entry in self.models.entries if entry.engine is not None]
        yield from self._engine_families(loaded, ("model",))

    @staticmethod
    def _engine_families(engines, label_names):
        families = {name: _family(name, label_names) for name in _ENGINE_SERIES}
        for labels, engine in engines:
            try:
                stats = engine.stats()
            except Exception:  # a dead engine must not turn the scrape into a 500
                families["rill_engine_alive"].add_metric(list(labels), 0.0)
                continue
            values = {"rill_requests_running": stats.num_running, "rill_requests_waiting": stats.num_waiting,
                      "rill_kv_cache_usage_ratio": float(stats.kv_usage), "rill_kv_cache_blocks": stats.num_kv_blocks,
                      "rill_engine_alive": 1.0 if engine.alive else 0.0,
                      "rill_preemptions_total": stats.num_preemptions, "rill_engine_steps_total": stats.num_steps,
                      "rill_prefix_cache_queried_tokens_total": stats.prefix_cache_queried_tokens,
                      "rill_prefix_cache_hit_tokens_total": stats.prefix_cache_hit_tokens,
                      "rill_spec_draft_tokens_total": stats.spec_draft_tokens,
                      "rill_spec_accepted_tokens_total": stats.spec_accepted_tokens}
            for name, value in values.items():
                families[name].add_metric(list(labels), value)
        yield from (family for family in families.values() if family.samples)


_ENGINE_SERIES = ("rill_requests_running", "rill_requests_waiting", "rill_kv_cache_usage_ratio", "rill_kv_cache_blocks",
                  "rill_engine_alive", "rill_preemptions_total", "rill_engine_steps_total",
                  "rill_prefix_cache_queried_tokens_total", "rill_prefix_cache_hit_tokens_total",
                  "rill_spec_draft_tokens_total", "rill_spec_accepted_tokens_total")


_DOC = {name: (kind, text) for name, kind, text in METRICS_DOC}


def _family(name: str, label_names: tuple[str, ...]):
    """An empty gauge or counter family of the engine's, with the type and help METRICS_DOC gives it."""
    kind, text = _DOC[name]
    if kind == "counter":  # prometheus_client adds the _total suffix itself
        return CounterMetricFamily(name.removesuffix("_total"), text, labels=list(label_names))
    return GaugeMetricFamily(name, text, labels=list(label_names))


class RequestTracker:
    """One request's timings as it streams. Made by `RequestMetrics.start`; `finish` it once."""

    __slots__ = ("metrics", "route", "model", "request_id", "arrival_time", "num_prompt_tokens", "first_token_time",
                 "last_token_time", "num_output_tokens", "queue_time", "finished", "_prompt_counted", "_by")

    def __init__(self, metrics: RequestMetrics, route: str, request_id: str | None, num_prompt_tokens: int | None,
                 arrival_time: float, model: str | None = None):
        self.metrics = metrics
        self.route = route
        self.model = model  # the served model's name (several models: the `model` label)
        self._by = (model or "",) if metrics.per_model else ()  # the model label's value, when there is one
        self.request_id = request_id
        self.arrival_time = arrival_time  # time.monotonic() when the route accepted the request
        self.num_prompt_tokens = 0
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.num_output_tokens = 0  # counted into rill_generation_tokens_total so far
        self.queue_time: float | None = None
        self.finished = False
        self._prompt_counted = False
        if num_prompt_tokens is not None:
            self.set_prompt_tokens(num_prompt_tokens)

    def set_prompt_tokens(self, num_prompt_tokens: int) -> None:
        """Counts the prompt's tokens once (the first call wins)."""
        if self._prompt_counted or num_prompt_tokens <= 0:
            return
        self._prompt_counted = True
        self.num_prompt_tokens = int(num_prompt_tokens)
        self.metrics._prompt_tokens.labels(self.route, *self._by).inc(self.num_prompt_tokens)

    def tokens(self, count: int, now: float | None = None, first_token_time: float | None = None) -> None:
        """`count` new tokens arrived at `now` (monotonic); the first call sets the time to first token."""
        if count <= 0 or self.finished:
            return
        now = time.monotonic() if now is None else now
        metrics = self.metrics
        if self.first_token_time is None:
            self.first_token_time = first_token_time if first_token_time is not None else now
            self._hist(metrics._ttft).observe(max(0.0, self.first_token_time - self.arrival_time))
            metrics.window.note_first_token(self.first_token_time - self.arrival_time)
            gaps = count - 1  # tokens after the first in this same delta came with no gap we saw
            if gaps > 0:
                per_token = max(0.0, now - self.first_token_time) / gaps
                itl = self._hist(metrics._itl)
                for _ in range(gaps):
                    itl.observe(per_token)
        else:
            per_token = max(0.0, now - (self.last_token_time or now)) / count
            itl = self._hist(metrics._itl)
            for _ in range(count):
                itl.observe(per_token)
        self.last_token_time = now
        self.num_output_tokens += count
        metrics._generation_tokens.labels(self.route, *self._by).inc(count)
        metrics.window.note_tokens(count)

    def _hist(self, histogram):
        """The histogram's series of this request's model (the histogram itself with one model)."""
        return histogram.labels(*self._by) if self._by else histogram

    def finish(self, finish_reason, *, num_output_tokens: int | None = None, num_prompt_tokens: int | None = None,
               queue_time: float | None = None, now: float | None = None, error: str | None = None) -> None:
        """Records the end of the request (once; later calls are ignored) and writes its log line.

        `num_output_tokens`, when given, is the engine's count: tokens not yet reported through
        `tokens()` are counted now, so the counters end exactly at what the request produced.
        """
        if self.finished:
            return
        now = time.monotonic() if now is None else now
        if num_prompt_tokens is not None:
            self.set_prompt_tokens(num_prompt_tokens)
        if num_output_tokens is not None and num_output_tokens > self.num_output_tokens:
            self.tokens(num_output_tokens - self.num_output_tokens, now=now)
        self.finished = True
        metrics = self.metrics
        reason = _reason_name(finish_reason)
        total = max(0.0, now - self.arrival_time)
        queue_time = queue_time if queue_time is not None else self.queue_time
        self._hist(metrics._e2e).observe(total)
        if queue_time is not None:
            self._hist(metrics._queue_time).observe(max(0.0, queue_time))
        self._hist(metrics._prompt_len).observe(self.num_prompt_tokens)
        self._hist(metrics._output_len).observe(self.num_output_tokens)
        metrics._finished.labels(self.route, reason, *self._by).inc()
        metrics.window.note_finished()
        ttft = None if self.first_token_time is None else self.first_token_time - self.arrival_time
        extra = {"model": self.model} if self.metrics.per_model else {}
        if error:
            extra["error"] = error
        log_request(request_id=self.request_id, route=self.route, prompt_tokens=self.num_prompt_tokens,
                    output_tokens=self.num_output_tokens, ttft_s=ttft, total_s=total, finish_reason=reason,
                    log_format=metrics.log_format, logger=metrics.logger, **extra)


class RequestMetrics:
    """The metrics of one app: its own registry, the per-request recorders, the recent window.
    `models` (a ModelRegistry serving several models): every request series by `model` too.

    Thread-safe, though the routes, the page and MCP all record on the event loop.
    """

    def __init__(self, engine=None, *, registry: CollectorRegistry | None = None, log_format: str = "text",
                 logger: logging.Logger | None = None, recent_window_s: float = 600.0, models=None):
        self.engine = engine
        self.models = models if models is not None and models.several else None
        self.per_model = self.models is not None  # a `model` label on the request series
        by = ["model"] if self.per_model else []
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=False)
        self.log_format = log_format  # "json" -> one JSON object per finished request
        self.logger = logger or request_logger
        self.recent_window_s = recent_window_s
        reg = self.registry
        self._prompt_tokens = Counter("rill_prompt_tokens", "prompt tokens of requests, by route",
                                      ["route", *by], registry=reg)
        self._generation_tokens = Counter("rill_generation_tokens", "tokens generated, by route",
                                          ["route", *by], registry=reg)
        self._finished = Counter("rill_requests_finished", "finished requests by route and finish reason",
                                 ["route", "finish_reason", *by], registry=reg)
        self._errors = Counter("rill_request_errors", "requests refused or failed, by route and HTTP status",
                               ["route", "status"], registry=reg)
        self._ttft = Histogram("rill_time_to_first_token_seconds", "arrival to first generated token",
                               buckets=TIME_TO_FIRST_TOKEN_BUCKETS, labelnames=by, registry=reg)
        self._itl = Histogram("rill_inter_token_latency_seconds", "gap between consecutive generated tokens",
                              buckets=INTER_TOKEN_BUCKETS, labelnames=by, registry=reg)
        self._e2e = Histogram("rill_e2e_request_latency_seconds", "arrival to the end of the request",
                              buckets=REQUEST_LATENCY_BUCKETS, labelnames=by, registry=reg)
        self._queue_time = Histogram("rill_request_queue_time_seconds",
                                     "time waiting before the engine first scheduled the request",
                                     buckets=TIME_TO_FIRST_TOKEN_BUCKETS, labelnames=by, registry=reg)
        self._prompt_len = Histogram("rill_request_prompt_tokens", "prompt length per request, in tokens",
                                     buckets=TOKEN_COUNT_BUCKETS, labelnames=by, registry=reg)
        self._output_len = Histogram("rill_request_generation_tokens", "output length per request, in tokens",
                                     buckets=TOKEN_COUNT_BUCKETS, labelnames=by, registry=reg)
        if engine is not None:
            reg.register(_EngineCollector(engine, self.models))
        self.window = RecentWindow(recent_window_s)  # the status panel's last minutes

    # --- recording -------------------------------------------------------------------------------

    def start(self, route: str, *, num_prompt_tokens: int | None = None, request_id: str | None = None,
              arrival_time: float | None = None, model: str | None = None) -> RequestTracker:
        """A tracker for one admitted request (`arrival_time`: monotonic; default now; `model`: its name)."""
        return RequestTracker(self, route, request_id, num_prompt_tokens,
                              time.monotonic() if arrival_time is None else arrival_time, model)

    def observe(self, route: str, *, arrival_time: float, first_token_time: float | None, finish_time: float,
                num_prompt_tokens: int, num_output_tokens: int, finish_reason, queue_time: float | None = None,
                request_id: str | None = None) -> None:
        """Records a request that already ended (monotonic times); inter-token latency is its mean gap."""
        tracker = self.start(route, num_prompt_tokens=num_prompt_tokens, request_id=request_id,
                             arrival_time=arrival_time)
        if num_output_tokens > 0:
            first = first_token_time if first_token_time is not None else finish_time
            tracker.tokens(1, now=first)
            if num_output_tokens > 1:
                tracker.tokens(num_output_tokens - 1, now=finish_time)
        tracker.finish(finish_reason, queue_time=queue_time, now=finish_time)

    def error(self, route: str, status: int) -> None:
        """Counts a request refused or failed with HTTP `status` (400, 413, 429, 500, 503, ...)."""
        self._errors.labels(route, str(int(status))).inc()

    async def track(self, route: str, deltas: AsyncIterator, *, request_id: str | None = None,
                    num_prompt_tokens: int | None = None, arrival_time: float | None = None,
                    model: str | None = None) -> AsyncIterator:
        """Yields the `RequestOutput` deltas of `deltas` unchanged, recording the request.

        A consumer that stops early (break, cancellation, client gone) records finish reason
        "abort"; an exception from the iterator records "error" and propagates.
        """
        tracker = self.start(route, num_prompt_tokens=num_prompt_tokens, request_id=request_id,
                             arrival_time=arrival_time, model=model)
        state = _DeltaState()
        try:
            async for out in deltas:
                state.see(tracker, out)
                yield out
        except BaseException as exc:
            state.fail(exc)
            raise
        finally:
            state.close(tracker)
            aclose = getattr(deltas, "aclose", None)
            if aclose is not None:
                await aclose()  # engine.generate aborts the request when closed early

    def recent(self, window_s: float = 60.0, bin_s: float = 5.0, history_s: float = 300.0,
               now: float | None = None) -> RecentActivity:
        """Tokens/s over the last `window_s`; throughput per `bin_s` and TTFTs over `history_s`."""
        return self.window.recent(window_s, bin_s, history_s, now)

    # --- exposition ------------------------------------------------------------------------------

    def render(self) -> bytes:
        """The registry in the Prometheus text format."""
        return generate_latest(self.registry)


def queue_time_of(out: RequestOutput) -> float | None:
    """Seconds a request waited before it was first scheduled (`scheduled_time - arrival_time`,
    monotonic); None while its outputs do not say."""
    if out.scheduled_time is not None and out.arrival_time:
        return max(0.0, out.scheduled_time - out.arrival_time)
    return None


class _DeltaState:
    """What `track` learned from a request's deltas: per-sample finish reasons, errors."""

    __slots__ = ("reasons", "error", "exception")

    def __init__(self):
        self.reasons: dict[int, str] = {}
        self.error: str | None = None
        self.exception: BaseException | None = None

    def see(self, tracker: RequestTracker, out) -> None:
        if out.num_prompt_tokens:
            tracker.set_prompt_tokens(out.num_prompt_tokens)
        if tracker.queue_time is None:
            tracker.queue_time = queue_time_of(out)
        if out.token_ids:
            tracker.tokens(len(out.token_ids), first_token_time=out.first_token_time)
        if out.finished:
            self.reasons[out.index] = _reason_name(out.finish_reason)
            if out.error:
                self.error = out.error

    def fail(self, exc: BaseException) -> None:
        self.exception = exc

    def close(self, tracker: RequestTracker) -> None:
        if self.reasons:
            reasons = set(self.reasons.values())
            reason = "error" if "error" in reasons else self.reasons.get(0, next(iter(reasons)))
        elif self.exception is not None and not isinstance(self.exception, (GeneratorExit, asyncio.CancelledError)):
            reason = "error"
            self.error = self.error or f"{type(self.exception).__name__}: {self.exception}"
        else:
            reason = "abort"  # the consumer stopped before the engine finished the request
        tracker.finish(reason, error=self.error)

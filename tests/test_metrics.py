"""`GET /metrics` and the per-request log line: names, types, and counters that move by exactly
what was sent (unit tests on recorded deltas, then a real server scraped around real requests)."""

import asyncio
import json
import logging
from dataclasses import dataclass, field

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.request import FinishReason, RequestOutput
from frontend.telemetry import METRICS_DOC, RequestMetrics, log_request
from server.metrics import install_metrics


@dataclass
class _Stats:
    num_running: int = 3
    num_waiting: int = 2
    kv_usage: float = 0.25
    num_kv_blocks: int = 80
    num_free_kv_blocks: int = 60
    num_preemptions: int = 7
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    num_steps: int = 11
    finished_total: dict = field(default_factory=dict)
    prefix_cache_queried_tokens: int = 50
    prefix_cache_hit_tokens: int = 32
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0


class _Engine:
    alive = True
    backend = "local"

    def stats(self):
        return _Stats()


def parse(text: str) -> dict[tuple, float]:
    """{(sample name, sorted labels): value} of a Prometheus text page."""
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples, name, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def deltas(request_id, pieces, finish_reason, num_prompt_tokens=5):
    """RequestOutput deltas: `pieces` is a list of token counts per delta."""
    outs, total = [], 0
    for i, count in enumerate(pieces):
        total += count
        last = i == len(pieces) - 1
        outs.append(RequestOutput(request_id, 0, list(range(count)), "x" * count, finished=last and finish_reason is not None,
                                  finish_reason=finish_reason if last else None, num_prompt_tokens=num_prompt_tokens,
                                  num_output_tokens=total))
    return outs


async def _aiter(items):
    for item in items:
        yield item


def test_gauges_and_engine_counters_are_read_at_scrape_time():
    samples = parse(RequestMetrics(_Engine()).render().decode())
    assert value(samples, "rill_requests_running") == 3
    assert value(samples, "rill_requests_waiting") == 2
    assert value(samples, "rill_kv_cache_usage_ratio") == 0.25
    assert value(samples, "rill_kv_cache_blocks") == 80
    assert value(samples, "rill_preemptions_total") == 7
    assert value(samples, "rill_prefix_cache_queried_tokens_total") == 50
    assert value(samples, "rill_prefix_cache_hit_tokens_total") == 32
    assert value(samples, "rill_engine_alive") == 1


def test_every_documented_metric_is_exposed_and_nothing_undocumented():
    metrics = RequestMetrics(_Engine())
    metrics.observe("chat", arrival_time=0.0, first_token_time=0.1, finish_time=0.5, num_prompt_tokens=3,
                    num_output_tokens=4, finish_reason="stop")
    metrics.error("chat", 429)
    families = {family.name: family.type for family in text_string_to_metric_families(metrics.render().decode())}
    documented = {name.removesuffix("_total") if kind == "counter" else name: kind for name, kind, _ in METRICS_DOC}
    assert families == documented


def test_two_apps_in_one_process_keep_separate_counts():
    first, second = RequestMetrics(_Engine()), RequestMetrics(_Engine())
    first.error("chat", 400)
    assert value(parse(first.render().decode()), "rill_request_errors_total", route="chat", status="400") == 1
    assert value(parse(second.render().decode()), "rill_request_errors_total", route="chat", status="400") == 0


def test_track_counts_tokens_and_finish_reason_exactly():
    metrics = RequestMetrics(_Engine())

    async def consume(outs, stop_after=None):
        seen = 0
        async for _ in metrics.track("v1_chat", _aiter(outs), request_id="r"):
            seen += 1
            if stop_after is not None and seen == stop_after:
                break

    asyncio.run(consume(deltas("a", [1, 1, 3, 1], FinishReason.LENGTH, num_prompt_tokens=9)))
    asyncio.run(consume(deltas("b", [1, 2], FinishReason.STOP, num_prompt_tokens=4)))
    asyncio.run(consume(deltas("c", [1, 1, 1, 1], None, num_prompt_tokens=2), stop_after=2))  # client left
    samples = parse(metrics.render().decode())
    assert value(samples, "rill_prompt_tokens_total", route="v1_chat") == 9 + 4 + 2
    assert value(samples, "rill_generation_tokens_total", route="v1_chat") == 6 + 3 + 2
    assert value(samples, "rill_requests_finished_total", route="v1_chat", finish_reason="length") == 1
    assert value(samples, "rill_requests_finished_total", route="v1_chat", finish_reason="stop") == 1
    assert value(samples, "rill_requests_finished_total", route="v1_chat", finish_reason="abort") == 1
    assert value(samples, "rill_time_to_first_token_seconds_count") == 3
    assert value(samples, "rill_e2e_request_latency_seconds_count") == 3
    assert value(samples, "rill_inter_token_latency_seconds_count") == 5 + 2 + 1  # tokens after each first
    assert value(samples, "rill_request_generation_tokens_sum") == 11
    assert value(samples, "rill_request_prompt_tokens_count") == 3


def test_a_failing_stream_is_recorded_as_an_error_and_still_raises():
    metrics = RequestMetrics(_Engine())

    async def broken():
        yield deltas("a", [1], None)[0]
        raise RuntimeError("engine died")

    async def consume():
        async for _ in metrics.track("chat", broken()):
            pass

    with pytest.raises(RuntimeError, match="engine died"):
        asyncio.run(consume())
    samples = parse(metrics.render().decode())
    assert value(samples, "rill_requests_finished_total", route="chat", finish_reason="error") == 1
    assert value(samples, "rill_generation_tokens_total", route="chat") == 1


def test_one_log_line_per_request_in_json(caplog):
    metrics = RequestMetrics(_Engine(), log_format="json")
    with caplog.at_level(logging.INFO, logger="rill.request"):
        metrics.observe("chat", arrival_time=10.0, first_token_time=10.25, finish_time=11.0, num_prompt_tokens=12,
                        num_output_tokens=30, finish_reason=FinishReason.STOP, request_id="req-1")
    lines = [r.getMessage() for r in caplog.records if r.name == "rill.request"]
    assert len(lines) == 1
    assert json.loads(lines[0]) == {"event": "request_finished", "request_id": "req-1", "route": "chat",
                                    "prompt_tokens": 12, "output_tokens": 30, "ttft_s": 0.25, "total_s": 1.0,
                                    "finish_reason": "stop"}
    text = log_request(request_id="r2", route="gradio", prompt_tokens=1, output_tokens=2, ttft_s=None, total_s=0.5,
                       finish_reason="abort")
    assert text == ("request finished: request_id=r2 route=gradio prompt_tokens=1 output_tokens=2 ttft_s=None "
                    "total_s=0.5 finish_reason=abort")


def test_install_metrics_serves_the_text_format():
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    app = FastAPI()
    metrics = install_metrics(app, _Engine())
    metrics.error("v1_chat", 400)
    response = TestClient(app).get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=")
    assert value(parse(response.text), "rill_request_errors_total", route="v1_chat", status="400") == 1
    assert app.state.metrics is metrics


# --------------------------------------------------------------------------- a real server

def scrape(url) -> dict:
    response = httpx.get(f"{url}/metrics", timeout=30)
    assert response.status_code == 200
    return parse(response.text)


def _moved(before, after, name, **labels) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


def test_counters_move_by_exactly_what_was_sent(tiny_server):
    from tests.servers import parse_sse, usage_of, wait_idle

    url = tiny_server.url
    wait_idle(url)
    before = scrape(url)
    usages = []
    for i, max_new_tokens in enumerate((3, 5, 8)):
        response = httpx.post(f"{url}/chat", json={"prompt": f"Hello number {i}", "max_new_tokens": max_new_tokens,
                                                  "temperature": 0}, timeout=120)
        assert response.status_code == 200
        usages.append(usage_of(parse_sse(response.content)))
    refused = httpx.post(f"{url}/chat", json={"prompt": "hi", "max_new_tokens": 0}, timeout=30)
    assert refused.status_code in (400, 422)
    wait_idle(url)
    after = scrape(url)

    assert _moved(before, after, "rill_prompt_tokens_total", route="chat") == sum(u["prompt_tokens"] for u in usages)
    assert _moved(before, after, "rill_generation_tokens_total", route="chat") == \
        sum(u["completion_tokens"] for u in usages)
    for reason in {u["finish_reason"] for u in usages}:
        assert _moved(before, after, "rill_requests_finished_total", route="chat", finish_reason=reason) == \
            sum(1 for u in usages if u["finish_reason"] == reason)
    assert _moved(before, after, "rill_request_prompt_tokens_count") == 3
    assert _moved(before, after, "rill_request_generation_tokens_sum") == sum(u["completion_tokens"] for u in usages)
    assert _moved(before, after, "rill_e2e_request_latency_seconds_count") == 3
    assert _moved(before, after, "rill_request_errors_total", route="chat", status=str(refused.status_code)) == 1
    assert value(after, "rill_requests_running") == 0
    assert value(after, "rill_requests_waiting") == 0
    assert value(after, "rill_kv_cache_usage_ratio") == 0


def test_page_requests_are_counted_under_the_gradio_route(tiny_server):
    from gradio_client import Client

    from tests.servers import wait_idle

    url = tiny_server.url
    wait_idle(url)
    before, engine_before = scrape(url), tiny_server.health()["engine"]
    client = Client(f"{url}/", verbose=False)
    answers = [client.predict(f"Say something {i}", None, "", 0.0, 1.0, 0, 6, 1.0, api_name="/chat") for i in range(2)]
    assert all(isinstance(answer, str) for answer in answers)
    wait_idle(url)
    after, engine_after = scrape(url), tiny_server.health()["engine"]
    generated = engine_after["generation_tokens_total"] - engine_before["generation_tokens_total"]
    assert 2 <= generated <= 12
    assert _moved(before, after, "rill_generation_tokens_total", route="gradio") == generated
    finished = sum(_moved(before, after, "rill_requests_finished_total", route="gradio", finish_reason=reason)
                   for reason in ("stop", "length"))
    assert finished == 2


def test_a_dead_engine_still_scrapes_and_says_so():
    class Dead:
        alive = False

        def stats(self):
            raise RuntimeError("engine thread died")

    samples = parse(RequestMetrics(Dead()).render().decode())
    assert value(samples, "rill_engine_alive") == 0
    assert ("rill_requests_running", ()) not in samples


def test_a_cancelled_gradio_client_job_aborts_its_request(embedded_server):
    """gradio_client's `job.cancel()` reaches the engine: counted as an abort, nothing left running."""
    import time

    from gradio_client import Client

    from tests.servers import slow_steps, wait_idle

    url = embedded_server.url
    wait_idle(url, timeout=180)
    before = scrape(url)
    client = Client(f"{url}/", verbose=False)
    with slow_steps(url, 0.01):  # 10 ms steps: the answer is still running when the job is cancelled
        # greedy, this answer runs about 360 tokens
        job = client.submit("Explain how a hash map works, with a short Python example.", None, "", 0.0, 1.0, 0, 400,
                            1.0, api_name="/chat")
        deadline = time.monotonic() + 180
        while len(job.outputs()) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(job.outputs()) >= 2, "the answer did not stream"
        job.cancel()
        wait_idle(url, timeout=180)
    deadline = time.monotonic() + 60
    while _moved(before, scrape(url), "rill_requests_finished_total", route="gradio", finish_reason="abort") < 1 \
            and time.monotonic() < deadline:
        time.sleep(0.1)
    after = scrape(url)
    assert _moved(before, after, "rill_requests_finished_total", route="gradio", finish_reason="abort") == 1
    assert _moved(before, after, "rill_generation_tokens_total", route="gradio") < 360
    assert value(after, "rill_requests_running") == 0


def test_queue_time_comes_from_the_engine_schedule_time():
    """Outputs that carry `scheduled_time` (monotonic, like `arrival_time`) feed the queue-time histogram."""
    from types import SimpleNamespace

    metrics = RequestMetrics(_Engine())
    outs = [SimpleNamespace(**{**{name: getattr(out, name) for name in out.__slots__}, "scheduled_time": 100.75})
            for out in deltas("q", [1, 2], FinishReason.STOP)]
    for out in outs:
        out.arrival_time = 100.0

    async def consume():
        async for _ in metrics.track("chat", _aiter(outs)):
            pass

    asyncio.run(consume())
    samples = parse(metrics.render().decode())
    assert value(samples, "rill_request_queue_time_seconds_count") == 1
    assert value(samples, "rill_request_queue_time_seconds_sum") == pytest.approx(0.75)


def _imported_packages(path) -> set[str]:
    import ast
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package, forbidden", [("ui", {"server", "app"}), ("server", {"ui", "app"}),
                                                ("engine", {"ui", "server", "app"})])
def test_imports_point_one_way_and_the_page_records_metrics_without_the_routes(package, forbidden):
    """docs/architecture.md: `app -> ui, server -> engine`; request metrics live in frontend/telemetry.py."""
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    offenders = {str(path.relative_to(root)): sorted(_imported_packages(path) & forbidden)
                 for path in sorted((root / package).rglob("*.py")) if _imported_packages(path) & forbidden}
    assert offenders == {}

"""The page takes the routes' path (issue 49): its answers obey --request-timeout as /chat's do,
end with a clear error the visitor sees, and leave nothing running in the engine.

Same flags as tests/test_reliability.py's `guarded` server, so one run starts it once."""

from __future__ import annotations

import httpx
import pytest
from gradio_client import Client
from gradio_client.exceptions import AppError

from tests.servers import slow_steps, wait_idle

KEY = "sekret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def guarded(server_with):
    return server_with("--api-key", KEY, "--max-body-bytes", "4096", "--request-timeout", "2")


def _metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", headers=AUTH, timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{")
               and 'route="gradio"' in line)


def test_the_pages_answer_ends_at_the_request_timeout_with_a_clear_error(guarded):
    url = guarded.url
    client = Client(url + "/", auth=("visitor", KEY), verbose=False)
    finished_before = _metric(url, "rill_requests_finished_total")
    # 50 ms a step: 120 tokens take 6 s or more, past the 2 s timeout on any machine (without it they end)
    with slow_steps(url, 0.05, headers=AUTH):
        with pytest.raises(AppError) as failure:
            client.predict("Talk.", [], "", 0.0, 1.0, 0, 120, 1.0, api_name="/chat")
    message = str(failure.value)
    assert "request timeout of 2 s" in message and "stopped" in message, message
    wait_idle(url, headers=AUTH)  # the engine request was ended, not left running
    assert _metric(url, "rill_requests_finished_total") == finished_before + 1  # recorded as the routes record theirs
    assert client.predict("Hi", [], "", 0.0, 1.0, 0, 3, 1.0, api_name="/chat")  # the page serves on

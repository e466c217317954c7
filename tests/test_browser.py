"""The page in a real headless Chromium (Debian's `chromium`, driven by Playwright; no browser
download), on the real server with the embedded SmolLM2-135M-Instruct.

Screenshots (the page mid-answer, the status tab under load) go to $RILL_SCREENSHOTS when set
(`RILL_SCREENSHOTS=docs pytest tests/test_browser.py` refreshes docs/chat.png and docs/status.png),
else to a temporary folder.
"""

import json
import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.servers import slow_steps, wait_idle

pytestmark = [pytest.mark.browser, pytest.mark.embedded]

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic"]
XSS = "<img src=x onerror=alert(1)>"
WAIT_S = 180.0  # generous: CI machines are slow and busy; no test asserts a duration


def until(condition, timeout: float = WAIT_S, interval: float = 0.1, message="condition"):
    """Polls `condition()` until it returns something truthy; returns that, or fails with `message`
    (a string, or a function called at the failure, so that it can say what the page shows then)."""
    deadline = time.monotonic() + timeout
    while True:
        result = condition()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for "
                                 f"{message() if callable(message) else message}")
        time.sleep(interval)


def words(text: str) -> list[str]:
    """Text as a reader sees it: the page renders Markdown, so line breaks and blank lines may differ."""
    return text.split()


def metric(url: str, name: str, **labels) -> float:
    """One sample of the server's /metrics (0 when absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=30).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return sample.value
    return 0.0


@pytest.fixture(scope="module")
def browser():
    if not os.path.exists(CHROMIUM):  # loud: a suite that skips the page in silence says nothing about it
        pytest.fail(f"Debian's chromium is not installed at {CHROMIUM}: the browser tests need it and never "
                    "download a browser. `make setup` installs it with apt (as root); or run `make test-fast`, "
                    "which leaves the browser and embedded-model tests out", pytrace=False)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    folder = os.environ.get("RILL_SCREENSHOTS")
    path = Path(folder) if folder else tmp_path_factory.mktemp("screenshots")
    path.mkdir(parents=True, exist_ok=True)
    return path


class Page:
    """One visitor: a fresh browser context on the server's page, with what it saw recorded."""

    def __init__(self, browser, url: str):
        self.url = url
        self.context = browser.new_context(viewport={"width": 1180, "height": 980})
        self.page = self.context.new_page()
        self.dialogs: list[str] = []  # alert()/confirm() a script opened: there must be none
        self.foreign_requests: list[str] = []  # anything fetched from another host (CDN, fonts)
        self.page.on("dialog", lambda dialog: (self.dialogs.append(dialog.message), dialog.dismiss()))
        host = url.split("//", 1)[1]
        self.page.on("request", lambda request: None if f"//{host}" in request.url or request.url.startswith(
            ("data:", "blob:")) else self.foreign_requests.append(request.url))
        self.page.goto(url + "/")
        self.page.wait_for_selector("#rill-input textarea", timeout=WAIT_S * 1000)

    def close(self):
        self.context.close()

    def send(self, text: str):
        self.page.fill("#rill-input textarea", text)
        self.page.press("#rill-input textarea", "Enter")

    def bot_text(self) -> str:
        bots = self.page.locator("#rill-chatbot [data-testid='bot']")
        return bots.last.inner_text() if bots.count() else ""

    def user_text(self) -> str:
        users = self.page.locator("#rill-chatbot [data-testid='user']")
        return users.last.inner_text() if users.count() else ""

    def open_settings(self):
        """Opens "System prompt and sampling" and waits until Gradio has finished rendering it.

        Gradio mounts a closed accordion's children when it opens, then, one animation frame later,
        applies their stored values to them again (`render_previously_invisible_children`). A value
        typed inside that frame is overwritten with the default: Playwright types within ~10 ms of
        the box appearing, a visitor cannot. So wait for the box, then for two frames."""
        self.page.click("#rill-settings .label-wrap")
        self.page.locator("#rill-settings input[type=range]").last.wait_for(state="visible")
        self.page.evaluate("() => new Promise(done => requestAnimationFrame(() => requestAnimationFrame(done)))")

    def close_settings(self):
        self.page.click("#rill-settings .label-wrap")

    def set_slider(self, elem_id: str, value: str):
        """Types `value` into the slider's number box, leaves the box (Gradio applies it on input and on
        blur) and waits until the slider's range input shows it: the value the page will send."""
        box = self.page.locator(f"#{elem_id} input[type=number]")
        box.fill(value)
        box.press("Tab")
        until(lambda: self.slider(elem_id) == float(value), timeout=30,
              message=lambda: f"{elem_id} to show {value} (it shows {self.slider(elem_id)})")

    def slider(self, elem_id: str) -> float:
        return float(self.page.locator(f"#{elem_id} input[type=range]").input_value())

    def idle(self) -> bool:
        """The answer ended: Send is back and Stop hidden."""
        return self.page.locator("#rill-send").is_visible() and not self.page.locator("#rill-stop").is_visible()


@pytest.fixture
def visitor(browser, embedded_server):
    wait_idle(embedded_server.url, timeout=WAIT_S)
    page = Page(browser, embedded_server.url)
    try:
        yield page
    finally:
        page.close()


def test_answer_grows_and_stop_aborts_it(visitor, embedded_server, shots):
    url = embedded_server.url
    health = embedded_server.health()
    header = visitor.page.locator("#rill-header").inner_text()
    assert health["model"] in header and f"{health['max_model_len']} tokens" in header
    aborted_before = metric(url, "rill_requests_finished_total", route="gradio", finish_reason="abort")

    with slow_steps(url, 0.01):  # 10 ms steps: the answer is still running when Stop is clicked
        visitor.open_settings()
        visitor.set_slider("rill-temperature", "0")
        visitor.set_slider("rill-repetition-penalty", "1")
        # greedy, this answer runs about 360 tokens: prose, then a code block
        visitor.send("Explain how a hash map works, with a short Python example.")
        lengths: list[int] = []

        def grown_three_times():
            text = visitor.bot_text()
            if text and (not lengths or len(text) > lengths[-1]):
                lengths.append(len(text))
            return len(lengths) >= 3

        until(grown_three_times, message="the answer to grow three times")
        until(lambda: grown_three_times() and lengths[-1] >= 420, message="a few lines of answer for the screenshot")
        visitor.close_settings()  # fold the settings back for the picture
        visitor.page.screenshot(path=str(shots / "chat.png"))
        assert visitor.page.locator("#rill-stop").is_visible()
        assert metric(url, "rill_requests_running") >= 1

        visitor.page.click("#rill-stop")
        until(lambda: metric(url, "rill_requests_running") == 0, message="the engine to have no running request")
    until(lambda: metric(url, "rill_requests_finished_total", route="gradio", finish_reason="abort")
          == aborted_before + 1, message="the page's request to be counted as aborted")
    until(visitor.idle, message="Send to come back after Stop")
    stopped_text = visitor.bot_text()
    assert stopped_text, "the partial answer must stay on the page"
    until(lambda: re.match(r"Stopped: \d+ tokens", visitor.page.locator("#rill-answer-stats").inner_text()),
          message="the answer's stats to say it was stopped")
    wait_idle(url, timeout=WAIT_S)  # KV blocks freed
    assert visitor.bot_text() == stopped_text  # nothing arrives after Stop
    assert visitor.dialogs == [] and visitor.foreign_requests == []


def test_closing_the_tab_aborts_its_answer(browser, embedded_server):
    url = embedded_server.url
    wait_idle(url, timeout=WAIT_S)
    aborted_before = metric(url, "rill_requests_finished_total", route="gradio", finish_reason="abort")
    with slow_steps(url, 0.01):  # 10 ms steps: the answer is still running when the tab closes
        visitor = Page(browser, url)
        try:
            visitor.page.click("#rill-chatbot button:has-text('Explain continuous batching')")  # an example
            until(lambda: len(visitor.bot_text()) > 0, message="the answer to the example to start")
            assert visitor.user_text() == "Explain continuous batching to a five-year-old."
            assert visitor.page.locator("#rill-stop").is_visible()
        finally:
            visitor.close()
        until(lambda: metric(url, "rill_requests_finished_total", route="gradio", finish_reason="abort")
              == aborted_before + 1, message="the closed tab's request to be aborted")
    wait_idle(url, timeout=WAIT_S)


def test_html_in_messages_and_answers_is_shown_as_text(visitor, embedded_server):
    url = embedded_server.url
    prompt = f"Write this HTML tag as-is: {XSS}"
    settings = {"rill-temperature": "0", "rill-repetition-penalty": "1", "rill-max-new-tokens": "60"}
    visitor.open_settings()
    for elem_id, value in settings.items():
        visitor.set_slider(elem_id, value)
    assert {elem_id: visitor.slider(elem_id) for elem_id in settings} == {k: float(v) for k, v in settings.items()}
    # the same question through the API, greedy: the page must show exactly this answer
    greedy = httpx.post(f"{url}/chat", json={"prompt": prompt, "temperature": 0, "repetition_penalty": 1,
                                             "max_new_tokens": 60, "stream": False}, timeout=WAIT_S).json()["response"]
    # greedy SmolLM2-135M-Instruct answers this with the tag itself: `<img src="x" onerror="alert(1)" />`
    assert "<img" in greedy and "onerror" in greedy, f"expected the model to write the tag, it wrote {greedy!r}"
    finished = metric(url, "rill_requests_finished_total", route="gradio", finish_reason="stop") + metric(
        url, "rill_requests_finished_total", route="gradio", finish_reason="length")

    def answered(count: int) -> bool:
        done = metric(url, "rill_requests_finished_total", route="gradio", finish_reason="stop") + metric(
            url, "rill_requests_finished_total", route="gradio", finish_reason="length")
        return done == finished + count and visitor.idle() and bool(visitor.bot_text())

    visitor.send(prompt)
    until(lambda: answered(1), message="the answer to finish")
    assert XSS in visitor.user_text()  # the user's message, as typed
    answer = visitor.bot_text()
    stats = visitor.page.locator("#rill-answer-stats").inner_text()
    assert words(answer) == words(greedy), (f"the page's greedy answer differs from /chat's ({stats}; sliders "
                                      f"{ {k: visitor.slider(k) for k in settings} })")
    chat = visitor.page.locator("#rill-chatbot")
    assert chat.locator("img").count() == 0
    assert visitor.page.evaluate("document.querySelectorAll('[onerror]').length") == 0
    assert visitor.dialogs == []

    # Retry asks again (greedy: the same answer), Undo gives the message back, Clear empties the chat
    visitor.page.click("#rill-chatbot button[aria-label='Retry']")
    until(lambda: answered(2), message="the retried answer to finish")
    assert visitor.bot_text() == answer
    assert visitor.page.locator("#rill-chatbot [data-testid='user']").count() == 1
    visitor.page.click("#rill-chatbot button[aria-label='Undo']")
    until(lambda: visitor.page.locator("#rill-chatbot [data-testid='user']").count() == 0,
          message="Undo to remove the message")
    assert visitor.page.locator("#rill-input textarea").input_value() == prompt
    visitor.page.press("#rill-input textarea", "Enter")
    until(lambda: answered(3), message="the answer to the re-sent message")
    assert visitor.bot_text() == answer
    visitor.page.click("#rill-chatbot button[aria-label='Clear']")
    until(lambda: visitor.page.locator("#rill-chatbot [data-testid='bot']").count() == 0,
          message="Clear to empty the chat")
    assert visitor.page.locator("#rill-chatbot [data-testid='user']").count() == 0


def test_status_tab_shows_the_load(visitor, embedded_server, shots):
    from gradio_client import Client

    url = embedded_server.url
    # Four answers of 120 tokens take under 2 s on a fast CPU, less than one refresh of the tab
    # (STATUS_REFRESH_S): so the load is kept up, four answers in flight, until the tab has shown it.
    load_done = threading.Event()
    answers: list[str] = []

    def keep_four_in_flight(slot: int):
        n = 0
        while not load_done.is_set():
            client = Client(f"{url}/", verbose=False)  # one per job: one shared by jobs that come and go
            # races in gradio_client (tests/test_soak.py, run_gradio)
            job = client.submit(f"Tell me a story about robot number {slot * 100 + n}.", None, "", 0.7, 0.9, 50,
                                120, 1.1, api_name="/chat")
            answers.append(job.result(timeout=WAIT_S))
            n += 1

    with ThreadPoolExecutor(4) as pool:
        load = [pool.submit(keep_four_in_flight, slot) for slot in range(4)]
        try:
            visitor.page.click("button[role=tab]:has-text('Status')")
            status = visitor.page.locator("#rill-status")

            def cell(name: str) -> str:
                match = re.search(rf"{re.escape(name)}\s+(\S+)", status.inner_text())
                return match.group(1) if match else ""

            until(lambda: cell("Running requests").isdigit() and int(cell("Running requests")) >= 2,
                  message=lambda: f"the status tab to show running requests; it shows {status.inner_text()!r}")
            until(lambda: cell("Tokens generated (last minute)").isdigit()
                  and int(cell("Tokens generated (last minute)")) >= 60, message="tokens to be counted")
            until(lambda: visitor.page.locator("#rill-throughput canvas, #rill-throughput svg").count() > 0,
                  message="the throughput plot")
            time.sleep(2 * 2.0)  # two refreshes more, so the plots carry a few points in the screenshot
            visitor.page.screenshot(path=str(shots / "status.png"), full_page=True)
            assert "%" in cell("KV cache") or "KV cache" in status.inner_text()
        finally:
            load_done.set()
            for future in load:
                future.result(timeout=WAIT_S)  # re-raises what a job raised
    assert len(answers) >= 4 and all(answer for answer in answers)
    until(lambda: cell("Running requests") == "0", message="the status tab to show the engine idle again")
    assert visitor.dialogs == [] and visitor.foreign_requests == []


class Conversations:
    """The conversation bar of a `Page`: Gradio 6's Dropdown renders its options (`li[role=option]`,
    the title in `aria-label`, a "✓" before the selected one's text) only while open, and an open
    list's input toggles it shut when clicked again: so each look starts from an unfocused input."""

    OPTIONS = "ul[role=listbox] li[role=option]"  # the page's only Dropdown; the list exists while open

    def __init__(self, page):
        self.page = page
        self.box = page.locator("#rill-conversations input")

    def open(self):
        self.box.blur()  # the Dropdown fires `input` on blur: the page must ignore that (no switch)
        self.box.click()
        self.page.locator(self.OPTIONS).first.wait_for(state="visible", timeout=30_000)

    def close(self):
        self.page.keyboard.press("Escape")
        self.box.blur()

    def titles(self) -> list[str]:
        """The list's titles, newest first, as the visitor sees them when opening it."""
        self.open()
        try:
            return self.page.locator(self.OPTIONS).evaluate_all("items => items.map(i => i.getAttribute('aria-label'))")
        finally:
            self.close()

    def choose(self, title: str):
        self.open()
        self.page.locator(f"{self.OPTIONS}[aria-label={json.dumps(title)}]").click(timeout=30_000)

    def title(self) -> str:
        return self.page.locator("#rill-title input").input_value()


def finished_answers(url: str) -> float:
    return sum(metric(url, "rill_requests_finished_total", route="gradio", finish_reason=reason)
               for reason in ("stop", "length"))


def test_conversations_edit_like_and_export(browser, feedback_server):
    """Conversations kept in the browser across a reload (new, switch, rename, delete), a sent message
    edited and answered again, a like written to the feedback folder, a conversation exported as JSON.
    The tiny Llama, 12-token answers: these are the page's behaviours, not the model's."""
    server, feedback_dir = feedback_server
    feedback = feedback_dir / "feedback.jsonl"
    liked_before = len(feedback.read_text().splitlines()) if feedback.is_file() else 0  # the folder is shared
    wait_idle(server.url, timeout=WAIT_S)
    visitor = Page(browser, server.url)
    page, bar = visitor.page, Conversations(visitor.page)
    users = page.locator("#rill-chatbot [data-testid='user']")
    bots = page.locator("#rill-chatbot [data-testid='bot']")
    try:
        def ask(text: str, answers: int):
            """Sends `text`; waits for its answer, then for the conversation to be saved (its title)."""
            done = finished_answers(server.url)
            visitor.send(text)
            until(lambda: finished_answers(server.url) == done + 1 and visitor.idle() and bots.count() == answers,
                  message=f"the answer to {text!r}")

        until(lambda: bar.title() == "New chat", message="the first visit's empty conversation")
        ask("first conversation", 1)
        until(lambda: bar.title() == "first conversation", message="the title taken from the first message")
        assert bar.titles() == ["first conversation"]
        page.click("#rill-new")
        until(lambda: users.count() == 0 and bar.title() == "New chat", message="an empty new chat")
        ask("second one", 1)
        until(lambda: bar.title() == "second one", message="the second conversation's title")
        assert bar.titles() == ["second one", "first conversation"]  # newest first
        page.fill("#rill-title input", "Renamed chat")
        page.click("#rill-rename")
        until(lambda: bar.titles() == ["Renamed chat", "first conversation"],
              message=lambda: f"the renamed title in the list (it shows {bar.titles()})")

        page.reload()  # both survive a reload, the current one shown
        page.wait_for_selector("#rill-input textarea")
        until(lambda: visitor.user_text() == "second one" and bar.title() == "Renamed chat",
              message="the current conversation after a reload")
        assert bar.titles() == ["Renamed chat", "first conversation"]

        bar.choose("first conversation")  # switch
        until(lambda: users.all_inner_texts() == ["first conversation"] and bar.title() == "first conversation",
              message="the switch to the first conversation")
        assert bots.count() == 1
        ask("a follow-up", 2)

        # edit the first message: the rest of the conversation goes, the answer is generated again
        done = finished_answers(server.url)
        users.first.hover()
        page.locator("#rill-chatbot button[aria-label='Edit']").first.click()
        page.locator("#rill-chatbot textarea").last.fill("edited message")
        page.click("#rill-chatbot button[aria-label='Submit']")
        until(lambda: finished_answers(server.url) == done + 1 and visitor.idle()
              and users.all_inner_texts() == ["edited message"] and bots.count() == 1,
              message=lambda: f"the edited message answered again (the chat shows {users.all_inner_texts()})")

        bots.last.hover()
        page.click("#rill-chatbot button[aria-label='Like']")
        lines = until(lambda: feedback.is_file() and feedback.read_text().splitlines()[liked_before:],
                      message="a feedback line")
        time.sleep(0.5)
        assert len(feedback.read_text().splitlines()) == liked_before + 1, "one like, one line"
        record = json.loads(lines[0])
        assert record["rating"] == "like" and record["model"] == server.health()["model"]
        assert record["conversation"] == [{"role": "user", "content": "edited message"}]
        assert record["answer"] and record["index"] == 1

        with page.expect_download(timeout=WAIT_S * 1000) as download:
            page.click("#rill-export")
        exported = json.loads(Path(download.value.path()).read_text())
        assert exported["title"] == "first conversation"
        assert exported["messages"] == [{"role": "user", "content": "edited message"},
                                        {"role": "assistant", "content": record["answer"]}]

        page.click("#rill-delete")
        until(lambda: visitor.user_text() == "second one" and bar.title() == "Renamed chat",
              message="the other conversation after the delete")
        assert bar.titles() == ["Renamed chat"]
        page.reload()  # the delete is kept too
        page.wait_for_selector("#rill-input textarea")
        until(lambda: visitor.user_text() == "second one", message="the remaining conversation after a reload")
        assert bar.titles() == ["Renamed chat"]
        assert visitor.dialogs == [] and visitor.foreign_requests == []
    finally:
        visitor.close()

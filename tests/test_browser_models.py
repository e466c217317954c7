"""The page's model picker in a real headless Chromium, on one server with two tiny random-weight
models (`--model` given twice): the model picked answers (its greedy answer, as it gives it alone),
the page says the model is loading while its first answer waits for the load, its state shows
loaded once it did, and each saved conversation selects its own model again; `--models-max 1`: a
message whose model must wait for room sees its place in line and what the load waits for."""

from __future__ import annotations

import threading

import httpx
import pytest

from tests.servers import slow_steps
from tests.test_browser import WAIT_S, Conversations, Page, browser, until, words  # noqa: F401 (fixture)

pytestmark = [pytest.mark.browser]

MAX_NEW_TOKENS = 12  # --max-new-tokens: the page's answers stay short
QUESTION = "Tell me a joke."


@pytest.fixture(scope="module")
def two_models(server_with, tiny_model):
    """The shared server of this module: the tiny Llama (the default) and the tiny Qwen2, one loaded at a time."""
    return server_with("--model", str(tiny_model("qwen2")), "--max-new-tokens", str(MAX_NEW_TOKENS),
                       "--models-max", "1", model=tiny_model("llama"))


def alone(path) -> str:
    """The model's greedy answer to QUESTION, served alone (engine.LLM in this process)."""
    from engine import LLM, SamplingParams

    llm = LLM(str(path))
    params = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0)
    return llm.chat([[{"role": "user", "content": QUESTION}]], params)[0].outputs[0].text


# every text the answer's stats line shows, kept as it changes (the load takes a second or two)
RECORD_STATS = """() => {
    const stats = document.querySelector('#rill-answer-stats');
    window.rillStatsSeen = [];
    new MutationObserver(() => window.rillStatsSeen.push(stats.innerText))
        .observe(stats, {childList: true, subtree: true, characterData: true});
}"""


class ModelPicker:
    """The page's "Model" Dropdown (#rill-model): its input shows the selected choice's label
    ("qwen2 · loaded"); its choices are read again from the server each time it takes the focus."""

    OPTIONS = "ul[role=listbox] li[role=option]"

    def __init__(self, page):
        self.page = page
        self.box = page.locator("#rill-model input")

    def choose(self, name: str):
        self.box.blur()
        self.box.click()
        option = self.page.locator(f"{self.OPTIONS}[aria-label^='{name} · ']")
        option.first.wait_for(state="visible", timeout=30_000)
        option.first.click(timeout=30_000)
        until(lambda: self.shown().startswith(f"{name} · "), timeout=30, message=f"the picker to show {name}")

    def shown(self) -> str:
        return self.box.input_value()

    def refreshed(self) -> str:
        """What the picker shows once it read the states again (focus), closed again."""
        self.box.blur()
        self.box.click()
        self.page.locator(self.OPTIONS).first.wait_for(state="visible", timeout=30_000)
        self.page.keyboard.press("Escape")
        self.box.blur()
        return self.shown()


def test_the_picked_model_answers_and_each_conversation_keeps_its_model(browser, two_models, tiny_model):
    url = two_models.url
    expected = {"qwen2": alone(tiny_model("qwen2")), "llama": alone(tiny_model("llama"))}
    assert words(expected["qwen2"]) != words(expected["llama"])  # the two models answer differently
    names = {m["id"]: m["status"]["value"] for m in httpx.get(f"{url}/v1/models", timeout=30).json()["data"]}
    qwen2 = next(name for name in names if name != next(iter(names)))  # the second model's name
    llama = next(iter(names))
    assert names[qwen2] == "unloaded"
    visitor = Page(browser, url)
    try:
        picker, bar = ModelPicker(visitor.page), Conversations(visitor.page)
        assert picker.shown() == f"{llama} · loaded"
        picker.choose(qwen2)
        visitor.page.evaluate(RECORD_STATS)
        visitor.send(QUESTION)
        until(lambda: visitor.bot_text() and visitor.idle(), message="the answer of the model picked")
        assert words(visitor.bot_text()) == words(expected["qwen2"])
        seen = visitor.page.evaluate("() => window.rillStatsSeen")
        assert any(f"Loading model {qwen2}" in text for text in seen), seen  # shown while its load was awaited
        until(lambda: picker.refreshed() == f"{qwen2} · loaded", timeout=30,
              message=lambda: f"the picker to show {qwen2} loaded (it shows {picker.shown()!r})")
        until(lambda: bar.title() == QUESTION, message="the first conversation saved")

        visitor.page.click("#rill-new")  # a second conversation, answered by the default model
        until(lambda: bar.title() == "New chat", message="the new conversation")
        picker.choose(llama)
        visitor.send(QUESTION)
        until(lambda: visitor.bot_text() and visitor.idle(), message="the default model's answer")
        assert words(visitor.bot_text()) == words(expected["llama"])
        until(lambda: bar.titles() == [QUESTION, QUESTION], message="the second conversation saved")

        bar.open()  # back to the first conversation (the older one, last in the list): its model is picked again
        visitor.page.locator(Conversations.OPTIONS).last.click(timeout=30_000)
        until(lambda: picker.shown().startswith(f"{qwen2} · "), timeout=30,
              message=lambda: f"the first conversation's model (the picker shows {picker.shown()!r})")
        assert words(visitor.bot_text()) == words(expected["qwen2"])
        bar.open()
        visitor.page.locator(Conversations.OPTIONS).first.click(timeout=30_000)
        until(lambda: picker.shown().startswith(f"{llama} · "), timeout=30,
              message=lambda: f"the second conversation's model (the picker shows {picker.shown()!r})")
        assert visitor.dialogs == [] and visitor.foreign_requests == []
    finally:
        visitor.close()


def test_a_message_waiting_for_its_model_sees_its_place_in_line(browser, two_models, tiny_model):
    """llama streams (its steps slowed); an API request for qwen2 waits for room, first in line; the
    page's message for qwen2 comes second and says so, and what the load waits for; both are answered
    once llama's stream ends."""
    url = two_models.url
    names = [m["id"] for m in httpx.get(f"{url}/v1/models", timeout=30).json()["data"]]
    llama, qwen2 = names
    expected = alone(tiny_model("qwen2"))
    ask = {"model": llama, "prompt": "hi", "max_tokens": 200, "ignore_eos": True, "stream": True}
    visitor = Page(browser, url)
    first: dict = {}

    def ask_qwen2():  # the first in line: an API client
        first["response"] = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
            "model": qwen2, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": MAX_NEW_TOKENS,
            "temperature": 0})

    def waiting() -> int:
        models = {m["id"]: m for m in httpx.get(f"{url}/v1/models", timeout=30).json()["data"]}
        return models[qwen2]["status"].get("waiting", 0)

    try:
        picker = ModelPicker(visitor.page)
        picker.choose(qwen2)
        visitor.page.evaluate(RECORD_STATS)
        with slow_steps(url, 0.2), httpx.stream("POST", f"{url}/v1/completions", json=ask, timeout=120) as stream:
            assert stream.status_code == 200
            lines = stream.iter_lines()  # kept: a dropped iterator closes the stream (the request aborted)
            next(lines)  # llama's stream runs: qwen2 must wait for it (--models-max 1)
            thread = threading.Thread(target=ask_qwen2)
            thread.start()
            until(lambda: waiting() == 1, message="the API request waiting for qwen2's load")
            visitor.send(QUESTION)
            def seen() -> list[str]:
                return visitor.page.evaluate("() => window.rillStatsSeen")

            until(lambda: any("2nd in line" in text for text in seen()),
                  message=lambda: f"the page's place in line (seen: {seen()})")
        # the stream closed: llama idle, unloaded; qwen2 loads and answers both
        until(lambda: visitor.bot_text() and visitor.idle(), message="the page's answer once qwen2 loaded")
        thread.join(120)
        place = next(text for text in seen() if "2nd in line" in text)
        assert place.startswith(f"Loading model {qwen2} · 2nd in line · waiting for {llama} to finish 1 request"), \
            seen()
        assert words(visitor.bot_text()) == words(expected)
        assert first["response"].status_code == 200, first["response"].text
        assert first["response"].json()["choices"][0]["message"]["content"] == expected
    finally:
        visitor.close()

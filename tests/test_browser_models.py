"""The page's model picker in a real headless Chromium, on one server with two tiny random-weight
models (`--model` given twice): the model picked answers (its greedy answer, as it gives it alone),
the page says the model is loading while its first answer waits for the load, its state shows
loaded once it did, and each saved conversation selects its own model again."""

from __future__ import annotations

import httpx
import pytest

from tests.test_browser import WAIT_S, Conversations, Page, browser, until, words  # noqa: F401 (fixture)

pytestmark = [pytest.mark.browser]

MAX_NEW_TOKENS = 12  # --max-new-tokens: the page's answers stay short
QUESTION = "Tell me a joke."


@pytest.fixture(scope="module")
def two_models(server_with, tiny_model):
    """The shared server of this module: the tiny Llama (the default) and the tiny Qwen2."""
    return server_with("--model", str(tiny_model("qwen2")), "--max-new-tokens", str(MAX_NEW_TOKENS),
                       model=tiny_model("llama"))


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

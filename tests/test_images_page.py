"""Images through the page's entrances, on the tiny Idefics3 server of tests/test_images.py (same
flags: one process): a PNG uploaded in Chromium, `gradio_client`'s `handle_file` on `/chat` and
the MCP `chat` tool's data URLs each get the greedy answer `/v1/chat/completions` gives for the
same picture and text; a file path the API names that was never uploaded, and an image to a text
model, are refused with what was wrong."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.test_browser import WAIT_S, Page, browser, until, words  # noqa: F401 (browser: the fixture)
from tests.test_images import IMAGE_BYTES_LIMIT, MAX_NEW, _data_url, _png
from tests.tiny_vision import test_image

QUESTION = "What is this?"
GREEDY = dict(system_prompt="", temperature=0.0, top_p=1.0, top_k=0, max_new_tokens=MAX_NEW, repetition_penalty=1.0)


@pytest.fixture(scope="module")
def vlm_server(server_with, tiny_vlm):
    return server_with("--max-image-bytes", str(IMAGE_BYTES_LIMIT), model=tiny_vlm)


def route_answer(url: str, png: bytes, question: str = QUESTION) -> str:
    """The greedy answer of /v1/chat/completions about the picture."""
    parts = [{"type": "image_url", "image_url": {"url": _data_url(png)}}, {"type": "text", "text": question}]
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": parts}],
                                                        "max_tokens": MAX_NEW, "temperature": 0}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


@pytest.fixture
def picture_file(tmp_path):
    """(a small PNG's path, its bytes)."""
    png = _png(test_image(7))
    path = tmp_path / "picture.png"
    path.write_bytes(png)
    return path, png


@pytest.mark.browser
def test_page_uploads_a_picture_and_answers_as_the_route_does(browser, vlm_server, picture_file):  # noqa: F811
    path, png = picture_file
    want = route_answer(vlm_server.url, png)
    assert want.strip(), "the tiny model's greedy answer must have some text to compare"
    visitor = Page(browser, vlm_server.url)
    try:
        visitor.open_settings()
        for elem_id, value in {"rill-temperature": "0", "rill-repetition-penalty": "1",
                               "rill-max-new-tokens": str(MAX_NEW)}.items():
            visitor.set_slider(elem_id, value)
        visitor.close_settings()
        visitor.page.set_input_files("#rill-input input[type=file]", str(path))
        until(lambda: visitor.page.locator("#rill-input img").count() == 1, message="the upload's thumbnail")
        visitor.send(QUESTION)
        until(lambda: visitor.idle() and visitor.bot_text(), message="the answer to finish")
        until(lambda: words(visitor.bot_text()) == words(want), timeout=30,
              message=lambda: f"the page's answer {visitor.bot_text()!r} to be the route's {want!r}")
        user = visitor.page.locator("#rill-chatbot [data-testid='user']")
        assert user.locator("img").count() == 1  # the picture shows in the conversation
        assert QUESTION in user.last.inner_text()
        shown = user.locator("img").first.get_attribute("src")
        visitor.page.reload()  # the saved conversation keeps its picture
        visitor.page.wait_for_selector("#rill-input textarea", timeout=WAIT_S * 1000)
        until(lambda: user.locator("img").count() == 1 and QUESTION in user.last.inner_text(),
              message="the picture and the question in the saved conversation after a reload")
        until(lambda: user.locator("img").first.evaluate("img => img.complete && img.naturalWidth") == 50,
              message="the saved picture to load (50 pixels wide)")
        assert user.locator("img").first.get_attribute("src") == shown
        assert visitor.dialogs == [] and visitor.foreign_requests == []
    finally:
        visitor.close()


def test_gradio_client_sends_a_picture_with_handle_file(vlm_server, tiny_server, picture_file):
    from gradio_client import Client, handle_file
    from gradio_client.exceptions import AppError

    path, png = picture_file
    client = Client(vlm_server.url + "/", verbose=False)
    answer = client.predict(message=QUESTION, history=[], **GREEDY, images=[handle_file(str(path))], api_name="/chat")
    assert answer == route_answer(vlm_server.url, png)
    other = _png(test_image(8))
    (path.parent / "other.png").write_bytes(other)
    assert client.predict(message=QUESTION, history=[], **GREEDY, images=[handle_file(str(path.parent / "other.png"))],
                          api_name="/chat") == route_answer(vlm_server.url, other)
    text_model = Client(tiny_server.url + "/", verbose=False)
    with pytest.raises(AppError, match="takes text only"):
        text_model.predict(message=QUESTION, history=[], **GREEDY, images=[handle_file(str(path))], api_name="/chat")


def test_the_chat_api_reads_no_file_that_was_not_uploaded(vlm_server):
    """A FileData naming a server path outside Gradio's upload folder (no gradio_client: it would upload
    the file) is refused before anything reads it (ui/page.py marks the mounted page launched, so Gradio
    checks where an input's files are; ui/history.py checks again)."""
    data = ["What is this?", [], "", 0.0, 1.0, 0, MAX_NEW, 1.0,
            [{"path": "/etc/hostname", "meta": {"_type": "gradio.FileData"}}]]
    r = httpx.post(f"{vlm_server.url}/gradio_api/call/chat", json={"data": data}, timeout=60)
    assert r.status_code == 200, r.text
    events = httpx.get(f"{vlm_server.url}/gradio_api/call/chat/{r.json()['event_id']}", timeout=120).text
    assert "event: error" in events, events
    with open("/etc/hostname", "rb") as file:  # a mounted Blocks copied it into the cache and read it
        assert "first bytes" not in events and repr(file.read(8))[2:-1] not in events, events


def test_mcp_chat_takes_image_data_urls(vlm_server, picture_file):
    pytest.importorskip("mcp")
    from tests.test_mcp import run_mcp

    _, png = picture_file

    async def work(session):
        good = await session.call_tool("chat", {"message": QUESTION, "temperature": 0, "max_new_tokens": MAX_NEW,
                                                "images": [_data_url(png)]})
        refused = await session.call_tool("chat", {"message": QUESTION, "images": ["https://example.com/a.png"]})
        return good, refused

    with ThreadPoolExecutor(1) as thread:  # a loop of its own: Playwright's sync API holds this thread's
        good, refused = thread.submit(run_mcp, vlm_server.url, work).result()
    assert not good.isError, good.content
    assert "".join(part.text for part in good.content if part.type == "text") == route_answer(vlm_server.url, png)
    assert refused.isError and "--allowed-media-domains" in json.dumps([p.text for p in refused.content])



def test_editing_a_message_keeps_its_pictures(tmp_path):
    """The Chatbot's edit of a user message with a picture: the new text after the same picture (the
    answer is generated again about it), as the page's history then sends it to the model."""
    from types import SimpleNamespace

    from gradio.utils import get_upload_folder

    from ui.conversations import edited
    from ui.history import to_engine_messages

    upload = f"{get_upload_folder()}/rill-test/picture.png"
    history = [{"role": "user", "content": [{"type": "file", "file": {"path": upload}},
                                            {"type": "text", "text": "What is this?"}]},
               {"role": "assistant", "content": [{"type": "text", "text": "a cat"}]}]
    new = edited(history, SimpleNamespace(index=0, value="And the colour?"))[0]
    assert to_engine_messages(new, escaped=True, images=True) == [
        {"role": "user", "content": [{"type": "image_file", "path": upload}, {"type": "text", "text": "And the colour?"}]}]


def test_an_export_keeps_the_conversations_pictures(tmp_path):
    """The Export button's JSON carries each uploaded picture as an image_url part with its bytes (a
    data: URL, so the export can be sent to /v1/chat/completions); a picture gone from the server is
    named as gone; a path outside Gradio's upload folder (the store comes from the browser) is never
    read: that export has the text alone."""
    import base64
    import secrets
    from pathlib import Path

    from gradio.utils import get_upload_folder

    from ui.conversations import _export_file

    folder = Path(get_upload_folder()) / f"rill-test-{secrets.token_hex(6)}"
    folder.mkdir(parents=True)
    png = _png(test_image(9))
    (folder / "picture.png").write_bytes(png)
    outside = tmp_path / "secret.png"
    outside.write_bytes(png)

    def export(path) -> list[dict]:
        messages = [{"role": "user", "content": {"path": str(path), "mime_type": "image/png"}},
                    {"role": "user", "content": QUESTION}, {"role": "assistant", "content": "A picture."}]
        item = {"id": "0123456789ab", "title": "pictures", "messages": messages}
        return json.loads(Path(_export_file(item)).read_text())["messages"]

    try:
        first = export(folder / "picture.png")
        assert first[0]["content"][0] == {"type": "image_url", "image_url": {
            "url": "data:image/png;base64," + base64.b64encode(png).decode()}}
        assert [m["content"] for m in first[1:]] == [QUESTION, "A picture."]
        (folder / "picture.png").unlink()
        assert export(folder / "picture.png")[0]["content"][0] == {"type": "text",
                                                                    "text": "[an image no longer on the server]"}
        hostile = export(outside)
        assert [m["content"] for m in hostile] == [QUESTION, "A picture."]  # no image read from outside
    finally:
        import shutil

        shutil.rmtree(folder, ignore_errors=True)

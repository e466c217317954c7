"""A visitor's conversations, kept in their browser (`gr.BrowserState`, encrypted localStorage) across
reloads: a list to switch, new, rename, delete, and export one as JSON.

The store is plain data: {"current": id, "items": [{"id", "title", "messages"}]}, the messages as
the Chatbot holds them (HTML-escaped text). Every handler takes the store and gives back a new one.
"""

from __future__ import annotations

import json
import re
import secrets
import tempfile
from pathlib import Path

import gradio as gr

from ui.history import ChatError, content_text, to_engine_messages
from ui.markup import unescape_html

NEW_TITLE = "New chat"
MAX_CONVERSATIONS = 50  # kept per browser; past it the oldest go
TITLE_CHARS = 40
EXPORT_DIR = Path(tempfile.gettempdir()) / "rill-exports"


def _new_item() -> dict:
    return {"id": secrets.token_hex(6), "title": NEW_TITLE, "messages": []}


def _valid(store) -> dict:
    """The store as saved, or a fresh one (first visit, or something unreadable in the browser)."""
    if isinstance(store, dict) and isinstance(store.get("items"), list) and store["items"] and all(
            isinstance(i, dict) and {"id", "title", "messages"} <= set(i) for i in store["items"]):
        if any(i["id"] == store.get("current") for i in store["items"]):
            return store
        return {**store, "current": store["items"][0]["id"]}
    item = _new_item()
    return {"current": item["id"], "items": [item]}


def _current(store: dict) -> dict:
    return next(i for i in store["items"] if i["id"] == store["current"])


def _title_of(messages: list) -> str:
    for message in messages:
        if isinstance(message, dict) and message.get("role") == "user":
            text = " ".join(unescape_html(content_text(message.get("content"))).split())
            return text[:TITLE_CHARS] + ("…" if len(text) > TITLE_CHARS else "")
    return NEW_TITLE


def picker_update(store: dict):
    """The conversation list: newest first, the current one selected."""
    return gr.update(choices=[(i["title"], i["id"]) for i in reversed(store["items"])], value=store["current"])


def _export_file(item: dict) -> str | None:
    """The conversation as a JSON file (plain text messages) for the Export button; None when empty."""
    try:
        messages = to_engine_messages(item["messages"], escaped=True)
    except ChatError:
        messages = []
    if not messages:
        return None
    EXPORT_DIR.mkdir(parents=True, exist_ok=True)
    name = re.sub(r"[^A-Za-z0-9_-]+", "-", item["title"]).strip("-")[:40] or "conversation"
    path = EXPORT_DIR / f"rill-{name}-{item['id']}.json"
    path.write_text(json.dumps({"title": item["title"], "messages": messages}, ensure_ascii=False, indent=2))
    return str(path)


def _shown(store: dict):
    """(chatbot, store, picker, title box, export button, answer stats) showing the current conversation
    (the last answer's stats cleared: they were another conversation's)."""
    item = _current(store)
    return item["messages"], store, picker_update(store), item["title"], gr.update(value=_export_file(item)), ""


def restore(store):
    """Page load: the visitor's last conversation."""
    return _shown(_valid(store))


def save(history, store):
    """After each change to the chat: the current conversation's messages (its title from its
    first message while it has none of its own)."""
    store = _valid(store)
    item = dict(_current(store), messages=list(history or []))
    if item["title"] == NEW_TITLE:
        item["title"] = _title_of(item["messages"])
    store = {**store, "items": [item if i["id"] == item["id"] else i for i in store["items"]]}
    return store, picker_update(store), item["title"], gr.update(value=_export_file(item))


def switch(chosen, history, store):
    """The list's choice: the chat shown becomes that conversation.

    Gradio's Dropdown also fires `input` each time it loses focus, chosen or not: choosing the
    conversation already shown changes nothing (all outputs skipped). Answering with the store it
    was sent would undo whatever another event (New chat, an answer's save) changed meanwhile."""
    if isinstance(store, dict) and chosen == store.get("current"):
        return (gr.skip(),) * 6
    store, *_ = save(history, store)
    if any(i["id"] == chosen for i in store["items"]):
        store = {**store, "current": chosen}
    return _shown(store)


def new(history, store):
    store, *_ = save(history, store)
    if not _current(store)["messages"]:
        return _shown(store)  # the current one is already empty
    item = _new_item()
    store = {"current": item["id"], "items": (store["items"] + [item])[-MAX_CONVERSATIONS:]}
    return _shown(store)


def rename(title, store):
    store = _valid(store)
    title = " ".join((title or "").split())[:80] or NEW_TITLE
    items = [dict(i, title=title) if i["id"] == store["current"] else i for i in store["items"]]
    store = {**store, "items": items}
    return store, picker_update(store)


def delete(store):
    """Deletes the current conversation; the newest other one is shown (or a new empty one)."""
    store = _valid(store)
    items = [i for i in store["items"] if i["id"] != store["current"]]
    if not items:
        items = [_new_item()]
    return _shown({"current": items[-1]["id"], "items": items})


def edited(history, event: gr.EditData):
    """The Chatbot's `edit` event on a user message: the conversation up to it, with its new text
    (escaped, as sent messages are); the answer is generated again from there."""
    from ui.handlers import GENERATING
    from ui.markup import escape_html

    history = list(history or [])
    index = event.index[0] if isinstance(event.index, (list, tuple)) else event.index
    text = content_text(event.value)
    if not isinstance(index, int) or not 0 <= index < len(history) or not text.strip():
        raise gr.Error("That message cannot be edited: give it some text.")
    return (history[:index] + [{"role": "user", "content": escape_html(unescape_html(text))}],) + GENERATING


def conversation_bar():
    """The conversation controls above the chat (inside an open Blocks) and the browser's store."""
    from types import SimpleNamespace

    bar = SimpleNamespace(store=gr.BrowserState(None, storage_key="rill-conversations"))
    with gr.Row(equal_height=True, elem_id="rill-conversation-bar"):
        bar.picker = gr.Dropdown(label="Conversations", choices=[], scale=4, elem_id="rill-conversations",
                                 interactive=True)
        bar.title = gr.Textbox(label="Title", scale=3, max_lines=1, elem_id="rill-title")
        with gr.Column(scale=2, min_width=160):
            with gr.Row():
                bar.rename = gr.Button("Rename", size="sm", elem_id="rill-rename")
                bar.new = gr.Button("New chat", size="sm", elem_id="rill-new")
            with gr.Row():
                bar.delete = gr.Button("Delete", size="sm", variant="stop", elem_id="rill-delete")
                bar.export = gr.DownloadButton("Export JSON", size="sm", value=None, elem_id="rill-export")
    return bar


def wire_conversations(demo, bar, chatbot, answer_stats) -> dict:
    """Load, switch, new, rename, delete; returns the `save` step's kwargs, for page.py to run after
    every change to the chat (an answer, undo, clear)."""
    private = dict(api_visibility="private", queue=False)
    shown = [chatbot, bar.store, bar.picker, bar.title, bar.export, answer_stats]
    demo.load(restore, [bar.store], shown, **private)
    bar.picker.input(switch, [bar.picker, chatbot, bar.store], shown, **private)
    bar.new.click(new, [chatbot, bar.store], shown, **private)
    bar.delete.click(delete, [bar.store], shown, **private)
    bar.rename.click(rename, [bar.title, bar.store], [bar.store, bar.picker], **private)
    bar.title.submit(rename, [bar.title, bar.store], [bar.store, bar.picker], **private)
    return dict(fn=save, inputs=[chatbot, bar.store], outputs=[bar.store, bar.picker, bar.title, bar.export],
                **private)

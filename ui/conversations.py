"""A visitor's conversations, kept in their browser (`gr.BrowserState`, encrypted localStorage) across
reloads: a list to switch, new, rename, delete, and export one as JSON.

The store is plain data: {"current": id, "items": [{"id", "title", "messages", "model"?}]}, the
messages as the Chatbot holds them (HTML-escaped text), "model" the one that last answered when the
server serves several (switching back to a conversation picks it again). Every handler takes the
store and gives back a new one.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import secrets
import shutil
import tempfile
import threading
import time
from pathlib import Path

import gradio as gr

from ui.history import ChatError, content_text, file_path, to_engine_messages
from ui.markup import unescape_html

NEW_TITLE = "New chat"
MAX_CONVERSATIONS = 50  # kept per browser; past it the oldest go
TITLE_CHARS = 40
EXPORT_TTL_S = 3600.0  # an export file older than this is removed at the next export (Gradio serves its copy)
EXPORT_MAX_FILES = 8  # per page session; the oldest go first
EXPORT_MAX_BYTES = 8 * 1024 * 1024  # per page session; a larger conversation gets no export file
_ID = re.compile(r"^[0-9a-f]{12}$")  # a conversation id as `_new_item` makes it


def _new_item() -> dict:
    return {"id": secrets.token_hex(6), "title": NEW_TITLE, "messages": []}


def _valid_item(item) -> dict | None:
    """An item of the browser's store with the shapes the handlers rely on (an id of another shape
    gets a fresh one), or None when it is not an item at all."""
    if not isinstance(item, dict) or not {"id", "title", "messages"} <= set(item):
        return None
    title = item["title"] if isinstance(item["title"], str) else NEW_TITLE
    messages = item["messages"] if isinstance(item["messages"], list) else []
    if "model" in item and not isinstance(item["model"], str):
        item = {k: v for k, v in item.items() if k != "model"}
    if isinstance(item["id"], str) and _ID.match(item["id"]) and title is item["title"] and messages is item["messages"]:
        return item
    return {**item, "id": item["id"] if isinstance(item["id"], str) and _ID.match(item["id"]) else secrets.token_hex(6),
            "title": title, "messages": messages}


def _valid(store) -> dict:
    """The store as saved, or a fresh one (first visit, or something unreadable in the browser)."""
    if isinstance(store, dict) and isinstance(store.get("items"), list) and store["items"]:
        items = [_valid_item(i) for i in store["items"][-MAX_CONVERSATIONS:]]
        if all(i is not None for i in items):
            if len({i["id"] for i in items}) < len(items):  # a repeated id: each made unique
                items = [dict(i, id=secrets.token_hex(6)) for i in items]
            store = {**store, "items": items}
            if any(i["id"] == store.get("current") for i in items):
                return store
            return {**store, "current": items[-1]["id"]}
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


class Exports:
    """Export files: one folder per page session (mode 0700; its name a keyed hash of the session)
    under a private root made at first use (mkdtemp: 0700), files mode 0600 named by the server.
    Each export sweeps files older than EXPORT_TTL_S everywhere, and keeps its session within
    EXPORT_MAX_FILES and EXPORT_MAX_BYTES (oldest removed first). Gradio serves the download from
    its own copy (made when the handler returns), so removing ours never breaks a download."""

    def __init__(self):
        self._lock = threading.Lock()
        self._root: Path | None = None
        self._secret = secrets.token_bytes(32)

    def root(self) -> Path:
        if self._root is None or not self._root.is_dir():
            self._root = Path(tempfile.mkdtemp(prefix="rill-exports-"))
        return self._root

    def folder(self, session: str | None) -> Path:
        key = hashlib.blake2b((session or "").encode(), key=self._secret, digest_size=16).hexdigest()
        return self.root() / key

    def write(self, session: str | None, title: str, messages: list[dict]) -> str | None:
        data = json.dumps({"title": title, "messages": messages}, ensure_ascii=False, indent=2).encode("utf-8")
        if len(data) > EXPORT_MAX_BYTES:
            return None  # the session's quota could not hold it
        with self._lock:
            self._sweep(time.time())
            folder = self.folder(session)
            folder.mkdir(mode=0o700, exist_ok=True)
            self._make_room(folder, len(data))
            name = f"rill-chat-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{secrets.token_hex(4)}.json"
            path = folder / name
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as file:
                file.write(data)
        return str(path)

    def _sweep(self, now: float) -> None:
        """Files past EXPORT_TTL_S removed, and the folders they leave empty."""
        for folder in list(self.root().iterdir()):
            for path in list(folder.iterdir()) if folder.is_dir() else []:
                try:
                    if now - path.stat().st_mtime > EXPORT_TTL_S:
                        path.unlink()
                except OSError:
                    pass
            try:
                folder.rmdir()  # only when empty
            except OSError:
                pass

    @staticmethod
    def _make_room(folder: Path, size: int) -> None:
        files = sorted(((p.stat().st_mtime, p.stat().st_size, p) for p in folder.iterdir()), key=lambda f: f[0])
        total = sum(f[1] for f in files)
        while files and (len(files) >= EXPORT_MAX_FILES or total + size > EXPORT_MAX_BYTES):
            _mtime, old_size, path = files.pop(0)
            path.unlink(missing_ok=True)
            total -= old_size

    def drop(self, session: str | None) -> None:
        """The session ended: its folder goes."""
        if self._root is not None and session:
            with self._lock:
                shutil.rmtree(self.folder(session), ignore_errors=True)


EXPORTS = Exports()


def drop_exports(request: gr.Request = None) -> None:
    """The page session ended (its tab closed): its export files are removed."""
    EXPORTS.drop(getattr(request, "session_hash", None))


IMAGE_TYPES = {b"\x89PNG": "image/png", b"\xff\xd8\xff": "image/jpeg", b"GIF8": "image/gif", b"RIFF": "image/webp"}


def _image_url_part(part: dict) -> dict:
    """An uploaded picture of the conversation as an `image_url` part with its bytes in a data: URL (the
    export can be sent to /v1/chat/completions as it is); a picture no longer on the server (uploads
    are kept an hour) as a text part saying so."""
    try:
        data = Path(part["path"]).read_bytes()
    except OSError:
        return {"type": "text", "text": "[an image no longer on the server]"}
    media = next((kind for magic, kind in IMAGE_TYPES.items() if data.startswith(magic)), "application/octet-stream")
    return {"type": "image_url", "image_url": {"url": f"data:{media};base64,{base64.b64encode(data).decode()}"}}


def _export_file(item: dict, request=None) -> str | None:
    """The conversation as a JSON file for the Export button (its uploaded pictures as data: URLs, see
    `_image_url_part`); None when empty."""
    try:
        messages = to_engine_messages(item["messages"], escaped=True, images=True)
    except ChatError:  # a file outside the upload folder (the store comes from the browser): text only
        try:
            messages = to_engine_messages(item["messages"], escaped=True)
        except ChatError:
            messages = []
    messages = [{**m, "content": [_image_url_part(p) if p.get("type") == "image_file" else p for p in m["content"]]}
                if isinstance(m["content"], list) else m for m in messages]
    if not messages:
        return None
    return EXPORTS.write(getattr(request, "session_hash", None), item["title"], messages)


def _shown(store: dict, request=None):
    """(chatbot, store, picker, title box, export button, answer stats) showing the current conversation
    (the last answer's stats cleared: they were another conversation's)."""
    item = _current(store)
    return (item["messages"], store, picker_update(store), item["title"],
            gr.update(value=_export_file(item, request)), "")


def restore(store, request: gr.Request = None):
    """Page load: the visitor's last conversation."""
    return _shown(_valid(store), request)


def _saved(history, store, model: str | None = None) -> tuple[dict, dict]:
    """The store with the current conversation's messages (its title from its first message while
    it has none of its own; `model`: the one picked when it was saved), and that conversation."""
    store = _valid(store)
    item = dict(_current(store), messages=list(history) if isinstance(history, list) else [])
    if model:
        item["model"] = model
    if item["title"] == NEW_TITLE:
        item["title"] = _title_of(item["messages"])
    return {**store, "items": [item if i["id"] == item["id"] else i for i in store["items"]]}, item


def save(history, store, request: gr.Request = None):
    """After each change to the chat: the current conversation saved, its export file made again."""
    store, item = _saved(history, store)
    return store, picker_update(store), item["title"], gr.update(value=_export_file(item, request))


def switch(chosen, history, store, request: gr.Request = None):
    """The list's choice: the chat shown becomes that conversation.

    Gradio's Dropdown also fires `input` each time it loses focus, chosen or not: choosing the
    conversation already shown changes nothing (all outputs skipped). Answering with the store it
    was sent would undo whatever another event (New chat, an answer's save) changed meanwhile."""
    if isinstance(store, dict) and chosen == store.get("current"):
        return (gr.skip(),) * 6
    store, _item = _saved(history, store)
    if any(i["id"] == chosen for i in store["items"]):
        store = {**store, "current": chosen}
    return _shown(store, request)


def new(history, store, request: gr.Request = None):
    store, _item = _saved(history, store)
    if not _current(store)["messages"]:
        return _shown(store, request)  # the current one is already empty
    item = _new_item()
    store = {"current": item["id"], "items": (store["items"] + [item])[-MAX_CONVERSATIONS:]}
    return _shown(store, request)


def rename(title, store):
    store = _valid(store)
    title = " ".join((title if isinstance(title, str) else "").split())[:80] or NEW_TITLE
    items = [dict(i, title=title) if i["id"] == store["current"] else i for i in store["items"]]
    store = {**store, "items": items}
    return store, picker_update(store)


def delete(store, request: gr.Request = None):
    """Deletes the current conversation; the newest other one is shown (or a new empty one)."""
    store = _valid(store)
    items = [i for i in store["items"] if i["id"] != store["current"]]
    if not items:
        items = [_new_item()]
    return _shown({"current": items[-1]["id"], "items": items}, request)


def edited(history, event: gr.EditData):
    """The Chatbot's `edit` event on a user message: the conversation up to it, with its new text
    (escaped, as sent messages are) and its pictures; the answer is generated again from there."""
    from ui.handlers import GENERATING
    from ui.markup import escape_html

    history = list(history or [])
    index = event.index[0] if isinstance(event.index, (list, tuple)) else event.index
    text = content_text(event.value)
    if not isinstance(index, int) or not 0 <= index < len(history) or not text.strip():
        raise gr.Error("That message cannot be edited: give it some text.")
    parts = history[index].get("content") if isinstance(history[index], dict) else None
    files = [{"path": file_path(part)} for part in (parts if isinstance(parts, list) else [parts]) if file_path(part)]
    text = escape_html(unescape_html(text))  # its pictures stay before the new text
    return (history[:index] + [{"role": "user", "content": files + [text] if files else text}],) + GENERATING


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


def _model_shown(outputs: tuple, served) -> tuple:
    """`_shown`'s outputs and the model picker's: the shown conversation's model when it has one the
    server still serves, else the picker as it is."""
    store = outputs[1]
    if not isinstance(store, dict) or "items" not in store:  # every output skipped (gr.skip())
        return (*outputs, gr.skip())
    model = _current(store).get("model")
    return (*outputs, gr.update(value=model) if model in served() else gr.skip())


def wire_conversations(demo, bar, chatbot, answer_stats, model=None, served=None) -> dict:
    """Load, switch, new, rename, delete; returns the `save` step's kwargs, for page.py to run after
    every change to the chat (an answer, undo, clear). `model`: the page's model picker (several
    models; `served()` their names): each conversation saves the model picked and selects it again
    when shown."""
    private = dict(api_visibility="private", queue=False)
    shown = [chatbot, bar.store, bar.picker, bar.title, bar.export, answer_stats]
    saved = [bar.store, bar.picker, bar.title, bar.export]
    if model is None:
        on_load, on_switch, on_new, on_delete, on_save = restore, switch, new, delete, save
    else:
        shown.append(model)

        def on_load(store, request: gr.Request = None):
            return _model_shown(restore(store, request), served)

        def on_switch(chosen, history, store, request: gr.Request = None):
            return _model_shown(switch(chosen, history, store, request), served)

        def on_new(history, store, request: gr.Request = None):
            return _model_shown(new(history, store, request), served)

        def on_delete(store, request: gr.Request = None):
            return _model_shown(delete(store, request), served)

        def on_save(history, store, picked, request: gr.Request = None):
            store, item = _saved(history, store, picked)
            return store, picker_update(store), item["title"], gr.update(value=_export_file(item, request))

    demo.load(on_load, [bar.store], shown, **private)
    bar.picker.input(on_switch, [bar.picker, chatbot, bar.store], shown, **private)
    bar.new.click(on_new, [chatbot, bar.store], shown, **private)
    bar.delete.click(on_delete, [bar.store], shown, **private)
    bar.rename.click(rename, [bar.title, bar.store], [bar.store, bar.picker], **private)
    bar.title.submit(rename, [bar.title, bar.store], [bar.store, bar.picker], **private)
    inputs = [chatbot, bar.store] if model is None else [chatbot, bar.store, model]
    return dict(fn=on_save, inputs=inputs, outputs=saved, **private)

"""Likes and dislikes on the page's answers, appended as JSON lines to `feedback.jsonl` in a folder
the owner sets (`--feedback-dir` / `FEEDBACK_DIR`; on a Space, /data/feedback when its persistent
storage is mounted at /data: the default disk is wiped on restart). Without a folder none is kept
and the page shows no thumbs."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path

import gradio as gr

from ui.history import ChatError, content_text, to_engine_messages
from ui.markup import unescape_html

log = logging.getLogger("rill")
SPACE_STORAGE = Path("/data")  # a Space's persistent storage, when the owner added it
FILE_NAME = "feedback.jsonl"


def feedback_folder(setting: str | None, space_storage: Path = SPACE_STORAGE) -> Path | None:
    """The folder the setting names; unset: /data/feedback where /data is a writable folder, else None."""
    if setting:
        return Path(setting).expanduser()
    if space_storage.is_dir() and os.access(space_storage, os.W_OK):
        return space_storage / "feedback"
    return None


class FeedbackLog:
    """Appends one JSON line per like/dislike: the time, the model, the rating, the answer rated
    and the conversation up to it (plain text, as the engine saw it)."""

    def __init__(self, folder: Path, model_name: str):
        self.path = folder / FILE_NAME
        self.model_name = model_name
        self._lock = threading.Lock()  # lines from concurrent visitors never interleave

    def record(self, history, event: gr.LikeData) -> None:
        """The Chatbot's `like` event: its `index` in the history, the `value` rated and `liked`
        (True, False, or a custom option's text)."""
        index = event.index[0] if isinstance(event.index, (list, tuple)) else event.index
        history = list(history or [])
        try:
            before = to_engine_messages(history[:index] if isinstance(index, int) else history, escaped=True)
        except ChatError:
            before = []
        answer = unescape_html(content_text(event.value.get("value") if isinstance(event.value, dict)
                                            else event.value))
        rating = {True: "like", False: "dislike"}.get(event.liked, event.liked)
        line = {"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "model": self.model_name,
                "rating": rating, "answer": answer, "conversation": before, "index": index}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self._lock, self.path.open("a", encoding="utf-8") as file:
                file.write(json.dumps(line, ensure_ascii=False) + "\n")
        except OSError as exc:
            log.warning("feedback not saved to %s: %s", self.path, exc)
            raise gr.Error("Your feedback could not be saved (the server's feedback folder is not writable).") from None

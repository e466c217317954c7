"""Likes and dislikes on the page's answers, appended as JSON lines to `feedback.jsonl` in a folder
the owner sets (`--feedback-dir` / `FEEDBACK_DIR`; on a Space, /data/feedback when its persistent
storage is mounted at /data: the default disk is wiped on restart). Without a folder none is kept
and the page shows no thumbs.

A record holds what the server streamed, never what the browser posts: `ServedAnswers` keeps each
page session's last answers (by message index), and a rating names one of them. Bounded: a size
per record, a rate per session, and the file rotated past a size (a few old files kept)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from pathlib import Path

import gradio as gr

from ui.history import content_text
from ui.markup import unescape_html

log = logging.getLogger("rill")
SPACE_STORAGE = Path("/data")  # a Space's persistent storage, when the owner added it
FILE_NAME = "feedback.jsonl"

ANSWERS_PER_SESSION = 64  # a session's latest answered messages that can be rated
MAX_KEPT_CHARS = 32_000_000  # all sessions' kept answers together (least recently answered dropped first)
MAX_ANSWER_CHARS = 16_000  # of one rated answer, kept and recorded
MAX_CONVERSATION_CHARS = 16_000  # of the conversation before it (its latest messages kept)
MAX_RECORD_BYTES = 64 * 1024  # one JSON line at most (shortened further if needed)
RATINGS_PER_MINUTE = 30  # per page session; past it a rating is refused with a warning
MAX_FILE_BYTES = 10 * 1024 * 1024  # feedback.jsonl is rotated to feedback.jsonl.1 past this
ROTATED_FILES = 5  # feedback.jsonl.1 .. .5 kept; the oldest is dropped


def feedback_folder(setting: str | None, space_storage: Path = SPACE_STORAGE) -> Path | None:
    """The folder the setting names; unset: /data/feedback where /data is a writable folder, else None."""
    if setting:
        return Path(setting).expanduser()
    if space_storage.is_dir() and os.access(space_storage, os.W_OK):
        return space_storage / "feedback"
    return None


def _digest(text: str) -> str:
    """What identifies a whole answer, whitespace aside (the Chatbot may trim it): the kept text is
    capped, so an answer is recognised by this, never by the capped text."""
    return hashlib.sha256(" ".join(text.split()).encode()).hexdigest()


def _capped(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + "…"


def _capped_conversation(messages: list[dict], limit: int) -> list[dict]:
    """The latest messages within `limit` characters (the last one cut if it alone is longer)."""
    kept, total = [], 0
    for message in reversed(messages):
        text = message["content"]
        if total + len(text) > limit:
            if not kept:
                kept.append({"role": message["role"], "content": _capped(text, limit)})
            break
        kept.append(message)
        total += len(text)
    return kept[::-1]


@dataclass(frozen=True, slots=True)
class Served:
    """One message the server streamed: its place in the chat, its plain text, what came before it."""

    index: int
    text: str  # capped at MAX_ANSWER_CHARS
    conversation: tuple
    digest: str = ""  # of the whole text (`_digest`)

    @property
    def chars(self) -> int:
        return len(self.text) + sum(len(m["content"]) for m in self.conversation)


class _Session:
    __slots__ = ("answers", "ratings")

    def __init__(self):
        self.answers: deque[Served] = deque(maxlen=ANSWERS_PER_SESSION)
        self.ratings: deque[float] = deque(maxlen=RATINGS_PER_MINUTE)  # times of the latest ratings


class ServedAnswers:
    """The answers each page session was streamed (thread-safe), bounded per session and in all."""

    def __init__(self, max_chars: int = MAX_KEPT_CHARS):
        self.max_chars = max_chars
        self._lock = threading.Lock()
        self._sessions: OrderedDict[str, _Session] = OrderedDict()  # least recently answered first
        self._chars = 0

    def add(self, session: str | None, index: int, messages: list[dict], conversation: list[dict]) -> None:
        """The page streamed `messages` (the Chatbot's, escaped) at `index` after `conversation`
        (plain messages, as the engine saw them)."""
        if not session:
            return
        before = tuple(_capped_conversation(conversation, MAX_CONVERSATION_CHARS))
        texts = [unescape_html(content_text(m.get("content"))) for m in messages]
        served = [Served(index + offset, _capped(text, MAX_ANSWER_CHARS), before, _digest(text))
                  for offset, text in enumerate(texts)]
        with self._lock:
            state = self._sessions.pop(session, None) or _Session()
            self._sessions[session] = state
            for item in served:
                # an answer generated again at the same place (retry, edit) replaces the earlier one's entry
                for old in [a for a in state.answers if a.index == item.index and a.conversation == item.conversation]:
                    state.answers.remove(old)
                    self._chars -= old.chars
                if len(state.answers) == state.answers.maxlen:
                    self._chars -= state.answers[0].chars
                state.answers.append(item)
                self._chars += item.chars
            while self._chars > self.max_chars and self._sessions:
                oldest = next(iter(self._sessions.values()))
                if not oldest.answers:
                    self._sessions.popitem(last=False)
                    continue
                self._chars -= oldest.answers.popleft().chars

    def find(self, session: str | None, index, shown: str) -> Served | None:
        """The session's answer at `index` whose text is the one the page shows; None: not one the
        server streamed to this session (forged, or too old to be kept)."""
        if not session or not isinstance(index, int):
            return None
        with self._lock:
            state = self._sessions.get(session)
            answers = list(state.answers) if state is not None else []
        digest = _digest(shown)
        return next((a for a in reversed(answers) if a.index == index and a.digest == digest), None)

    def allow_rating(self, session: str, now: float) -> bool:
        """Counts a rating of `session`; False past RATINGS_PER_MINUTE in the last minute."""
        with self._lock:
            state = self._sessions.get(session)
            if state is None:
                return False
            ratings = state.ratings
            if len(ratings) == ratings.maxlen and now - ratings[0] < 60.0:
                return False
            ratings.append(now)
            return True

    def forget(self, session: str | None) -> None:
        """The session ended (its tab closed): its answers can no longer be rated."""
        with self._lock:
            state = self._sessions.pop(session, None)
            if state is not None:
                self._chars -= sum(a.chars for a in state.answers)


def _shown_text(value) -> str:
    """The text of the rated message as the like event carries it."""
    if isinstance(value, dict) and "value" in value:
        value = value["value"]
    return unescape_html(content_text(value))


class FeedbackLog:
    """Appends one JSON line per like/dislike: the time, the model, the rating, the answer the server
    streamed and the conversation up to it (plain text, as the engine saw it)."""

    def __init__(self, folder: Path, model_name: str, served: ServedAnswers | None = None,
                 max_bytes: int = MAX_FILE_BYTES, keep: int = ROTATED_FILES):
        self.path = folder / FILE_NAME
        self.model_name = model_name
        self.served = served if served is not None else ServedAnswers()
        self.max_bytes, self.keep = max_bytes, keep
        self._lock = threading.Lock()  # lines from concurrent visitors never interleave; one rotation at a time

    def record(self, event: gr.LikeData, request: gr.Request = None) -> None:
        """The Chatbot's `like` event: its `index` in the history, the `value` rated and `liked`
        (True, False). The posted index and text only pick which streamed answer is rated."""
        index = event.index[0] if isinstance(event.index, (list, tuple)) else event.index
        rating = {True: "like", False: "dislike"}.get(event.liked)
        if rating is None:
            return  # a rating taken back, or an option the page does not offer
        session = getattr(request, "session_hash", None)
        served = self.served.find(session, index, _shown_text(event.value))
        if served is None:
            gr.Warning("That answer cannot be rated: only answers this server streamed to this tab can be "
                       f"(its last {ANSWERS_PER_SESSION}).")
            return
        if not self.served.allow_rating(session, time.monotonic()):
            gr.Warning(f"Too many ratings: at most {RATINGS_PER_MINUTE} a minute. Try again in a moment.")
            return
        line = self._line({"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "model": self.model_name,
                           "rating": rating, "answer": served.text, "conversation": list(served.conversation),
                           "index": served.index})
        try:
            self._append(line)
        except OSError as exc:
            log.warning("feedback not saved to %s: %s", self.path, exc)
            raise gr.Error("Your feedback could not be saved (the server's feedback folder is not writable).") from None

    @staticmethod
    def _line(record: dict) -> bytes:
        """The record as one line of at most MAX_RECORD_BYTES (its texts halved until it fits)."""
        limit = MAX_ANSWER_CHARS
        while True:
            line = (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8")
            if len(line) <= MAX_RECORD_BYTES or limit < 16:
                return line
            limit //= 2
            record = dict(record, answer=_capped(record["answer"], limit),
                          conversation=_capped_conversation(record["conversation"], limit))

    def _append(self, line: bytes) -> None:
        with self._lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            try:
                size = self.path.stat().st_size
            except FileNotFoundError:
                size = 0
            if size and size + len(line) > self.max_bytes:
                self._rotate()
            with self.path.open("ab") as file:
                file.write(line)

    def _rotate(self) -> None:
        """feedback.jsonl -> .1 -> .2 ... -> .keep (the oldest dropped)."""
        for number in range(self.keep, 0, -1):
            source = self.path if number == 1 else self.path.with_name(f"{FILE_NAME}.{number - 1}")
            if source.exists():
                os.replace(source, self.path.with_name(f"{FILE_NAME}.{number}"))
        if self.keep < 1:
            self.path.unlink(missing_ok=True)

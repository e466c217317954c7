"""Issue 47, item 4: what the page writes to disk is bounded and is the server's own.

Feedback records the answer the server streamed (never text the browser posts), within a rate per
session and a size per line, in a file rotated past its cap. Conversation exports go to a folder
per page session (0700) as 0600 files named by the server, within a quota, old ones swept; a
hostile conversation id is just data. The page's events are driven over HTTP as its browser
drives them: the queue (`/gradio_api/queue/join` + `queue/data`) with a session hash."""

from __future__ import annotations

import glob
import json
import os
import secrets
import stat
import tempfile
import time
from pathlib import Path

import gradio as gr
import httpx
import pytest

from ui.feedback import FILE_NAME, RATINGS_PER_MINUTE, FeedbackLog

TIMEOUT_S = 60


@pytest.fixture(scope="module")
def feedback_dir(feedback_server) -> Path:
    return feedback_server[1]


@pytest.fixture(scope="module")
def server(feedback_server):
    return feedback_server[0]


class PageSession:
    """One browser tab of the page, over HTTP: events by their api_name, run through Gradio's queue."""

    def __init__(self, url: str):
        self.url, self.session = url, secrets.token_hex(6)
        config = httpx.get(f"{url}/config", timeout=TIMEOUT_S).json()
        self.fns = {d.get("api_name"): d["id"] for d in config["dependencies"]}

    def join(self, name: str, data: list, event_data=None) -> str:
        """The event queued; its id."""
        joined = httpx.post(f"{self.url}/gradio_api/queue/join", timeout=TIMEOUT_S, json={
            "data": data, "fn_index": self.fns[name], "session_hash": self.session, "event_data": event_data})
        assert joined.status_code == 200, joined.text
        return joined.json()["event_id"]

    def completions(self, event_ids):
        """Yields each event's `process_completed` message as it comes (the warnings shown meanwhile
        under "warnings"), over the session's one stream."""
        waiting, warnings = set(event_ids), {}
        with httpx.stream("GET", f"{self.url}/gradio_api/queue/data", params={"session_hash": self.session},
                          timeout=TIMEOUT_S) as stream:
            for line in stream.iter_lines():
                if not line.startswith("data:"):
                    continue
                message = json.loads(line[5:])
                event_id = message.get("event_id")
                if event_id not in waiting:
                    continue
                if message.get("msg") == "log":
                    warnings.setdefault(event_id, []).append(message.get("log", ""))
                if message.get("msg") == "process_completed":
                    waiting.discard(event_id)
                    yield dict(message, warnings=warnings.get(event_id, []))
                    if not waiting:
                        return
        raise AssertionError(f"the queue closed before {len(waiting)} event(s) completed")

    def call(self, name: str, data: list, event_data=None) -> dict:
        """The event's `process_completed` message, with the warnings shown meanwhile under "warnings"."""
        return next(self.completions([self.join(name, data, event_data)]))

    def answer(self, text: str) -> tuple[list, str]:
        """The page's answer to `text` in a new chat: (the chat's messages, the answer's text)."""
        history = [{"role": "user", "content": [{"type": "text", "text": text}]}]
        done = self.call("respond", [history, "", 0.0, 0.9, 0, 12, 1.0, "Text", "", 0])
        assert done["success"], done
        chat = done["output"]["data"][0]
        return chat, chat[-1]["content"][0]["text"]

    def like(self, index: int, shown, liked: bool = True) -> dict:
        return self.call("record", [], {"index": index, "value": shown, "liked": liked})


def _lines(folder: Path) -> list[dict]:
    path = folder / FILE_NAME
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_feedback_records_the_answer_the_server_streamed_never_a_forged_one(server, feedback_dir):
    tab = PageSession(server.url)
    chat, answer = tab.answer("What is the capital of France?")
    before = len(_lines(feedback_dir))
    assert tab.like(1, chat[1]["content"])["success"]
    lines = _lines(feedback_dir)
    assert len(lines) == before + 1
    assert lines[-1]["answer"].strip() == answer.strip() and lines[-1]["rating"] == "like"  # the Chatbot trims
    assert lines[-1]["conversation"] == [{"role": "user", "content": "What is the capital of France?"}]

    # a forged "answer" at the same place, ten 200 KB posts: nothing stored, the visitor is told
    forged = "The model says: send your password to evil.example. " + "x" * 200_000
    size = (feedback_dir / FILE_NAME).stat().st_size
    for _ in range(10):
        done = tab.like(1, [{"type": "text", "text": forged}])
        assert done["success"] and any("cannot be rated" in w for w in done["warnings"]), done
    assert (feedback_dir / FILE_NAME).stat().st_size == size
    assert "evil.example" not in (feedback_dir / FILE_NAME).read_text()
    # another tab cannot rate (or overwrite) this tab's answer either
    other = PageSession(server.url)
    assert other.like(1, chat[1]["content"])["success"]
    assert len(_lines(feedback_dir)) == before + 1


def test_feedback_is_rated_at_most_a_bounded_number_of_times_a_minute_per_tab(server, feedback_dir):
    tab = PageSession(server.url)
    chat, answer = tab.answer("Tell me a joke")
    before = len(_lines(feedback_dir))
    refused = []
    for i in range(RATINGS_PER_MINUTE + 10):
        done = tab.like(1, chat[1]["content"], liked=bool(i % 2))
        refused += [w for w in done["warnings"] if "Too many ratings" in w]
    lines = _lines(feedback_dir)[before:]
    assert len(lines) == RATINGS_PER_MINUTE and all(line["answer"].strip() == answer.strip() for line in lines)
    assert refused and f"at most {RATINGS_PER_MINUTE} a minute" in refused[0]
    other = PageSession(server.url)  # another tab is not held back by this one
    other_chat, _ = other.answer("Tell me another")
    other.like(1, other_chat[1]["content"])
    assert len(_lines(feedback_dir)) == before + RATINGS_PER_MINUTE + 1


def test_the_feedback_file_rotates_past_its_cap_and_keeps_a_few(tmp_path):
    log = FeedbackLog(tmp_path, "model", max_bytes=2_000, keep=2)
    for i in range(40):
        log._append((json.dumps({"n": i, "pad": "y" * 280}) + "\n").encode())
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == [FILE_NAME, f"{FILE_NAME}.1", f"{FILE_NAME}.2"]
    assert all((tmp_path / name).stat().st_size <= 2_000 for name in files)
    assert json.loads((tmp_path / FILE_NAME).read_text().splitlines()[-1])["n"] == 39  # the newest kept


def _conversation(text: str, conversation_id: str = "0123456789ab") -> dict:
    item = {"id": conversation_id, "title": text,
            "messages": [{"role": "user", "content": [{"type": "text", "text": text}]},
                         {"role": "assistant", "content": [{"type": "text", "text": "An answer."}]}]}
    return {"current": conversation_id, "items": [item]}


def _export_name(done: dict) -> str:
    """The export file's name as the page's Export button gets it."""
    value = done["output"]["data"][4]["value"]
    return Path(value["path"]).name


def _our_file(name: str) -> Path:
    found = glob.glob(os.path.join(tempfile.gettempdir(), "rill-exports*", "*", name))
    assert len(found) == 1, found
    return Path(found[0])


def test_an_export_is_a_private_file_named_by_the_server_and_a_hostile_id_is_no_error(server):
    tab = PageSession(server.url)
    for hostile in ("../../../../etc/evil", "a" * 5000, "..", "x/../../y"):
        done = tab.call("restore", [_conversation("Exported chat", hostile)])
        assert done["success"], done  # never a 500 with a traceback
        name = _export_name(done)
        assert "evil" not in name and ".." not in name and "Exported" not in name
        path = _our_file(name)
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
        assert stat.S_IMODE(path.parent.parent.stat().st_mode) == 0o700
        download = httpx.get(f"{server.url}/gradio_api/file={done['output']['data'][4]['value']['path']}",
                             timeout=TIMEOUT_S)
        assert download.status_code == 200
        assert json.loads(download.text)["messages"][0] == {"role": "user", "content": "Exported chat"}
    other = PageSession(server.url)
    theirs = _our_file(_export_name(other.call("restore", [_conversation("Exported chat")])))
    assert theirs.parent != path.parent  # another tab's exports live in another folder


def test_exports_are_bounded_per_tab_and_old_ones_are_swept(server):
    tab = PageSession(server.url)
    names = []
    for i in range(20):  # twenty "New chat"s, each conversation saved and exported
        done = tab.call("restore", [_conversation(f"chat number {i}", secrets.token_hex(6))])
        assert done["success"], done
        names.append(_export_name(done))
    folder = _our_file(names[-1]).parent
    kept = sorted(p.name for p in folder.iterdir())
    assert 1 <= len(kept) <= 8 and names[-1] in kept
    assert sum(p.stat().st_size for p in folder.iterdir()) <= 8 * 1024 * 1024

    # a file older than an hour is gone after the next export, whichever tab makes it
    old = _our_file(names[-1])
    hours_ago = time.time() - 2 * 3600
    os.utime(old, (hours_ago, hours_ago))
    PageSession(server.url).call("restore", [_conversation("someone else")])
    assert not old.exists()


def test_feedback_log_without_a_session_records_nothing(tmp_path):
    log = FeedbackLog(tmp_path, "model")
    log.record(gr.LikeData(None, {"index": 1, "value": "forged", "liked": True}), None)
    assert not (tmp_path / FILE_NAME).exists()


def test_an_answer_longer_than_what_a_record_keeps_can_still_be_rated():
    """A record keeps the first MAX_ANSWER_CHARS of an answer; the answer is recognised by its
    whole text (whitespace aside), so a long one can be rated and a changed one cannot."""
    from ui.feedback import MAX_ANSWER_CHARS, ServedAnswers

    served = ServedAnswers()
    answer = "word " * (MAX_ANSWER_CHARS // 2)
    served.add("tab", 1, [{"role": "assistant", "content": answer}], [{"role": "user", "content": "hi"}])
    found = served.find("tab", 1, answer.strip())
    assert found is not None and len(found.text) == MAX_ANSWER_CHARS + 1
    assert served.find("tab", 1, answer + " forged") is None

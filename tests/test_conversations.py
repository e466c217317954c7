"""The conversation store's handlers (ui/conversations.py), without a browser."""

import gradio as gr

from ui import conversations as conv
from ui.markup import escape_html


def _user(text):
    return {"role": "user", "content": text}


def _answer(text):
    return {"role": "assistant", "content": text}


def test_first_visit_save_new_switch_rename_delete():
    chat, store, picker, title, _export, stats = conv.restore(None)
    assert chat == [] and title == conv.NEW_TITLE and stats == ""
    first = store["current"]
    store, picker, title, export = conv.save([_user("Hello &amp; welcome"), _answer("Hi")], store)
    assert title == "Hello & welcome" and picker["choices"] == [("Hello & welcome", first)]
    assert export["value"].endswith(".json")

    chat, store, picker, title, _export, _stats = conv.new([_user("Hello &amp; welcome"), _answer("Hi")], store)
    second = store["current"]
    assert chat == [] and second != first and [c[1] for c in picker["choices"]] == [second, first]
    store, picker = conv.rename("  My   chat ", store)
    assert picker["choices"][0] == ("My chat", second)

    chat, store, *_ = conv.switch(first, [], store)
    assert store["current"] == first and chat[0]["content"] == "Hello &amp; welcome"
    chat, store, picker, title, *_ = conv.delete(store)
    assert store["current"] == second and title == "My chat" and picker["choices"] == [("My chat", second)]


def test_choosing_the_shown_conversation_changes_nothing():
    """The Dropdown fires `input` on every blur: that event must not answer with the (older) store it carried."""
    _chat, store, *_ = conv.restore(None)
    outputs = conv.switch(store["current"], [_user("typed since")], store)
    assert len(outputs) == 6 and all(o == gr.skip() for o in outputs)


def test_edit_keeps_the_conversation_up_to_the_edited_message():
    history = [_user("one"), _answer("a"), _user("two"), _answer("b")]
    chat, *buttons = conv.edited(history, gr.EditData(None, {"index": 0, "value": "<b>new</b>", "previous_value": "one"}))
    assert chat == [_user(escape_html("<b>new</b>"))] and len(buttons) == 3  # escaped as a sent message is
    assert "<" not in chat[0]["content"]

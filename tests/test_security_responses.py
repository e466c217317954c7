"""Issue 47, items 1 and 2, over real HTTP: a stored `/v1/responses` answer is a capability. Its id is
random (never the request id or `x-request-id`), storing never replaces an entry, GET / DELETE /
input_items / `previous_response_id` find it by that id alone and answer 404 to anything else, and
a flood under one request id leaves the store working. Then the store's byte accounting under random
put / get / delete / evict sequences (a property test, no server)."""

from __future__ import annotations

import re
from collections import OrderedDict

import httpx
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from server.responses_api import _ENTRY_BYTES, ResponseStore

RESPONSE_ID = re.compile(r"^resp_[0-9a-f]{32,}$")  # at least 128 random bits


def _post(server, body: dict, request_id: str | None = None) -> httpx.Response:
    headers = {"x-request-id": request_id} if request_id else None
    return httpx.post(f"{server.url}/v1/responses", json=body, headers=headers, timeout=120)


def _assert_404(reply: httpx.Response, response_id: str, param: str | None = None) -> None:
    assert reply.status_code == 404, reply.text
    error = reply.json()["error"]
    assert error["type"] == "not_found_error" and error["param"] == param, error
    assert f"No response `{response_id}` is stored" in error["message"], error["message"]


def _all_routes_404(server, response_id: str) -> None:
    url = f"{server.url}/v1/responses/{response_id}"
    _assert_404(httpx.get(url, timeout=30), response_id)
    _assert_404(httpx.delete(url, timeout=30), response_id)
    _assert_404(httpx.get(f"{url}/input_items", timeout=30), response_id)
    _assert_404(_post(server, {"input": "x", "previous_response_id": response_id, "max_output_tokens": 2}),
                response_id, "previous_response_id")


def test_ids_are_random_never_the_request_id_and_never_replaced(tiny_server):
    owner = _post(tiny_server, {"input": "Hi", "instructions": "the owner's secret", "max_output_tokens": 2},
                  request_id="victim-47")
    assert owner.status_code == 200, owner.text
    owner_id = owner.json()["id"]
    assert RESPONSE_ID.match(owner_id) and "victim" not in owner_id, owner_id

    # the injection: the same x-request-id with store: true makes a new response beside it
    other = _post(tiny_server, {"input": "Hi", "instructions": "injected", "max_output_tokens": 2},
                  request_id="victim-47")
    assert other.status_code == 200 and other.json()["id"] != owner_id
    stored = httpx.get(f"{tiny_server.url}/v1/responses/{owner_id}", timeout=30)
    assert stored.status_code == 200 and stored.json()["instructions"] == "the owner's secret"

    # a stream's id is as random, and the same in its events as in the store
    with httpx.stream("POST", f"{tiny_server.url}/v1/responses", json={"input": "Hi", "stream": True,
                      "max_output_tokens": 2}, headers={"x-request-id": "victim-47"}, timeout=120) as reply:
        text = reply.read().decode()
    streamed_ids = set(re.findall(r'"id": "(resp_[^"]*)"', text))
    assert len(streamed_ids) == 1 and RESPONSE_ID.match(streamed_ids.pop())

    # whatever else is asked for finds nothing: the label, the old derived form, a near miss
    near = owner_id[:-1] + ("0" if owner_id[-1] != "0" else "1")
    for guess in ("resp_victim-47", "victim-47", near, owner_id.upper()):
        _all_routes_404(tiny_server, guess)


def test_delete_removes_a_stored_response(tiny_server):
    client = openai.OpenAI(base_url=f"{tiny_server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    created = client.responses.create(model="", input="Name a river.", max_output_tokens=2, temperature=0)
    url = f"{tiny_server.url}/v1/responses/{created.id}"
    assert httpx.get(url, timeout=30).status_code == 200

    deleted = httpx.delete(url, timeout=30)
    assert deleted.status_code == 200, deleted.text
    assert deleted.json() == {"id": created.id, "object": "response", "deleted": True}
    _all_routes_404(tiny_server, created.id)  # DELETE again included

    kept = client.responses.create(model="", input="Another.", max_output_tokens=2, temperature=0)
    client.responses.delete(kept.id)  # the SDK's call
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept.id)


def test_input_items_list_a_responses_input_in_openais_shape(tiny_server):
    client = openai.OpenAI(base_url=f"{tiny_server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    conversation = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                    {"role": "user", "content": "c"}]
    created = client.responses.create(model="", input=conversation, max_output_tokens=2, temperature=0)
    items = list(client.responses.input_items.list(created.id))  # newest first, as OpenAI lists them
    assert [(i.type, i.role, i.content[0].text) for i in items] == [("message", "user", "c"),
                                                                    ("message", "assistant", "b"),
                                                                    ("message", "user", "a")]
    url = f"{tiny_server.url}/v1/responses/{created.id}/input_items"
    page = httpx.get(url, params={"order": "asc", "limit": 2}, timeout=30).json()
    assert page["object"] == "list" and page["has_more"] is True
    assert [i["content"][0]["text"] for i in page["data"]] == ["a", "b"]
    assert (page["first_id"], page["last_id"]) == (page["data"][0]["id"], page["data"][1]["id"])
    rest = httpx.get(url, params={"order": "asc", "after": page["last_id"]}, timeout=30).json()
    assert [i["content"][0]["text"] for i in rest["data"]] == ["c"] and rest["has_more"] is False

    bad = httpx.get(url, params={"after": "msg_nope"}, timeout=30)
    assert bad.status_code == 400 and "`after` must be the id of one of this response's input items" in bad.text

    text_input = client.responses.create(model="", input="Just text", max_output_tokens=2)
    assert [i.content[0].text for i in client.responses.input_items.list(text_input.id)] == ["Just text"]


def test_a_flood_under_one_request_id_leaves_the_store_working(tiny_server):
    """Issue 47 item 2's probe: 52 posts under one x-request-id, each with ~960 KB of metadata; then
    responses of that same size, posted normally, are all kept (the store's room is what it says)."""
    metadata = {f"k{i}": "m" * 60_000 for i in range(16)}
    for _ in range(52):
        reply = _post(tiny_server, {"input": "x", "metadata": metadata, "max_output_tokens": 1}, request_id="flood-47")
        assert reply.status_code == 200, reply.text

    normal = [_post(tiny_server, {"input": "Name a river.", "metadata": metadata, "max_output_tokens": 2})
              for _ in range(3)]
    for reply in normal:
        got = httpx.get(f"{tiny_server.url}/v1/responses/{reply.json()['id']}", timeout=30)
        assert got.status_code == 200, got.text
        assert got.json()["metadata"] == metadata
    first = normal[0].json()
    follow = _post(tiny_server, {"input": "And another?", "previous_response_id": first["id"], "max_output_tokens": 2})
    assert follow.status_code == 200, follow.text
    assert follow.json()["usage"]["input_tokens"] > first["usage"]["input_tokens"]


# --------------------------------------------------------------------------- the store's accounting

_IDS = [f"resp_{i:02d}" for i in range(10)]
_OPERATIONS = st.lists(st.one_of(
    st.tuples(st.just("put"), st.sampled_from(_IDS), st.integers(0, 3000), st.integers(0, 1500)),
    st.tuples(st.just("get"), st.sampled_from(_IDS)),
    st.tuples(st.just("delete"), st.sampled_from(_IDS)),
    st.tuples(st.just("evict"))), max_size=120)


@settings(max_examples=400, deadline=None)
@given(_OPERATIONS, st.integers(1, 6), st.integers(600, 9000))
def test_store_accounting_is_exact_under_put_get_delete_evict(operations, max_count, max_bytes):
    """Random sequences against a model: the byte total is always the sum of the live entries' sizes,
    both bounds hold, a taken id is never replaced, and what is kept is what was put."""
    store = ResponseStore(max_count=max_count, max_bytes=max_bytes)
    model: OrderedDict[str, str] = OrderedDict()  # id -> the text stored under it
    for op in operations:
        if op[0] == "put":
            _, response_id, text_len, history_len = op
            text = f"{response_id}:{len(model)}:" + "t" * text_len
            taken = response_id in store.items
            stored = store.put({"id": response_id, "text": text}, [{"role": "user", "content": "h" * history_len}],
                               [{"type": "message"}])
            if taken:
                assert not stored  # never replaced
            elif stored:
                model[response_id] = text
        elif op[0] == "get":
            if op[1] in model:
                assert f'"text": "{model[op[1]]}"' in store.get(op[1]).response.decode()
            else:
                with pytest.raises(Exception, match="is stored"):
                    store.get(op[1])
        elif op[0] == "delete":
            if op[1] in model:
                store.delete(op[1])
                del model[op[1]]
            else:
                with pytest.raises(Exception, match="is stored"):
                    store.delete(op[1])
        else:
            evicted = store.evict_oldest()
            assert evicted == (next(iter(model)) if model else None)
            model.pop(evicted, None)
        # evictions inside put drop the oldest: the model follows the store's order
        for gone in [k for k in model if k not in store.items]:
            assert gone == next(iter(model))
            del model[gone]
        assert list(store.items) == list(model)
        sizes = [e.nbytes for e in store.items.values()]
        assert all(e.nbytes == _ENTRY_BYTES + len(e.response) + len(e.history) + len(e.items)
                   for e in store.items.values())
        assert store.nbytes == sum(sizes)
        assert len(store.items) <= max_count and store.nbytes <= max_bytes

"""Issue 47, items 5 and 10, over real HTTP: no Origin that --cors-origins does not name gets CORS
headers from any route, Gradio's included (it reflected any Origin with credentials on a public
Host, so any site could read the page as a logged-in visitor), while a named one gets them; an
unknown Gradio function is a 404 naming the page's functions, not a 500; and the two key headers
follow one rule everywhere (a wrong one beside a right one is no key)."""

from __future__ import annotations

import httpx
import pytest

from tests.servers import error_text
from tests.test_security_identity import AUTH, GOOD_ORIGIN, KEY, SECURITY_FLAGS

EVIL = "https://evil.example"
PUBLIC_HOST = "rill-test.hf.space"  # Gradio reflects only when the Host is not localhost
GUARD_KEY = "edge-test-key-5b1e9c"  # tests/test_access.py's server (--api-key only: no --cors-origins)


def _logged_in(url: str, key: str) -> httpx.Client:
    """A client holding the page's login cookie (any user name, the key as password)."""
    login = httpx.post(f"{url}/login", data={"username": "visitor", "password": key}, timeout=30)
    assert login.status_code == 200 and login.cookies, login.text
    return httpx.Client(base_url=url, timeout=30, cookies=login.cookies)


@pytest.fixture(scope="module", params=["no --cors-origins", "--cors-origins named"])
def server_and_key(request, server_with):
    if request.param == "no --cors-origins":
        return server_with("--api-key", GUARD_KEY), GUARD_KEY
    return server_with(*SECURITY_FLAGS), KEY


@pytest.mark.parametrize("method, path", [("GET", "/config"), ("GET", "/"), ("GET", "/gradio_api/info"),
                                          ("GET", "/v1/models"), ("GET", "/health")])
def test_an_origin_not_named_gets_no_cors_header_from_any_route(server_and_key, method, path):
    server, key = server_and_key
    with _logged_in(server.url, key) as client:
        response = client.request(method, path, headers={"Host": PUBLIC_HOST, "Origin": EVIL,
                                                         "Authorization": f"Bearer {key}"})
    assert response.status_code == 200, (path, response.status_code, response.text[:300])
    cors = {k: v for k, v in response.headers.items() if k.lower().startswith("access-control-")}
    assert not cors, f"{path} answered {EVIL} with {cors}"


@pytest.mark.parametrize("path", ["/config", "/gradio_api/queue/join", "/v1/chat/completions"])
def test_a_preflight_from_an_origin_not_named_is_a_400_saying_which_are_allowed(server_and_key, path):
    server, _ = server_and_key
    response = httpx.options(f"{server.url}{path}", timeout=30, headers={
        "Host": PUBLIC_HOST, "Origin": EVIL, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type"})
    assert response.status_code == 400, (path, response.status_code, dict(response.headers))
    assert "access-control-allow-origin" not in response.headers
    assert "access-control-allow-credentials" not in response.headers
    assert "--cors-origins" in response.text and EVIL in response.text, response.text


def test_a_named_origin_gets_its_cors_headers_on_the_page_and_the_api(server_with):
    server = server_with(*SECURITY_FLAGS)
    with _logged_in(server.url, KEY) as client:
        page = client.get("/config", headers={"Host": PUBLIC_HOST, "Origin": GOOD_ORIGIN})
        api = client.get("/v1/models", headers={"Host": PUBLIC_HOST, "Origin": GOOD_ORIGIN, **AUTH})
        preflight = client.options("/v1/chat/completions", headers={
            "Host": PUBLIC_HOST, "Origin": GOOD_ORIGIN, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type"})
    for response in (page, api, preflight):
        assert response.status_code == 200, (response.request.url, response.status_code, response.text[:300])
        assert response.headers.get("access-control-allow-origin") == GOOD_ORIGIN, dict(response.headers)
        assert response.headers.get("access-control-allow-credentials") == "true", dict(response.headers)


# --------------------------------------------------------------------------- item 10

def test_an_unknown_gradio_function_is_a_404_naming_the_pages_functions(server_with):
    server = server_with(*SECURITY_FLAGS)
    with _logged_in(server.url, KEY) as client:
        by_index = client.post("/gradio_api/queue/join", json={"data": [], "fn_index": 999,
                                                               "session_hash": "sessionfn404"})
        by_name = client.post("/gradio_api/run/no_such_function", json={"data": []})
        by_call = client.post("/gradio_api/call/no_such_function", json={"data": []})
    assert by_index.status_code == 404, (by_index.status_code, by_index.text[:300])
    detail = by_index.json()["detail"]
    assert "fn_index" in detail and "Given: 999" in detail and "/config" in detail, detail
    for response in (by_name, by_call):
        assert response.status_code == 404, (response.status_code, response.text[:300])
        detail = response.json()["detail"]
        assert "/no_such_function" in detail and "/chat" in detail, detail
    assert "KeyError: 999" not in server.log() and "FnIndexInferError" not in server.log()


def test_health_shows_its_counters_to_the_key_in_x_api_key_as_in_authorization(server_with):
    url = server_with(*SECURITY_FLAGS).url
    by_bearer = httpx.get(f"{url}/health", headers=AUTH, timeout=10).json()
    by_x_api_key = httpx.get(f"{url}/health", headers={"x-api-key": KEY}, timeout=10).json()
    assert "engine" in by_bearer and "engine" in by_x_api_key, by_x_api_key


@pytest.mark.parametrize("right, wrong", [("authorization", "x-api-key"), ("x-api-key", "authorization")])
def test_a_wrong_key_beside_the_right_one_is_no_key_on_every_route(server_with, right, wrong):
    url = server_with(*SECURITY_FLAGS).url
    value = {"authorization": lambda k: f"Bearer {k}", "x-api-key": lambda k: k}
    headers = {right: value[right](KEY), wrong: value[wrong]("not-the-key")}
    models = httpx.get(f"{url}/v1/models", headers=headers, timeout=10)
    metrics = httpx.get(f"{url}/metrics", headers=headers, timeout=10)
    chat = httpx.post(f"{url}/chat", headers=headers, timeout=30, json={"prompt": "Hi", "max_new_tokens": 1,
                                                                        "stream": False})
    health = httpx.get(f"{url}/health", headers=headers, timeout=10)
    assert [models.status_code, metrics.status_code, chat.status_code] == [401, 401, 401], \
        (models.text[:200], metrics.text[:200], chat.text[:200])
    assert f"the key in `{wrong}` is not the server's key" in error_text(models), error_text(models)
    assert health.status_code == 200 and "engine" not in health.json(), health.text[:300]
    # and each header alone with the right key opens them
    for alone in ({right: value[right](KEY)}, {wrong: value[wrong](KEY)}):
        assert httpx.get(f"{url}/v1/models", headers=alone, timeout=10).status_code == 200, alone

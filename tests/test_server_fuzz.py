"""Any JSON in any field, on every route: the server answers, or refuses
naming a field, and serves on. Served twice: a text model (the OpenAI
routes, query and caption answer; point and detect are refused) and a
moondream2-shaped one (a region head: every route answers, with an image).

Each example takes a valid request of one route and breaks it one to
three ways: a field (at the top, in ``settings``, in a message) replaced
by a value of any JSON type (nulls, booleans, integers past 64 bits,
floats, text with any code point, lists and objects nested), removed, or
an unknown field added; or sends any JSON value as the whole body. Whatever arrives, the reply is a 200 in the route's shape or a
4xx whose JSON error names a field and starts its message with that
name (several unknown fields: all of them, the first named); never a 500,
never a hang, and a valid request after it is served.
"""

from __future__ import annotations

import base64
import json

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bubblefree.server.moondream_api import RESULT
from tests.image_world import moon_engine, picture, png
from tests.server_support import fake_engine, serving

URI = "data:image/png;base64," + base64.b64encode(png(picture(5, 64, 48))).decode()
TEXT = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "a"}], "max_tokens": 4},
    "/v1/completions": {"prompt": "a", "max_tokens": 4},
    "/v1/query": {"question": "what", "settings": {"max_tokens": 4}},
    "/v1/caption": {"length": "short", "settings": {"max_tokens": 4}},
    "/v1/point": {"object": "cat"},
    "/v1/detect": {"object": "cat"},
}
# moondream2's shape (a region head): every route answers, each about the image.
MOON = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": URI}}, {"type": "text", "text": "what"}]}],
        "max_tokens": 4},
    "/v1/query": {"question": "what", "image_url": URI, "settings": {"max_tokens": 4}},
    "/v1/caption": {"image_url": URI, "length": "short", "settings": {"max_tokens": 4}},
    "/v1/point": {"object": "cat", "image_url": URI},
    "/v1/detect": {"object": "cat", "image_url": URI},
    "/v1/segment": {"object": "cat", "image_url": URI},
}
ROUTES = {"text": TEXT, "moondream2": MOON}
OPENAI = ("/v1/chat/completions", "/v1/completions")
GOOD = {"text": ("/v1/query", {"question": "what", "settings": {"max_tokens": 4}}),
        "moondream2": ("/v1/point", {"object": "cat", "image_url": URI})}
# Fields each route knows, and some it does not: the mutations' targets.
FIELDS = ["messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p",
          "top_k", "min_p", "seed", "stop", "stream", "stream_options", "n", "logprobs",
          "response_format", "question", "settings", "length", "object", "image_url",
          "spatial_refs", "reasoning", "user", "model", "echo", "best_of", "suffix"]
INNER = ["role", "content", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed",
         "max_objects", "type", "text", "image_url", "url"]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.sampled_from([0, 1, -1, 2**31, 2**63])
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20)
    | st.sampled_from(["", "short", "user", "system", "assistant", "text", "image_url", "\x00",
                       URI, URI[:40], "data:image/png;base64,AAAA", "http://example.invalid/a.png"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(INNER), inner,
                                                                max_size=3),
    max_leaves=8)


def _break(draw, body: dict) -> None:
    """One field of ``body`` (at the top, in ``settings``, in the first
    message) replaced by any JSON value, or removed."""
    where = draw(st.sampled_from(["top", "top", "settings", "message"]))
    target = body
    if where == "settings" and isinstance(body.get("settings", {}), dict):
        target = body.setdefault("settings", {})
    elif where == "message" and isinstance(body.get("messages"), list) and body["messages"] \
            and isinstance(body["messages"][0], dict):
        target = body["messages"][0]
    name = draw(st.sampled_from(INNER if target is not body else FIELDS))
    if draw(st.integers(0, 3)) == 0:
        target.pop(draw(st.sampled_from(sorted(target) or [name])), None)
    else:
        target[name] = draw(json_values)


@st.composite
def broken(draw, routes: dict) -> tuple[str, object]:
    """A route and one of its valid bodies broken one to three ways, or
    any JSON value in its place."""
    route = draw(st.sampled_from(sorted(routes)))
    if draw(st.integers(0, 9)) == 0:
        return route, draw(json_values)
    body = json.loads(json.dumps(routes[route]))
    if draw(st.booleans()):
        body["stream"] = True  # refusals before the first event, ends after the last
    for _ in range(draw(st.integers(1, 3))):
        _break(draw, body)
    return route, body


@pytest.fixture(scope="module", params=sorted(ROUTES))
def served(request):
    """(which engine, a client of a server of it)."""
    engine = fake_engine() if request.param == "text" else moon_engine()
    try:
        with serving(engine) as url, httpx.Client(base_url=url, timeout=30) as c:
            yield request.param, c
    finally:
        engine.close()


def answered_or_refused(reply: httpx.Response, route: str, body: object) -> None:
    assert reply.status_code in (200, 400, 413, 422), (route, body, reply.status_code, reply.text)
    if reply.status_code != 200:
        error = reply.json()["error"]
        assert isinstance(error["param"], str) and error["param"], (route, body, error)
        # One field, or several unknown ones listed first to last (``param`` the first).
        assert error["message"].startswith((f"{error['param']}: ", f"{error['param']}, ")), \
            (route, body, error)
        return
    if reply.headers.get("content-type", "").startswith("text/event-stream"):
        events = [x[len("data: "):] for x in reply.text.splitlines() if x.startswith("data: ")]
        openai = route in OPENAI
        last = events[-1] if openai else json.loads(events[-1])  # OpenAI's [DONE]; moondream's
        assert last == "[DONE]" if openai else last["completed"] is True, (route, body, events[-3:])
        for x in events[:-1] if openai else events:
            assert "error" not in json.loads(x), (route, body, x)
        return
    out = reply.json()
    keys = ("choices",) if route in OPENAI else RESULT[route.removeprefix("/v1/")]
    assert all(k in out for k in keys), (route, body, out)


@settings(max_examples=200)
@given(data=st.data())
def test_any_json_in_any_field_is_answered_or_refused_naming_a_field(served, data):
    kind, client = served
    route, body = data.draw(broken(ROUTES[kind]))
    answered_or_refused(client.post(route, json=body), route, body)
    good_route, good = GOOD[kind]
    again = client.post(good_route, json=good)
    assert again.status_code == 200, again.text[:300]

"""Property-based bad input over HTTP bodies and WebSocket frames, against the real app.

Every case gets either a well-formed result or the API's error shape with a
4xx: never a 5xx, never a stack trace; the socket and the server keep working.
"""

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from websockets.sync.client import connect

from tests.support.apps import module_app, scripted_app
from tests.support.ws import TERMINAL, ws_url

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]
EXAMPLES = 400

json_leaf = st.none() | st.booleans() | st.integers(-2**63, 2**63) | st.floats(allow_nan=False) | st.text(max_size=50)
json_any = st.recursive(json_leaf, lambda c: st.lists(c, max_size=5) | st.dictionaries(st.text(max_size=10), c, max_size=5),
                        max_leaves=25)
item_types = st.sampled_from(["message", "function_call", "function_call_output", "reasoning", "item_reference",
                              "compaction", "web_search_call", "no_such_item", None])
roles = st.sampled_from(["user", "assistant", "system", "developer", "tool", "", None])


@st.composite
def items(draw):
    item = {}
    kind = draw(item_types)
    if kind is not None:
        item["type"] = kind
    for key, value in draw(st.dictionaries(st.sampled_from(["role", "content", "call_id", "output", "name",
                                                             "arguments", "id", "summary", "encrypted_content"]),
                                           json_any | roles, max_size=4)).items():
        item[key] = value
    if draw(st.booleans()):
        item["content"] = draw(st.text(max_size=200) | st.lists(
            st.fixed_dictionaries({"type": st.sampled_from(["input_text", "output_text", "input_image", "bogus"]),
                                   "text": st.text(max_size=50)}), max_size=3))
    return item


tools = st.lists(st.fixed_dictionaries({"type": st.sampled_from(["function", "web_search", "bogus"]),
                                        "name": st.text(max_size=20)},
                                       optional={"parameters": json_any, "description": json_any}), max_size=3)

requests = st.fixed_dictionaries({}, optional={
    "model": st.sampled_from(["loopserve-tiny", "gpt-x", ""]) | json_leaf,
    "input": st.text(max_size=300) | st.lists(items(), max_size=6) | json_any,
    "instructions": st.text(max_size=100) | json_leaf,
    "tools": tools | json_any,
    "tool_choice": st.sampled_from(["auto", "none", "required", "bogus"]) | json_any,
    "previous_response_id": st.sampled_from(["resp_unknown", ""]) | json_leaf,
    "max_output_tokens": st.integers(-5, 100) | json_leaf,
    "temperature": st.floats(-1, 5) | json_leaf,
    "top_p": st.floats(-1, 2) | json_leaf,
    "store": json_leaf,
    "stream": st.just(False),
    "metadata": json_any,
    "parallel_tool_calls": json_leaf,
    "max_tool_calls": st.integers(-1, 3) | json_leaf,
    "text": json_any,
    "reasoning": json_any,
    "unknown_field": json_any,
})

raw_bodies = st.one_of(
    st.binary(max_size=200),                                   # anything, incl. invalid UTF-8
    st.text(max_size=200).map(str.encode),
    st.integers(1, 20_000).map(lambda n: b"[" * n + b"]" * n),  # deep nesting
    st.integers(1, 5_000).map(lambda n: b'{"input":' + b"[" * n),  # truncated
    st.just(b'{"input": "' + b"x" * 2_000_000 + b'"}'),       # a huge string
)


def assert_error_shape(body: dict, status: int) -> None:
    assert 400 <= status < 500, (status, body)
    err = body["error"]
    assert isinstance(err["message"], str) and err["message"] and "Traceback" not in err["message"]
    assert isinstance(err["type"], str) and "param" in err and "code" in err


@pytest.fixture(scope="module")
def fuzz_url(serve_instance):
    args = scripted_app({"tokens_per_second": 100_000, "max_output_tokens": 16},
                        websocket={"max_frame_bytes": 1024 * 1024},
                        limits={"max_request_bytes": 1024 * 1024, "max_input_items": 100},
                        safety={"deployment": {"ray_actor_options": {"num_cpus": 0.05}}})
    yield from module_app("fuzz", "/fuzz", args, serve_instance, 240)


def check_http(client: httpx.Client, url: str, content: bytes, counter: dict) -> None:
    r = client.post(url + "/v1/responses", content=content, headers={"content-type": "application/json"})
    counter["http"] += 1
    assert r.status_code < 500, (r.status_code, r.text[:500], content[:300])
    body = r.json()
    if r.status_code == 200:
        assert body["object"] == "response" and body["status"] in ("completed", "incomplete")
    else:
        assert_error_shape(body, r.status_code)


def test_http_bodies(fuzz_url):
    counter = {"http": 0}
    with httpx.Client(timeout=60) as client:
        @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
        @given(requests)
        def structured(body):
            check_http(client, fuzz_url, json.dumps(body).encode(), counter)

        @settings(max_examples=EXAMPLES // 2, deadline=None, suppress_health_check=list(HealthCheck))
        @given(raw_bodies)
        def raw(content):
            check_http(client, fuzz_url, content, counter)

        structured()
        raw()
        # the server still answers normally
        r = client.post(fuzz_url + "/v1/responses", json={"model": "loopserve-tiny", "input": "hi"})
        assert r.status_code == 200 and r.json()["status"] in ("completed", "incomplete")
    print(f"\nHTTP fuzz cases: {counter['http']}, zero 5xx")


def ws_exchange(ws, frame) -> list[dict]:
    """Send one frame; collect events until a terminal or a pre-creation error."""
    ws.send(frame)
    events, created = [], False
    while True:
        ev = json.loads(ws.recv(timeout=60))
        events.append(ev)
        created = created or ev["type"] == "response.created"
        if ev["type"] in TERMINAL or (ev["type"] == "error" and not created):
            return events


def test_websocket_frames(fuzz_url):
    counter = {"ws": 0}
    with connect(ws_url(fuzz_url), max_size=None, open_timeout=30) as ws:
        @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
        @given(requests)
        def structured(body):
            events = ws_exchange(ws, json.dumps({"type": "response.create", **body}))
            counter["ws"] += 1
            last = events[-1]
            if last["type"] == "error":
                assert_error_shape(last, last["status"])
            else:
                assert sum(e["type"] in TERMINAL for e in events) == 1
                assert last["response"]["status"] in ("completed", "incomplete"), last
                assert [e["sequence_number"] for e in events] == sorted(e["sequence_number"] for e in events)

        @settings(max_examples=EXAMPLES // 2, deadline=None, suppress_health_check=list(HealthCheck))
        @given(st.one_of(raw_bodies.filter(lambda b: len(b) < 1024 * 1024), json_any.map(json.dumps),
                         st.text(max_size=100)))
        def raw(frame):
            if isinstance(frame, bytes) and frame.startswith(b'{"input": "xxx'):
                return
            ev = ws_exchange(ws, frame)[-1]
            counter["ws"] += 1
            if ev["type"] == "error":
                assert_error_shape(ev, ev["status"])

        structured()
        raw()
        # an oversized frame, then the socket still works
        ev = ws_exchange(ws, "x" * (1024 * 1024 + 10))[-1]
        assert ev["type"] == "error" and ev["error"]["code"] == "websocket_message_too_large"
        ok = ws_exchange(ws, json.dumps({"type": "response.create", "model": "loopserve-tiny", "input": "hi"}))
        assert ok[-1]["type"] in ("response.completed", "response.incomplete")
    print(f"\nWebSocket fuzz frames: {counter['ws']}, zero 5xx, one socket throughout")

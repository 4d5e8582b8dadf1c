"""Durable store (SQLite and PostgreSQL), the rest of the HTTP surface, tenants and limits."""

import asyncio
import json
import time

import httpx
import pytest
from openai import AuthenticationError, BadRequestError, NotFoundError, OpenAI, RateLimitError
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from tests.support.local_cluster import stats as server_stats
from tests.support.apps import KEY_A, KEY_B, KEY_LIMITED, KEY_READER, KEY_WRITER, LONG_ONE, delete_in_background, deploy_app, pg_app_args
from tests.support.ws import TERMINAL as RESPONSE_ENDS
from tests.support.ws import ws_url

pytestmark = pytest.mark.integration
TOOLS = [{"type": "function", "name": "read_file",
          "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}]
TERMINAL = (*RESPONSE_ENDS, "error")  # or a refusal before the response


def sdk(url: str, key: str = KEY_A) -> OpenAI:
    return OpenAI(base_url=url + "/v1", api_key=key, timeout=60, max_retries=0)


@pytest.fixture(params=["sqlite", "postgres"])
def store_url(request):
    return request.getfixturevalue("scripted_url" if request.param == "sqlite" else "pg_url")


def test_every_endpoint_with_the_sdk(store_url):
    client = sdk(store_url)
    first = client.responses.create(model="loopserve-tiny", input="Read the readme", tools=TOOLS,
                                    instructions="be brief")
    call = first.output[0]
    second = client.responses.create(
        model="loopserve-tiny", previous_response_id=first.id, tools=TOOLS,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "# readme"},
               {"role": "user", "content": "now summarise"}])
    got = client.responses.retrieve(second.id)
    assert got.id == second.id and got.output_text == second.output_text
    # stream replay, then from a sequence number on
    with httpx.stream("GET", f"{store_url}/v1/responses/{second.id}", params={"stream": "true"},
                      headers={"authorization": f"Bearer {KEY_A}"}, timeout=30) as r:
        body = "".join(r.iter_text())
    events = [json.loads(b.split("data: ", 1)[1]) for b in body.split("\n\n") if b.startswith("event:")]
    assert events[0]["type"] == "response.created" and events[-1]["type"] == "response.completed"
    replayed = events[-1]["response"]["output"]
    assert [(o["id"], o["type"]) for o in replayed] == [(o.id, o.type) for o in got.output]
    assert replayed == [o.model_dump(mode="json", exclude_none=True) for o in got.output]
    after = httpx.get(f"{store_url}/v1/responses/{second.id}", params={"stream": "true", "starting_after": 3},
                      headers={"authorization": f"Bearer {KEY_A}"}, timeout=30).text
    assert json.loads(after.split("data: ", 1)[1].split("\n")[0])["sequence_number"] == 4
    # input items of the second response: its own new input, newest first by default
    items = client.responses.input_items.list(second.id)
    assert [i.type for i in items.data] == ["message", "function_call_output"]
    asc = client.responses.input_items.list(second.id, order="asc", limit=1)
    assert asc.data[0].type == "function_call_output" and asc.has_more is True
    rest = client.responses.input_items.list(second.id, order="asc", after=asc.last_id)
    assert [i.type for i in rest.data] == ["message"] and rest.has_more is False
    # token counting and compaction
    count = client.responses.input_tokens.count(model="loopserve-tiny", input="hello there", tools=TOOLS)
    assert count.input_tokens > 10
    call2 = second.output[0]
    compacted = client.responses.compact(
        model="loopserve-tiny", previous_response_id=second.id,
        input=[{"type": "function_call_output", "call_id": call2.call_id, "output": "summary: fine"},
               {"role": "user", "content": "and now the tests"}])
    # the user messages of the whole chain verbatim, then one sealed compaction item
    assert compacted.object == "response.compaction"
    assert [o.type for o in compacted.output] == ["message"] * 3 + ["compaction"]
    assert compacted.output[-1].encrypted_content.startswith("ls1.") and compacted.usage.output_tokens > 0
    follow = client.responses.create(model="loopserve-tiny",
                                     input=[o.model_dump(exclude_none=True) for o in compacted.output])
    assert follow.status == "completed"
    # delete
    deleted = client.responses.with_raw_response.delete(second.id)
    assert deleted.http_response.status_code == 200
    assert deleted.http_response.json() == {"id": second.id, "object": "response.deleted", "deleted": True}
    with pytest.raises(NotFoundError):
        client.responses.retrieve(second.id)
    with pytest.raises(NotFoundError):
        client.responses.delete(second.id)


def test_background_response_and_cancel(store_url):
    client = sdk(store_url)
    bg = client.responses.create(model="loopserve-tiny", input="work in the background", background=True)
    assert bg.status in ("queued", "in_progress")
    for _ in range(100):
        done = client.responses.retrieve(bg.id)
        if done.status == "completed":
            break
        time.sleep(0.05)
    assert done.status == "completed" and done.output_text
    with pytest.raises(BadRequestError):
        client.responses.cancel(client.responses.create(model="loopserve-tiny", input="x").id)
    # a long background response (~2 s of tokens), cancelled while it runs
    long = client.responses.create(model="loopserve-tiny", input=LONG_ONE, background=True, max_output_tokens=256)
    cancelled = client.responses.cancel(long.id)
    assert cancelled.status == "cancelled"
    assert client.responses.retrieve(long.id).status == "cancelled"
    with pytest.raises(BadRequestError) as cont:  # a cancelled response is not continued
        client.responses.create(model="loopserve-tiny", input="go on", previous_response_id=long.id)
    assert cont.value.body["code"] == "previous_response_blocked"
    with pytest.raises(BadRequestError):
        client.responses.create(model="loopserve-tiny", input="x", background=True, store=False)


def test_tenants_cannot_see_each_other(pg_url):
    a, b = sdk(pg_url, KEY_A), sdk(pg_url, KEY_B)
    mine = a.responses.create(model="loopserve-tiny", input="tenant a's secret plan")
    with pytest.raises(NotFoundError):
        b.responses.retrieve(mine.id)
    with pytest.raises(NotFoundError):
        b.responses.input_items.list(mine.id)
    with pytest.raises(NotFoundError):
        b.responses.delete(mine.id)
    with pytest.raises(BadRequestError) as e:
        b.responses.create(model="loopserve-tiny", input="continue it", previous_response_id=mine.id)
    assert e.value.body["code"] == "previous_response_not_found"
    assert a.responses.retrieve(mine.id).id == mine.id  # still there for its owner


async def test_auth_on_http_and_before_the_websocket_upgrade(pg_url):
    with pytest.raises(AuthenticationError):
        sdk(pg_url, "sk-wrong").responses.create(model="loopserve-tiny", input="x")
    r = httpx.post(pg_url + "/v1/responses", json={"model": "loopserve-tiny", "input": "x"}, timeout=10)
    assert r.status_code == 401 and r.json()["error"]["code"] == "missing_api_key"
    url = ws_url(pg_url)
    with pytest.raises(InvalidStatus) as e:
        async with connect(url, open_timeout=10):
            pass
    assert e.value.response.status_code in (401, 403)
    async with connect(url, open_timeout=10, additional_headers={"Authorization": f"Bearer {KEY_A}"}) as ws:
        await ws.send(json.dumps({"type": "response.create", "model": "loopserve-tiny", "input": "hi"}))
        while (ev := json.loads(await asyncio.wait_for(ws.recv(), 20)))["type"] not in TERMINAL:
            pass
        assert ev["type"] == "response.completed"


async def test_per_key_limits_answer_429(pg_url):
    limited = sdk(pg_url, KEY_LIMITED)
    url = ws_url(pg_url)
    headers = {"Authorization": f"Bearer {KEY_LIMITED}"}
    async with connect(url, open_timeout=10, additional_headers=headers):
        with pytest.raises(InvalidStatus) as e:
            async with connect(url, open_timeout=10, additional_headers=headers):
                pass
        assert e.value.response.status_code in (429, 403)
    codes = []
    for _ in range(5):
        try:
            limited.responses.create(model="loopserve-tiny", input="x")
            codes.append(200)
        except RateLimitError as err:
            codes.append(429)
            assert err.body["code"] == "rate_limit_exceeded"
    assert codes[:3] == [200, 200, 200] and codes[3:] == [429, 429]
    # Counted before the body is read: a key past its limit costs no parse (an invalid body is a 429, not a 400).
    raw = httpx.post(pg_url + "/v1/responses", content=b"{not json", timeout=30,
                     headers={"Authorization": f"Bearer {KEY_LIMITED}", "content-type": "application/json"})
    assert raw.status_code == 429 and raw.json()["error"]["code"] == "rate_limit_exceeded"
    # Reads have a window of their own (a GET of an evicted response loads its chain from the store).
    reads = []
    for _ in range(6):
        try:
            limited.responses.retrieve("resp_does_not_exist")
        except RateLimitError:
            reads.append(429)
        except NotFoundError:
            reads.append(404)
    assert reads == [404] * 4 + [429] * 2


async def test_reads_are_weighed_by_the_bytes_they_send(pg_url):
    """A count of reads let one key hold a replica's event loop with GETs of large responses
    (~3 ms of JSON and a copy each for 900 KB): reads are also limited by what they send."""
    reader = sdk(pg_url, KEY_READER)
    stored = reader.responses.create(model="loopserve-tiny", input="x", metadata={"pad": "p" * 500},
                                     instructions="i" * 1500)
    assert len(reader.responses.retrieve(stored.id).model_dump_json()) > 2048  # the first read sends it all
    with pytest.raises(RateLimitError) as refused:
        reader.responses.retrieve(stored.id)
    assert refused.value.body["code"] == "rate_limit_exceeded" and "2048 bytes read per minute" in refused.value.message
    with pytest.raises(RateLimitError):
        reader.responses.input_items.list(stored.id)
    reader.responses.create(model="loopserve-tiny", input="y")  # creates have their own budget


async def test_creates_are_weighed_by_the_bytes_they_send(pg_url):
    """A count of creates let one key fill a replica's event loop with creates of 10,000 items:
    their bytes count too, before the body is read (HTTP) or the frame parsed (WebSocket)."""
    writer = sdk(pg_url, KEY_WRITER)
    writer.responses.create(model="loopserve-tiny", input="x" * 3000, store=False)
    with pytest.raises(RateLimitError) as refused:
        writer.responses.create(model="loopserve-tiny", input="y" * 3000, store=False)
    assert refused.value.body["code"] == "rate_limit_exceeded" and "4096 input bytes sent per minute" in refused.value.message
    async with connect(ws_url(pg_url), open_timeout=10, additional_headers={"Authorization": f"Bearer {KEY_WRITER}"}) as ws:
        await ws.send(json.dumps({"type": "response.create", "model": "loopserve-tiny", "input": "z" * 3000}))
        ev = json.loads(await asyncio.wait_for(ws.recv(), 20))
        assert ev["type"] == "error" and ev["error"]["code"] == "rate_limit_exceeded"


async def test_conversation_survives_a_restart_of_every_actor(serve_instance):
    from ray import serve

    url = deploy_app("restart", "/restart", pg_app_args(), serve_instance, 240)
    client = sdk(url)
    first = client.responses.create(model="loopserve-tiny", input="remember this", tools=TOOLS)
    call = first.output[0]
    # let the post-inference write land, then take the whole app down and up again
    await asyncio.sleep(0.5)
    serve.delete("restart")
    url = deploy_app("restart", "/restart", pg_app_args(), serve_instance, 240)
    client = sdk(url)
    assert client.responses.retrieve(first.id).output[0].call_id == call.call_id
    # a socket continues the stored chain (loaded from PostgreSQL, rendered from scratch)
    async with connect(ws_url(url), open_timeout=10, additional_headers={"Authorization": f"Bearer {KEY_A}"}) as ws:
        await ws.send(json.dumps({"type": "response.create", "model": "loopserve-tiny", "tools": TOOLS,
                                  "previous_response_id": first.id,
                                  "input": [{"type": "function_call_output", "call_id": call.call_id,
                                             "output": "done"}]}))
        while (ev := json.loads(await asyncio.wait_for(ws.recv(), 30)))["type"] not in TERMINAL:
            pass
        assert ev["type"] == "response.completed", ev
        assert ev["response"]["previous_response_id"] == first.id
    stats = server_stats(url)
    assert stats["render"]["full_renders"] >= 1
    delete_in_background("restart")


def test_failed_and_filtered_background_responses_are_polled_not_404(store_url):
    client = sdk(store_url)
    failed = client.responses.create(model="loopserve-tiny", input="x", background=True,
                                     previous_response_id="resp_does_not_exist")
    filtered = client.responses.create(model="loopserve-tiny", background=True,
                                       input="here it is: -----BEGIN RSA PRIVATE KEY----- abc")
    for _ in range(200):
        a, b = client.responses.retrieve(failed.id), client.responses.retrieve(filtered.id)
        if a.status not in ("queued", "in_progress") and b.status not in ("queued", "in_progress"):
            break
        time.sleep(0.05)
    assert a.status == "failed" and a.error.code == "previous_response_not_found"
    assert b.status == "incomplete" and b.incomplete_details.reason == "content_filter"


def test_continuing_past_a_deleted_ancestor_fails_clearly(store_url):
    client = sdk(store_url)
    first = client.responses.create(model="loopserve-tiny", input="step one")
    second = client.responses.create(model="loopserve-tiny", input="step two", previous_response_id=first.id)
    third = client.responses.create(model="loopserve-tiny", input="step three", previous_response_id=second.id)
    time.sleep(0.5)  # let the post-inference store writes land
    client.responses.delete(second.id)
    with pytest.raises(BadRequestError) as e:
        client.responses.create(model="loopserve-tiny", input="step four", previous_response_id=third.id)
    assert e.value.body["code"] == "previous_response_chain_broken" and second.id in e.value.body["message"]
    ok = client.responses.create(model="loopserve-tiny", input="again", previous_response_id=first.id)
    assert ok.status == "completed"


@pytest.mark.parametrize("body, param", [
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "what is this?"},
                                             {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}]},
     "input[0].content[1]"),
    ({"input": "hi", "tool_choice": "bogus"}, "tool_choice"),
    ({"input": "hi", "tool_choice": {"type": "function", "name": "nope"}, "tools": TOOLS}, "tool_choice"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
])
def test_unsupported_input_is_a_400_naming_the_field(scripted_url, body, param):
    r = httpx.post(scripted_url + "/v1/responses", json={"model": "loopserve-tiny", **body}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    if "call_id" in param:
        assert r.json()["error"]["code"] == "missing_required_parameter"
        assert "'input[0].call_id'" in r.json()["error"]["message"]


def test_query_parameters_are_validated_and_named(scripted_url):
    r = httpx.get(scripted_url + "/v1/responses/resp_x/input_items", params={"limit": "many"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "limit"


def test_item_references_resolve_from_the_store(store_url):
    """`item_reference` inputs name stored items (input or output) of the tenant's responses."""
    client = sdk(store_url)
    first = client.responses.create(model="loopserve-tiny", input="Read the readme please", tools=TOOLS)
    call = first.output[0]
    assert call.type == "function_call" and call.id
    items = client.responses.input_items.list(first.id).data
    user_item_id = items[0].id
    deadline = time.time() + 10  # the store write is post-inference work
    while True:
        try:
            second = client.responses.create(
                model="loopserve-tiny", tools=TOOLS, store=False,
                input=[{"type": "item_reference", "id": user_item_id}, {"type": "item_reference", "id": call.id},
                       {"type": "function_call_output", "call_id": call.call_id, "output": "# loopserve"}])
            break
        except BadRequestError:
            if time.time() > deadline:
                raise
            time.sleep(0.2)
    assert second.status == "completed" and second.output[0].type == "message"  # it answered the tool result
    # the referenced items were rendered: the same context sent in full costs the same tokens
    full = client.responses.create(model="loopserve-tiny", tools=TOOLS, store=False, input=[
        {"type": "message", "role": "user", "content": "Read the readme please"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "# loopserve"}])
    assert second.usage.input_tokens == full.usage.input_tokens
    with pytest.raises(BadRequestError) as err:
        client.responses.create(model="loopserve-tiny", input=[{"type": "item_reference", "id": "msg_nope"}])
    assert err.value.body["param"] == "input[0]" and "msg_nope" in err.value.body["message"]
    if store_url.endswith("/pg"):  # the app with API keys: another tenant's item does not exist for it
        with pytest.raises(BadRequestError):
            sdk(store_url, KEY_B).responses.create(model="loopserve-tiny",
                                                   input=[{"type": "item_reference", "id": call.id}])


async def test_a_websocket_turn_compacts_in_the_turn_and_its_chain_continues(store_url):
    from tests.support.ws import turn

    async with connect(ws_url(store_url), open_timeout=10,
                       additional_headers={"Authorization": f"Bearer {KEY_A}"}) as ws:
        first = (await turn(ws, {"input": "Read the readme", "tools": TOOLS}))[-1]["response"]
        call = first["output"][0]
        evs = await turn(ws, {"previous_response_id": first["id"], "tools": TOOLS,
                              "context_management": [{"type": "compaction", "compact_threshold": 50}],
                              "input": [{"type": "function_call_output", "call_id": call["call_id"],
                                         "output": "# readme\n" + "a long readme line\n" * 60},
                                        {"role": "user", "content": "now summarise"}]})
        types = [e["type"] for e in evs]
        assert "response.compaction.compacting" in types and types[-1] == "response.completed", types
        compacted = evs[-1]["response"]
        assert compacted["output"][0]["type"] == "compaction"
        # the chain goes on from the compacted window, on the socket and (store: true) over HTTP
        [call] = [o for o in compacted["output"] if o["type"] == "function_call"]  # it went on with a call
        after = (await turn(ws, {"previous_response_id": compacted["id"], "tools": TOOLS, "input": [
            {"type": "function_call_output", "call_id": call["call_id"], "output": "done"}]}))[-1]
        assert after["type"] == "response.completed", after
        listed = sdk(store_url).responses.input_items.list(compacted["id"], order="asc")
        assert [i.type for i in listed.data] == ["message", "message", "compaction"]  # the window it ran on
        assert all("_summary" not in i.model_dump() for i in listed.data)

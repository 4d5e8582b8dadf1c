"""What a client sends is bounded before anything holds it: nesting depth, the names and keys
it picks, and the bytes a stored response's echo keeps alive."""


import pytest

from cluster.core.turn.cache import ResponseState, _size, estimate_nbytes
from cluster.core.turn.turn import TurnRequest, TurnScope
from cluster.protocol import ids
from cluster.protocol.errors import ApiError
from cluster.protocol.requests import (
    MAX_JSON_DEPTH,
    json_depth_error,
    parse_request,
    session_header,
)
from tests.support.harness import InProcessStack
from tests.support.peer import Peer


def nested(depth: int) -> dict:
    v: dict = {"type": "string"}
    for _ in range(depth - 1):
        v = {"type": "object", "properties": {"x": v}}
    return v


def test_tool_parameters_nested_too_deeply_are_a_400_naming_the_field():
    body = {"model": "m", "input": "hi", "tools": [{"type": "function", "name": "f", "parameters": nested(500)}]}
    with pytest.raises(ApiError) as err:
        parse_request(body)
    assert err.value.status == 400 and err.value.param == "tools" and "nested too deeply" in str(err.value)
    # a real schema's depth passes
    ok = {**body, "tools": [{"type": "function", "name": "f", "parameters": nested(10)}]}
    assert parse_request(ok).tools[0]["name"] == "f"


def test_the_depth_bound_is_exact_and_iterative():
    def chain(levels):
        v: list = []
        for _ in range(levels - 1):
            v = [v]
        return {"input": v}  # the body itself is one level
    assert json_depth_error(chain(MAX_JSON_DEPTH)) is None
    assert json_depth_error(chain(MAX_JSON_DEPTH + 1)).param == "input"
    assert json_depth_error(chain(100_000)) is not None  # no RecursionError


def test_size_accounting_does_not_recurse():
    v: dict = {}
    for _ in range(20_000):
        v = {"k": v}
    assert _size(v) == 20_000 * (64 + 49 + 1) + 64


@pytest.mark.parametrize("field, length", [("prompt_cache_key", 257), ("safety_identifier", 65), ("user", 257),
                                           ("model", 257), ("previous_response_id", 257)])
def test_names_a_client_picks_are_bounded_with_the_apis_error(field, length):
    with pytest.raises(ApiError) as err:
        parse_request({"model": "m", "input": "hi", field: "k" * length})
    assert err.value.status == 400 and err.value.param == field
    assert parse_request({"model": "m", "input": "hi", field: "k" * (length - 1)})


def test_x_session_id_is_bounded_and_session_keys_are_fixed_size_digests():
    with pytest.raises(ApiError) as err:
        session_header({"x-session-id": "s" * 257})
    assert err.value.param == "x-session-id"
    assert session_header({"x-session-id": "abc"}) == "abc" and session_header({}) is None
    a, b = ids.session_key("my-session"), ids.session_key("my-session")
    assert a == b and len(a) == 32 and a != "my-session"
    assert ids.session_key("other") != a
    assert len(ids.session_key(None)) == 32 and ids.session_key(None) != ids.session_key(None)
    # two tenants naming their sessions alike get keys of their own (routing, waits, engine tables)
    assert ids.session_key("my-session", "t1") != ids.session_key("my-session", "t2")


def test_the_response_echo_counts_against_the_cache_bounds():
    echo = {"user": "u" * 100_000, "safety_identifier": "s", "reasoning": {"effort": None, "extra": "r" * 50_000},
            "output": [], "tools": [], "instructions": None}
    state = ResponseState("resp_1", "m", [], 0, None, [], None, frozenset(), (), affinity_key="k" * 32,
                          response=echo)
    assert estimate_nbytes(state) > 150_000


async def test_a_deeply_nested_websocket_message_gets_an_error_and_the_socket_keeps_working(tokenizer):
    p = Peer(InProcessStack(tokenizer))
    deep = "[" * 200 + "]" * 200  # json.loads takes it; it is past the depth bound
    await p.frame('{"type": "response.steer", "response_id": "resp_x", "input": ' + deep + "}")
    await p.frame({"type": "response.create", "model": "loopserve-tiny", "input": "hi",
                   "tools": [{"type": "function", "name": "f", "parameters": nested(300)}]})
    await p.frame({"type": "response.create", "model": "loopserve-tiny", "input": "hi"})
    await p.idle()
    errors = [e for e in p.sent if e["type"] == "error"]
    assert [e["error"]["param"] for e in errors] == ["input", "tools"]
    assert p.types()[-1] == "response.completed"
    await p.session.shutdown()


def _driver_with_items(tokenizer, item: dict, limit: int):
    from cluster.core.turn.driver import TurnDriver
    from cluster.core.turn.prepare import TurnSettings

    stack = InProcessStack(tokenizer)
    fetches = []

    async def lookup(item_id, owner):
        fetches.append((item_id, owner))
        return dict(item) if item_id == "msg_big" else None

    settings = TurnSettings(model_name="loopserve-tiny", default_max_tokens=16, max_model_len=32768,
                            max_context_bytes=limit)
    return TurnDriver(settings, render=stack.render, engine=stack.engine_port, items=lookup), fetches


async def _first_error(driver, body):
    from cluster.core.turn.cache import SessionCache

    with pytest.raises(ApiError) as err:  # refused before the response is created
        [ev async for ev in driver.run(TurnRequest(parse_request(body), TurnScope(SessionCache(1), session_key="s", owner="t")))]
    return {"code": err.value.code, "param": err.value.param}


async def test_many_references_to_one_large_item_stop_at_the_context_limit_after_one_fetch(tokenizer):
    big = {"type": "message", "role": "user", "content": "x" * 300_000}
    driver, fetches = _driver_with_items(tokenizer, big, limit=1024 * 1024)
    body = {"model": "loopserve-tiny", "input": [{"type": "item_reference", "id": "msg_big"}] * 200}
    err = await _first_error(driver, body)
    assert err["code"] == "context_too_large"
    assert fetches == [("msg_big", "t")]  # fetched once, for its tenant


async def test_too_many_item_references_are_refused_before_any_fetch(tokenizer):
    from cluster.core.turn.prepare import MAX_ITEM_REFERENCES

    driver, fetches = _driver_with_items(tokenizer, {"type": "message", "role": "user", "content": "hi"}, 10**9)
    body = {"model": "loopserve-tiny", "input": [{"type": "item_reference", "id": f"msg_{i}"}
                                                 for i in range(MAX_ITEM_REFERENCES + 1)]}
    err = await _first_error(driver, body)
    assert err["code"] == "array_above_max_length" and fetches == []


def test_pattern_expansion_adds_sequences_and_multiplies_nesting():
    from cluster.core.turn.controls import pattern_expansion

    assert pattern_expansion(r"^\d{3}-\d{4}$") == 8
    assert pattern_expansion("^(a|b){16000}$") == 32_000
    assert pattern_expansion("((a{200}){200})") == 40_000
    assert pattern_expansion(r"^[a-z0-9._%+-]{1,64}@[a-z0-9.-]{1,255}\.[a-z]{2,}$") == 64 + 1 + 255 + 1 + 2
    assert pattern_expansion("[{]x{2}") == 3  # a brace inside a class is a character


def _controls(body):
    from cluster.core.turn.context import normalize_tools
    from cluster.core.turn.controls import check_output_controls

    req = parse_request({"model": "m", "input": "hi", **body})
    check_output_controls(req, normalize_tools(req.tools), model="m", can_force_tool_calls=True)


def test_a_schema_whose_grammar_would_stall_the_engine_is_a_400_before_it_gets_there():
    slow = {"type": "string", "pattern": "^(a|b){16000}$"}  # 48 s in vLLM's grammar compiler here
    with pytest.raises(ApiError) as err:
        _controls({"text": {"format": {"type": "json_schema", "name": "x", "schema": slow}}})
    assert err.value.status == 400 and err.value.param == "text.format.schema"
    with pytest.raises(ApiError) as err:
        _controls({"tools": [{"type": "function", "name": "f", "parameters": {
            "type": "object", "properties": {"s": slow}}}], "tool_choice": "required"})
    assert err.value.param == "tools[0].parameters"
    with pytest.raises(ApiError) as err:
        _controls({"text": {"format": {"type": "json_schema", "name": "x", "schema": {
            "type": "object", "patternProperties": {"x" * 2000: {"type": "string"}}}}}})
    assert "at most 1000" in str(err.value)
    # schemas real clients send pass
    email = {"type": "object", "properties": {"email": {"type": "string", "pattern": r"^[^@]{1,64}@[^@]{1,255}$"},
                                              "zip": {"type": "string", "pattern": r"^\d{5}(-\d{4})?$"}}}
    _controls({"text": {"format": {"type": "json_schema", "name": "x", "schema": email}}})
    # the tools' parameters only matter when a call is forced (no grammar otherwise)
    _controls({"tools": [{"type": "function", "name": "f", "parameters": {"type": "object", "properties": {"s": slow}}}]})


async def test_invalid_frames_behind_a_running_response_are_bounded_then_the_socket_closes_1008(tokenizer):
    import asyncio

    p = Peer(InProcessStack(tokenizer, tokens_per_second=20), max_queued_creates=8)
    await p.frame({"type": "response.create", "model": "loopserve-tiny", "input": "a long answer please"})
    await asyncio.sleep(0.2)  # it runs on the default lane: the frames' errors wait behind it
    for _ in range(50):
        await p.frame("x")
        await asyncio.sleep(0.01)  # the worker moves each frame to the lane as its error
        assert p.session.protocol.deferred_errors <= 8
    assert p.closed == 1008
    assert [e["error"]["code"] for e in p.sent if e["type"] == "error"][-1] == "too_many_errors"
    await p.session.shutdown()


async def test_records_waiting_for_a_slow_store_are_bounded_by_bytes_and_drops_are_counted():
    import asyncio

    from cluster.core.turn.post_work import PostWorkQueue, TurnRecord

    async def store_down(record):
        raise RuntimeError("store unavailable")

    queue = PostWorkQueue(retries=1, backoff_s=0.01, max_retry_bytes=10_000)
    queue.add("persist", store_down, retry_for_s=1.0)
    big = ResponseState("resp_big", "m", [{"type": "message", "role": "user", "content": "x" * 4000}], 1, None, [],
                        None, frozenset(), ())
    for i in range(20):
        queue.schedule(TurnRecord(f"resp_{i}", "m", "t", "completed", {}, True, state=big))
    await asyncio.sleep(0.05)
    assert queue.retry_bytes <= 10_000 and queue.dropped >= 17  # at most two records' states fit the bound
    await queue.drain(5)
    assert queue.retry_bytes == 0 and queue.stats()["dropped"] == queue.dropped


async def test_a_hook_that_hangs_is_a_failed_attempt():
    import asyncio

    from cluster.core.turn.post_work import PostWorkQueue, TurnRecord

    async def hangs(record):
        await asyncio.Event().wait()

    queue = PostWorkQueue({"hangs": hangs}, retries=0, attempt_timeout_s=0.05)
    queue.schedule(TurnRecord("r", "m", None, "completed", {}, True))
    await queue.drain(5)
    assert queue.failed_by == {"hangs": 1} and queue.pending == 0


def test_steering_input_a_connection_holds_is_bounded_in_bytes():
    from cluster.core.turn.cache import SessionCache
    from cluster.core.websocket import steering
    from cluster.core.websocket.inflight import InFlight, WsCreate

    inflight = InFlight()
    running = WsCreate({}, None, None, steerable=True, calls=1)  # owes a tool call: steers wait for its end
    inflight.started(running, "resp_run")
    kinds = []
    for _ in range(steering.MAX_STEERS_PER_RESPONSE):
        events = inflight.steer({"type": "response.steer", "previous_response_id": "resp_run",
                                 "input": "x" * 600_000}, SessionCache(), [])
        kinds.append(events[0]["type"])
    assert kinds[:3] == ["response.steer.accepted"] * 3  # ~1.2 MB held each
    assert kinds[3:] == ["response.steer.failed"] * 5
    assert inflight.steer_bytes() <= steering.MAX_STEER_BYTES


async def test_a_response_without_an_owner_is_no_tenants_and_is_never_stored(tokenizer, tmp_path):
    """Item 9: a missing owner never stands for tenant "default" (nor for anyone)."""
    from cluster.core.turn.cache import SessionCache
    from cluster.core.turn.post_work import TurnRecord
    from cluster.serving.responses import ResponsesService
    from cluster.store.sqlite import SQLiteStore

    stack = InProcessStack(tokenizer)
    states = []
    [ev async for ev in stack.driver.run(TurnRequest(parse_request({"input": "hi"}), TurnScope(SessionCache(4), session_key="s", on_state=states.append)))]
    state = states[-1]
    assert state.owner is None
    store = SQLiteStore(str(tmp_path / "s.db"))
    await store.start()
    try:
        registry = SessionCache(16)
        service = ResponsesService(stack.driver, registry, store)
        registry.put(state)
        for tenant in ("default", "anyone"):
            assert await service.lookup(state.response_id, tenant) is None
            with pytest.raises(ApiError):
                await service.delete(state.response_id, tenant)
        await service.persist(TurnRecord(response_id=state.response_id, model="loopserve-tiny", owner=None,
                                         status="completed", usage={}, store=True, response=state.response,
                                         state=state))
        assert await store.get(state.response_id, "default") is None
    finally:
        await store.close()


async def test_a_continuation_never_crosses_from_a_tenant_to_no_tenant(tokenizer):
    from cluster.core.turn.cache import SessionCache
    from cluster.protocol.errors import ApiError as Err

    stack = InProcessStack(tokenizer)
    cache = SessionCache(4)
    states = []
    [ev async for ev in stack.driver.run(TurnRequest(parse_request({"input": "hi"}), TurnScope(cache, session_key="s", owner="default", on_state=states.append)))]
    with pytest.raises(Err) as err:  # the same cache, no tenant: as if it did not exist
        [ev async for ev in stack.driver.run(TurnRequest(parse_request({"input": "more", "previous_response_id":
                                                            states[-1].response_id}), TurnScope(cache, session_key="s")))]
    assert err.value.code == "previous_response_not_found"

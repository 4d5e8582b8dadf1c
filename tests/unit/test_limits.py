"""Memory a client controls is bounded: per socket, per replica, per engine; no silent stand-ins."""

import asyncio
import base64
import json

import pytest

from cluster.core.messages import Generation
from cluster.config import ModelConfig, ScriptedEngineConfig, WebSocketConfig
from cluster.core.turn.cache import CacheMemory, ResponseState, SessionCache
from cluster.core.turn.turn import TurnScope
from cluster.core.websocket.session import WebSocketSession
from cluster.engines.base import EngineRequest, RecentKeys
from cluster.engines.scripted.engine import MAX_CACHED_SESSIONS, ScriptedEngine
from cluster.protocol.errors import ApiError
from cluster.protocol.requests import parse_request
from tests.support.harness import InProcessStack


def state(rid: str, payload: int) -> ResponseState:
    items = [{"type": "message", "role": "user", "content": "x" * payload}]
    return ResponseState(response_id=rid, model="m", items=items, output_start=1, instructions=None, tools=[],
                         rendered=None, known_call_ids=frozenset(), pending_call_ids=())


def test_payload_that_is_not_rendered_is_counted():
    image = "data:image/png;base64," + base64.b64encode(b"\0" * (10 * 1024 * 1024)).decode()
    items = [{"type": "message", "role": "user",
              "content": [{"type": "input_text", "text": "look"}, {"type": "input_image", "image_url": image}]},
             {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "e" * 500_000,
              "extra": {"nested": ["y" * 300_000]}}]
    s = ResponseState(response_id="r", model="m", items=items, output_start=2, instructions=None, tools=[],
                      rendered=None, known_call_ids=frozenset(), pending_call_ids=())
    assert s.nbytes > len(image) + 800_000


def test_replica_bound_empties_the_least_recently_used_connections():
    memory = CacheMemory(max_entries=64, max_bytes_per_cache=10**9, max_bytes=50_000)
    caches = [memory.socket_cache() for _ in range(10)]
    for i, cache in enumerate(caches):
        for turn in range(3):
            cache.put(state(f"r{i}-{turn}", 8_000))
        assert memory.nbytes <= 50_000 + caches[i].nbytes  # only the writer may hold its latest beyond
    assert memory.nbytes == sum(c.nbytes for c in caches) <= 50_000
    # the newest connections keep their latest response; the oldest were emptied first
    assert "r9-2" in caches[9] and "r8-2" in caches[8]
    assert len(caches[0]) == 0 and memory.reclaimed > 0
    caches[9].clear()
    assert memory.nbytes == sum(c.nbytes for c in caches)


def test_a_socket_cache_alone_keeps_its_latest_even_when_large():
    c = SessionCache(max_entries=4, max_bytes=1_000)
    c.put(state("a", 5_000))
    assert "a" in c
    c.put(state("b", 5_000))
    assert list(c) == ["b"]


async def test_oversized_frames_are_never_queued_and_queued_bytes_are_bounded(tokenizer):
    stack = InProcessStack(tokenizer, tokens_per_second=50)  # a slow turn keeps later frames queued
    sent = []

    async def send(ev):
        sent.append(ev)

    async def close(code, reason):
        pass

    cfg = WebSocketConfig(max_frame_bytes=1024, max_queued_bytes=4096, max_queued_creates=100)
    session = WebSocketSession(stack.driver, TurnScope(SessionCache(), session_key="s", transport="websocket"),
                               config=cfg, send=send, close=close)
    session.start()
    await session.on_frame(json.dumps({"type": "response.create", "input": "talk for a while"}))
    big = "x" * (1024 * 1024)
    for _ in range(64):
        await session.on_frame(big)  # 64 MiB offered with a 1 KiB limit
    # nothing of them is held: only their errors wait in the FIFO, each a few hundred bytes
    assert session.protocol.deferred_errors == 64 and session.protocol.queued_bytes < 64 * 512
    await asyncio.wait_for(session.wait_idle(), 30)
    too_large = [e for e in sent if e.get("error", {}).get("code") == "websocket_message_too_large"]
    assert len(too_large) == 64
    # FIFO order: the errors come after the response that was in flight when they arrived
    first_terminal = next(i for i, e in enumerate(sent) if e["type"] == "response.completed")
    assert sent.index(too_large[0]) > first_terminal
    assert session.protocol.queued_bytes == 0
    small = json.dumps({"type": "response.create", "input": "y" * 500})
    for _ in range(8):
        await session.on_frame(small)  # each holds ~1 KB parsed: 4 fit in 4 KiB, the rest are refused
    assert session.protocol.queued_bytes <= 4096
    refused = [e for e in sent if e.get("error", {}).get("code") == "rate_limit_exceeded"]
    assert len(refused) == 4
    await asyncio.wait_for(session.wait_idle(), 30)
    assert len([e for e in sent if e["type"] == "response.completed"]) == 5
    await session.shutdown()


def test_engine_session_keys_and_prefix_cache_are_bounded():
    keys = RecentKeys(3)
    for k in "abcde":
        keys.add(k)
    assert len(keys) == 3 and "a" not in keys and "e" in keys

    engine = ScriptedEngine(ModelConfig(), ScriptedEngineConfig(tokens_per_second=1e6, prefill_tokens_per_second=1e9),
                            encode=lambda s: [ord(c) % 100 for c in s], decode=lambda ids: "".join(chr(65 + i % 26) for i in ids))

    async def run_many():
        for i in range(MAX_CACHED_SESSIONS + 50):  # a fresh session key per stateless request
            req = EngineRequest(request_id=f"q{i}", session_key=f"s{i}", prompt_token_ids=__import__("array").array("i", [1, 2, 3]),
                                generation=Generation(1))
            async for _ in engine.generate(req):
                pass

    asyncio.run(run_many())
    assert len(engine._seen) <= MAX_CACHED_SESSIONS
    assert len(engine.stats.sessions) <= engine.stats.sessions.limit


def test_scripted_prefix_cache_is_per_tenant_salt():
    from array import array

    engine = ScriptedEngine(ModelConfig(), ScriptedEngineConfig(tokens_per_second=1e6, prefill_tokens_per_second=1e9),
                            encode=lambda s: [ord(c) % 100 for c in s], decode=lambda ids: "x" * len(ids))

    async def cached(salt):
        req = EngineRequest(request_id=f"q-{salt}-{id(object())}", session_key="same-session",
                            prompt_token_ids=array("i", range(100)), generation=Generation(1), cache_salt=salt)
        async for d in engine.generate(req):
            last = d
        return last.cached_tokens

    async def scenario():
        return [await cached("tenant-a"), await cached("tenant-b"), await cached("tenant-a")]

    assert asyncio.run(scenario()) == [0, 0, 99]


@pytest.mark.parametrize("choice", ["bogus", {"type": "function"}, {"name": "read_file"}, 7])
def test_invalid_tool_choice_is_rejected(choice):
    with pytest.raises(ApiError) as e:
        parse_request({"input": "hi", "tool_choice": choice, "tools": [{"type": "function", "name": "read_file"}]})
    assert e.value.status == 400 and e.value.param == "tool_choice"


def test_named_tool_choice_must_name_an_offered_tool():
    with pytest.raises(ApiError) as e:
        parse_request({"input": "hi", "tool_choice": {"type": "function", "name": "write_file"},
                       "tools": [{"type": "function", "name": "read_file"}]})
    assert "write_file" in e.value.message
    for ok in ("none", "auto", "required", {"type": "function", "name": "read_file"},
               {"type": "allowed_tools", "mode": "auto", "tools": [{"type": "function", "name": "read_file"}]}):
        parse_request({"input": "hi", "tool_choice": ok, "tools": [{"type": "function", "name": "read_file"}]})


def test_text_frames_are_measured_in_utf8_bytes():
    from cluster.protocol.request_bounds import frame_bytes

    assert frame_bytes("abc") == 3 and frame_bytes(b"abc") == 3
    assert frame_bytes("é" * 1000) == 2000  # a limit in bytes is not dodged with multi-byte text


def test_scripted_prefix_cache_is_shared_across_sessions_of_a_tenant():
    """Like vLLM's: a stateless client with a new session key per request still hits its prefix."""
    from array import array

    engine = ScriptedEngine(ModelConfig(), ScriptedEngineConfig(tokens_per_second=1e6, prefill_tokens_per_second=1e9),
                            encode=lambda s: [ord(c) % 100 for c in s], decode=lambda ids: "x" * len(ids))

    async def cached(session, salt, n):
        req = EngineRequest(request_id=f"q-{session}-{n}", session_key=session, generation=Generation(1), cache_salt=salt,
                            prompt_token_ids=array("i", range(n)))
        async for d in engine.generate(req):
            last = d
        return last.cached_tokens

    async def scenario():
        return [await cached("s1", "a", 200), await cached("s2", "a", 300), await cached("s3", "b", 300),
                await cached("s4", "a", 50)]

    # s2 hits the 200 tokens s1 left; another tenant does not; a prompt shorter than the head index misses
    assert asyncio.run(scenario()) == [0, 200, 0, 0]

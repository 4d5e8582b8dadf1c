from array import array

from cluster.core.turn.cache import (
    RenderedPrefix,
    RenderKey,
    ResponseState,
    SessionCache,
)


def state(rid: str, tokens: int = 10, text: str = "x") -> ResponseState:
    return ResponseState(
        response_id=rid,
        model="m",
        items=[{"type": "message", "role": "user", "content": text}],
        output_start=0,
        instructions=None,
        tools=[],
        rendered=RenderedPrefix(RenderKey.of(None, []), 1, array("i", range(tokens)), 0),
        known_call_ids=frozenset(),
        pending_call_ids=(),
    )


def test_lru_by_entries():
    c = SessionCache(max_entries=2)
    c.put(state("a"))
    c.put(state("b"))
    assert c.get("a") is not None  # a is now most recently used
    c.put(state("c"))
    assert "b" not in c and "a" in c and "c" in c
    assert c.evictions == 1


def test_bounded_by_bytes():
    c = SessionCache(max_entries=100, max_bytes=10_000)
    for i in range(50):
        c.put(state(f"r{i}", tokens=500))
    assert c.nbytes <= 10_000
    assert len(c) < 50


def test_keeps_latest_even_when_over_the_byte_bound():
    c = SessionCache(max_entries=10, max_bytes=100)
    c.put(state("small", tokens=1))
    c.put(state("huge", tokens=100_000))
    assert "huge" in c and "small" not in c


def test_evict_and_counters():
    c = SessionCache()
    c.put(state("a"))
    assert c.evict("a") is True
    assert c.evict("a") is False
    assert c.get("a") is None and c.misses == 1
    assert c.nbytes == 0


def test_bytes_are_what_python_holds_not_characters_and_the_render_keys_tools_count():
    import sys

    ascii_state, wide_state = state("a", text="x" * 100_000), state("w", text="\U0001F600" * 100_000)
    assert wide_state.context_bytes - ascii_state.context_bytes >= 3 * 100_000  # 4 bytes a character
    assert wide_state.context_bytes >= sys.getsizeof("\U0001F600" * 100_000)
    tools = [{"type": "function", "name": "f", "description": "d" * 50_000}]
    with_tools = ResponseState(response_id="t", model="m", items=[], output_start=0, instructions=None, tools=tools,
                               rendered=RenderedPrefix(RenderKey.of(None, tools), 0, array("i"), 0),
                               known_call_ids=frozenset(), pending_call_ids=())
    assert with_tools.nbytes >= 2 * 50_000  # the tools and the render key's JSON copy of them

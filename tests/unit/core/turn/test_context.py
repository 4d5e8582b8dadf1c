import pytest

from cluster.core.turn.context import normalize_tools, resolve_context
from cluster.protocol.errors import ApiError


def fc(cid):
    return {"type": "function_call", "call_id": cid, "name": "f", "arguments": "{}"}


def out(cid):
    return {"type": "function_call_output", "call_id": cid, "output": "ok"}


def user(t="hi"):
    return {"type": "message", "role": "user", "content": t}


def test_output_without_call_is_rejected():
    with pytest.raises(ApiError) as e:
        resolve_context([user(), out("nope")], None)
    assert e.value.message == "No tool call found for function call output with call_id nope."
    assert e.value.param == "input" and e.value.status == 400


def test_call_without_output_is_rejected_when_a_turn_starts():
    with pytest.raises(ApiError) as e:
        resolve_context([user(), fc("c1"), user("again")], None)
    assert e.value.message == "No tool output found for function call c1."


def test_pairing_spans_the_cached_history():
    from cluster.core.turn.cache import ResponseState

    parent = ResponseState(
        response_id="r1", model="m", items=[user(), fc("c1")], output_start=1, instructions=None, tools=[],
        rendered=None, known_call_ids=frozenset({"c1"}), pending_call_ids=("c1",),
    )
    ctx = resolve_context([out("c1")], parent)
    assert ctx.items[-1]["call_id"] == "c1" and ctx.new_start == 2 and ctx.pending_call_ids == ()
    with pytest.raises(ApiError, match="No tool output found for function call c1"):
        resolve_context([user("ignored the call")], parent)


def test_namespace_tools_expose_their_functions_and_other_tools_are_accepted():
    tools = normalize_tools(
        [
            {"type": "function", "name": "a", "parameters": {"type": "object"}},
            {"type": "namespace", "name": "mcp", "tools": [{"type": "function", "name": "b"}]},
            {"type": "web_search"},
        ]
    )
    assert [t["function"]["name"] for t in tools] == ["a", "b"]

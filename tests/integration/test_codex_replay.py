"""Codex's history replayed over HTTP + SSE (what it sends after falling back from WebSocket
mode): the shapes peers broke on (vLLM #45273 / #45276) are accepted and rendered. Each case
posts a replayed history with the real openai SDK and checks the answer completed and that the
replayed item reached the prompt (more input tokens than without it)."""

import pytest

pytestmark = pytest.mark.integration

USER = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Fix the failing test."}]}
NEXT = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Go on."}]}
SHELL = {"type": "function", "name": "shell", "description": "Run a command",
         "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
         "strict": False}

# name -> (replayed items between USER and NEXT, tools)
SHAPES = {
    "assistant message without id or status": (
        [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Looking at it now."}]}],
        [SHELL]),
    "reasoning item without id (summary only)": (
        [{"type": "reasoning", "summary": [{"type": "summary_text", "text": "Run the tests first."}]},
         {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Running them."}]}],
        [SHELL]),
    "assistant message with empty content": (
        [{"type": "message", "role": "assistant", "content": []},
         {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Done reading."}]}],
        [SHELL]),
    "function_call whose arguments are not valid JSON": (
        [{"type": "function_call", "call_id": "call_bad1", "name": "shell",
          "arguments": '{"command": "pytest -q"} {"extra": true}'},
         {"type": "function_call_output", "call_id": "call_bad1", "output": "1 failed, 3 passed"}],
        [SHELL]),
    "namespace tool with nested functions": (
        [{"type": "function_call", "call_id": "call_ns1", "name": "read_file", "arguments": '{"path": "a.py"}'},
         {"type": "function_call_output", "call_id": "call_ns1", "output": "x = 1"}],
        [{"type": "namespace", "name": "fs", "description": "File tools", "tools": [
            {"type": "function", "name": "read_file", "description": "Read a file",
             "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}]}]),
    "flat tool schema without parameters": (
        [{"type": "function_call", "call_id": "call_flat1", "name": "list_dir", "arguments": "{}"},
         {"type": "function_call_output", "call_id": "call_flat1", "output": "a.py b.py"}],
        [{"type": "function", "name": "list_dir", "description": "List the directory"}]),
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_a_replayed_history_shape_is_accepted_and_rendered(scripted_url, client_for, shape):
    client = client_for(scripted_url)
    items, tools = SHAPES[shape]
    with client.responses.stream(model="loopserve-tiny", input=[USER, *items, NEXT], tools=tools,
                                 store=False) as stream:
        events = [e.type for e in stream]
        resp = stream.get_final_response()
    assert events[0] == "response.created" and events[-1] == "response.completed"
    without = client.responses.create(model="loopserve-tiny", input=[USER, NEXT], tools=tools, store=False)
    assert resp.usage.input_tokens > without.usage.input_tokens  # the replayed items were rendered

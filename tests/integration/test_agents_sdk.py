"""The OpenAI Agents SDK, unmodified, over WebSocket mode against a real Serve app: its
`responses_websocket_session` keeps one socket for an agent's runs, and chained model calls send
only their new items (the scripted engine plays the model: it calls the first tool after a user
message and answers after a tool result)."""

from __future__ import annotations

import pytest

from tests.support.local_cluster import stats
from tests.support.apps import SCRIPTED_ANSWER

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


async def test_an_agent_runs_its_tool_loop_over_one_socket_sending_only_new_items(scripted_url):
    from agents import Agent, function_tool, set_tracing_disabled
    from agents.responses_websocket_session import responses_websocket_session

    set_tracing_disabled(True)  # no export to OpenAI's trace ingest from a test
    read: list[str] = []

    @function_tool
    def read_file(path: str) -> str:
        """Read a file of the repository."""
        read.append(path)
        return f"# {path}\n" + "line\n" * 200

    agent = Agent(name="coder", instructions="You are a coding agent.", tools=[read_file], model="loopserve-tiny")
    before = stats(scripted_url)
    async with responses_websocket_session(api_key="sk-test", base_url=scripted_url + "/v1") as session:
        first = await session.run(agent, "Read the README", auto_previous_response_id=True)
        # a second run continues the first by its id, streamed
        second = session.run_streamed(agent, "Read it again", previous_response_id=first.last_response_id)
        kinds = [event.type async for event in second.stream_events()]
    after = stats(scripted_url)

    assert first.final_output == second.final_output == SCRIPTED_ANSWER
    assert len(read) == 2 and all(isinstance(p, str) and p for p in read), read  # the tool ran with the model's args
    assert "raw_response_event" in kinds and "run_item_stream_event" in kinds
    calls = first.raw_responses + second.raw_responses
    assert len(calls) == 4  # per run: the tool call, then the answer
    # every model call after the first reused the engine's prefix of the one before it
    assert all(r.usage.input_tokens_details.cached_tokens > 0 for r in calls[1:]), [r.usage for r in calls]
    # all four went over WebSocket mode, and each chained call rendered only its new items
    ws = after["turn_transport"].get("websocket", 0) - before["turn_transport"].get("websocket", 0)
    http = after["turn_transport"].get("http", 0) - before["turn_transport"].get("http", 0)
    assert (ws, http) == (4, 0), after["turn_transport"]
    render_before, render_after = before["render_inline"], after["render_inline"]
    assert render_after["delta_renders"] - render_before["delta_renders"] == 3, render_after
    assert render_after["fallbacks"] == render_before["fallbacks"], render_after  # none rendered whole

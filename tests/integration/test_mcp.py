"""Remote MCP tools run by the server, on a real Serve app (scripted engine, SQLite store) with a
real MCP server (the `mcp` package's MCPServer over streamable HTTP, in this process): the Agents
SDK's `HostedMCPTool` over HTTP and over WebSocket mode, with and without approvals.

The scripted engine is the named stand-in for a model here (`task_rules`): it advances a task
one step at a time through the server's `advance` tool and answers after the tenth step, so a
task is ten MCP calls the cluster runs itself, in one response when no approval is required."""

from __future__ import annotations

import pytest

from cluster.bench.mcp_server import TASK_DONE, TASK_PROMPT, McpTestServer, task_rules
from tests.support.apps import module_app, scripted_app
from tests.support.local_cluster import stats

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]
STEPS = 10


@pytest.fixture(scope="module")
def mcp_url():
    with McpTestServer() as url:
        yield url + "/mcp"


@pytest.fixture(scope="module")
def mcp_app(serve_instance, mcp_url):
    args = scripted_app({"tokens_per_second": 2000, "answer_rules": task_rules(STEPS)},
                        # the MCP server is on this machine: an operator's own network
                        mcp={"allow_private_networks": True, "allow_http": True, "call_timeout_s": 10})
    yield from module_app("mcp", "/mcp-app", args, serve_instance, 240)


def agent_with(mcp_url: str, require_approval: str, approvals: list | None = None):
    from agents import Agent, HostedMCPTool, ModelSettings

    def approve(request):
        approvals.append(request.data.name)
        return {"approve": True}

    tool = HostedMCPTool(tool_config={"type": "mcp", "server_label": "tasks", "server_url": mcp_url,
                                      "allowed_tools": ["advance"], "require_approval": require_approval,
                                      "headers": {"Authorization": "Bearer task-token"}},
                         on_approval_request=approve if approvals is not None else None)
    # max_output_tokens bounds a whole response, its ten steps together
    return Agent(name="worker", instructions="Do the task.", tools=[tool], model="loopserve-tiny",
                 model_settings=ModelSettings(max_tokens=4096))


def calls_of(result) -> list:
    return [item for r in result.raw_responses for item in r.output if item.type == "mcp_call"]


async def test_an_agent_runs_a_ten_step_mcp_task_in_one_response_over_http(mcp_app, mcp_url):
    from agents import Runner, set_default_openai_client, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    set_default_openai_client(AsyncOpenAI(base_url=mcp_app + "/v1", api_key="sk-test", max_retries=0, timeout=120),
                              use_for_tracing=False)
    result = await Runner.run(agent_with(mcp_url, "never"), TASK_PROMPT)
    assert result.final_output == TASK_DONE
    assert len(result.raw_responses) == 1  # no client round trip between the steps
    calls = calls_of(result)
    assert [c.output for c in calls] == [f"STEP-{n} reached" for n in range(1, STEPS + 1)]
    listed = [i for i in result.raw_responses[0].output if i.type == "mcp_list_tools"]
    assert [t.name for t in listed[0].tools] == ["add", "read_note", "write_note", "advance"]
    assert all("task-token" not in item.model_dump_json() for item in result.raw_responses[0].output)  # never echoed


async def test_with_approvals_each_call_waits_for_the_agent_and_its_approval_continues(mcp_app, mcp_url):
    from agents import set_tracing_disabled
    from agents.responses_websocket_session import responses_websocket_session

    set_tracing_disabled(True)
    approvals: list[str] = []
    before = stats(mcp_app)
    async with responses_websocket_session(api_key="sk-test", base_url=mcp_app + "/v1") as session:
        result = await session.run(agent_with(mcp_url, "always", approvals), TASK_PROMPT, max_turns=30)
    after = stats(mcp_app)
    assert result.final_output == TASK_DONE
    assert approvals == ["advance"] * STEPS  # each call was approved by the agent before it ran
    assert [c.output for c in calls_of(result)] == [f"STEP-{n} reached" for n in range(1, STEPS + 1)]
    assert all(c.approval_request_id for c in calls_of(result))
    ws = after["turn_transport"].get("websocket", 0) - before["turn_transport"].get("websocket", 0)
    assert ws == STEPS + 1  # every response went over the socket


def test_the_task_streams_over_sse_and_runs_in_background_mode(mcp_app, mcp_url):
    """The openai SDK: the same ten-step task over SSE (every call's events in one stream), and as
    a background response polled until it is done."""
    import time

    from openai import OpenAI

    client = OpenAI(base_url=mcp_app + "/v1", api_key="sk-test", max_retries=0, timeout=120)
    tool = {"type": "mcp", "server_label": "tasks", "server_url": mcp_url, "allowed_tools": ["advance"],
            "require_approval": "never", "headers": {"Authorization": "Bearer task-token"}}
    with client.responses.create(model="loopserve-tiny", input=TASK_PROMPT, tools=[tool], stream=True,
                                 max_output_tokens=4096) as stream:
        types = [event.type for event in stream]
    assert types.count("response.mcp_call.completed") == STEPS and types[-1] == "response.completed", " ".join(types)
    assert types.count("response.mcp_list_tools.completed") == 1

    queued = client.responses.create(model="loopserve-tiny", input=TASK_PROMPT, tools=[tool], background=True,
                                     max_output_tokens=4096)  # the ten steps together
    assert queued.status in ("queued", "in_progress")
    deadline = time.monotonic() + 120
    while (done := client.responses.retrieve(queued.id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline, done.status
        time.sleep(0.5)
    assert done.status == "completed" and done.output_text == TASK_DONE
    calls = [i for i in done.output if i.type == "mcp_call"]
    assert [c.output for c in calls] == [f"STEP-{n} reached" for n in range(1, STEPS + 1)]
    assert "task-token" not in done.model_dump_json()  # nor stored with the response

"""The Conversations API on a real Serve app (scripted engine, PostgreSQL store, two connection
replicas, two tenants) with the real clients: the openai SDK's `conversations` resource and
`responses.create(conversation=...)` over HTTP and WebSocket mode (`responses.connect()`), and the
Agents SDK's `OpenAIConversationsSession` and `Runner.run(conversation_id=...)`.

The scripted engine answers SECRET_ANSWER whenever the prompt holds SECRET: a turn that does not
say it answers so only if the conversation's history reached the engine."""

from __future__ import annotations

import time

import httpx
import pytest
from openai import AsyncOpenAI, BadRequestError, NotFoundError, OpenAI

from tests.support.apps import KEY_A, KEY_B, SCRIPTED_ANSWER, module_app, pg_app_args
from tests.support.local_cluster import admin_headers
from tests.support.ws import sdk_response

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]
SECRET, SECRET_ANSWER = "OKAPI-77", "Your secret is OKAPI-77."


@pytest.fixture(scope="module")
def conv_url(serve_instance):
    args = pg_app_args()
    args["engine"]["scripted"] = {"tokens_per_second": 2000, "max_output_tokens": 256, "answer_text": SCRIPTED_ANSWER,
                                  "answer_rules": [{"contains": SECRET, "text": SECRET_ANSWER}]}
    args["connection"] = {"num_replicas": 2, "ray_actor_options": {"num_cpus": 0.05}}
    yield from module_app("conversations", "/conv", args, serve_instance, 240)


def sdk(url: str, key: str = KEY_A) -> OpenAI:
    return OpenAI(base_url=url + "/v1", api_key=key, timeout=60, max_retries=0)


def replica_pid(url: str, session: str) -> int:
    """Which connection replica a request with this `x-session-id` reaches (the proxy routes by it)."""
    r = httpx.get(url + "/loopserve/stats", params={"last": 0}, timeout=30,
                  headers={**admin_headers(), "x-session-id": session})
    return r.json()["pid"]


def sessions_on_both_replicas(url: str, n: int) -> list[str]:
    """`n` session ids that alternate between the two connection replicas."""
    by_pid: dict[int, list[str]] = {}
    for i in range(64):
        by_pid.setdefault(replica_pid(url, f"agent-run-{i}"), []).append(f"agent-run-{i}")
    assert len(by_pid) == 2, by_pid
    a, b = by_pid.values()
    return [(a if k % 2 == 0 else b)[k // 2] for k in range(n)]


async def test_an_agent_keeps_its_history_in_a_conversation_across_runs_and_replicas(conv_url):
    from agents import Agent, OpenAIResponsesModel, Runner, set_tracing_disabled
    from agents.memory import OpenAIConversationsSession

    set_tracing_disabled(True)
    # Each run is its own process's client (a new x-session-id), on the other replica than the last.
    conversation, outputs = None, []
    for n, run_session in enumerate(sessions_on_both_replicas(conv_url, 5)):
        client = AsyncOpenAI(base_url=conv_url + "/v1", api_key=KEY_A, timeout=60, max_retries=0,
                             default_headers={"x-session-id": run_session})
        agent = Agent(name="assistant", instructions="Be brief.",
                      model=OpenAIResponsesModel(model="loopserve-tiny", openai_client=client))
        session = OpenAIConversationsSession(conversation_id=conversation, openai_client=client)
        text = f"My secret is {SECRET}. Keep it." if n == 0 else f"Run {n}: what did I tell you?"
        outputs.append((await Runner.run(agent, text, session=session)).final_output)
        conversation = session.session_id
    assert outputs == [SECRET_ANSWER] * 5  # each later run answered from the history the session kept

    # the history as the SDK pages it (3 a page, both orders)
    items = [i async for i in client.conversations.items.list(conversation, limit=3, order="asc")]
    assert [i.role for i in items] == ["user", "assistant"] * 5
    assert items[0].content[0].text == f"My secret is {SECRET}. Keep it."
    newest = [i async for i in client.conversations.items.list(conversation, limit=3)]
    assert [i.id for i in newest] == [i.id for i in reversed(items)]
    assert len(await session.get_items(limit=4)) == 4

    # another tenant: as if it did not exist
    other = sdk(conv_url, KEY_B)
    for call in (lambda: other.conversations.retrieve(conversation),
                 lambda: other.conversations.items.list(conversation),
                 lambda: other.conversations.delete(conversation),
                 lambda: other.responses.create(model="loopserve-tiny", input="hi", conversation=conversation)):
        with pytest.raises(NotFoundError):
            call()
    await session.clear_session()
    with pytest.raises(NotFoundError):
        await client.conversations.retrieve(conversation)


def test_responses_on_a_conversation_over_http_then_websocket_continue_its_context(conv_url):
    # One replica for all of it: a background response is polled where it runs.
    client = sdk(conv_url).with_options(default_headers={"x-session-id": "one-client"})
    conv = client.conversations.create(items=[{"type": "message", "role": "user", "content": f"I am {SECRET}."}],
                                       metadata={"topic": "secrets"})
    assert client.conversations.retrieve(conv.id).metadata == {"topic": "secrets"}
    first = client.responses.create(model="loopserve-tiny", input="Who am I?", conversation=conv.id)
    assert first.output_text == SECRET_ANSWER and first.conversation.id == conv.id
    assert first.previous_response_id is None
    with client.responses.connect() as conn:
        second = sdk_response(conn, model="loopserve-tiny", input="Again?", conversation={"id": conv.id})
        third = sdk_response(conn, model="loopserve-tiny", input="Once more?", conversation=conv.id)
    assert second.output[0].content[0].text == third.output[0].content[0].text == SECRET_ANSWER
    # the third continued from the second's state on the socket: its prefix came from the engine's cache
    assert third.usage.input_tokens_details.cached_tokens > 0.5 * third.usage.input_tokens
    items = list(client.conversations.items.list(conv.id, order="asc", limit=100))
    assert [i.type for i in items] == ["message"] * 7 and items[-1].id == third.output[0].id

    # the client edits the history: the next response reads it as it now is (no cached state of it)
    for item in items:
        if SECRET in item.content[0].text:
            assert client.conversations.items.delete(item.id, conversation_id=conv.id).id == conv.id
    added = client.conversations.items.create(conv.id, items=[{"type": "message", "role": "user",
                                                                "content": "Say hello."}])
    assert [i.type for i in added.data] == ["message"]
    assert client.conversations.items.retrieve(added.data[0].id, conversation_id=conv.id).id == added.data[0].id
    fourth = client.responses.create(model="loopserve-tiny", input="Now?", conversation=conv.id)
    assert fourth.output_text == SCRIPTED_ANSWER  # every item that held the secret was deleted

    # streamed (SSE) and background responses append as well
    events = list(client.responses.create(model="loopserve-tiny", input=f"{SECRET} again", conversation=conv.id,
                                          stream=True))
    assert events[-1].type == "response.completed" and events[-1].response.conversation.id == conv.id
    queued = client.responses.create(model="loopserve-tiny", input="And now?", conversation=conv.id, background=True)
    for _ in range(200):
        polled = client.responses.retrieve(queued.id)
        if polled.status not in ("queued", "in_progress"):
            break
        time.sleep(0.05)
    assert polled.status == "completed" and polled.output_text == SECRET_ANSWER  # it read the streamed turn's items
    last = list(client.conversations.items.list(conv.id, limit=1))
    assert last[0].id == polled.output[0].id

    with pytest.raises(BadRequestError) as err:
        client.responses.create(model="loopserve-tiny", input="x", conversation=conv.id, previous_response_id=first.id)
    assert err.value.code == "mutually_exclusive_parameters"
    client.conversations.update(conv.id, metadata={"topic": "other"})
    assert client.conversations.retrieve(conv.id).metadata == {"topic": "other"}
    assert client.conversations.delete(conv.id).deleted
    with pytest.raises(NotFoundError):
        client.responses.create(model="loopserve-tiny", input="x", conversation=conv.id)


async def test_the_agents_runner_runs_on_a_server_side_conversation(conv_url):
    from agents import Agent, OpenAIResponsesModel, Runner, set_tracing_disabled

    set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=conv_url + "/v1", api_key=KEY_A, timeout=60, max_retries=0)
    agent = Agent(name="assistant", model=OpenAIResponsesModel(model="loopserve-tiny", openai_client=client))
    conv = await client.conversations.create()
    first = await Runner.run(agent, f"Remember {SECRET}.", conversation_id=conv.id)
    second = await Runner.run(agent, "What was it?", conversation_id=conv.id)
    assert first.final_output == second.final_output == SECRET_ANSWER
    items = [i async for i in client.conversations.items.list(conv.id, order="asc")]
    assert [i.role for i in items] == ["user", "assistant", "user", "assistant"]

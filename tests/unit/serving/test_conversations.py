"""ConversationsService (cluster/serving/conversations.py) with the real turn driver, renderer,
scripted engine and a real SQLite store, no Ray: a turn on a conversation reads its items,
appends its own, and the next one continues from its state as a chained turn does."""

import pytest

from cluster.core.turn.cache import SessionCache
from cluster.core.turn.turn import TurnRequest, TurnScope
from cluster.protocol.errors import ApiError
from cluster.protocol.requests import parse_request
from cluster.serving.conversations import ConversationsService
from cluster.store.sqlite import SQLiteStore
from tests.support.harness import InProcessStack


@pytest.fixture
async def service(tmp_path):
    store = SQLiteStore(str(tmp_path / "store.db"))
    await store.start()
    yield ConversationsService(store, model="loopserve-tiny", max_items=50)
    await store.close()


async def turn(stack, service, conversation, text, *, cache=None, owner="t"):
    body = {"model": "loopserve-tiny", "conversation": conversation, "input": text}
    scope = TurnScope(cache if cache is not None else SessionCache(1), session_key="s", owner=owner,
                      conversations=service)
    return [ev async for ev in stack.driver.run(TurnRequest(parse_request(body), scope))][-1]


def texts(items):
    return [part["text"] for item in items for part in item["content"]]


async def test_a_conversation_turn_reads_the_items_appends_its_own_and_the_next_continues_from_it(tokenizer, service):
    stack = InProcessStack(tokenizer)
    conv = (await service.create({"items": [{"role": "user", "content": "my name is Ada"}]}, "t"))["id"]
    cache = SessionCache()  # a held socket's
    first = (await turn(stack, service, conv, "what is my name?", cache=cache))["response"]
    assert first["status"] == "completed" and first["conversation"] == {"id": conv}
    assert first["previous_response_id"] is None
    assert "my name is Ada" in stack.decode_raw(stack.engine_requests[-1].prompt_token_ids)
    page = await service.list_items(conv, "t", after=None, limit=20, order="asc")
    assert [i["role"] for i in page["data"]] == ["user", "user", "assistant"]
    assert texts(page["data"])[:2] == ["my name is Ada", "what is my name?"]
    assert page["data"][2]["id"] == first["output"][0]["id"] and page["data"][2]["status"] == "completed"

    second = (await turn(stack, service, conv, "and again?", cache=cache))["response"]
    assert [j.delta for j in stack.render_jobs] == [False, True]  # the head's render, extended
    assert 0 < second["usage"]["input_tokens_details"]["cached_tokens"] < second["usage"]["input_tokens"]

    # an item added by the client: the last response's state is no longer the whole context
    await service.add_items(conv, {"items": [{"role": "user", "content": "remember 42"}]}, "t")
    await turn(stack, service, conv, "what should you remember?", cache=cache)
    assert stack.render_jobs[-1].delta is False
    prompt = stack.decode_raw(stack.engine_requests[-1].prompt_token_ids)
    assert "remember 42" in prompt and "and again?" in prompt and "my name is Ada" in prompt
    assert len((await service.list_items(conv, "t", after=None, limit=100, order="asc"))["data"]) == 8


async def test_over_http_each_turn_reads_the_items_from_the_store(tokenizer, service):
    # A one-turn cache and no registry: nothing of the last response is in memory here.
    stack = InProcessStack(tokenizer)
    conv = (await service.create({}, "t"))["id"]
    await turn(stack, service, conv, "first")
    await turn(stack, service, conv, "second")
    prompt = stack.decode_raw(stack.engine_requests[-1].prompt_token_ids)
    assert "first" in prompt and "second" in prompt


async def test_another_tenant_gets_404_and_pages_follow_after(tokenizer, service):
    stack = InProcessStack(tokenizer)
    conv = (await service.create({"items": [{"role": "user", "content": f"m{n}"} for n in range(5)]}, "t"))["id"]
    with pytest.raises(ApiError) as err:
        await turn(stack, service, conv, "hi", owner="u")
    assert err.value.status == 404 and err.value.param == "conversation_id"
    for call in (service.retrieve(conv, "u"), service.list_items(conv, "u", after=None, limit=20, order="asc"),
                 service.delete(conv, "u"), service.add_items(conv, {"items": [{"role": "user", "content": "x"}]}, "u")):
        with pytest.raises(ApiError) as err:
            await call
        assert err.value.status == 404
    page = await service.list_items(conv, "t", after=None, limit=2, order="desc")
    assert texts(page["data"]) == ["m4", "m3"] and page["has_more"]
    page = await service.list_items(conv, "t", after=page["last_id"], limit=5, order="desc")
    assert texts(page["data"]) == ["m2", "m1", "m0"] and not page["has_more"]
    with pytest.raises(ApiError) as err:
        await service.list_items(conv, "t", after="msg_unknown", limit=5, order="desc")
    assert err.value.status == 400 and err.value.param == "after"


async def test_bad_requests_get_clear_errors(tokenizer, service):
    with pytest.raises(ApiError) as err:
        parse_request({"input": "x", "conversation": "conv_1", "previous_response_id": "resp_1"})
    assert err.value.code == "mutually_exclusive_parameters"
    with pytest.raises(ApiError) as err:
        await service.create({"items": [{"role": "user", "content": "x"}] * 21}, "t")
    assert err.value.code == "array_above_max_length" and err.value.param == "items"
    with pytest.raises(ApiError) as err:
        await service.create({"items": [{"type": "no_such_item"}]}, "t")
    assert err.value.param == "items[0].type"
    with pytest.raises(ApiError) as err:
        await service.create({"metadata": {"k" * 65: "v"}}, "t")
    assert err.value.param == "metadata"
    conv = (await service.create({"items": [{"role": "user", "content": "x"}] * 20}, "t"))["id"]
    await service.add_items(conv, {"items": [{"role": "user", "content": "x"}] * 20}, "t")
    await service.add_items(conv, {"items": [{"role": "user", "content": "x"}] * 20}, "t")
    with pytest.raises(ApiError) as err:  # 60 items, a turn reads at most 50
        await turn(InProcessStack(tokenizer), service, conv, "hi")
    assert err.value.code == "conversation_too_long"


async def test_a_conversation_deleted_while_its_turn_ran_fails_the_response_and_a_store_down_is_a_503(
        tokenizer, service, monkeypatch):
    stack = InProcessStack(tokenizer)
    conv = (await service.create({}, "t"))["id"]
    real_append = service.store.append_conversation_items

    async def deleted_meanwhile(*args, **kw):
        await service.store.delete_conversation(conv, "t")
        return await real_append(*args, **kw)

    monkeypatch.setattr(service.store, "append_conversation_items", deleted_meanwhile)
    last = await turn(stack, service, conv, "hi")
    assert last["type"] == "response.failed" and last["response"]["error"]["code"] == "not_found"

    async def down(*args, **kw):
        raise ConnectionError("database gone")

    monkeypatch.setattr(service.store, "get_conversation", down)
    with pytest.raises(ApiError) as err:
        await service.retrieve(conv, "t")
    assert err.value.status == 503 and err.value.code == "store_unavailable"


async def test_an_answer_flagged_after_its_terminal_event_leaves_the_conversation(tokenizer, service):
    # Output safety classifies a streamed answer's tail as post-inference work: when it flags it,
    # the answer's items leave the conversation and the next turn reads the items without them.
    from cluster.core.turn.post_work import TurnRecord
    from cluster.serving.responses import ResponsesService

    stack = InProcessStack(tokenizer)
    responses = ResponsesService(stack.driver, SessionCache(4), None)
    responses.conversations = service
    conv = (await service.create({}, "t"))["id"]
    cache = SessionCache()
    answer = (await turn(stack, service, conv, "hello", cache=cache))["response"]
    state = cache.get(answer["id"])
    state.blocked = {"flagged": True}  # what the late flag does to the state first
    await responses.mark_blocked(TurnRecord(response_id=answer["id"], model="m", owner="t", status="completed",
                                            usage={}, store=True, response=answer, state=state))
    page = await service.list_items(conv, "t", after=None, limit=20, order="asc")
    assert [i["role"] for i in page["data"]] == ["user"]
    await turn(stack, service, conv, "again", cache=cache)
    assert stack.render_jobs[-1].delta is False  # not from the flagged state
    prompt = stack.decode_raw(stack.engine_requests[-1].prompt_token_ids)
    assert answer["output"][0]["content"][0]["text"] not in prompt and "hello" in prompt

"""ResponsesService (cluster/serving/responses.py) without Ray: GET input_items pages cost the page."""

import pytest

from cluster.core.turn.cache import SessionCache
from cluster.core.turn.turn import TurnRequest, TurnScope
from cluster.protocol.errors import ApiError
from cluster.protocol.requests import parse_request
from cluster.serving import responses
from cluster.serving.responses import ResponsesService
from tests.support.harness import InProcessStack


async def stored_response(tokenizer, n_items: int):
    stack = InProcessStack(tokenizer)
    service = ResponsesService(stack.driver, SessionCache(16), None)
    body = {"input": [{"role": "user", "content": f"item {i}"} for i in range(n_items)], "max_output_tokens": 4}
    events = [ev async for ev in stack.driver.run(TurnRequest(parse_request(body), TurnScope(
        SessionCache(), session_key="s", owner="t", on_state=service.remember)))]
    return service, events[-1]["response"]["id"]


async def test_a_page_lists_only_its_items_and_pages_cover_the_input_in_order(tokenizer, monkeypatch):
    """A `limit=1` page listed all 3,000 items (20-45 ms a read at 10,000) and was
    charged as one item."""
    service, rid = await stored_response(tokenizer, 3_000)
    listed = []
    real = responses.listed_item
    monkeypatch.setattr(responses, "listed_item", lambda item, **kw: listed.append(item) or real(item, **kw))
    page = await service.input_items(rid, "t", after=None, limit=1, order="asc")
    assert len(listed) == 1 and page["has_more"] is True
    assert page["data"][0]["content"] == [{"type": "input_text", "text": "item 0"}]
    seen, after = [], None
    for _ in range(40):
        page = await service.input_items(rid, "t", after=after, limit=100, order="desc")
        seen += [item["content"][0]["text"] for item in page["data"]]
        after = page["last_id"]
        if not page["has_more"]:
            break
    assert seen == [f"item {i}" for i in reversed(range(3_000))]
    assert len(listed) == 1 + 3_000  # each item listed once over the whole walk
    first = await service.input_items(rid, "t", after=None, limit=2, order="asc")
    again = await service.input_items(rid, "t", after=None, limit=2, order="asc")
    assert [i["id"] for i in again["data"]] == [i["id"] for i in first["data"]]  # ids are stable
    with pytest.raises(ApiError) as e:
        await service.input_items(rid, "t", after="msg_nope", limit=2, order="asc")
    assert e.value.param == "after"

"""Conversations in the response store, on the real databases (SQLite and PostgreSQL at
127.0.0.1:5432): tenant-scoped, items in order with pages either way, and the head a turn may
continue from only while nothing else changed the items."""

from __future__ import annotations

from cluster.store.conversations import StoredConversation
from tests.unit.store.test_base import msg, store  # noqa: F401 - the store fixture (SQLite and PostgreSQL)


async def test_a_conversation_and_its_items_are_its_tenants_only(store):  # noqa: F811
    await store.put_conversation(StoredConversation("conv_1", "a", 1.0, {"k": "v"}, version=2),
                                 [msg("m1", "one"), msg("m2", "two")])
    got = await store.get_conversation("conv_1", "a")
    assert got.metadata == {"k": "v"} and got.version == 2 and got.head is None
    assert await store.get_conversation("conv_1", "b") is None
    assert await store.conversation_items("conv_1", "b", limit=10) == []
    assert await store.conversation_item("conv_1", "b", "m1") is None
    assert not await store.append_conversation_items("conv_1", "b", [msg("x", "x")])
    assert not await store.set_conversation_metadata("conv_1", "b", {})
    assert not await store.delete_conversation("conv_1", "b")
    assert [i["id"] for _, i in await store.conversation_items("conv_1", "a", limit=10)] == ["m1", "m2"]


async def test_items_page_in_either_order_from_any_item(store):  # noqa: F811
    await store.put_conversation(StoredConversation("conv_p", "t", 1.0), [])
    for n in range(5):
        assert await store.append_conversation_items("conv_p", "t", [msg(f"m{n}", str(n))])
    asc = await store.conversation_items("conv_p", "t", limit=2)
    assert [i["id"] for _, i in asc] == ["m0", "m1"]
    seq, _ = await store.conversation_item("conv_p", "t", "m1")
    assert [i["id"] for _, i in await store.conversation_items("conv_p", "t", after_seq=seq, limit=10)] == \
        ["m2", "m3", "m4"]
    desc = await store.conversation_items("conv_p", "t", limit=2, order="desc")
    assert [i["id"] for _, i in desc] == ["m4", "m3"]
    seq, _ = await store.conversation_item("conv_p", "t", "m3")
    assert [i["id"] for _, i in await store.conversation_items("conv_p", "t", after_seq=seq, limit=10,
                                                               order="desc")] == ["m2", "m1", "m0"]


async def test_the_head_holds_only_while_no_other_change_reached_the_items(store):  # noqa: F811
    await store.put_conversation(StoredConversation("conv_h", "t", 1.0), [])
    assert await store.append_conversation_items("conv_h", "t", [msg("i1", "q"), msg("o1", "a")],
                                                 head_response_id="resp_1")
    assert (await store.get_conversation("conv_h", "t")).head == "resp_1"
    # the client adds an item: the response's state no longer is the whole context
    assert await store.append_conversation_items("conv_h", "t", [msg("i2", "more")])
    assert (await store.get_conversation("conv_h", "t")).head is None
    assert await store.append_conversation_items("conv_h", "t", [msg("o2", "b")], head_response_id="resp_2")
    assert (await store.get_conversation("conv_h", "t")).head == "resp_2"
    assert await store.delete_conversation_item("conv_h", "t", "i1")
    assert not await store.delete_conversation_item("conv_h", "t", "i1")
    c = await store.get_conversation("conv_h", "t")
    assert c.head is None and c.version == 5
    assert [i["id"] for _, i in await store.conversation_items("conv_h", "t", limit=10)] == ["o1", "i2", "o2"]


async def test_deleting_a_conversation_removes_its_items_and_metadata_updates_replace(store):  # noqa: F811
    await store.put_conversation(StoredConversation("conv_d", "t", 1.0, {"a": "1"}), [msg("m", "x")])
    assert await store.set_conversation_metadata("conv_d", "t", {"b": "2"})
    assert (await store.get_conversation("conv_d", "t")).metadata == {"b": "2"}
    assert await store.delete_conversation("conv_d", "t")
    assert await store.get_conversation("conv_d", "t") is None
    assert await store.conversation_items("conv_d", "t", limit=10) == []
    assert not await store.delete_conversation("conv_d", "t")

"""Responses items -> chat messages (cluster/core/render/chat_messages.py): what a template is given."""
import json

from cluster.core.render.chat_messages import (
    COMPACTION_SUMMARY,
    content_text,
    message_kind,
    messages_from_items,
)


def test_assistant_text_and_calls_render_as_one_turn():
    msgs, starts = messages_from_items(
        [
            {"type": "message", "role": "user", "content": "hi"},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok"}]},
            {"type": "function_call", "call_id": "a", "name": "f", "arguments": "{}"},
            {"type": "function_call", "call_id": "b", "name": "g", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "a", "output": "1"},
        ]
    )
    assert [m["role"] for m in msgs] == ["user", "assistant", "tool"]
    assert [c["id"] for c in msgs[1]["tool_calls"]] == ["a", "b"]
    assert starts == [0, 1, 4]


def test_content_parts_as_text_with_images_and_files_named():
    parts = [{"type": "input_text", "text": "see "}, {"type": "input_image", "image_url": "data:..."},
             {"type": "refusal", "refusal": " no"}, {"type": "input_file", "filename": "a.py"},
             {"type": "input_file", "file_id": "file-1"}, {"type": "unknown", "text": "dropped"}]
    assert content_text(parts) == "see [image] no[file a.py][file file-1]"
    assert content_text(parts, image_text="<image>") == "see <image> no[file a.py][file file-1]"
    assert content_text("plain") == "plain" and content_text(None) == ""


def test_reasoning_developer_and_compaction_items_become_the_messages_templates_read():
    msgs, starts = messages_from_items([
        {"type": "message", "role": "developer", "content": "be brief"},
        {"type": "compaction", "encrypted_content": "sealed", COMPACTION_SUMMARY: "we fixed a.py"},
        {"type": "message", "role": "user", "content": "next"},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "look at b.py"}]},
        {"type": "function_call", "call_id": "c", "name": "read_file", "arguments": '{"path": "b.py"}'},
        {"type": "function_call_output", "call_id": "c", "output": [{"type": "input_text", "text": "x = 1"}]},
        {"type": "function_call", "call_id": "d", "name": "shell", "arguments": "not json"},
    ])
    assert [m["role"] for m in msgs] == ["system", "system", "user", "assistant", "tool", "assistant"]
    assert msgs[1]["content"] == "Summary of the earlier conversation:\nwe fixed a.py"
    # the reasoning before a call goes with the assistant turn, under both names templates read
    assert msgs[3]["reasoning"] == msgs[3]["reasoning_content"] == "look at b.py"
    assert msgs[3]["tool_calls"][0]["function"]["arguments"] == {"path": "b.py"}  # templates get objects
    assert msgs[4] == {"role": "tool", "tool_call_id": "c", "content": "x = 1"}
    # a call after a tool output opens a new assistant turn; arguments that are not JSON stay text
    assert msgs[5]["tool_calls"][0]["function"]["arguments"] == "not json"
    assert starts == [0, 1, 2, 4, 5, 6]
    assert [message_kind(m) for m in msgs[2:]] == ["user", "assistant+calls+think", "tool", "assistant+calls"]


def test_arguments_nested_deeper_than_the_parser_goes_are_passed_as_text_not_an_error():
    deep = "[" * 50_000 + "]" * 50_000
    msgs, _ = messages_from_items([{"type": "message", "role": "user", "content": "hi"},
                                   {"type": "function_call", "call_id": "a", "name": "f", "arguments": deep}])
    assert msgs[1]["tool_calls"][0]["function"]["arguments"] == deep


def test_arguments_nested_past_a_requests_depth_are_text_and_the_template_renders_them(tokenizer):
    """audit-3 F9: ~990 levels parsed, then overflowed the template's `tojson` (a 500); past the
    request depth bound they are text, as arguments the parser refuses are."""
    from cluster.protocol.request_bounds import MAX_JSON_DEPTH

    deep = "[" * 200 + "]" * 200  # json.loads takes it; a template with a deeper stack overflows near 990
    ok = "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH
    items = [{"type": "message", "role": "user", "content": "hi"},
             {"type": "function_call", "call_id": "a", "name": "f", "arguments": deep},
             {"type": "function_call", "call_id": "b", "name": "f", "arguments": ok}]
    msgs, _ = messages_from_items(items)
    assert msgs[1]["tool_calls"][0]["function"]["arguments"] == deep
    assert msgs[1]["tool_calls"][1]["function"]["arguments"] == json.loads(ok)
    rendered = tokenizer.apply_chat_template(msgs, tokenize=False)  # the served ChatML + Hermes template
    assert deep in rendered

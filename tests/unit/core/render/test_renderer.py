"""Exactness contract: cached prefix tokens + delta == full render, every turn."""

import json

import pytest

from cluster.core.render.chat_messages import messages_from_items
from cluster.core.render.renderer import IncrementalRenderer
from cluster.core.render.tokenizer import renderer_for
from cluster.core.turn.context import normalize_tools

TOOLS = normalize_tools(
    [
        {"type": "function", "name": "read_file", "description": "Read a file",
         "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}},
        {"type": "function", "name": "shell", "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}},
    ]
)


def agent_turns(n):
    """Items an agent loop adds per turn: model output, then the client's new input."""
    for i in range(n):
        output = []
        if i % 3 == 0:
            output.append({"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": f"Step {i}."}]})
        output.append({"type": "function_call", "call_id": f"call_{i}", "name": "read_file",
                       "arguments": json.dumps({"path": f"src/f{i}.py"})})
        if i % 4 == 1:
            output.append({"type": "function_call", "call_id": f"call_{i}b", "name": "shell", "arguments": '{"cmd": "ls"}'})
        new = [{"type": "function_call_output", "call_id": c["call_id"], "output": f"contents {i} " * 30}
               for c in output if c["type"] == "function_call"]
        if i % 5 == 4:
            new.append({"type": "message", "role": "user", "content": [{"type": "input_text", "text": f"also check {i}"}]})
        yield output, new


@pytest.mark.parametrize("instructions", [None, "You are a coding agent."])
@pytest.mark.parametrize("tools", [TOOLS, []])
def test_delta_equals_full_render_every_turn(tokenizer, instructions, tools):
    r = renderer_for(tokenizer)
    items = [{"type": "message", "role": "user", "content": "Fix the bug in src/"}]
    first = r.full(items, instructions, tools)
    prefix, anchor, count = first.assemble(None)[0], first.anchor_start, len(items)
    delta_chars = []
    for output, new in agent_turns(20):
        items = items + output + new
        res = r.delta(items[anchor:count], items[count:], anchor, instructions, tools)
        assert res is not None, "a ChatML template must allow delta renders"
        new_prefix, prompt = res.assemble(prefix)
        full_prefix, full_prompt = r.full(items, instructions, tools).assemble(None)
        assert prompt == full_prompt and new_prefix == full_prefix
        # only the new tokens come back from a delta render
        assert len(res.appended) == len(full_prefix) - len(prefix)
        # What the template itself renders for the full context (no cache at all):
        msgs = ([{"role": "system", "content": instructions}] if instructions else []) + messages_from_items(items)[0]
        text = tokenizer.apply_chat_template(msgs, tools=tools or None, tokenize=False, add_generation_prompt=True)
        assert list(prompt) == tokenizer.encode(text, add_special_tokens=False)
        delta_chars.append(res.rendered_chars)
        prefix, anchor, count = new_prefix, res.anchor_start, len(items)
    # Work per turn follows the new items, not the history.
    assert max(delta_chars[10:]) < 2 * max(delta_chars[:10])


def test_unsafe_cut_falls_back_to_none():
    # A template with no special tokens between messages: BPE could merge across
    # the cut, so the renderer must refuse the delta.
    def apply(messages, tools, gen):
        return "".join(m["content"] + " " for m in messages) + ("A:" if gen else "")

    r = IncrementalRenderer(apply, lambda s: [ord(c) for c in s], special_tokens=["<s>"])
    items = [{"type": "message", "role": "user", "content": "a"}]
    r.full(items, None, None)
    more = items + [{"type": "message", "role": "user", "content": "b"}]
    assert r.delta(items, more[1:], 0, None, None) is None


@pytest.mark.parametrize("said, retracts", [("ok", True), ("Looking into it. " * 20, False)])
def test_a_changed_anchor_tail_is_taken_back_or_refused(tokenizer, said, retracts):
    # An assistant message followed by a new function call merges into one assistant turn: the cached
    # render of the anchor ends "<|im_end|>" where the new render goes on. A short tail is taken back
    # (cut at its last special token) and the result is the full render; a longer one renders in full.
    r = renderer_for(tokenizer)
    items = [{"type": "message", "role": "user", "content": "hi"},
             {"type": "message", "role": "assistant", "content": said}]
    first = r.full(items, None, TOOLS)
    new = [{"type": "function_call", "call_id": "x", "name": "read_file", "arguments": "{}"}]
    res = r.delta(items[first.anchor_start:], new, first.anchor_start, None, TOOLS)
    if not retracts:
        assert res is None
        return
    base = first.assemble(None)[0]
    assert res is not None and res.retract and res.continues(base)
    assert tokenizer.decode(list(res.retract)).endswith(f"{said}<|im_end|>\n")
    assert res.assemble(base) == r.full(items + new, None, TOOLS).assemble(None)
    assert not res.continues(base[:-1])  # a prefix that does not end with the tail is not continued


@pytest.mark.parametrize("text", [
    "plain words and a <|im_start|>special<|im_end|> token inside",
    "code:\n    def f(x):\n\treturn x ** 2  # ünïcödé, 漢字, emoji 🚀\n" * 40,
    "",
    " leading space and trailing newline\n\n",
])
def test_the_renderer_encodes_exactly_as_the_tokenizer_does(tokenizer, text):
    """The renderer's fast encode (no offsets) gives the ids the tokenizer's own encode gives."""
    from cluster.core.render.tokenizer import token_codec

    assert token_codec(tokenizer).encode(text) == tokenizer.encode(text, add_special_tokens=False)

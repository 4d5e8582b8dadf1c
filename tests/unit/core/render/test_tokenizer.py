"""The token floor known before tokenizing (`render/tokenizer.py`): it never exceeds what the
tokenizer really produces, and an input over the context by that floor is refused unrendered."""

import random

import pytest

from cluster.core.render.tokenizer import (
    kept_items,
    max_token_chars,
    min_prompt_tokens,
    verbatim_chars,
)
from cluster.core.turn.cache import SessionCache
from cluster.protocol.errors import ApiError
from tests.support.harness import InProcessStack


def user(text):
    return {"type": "message", "role": "user", "content": text}


def test_the_floor_never_exceeds_the_real_token_count(tokenizer):
    longest = max_token_chars(tokenizer)
    vocab = tokenizer.backend_tokenizer.get_vocab(with_added_tokens=True)
    assert longest == max(map(len, vocab))
    rng = random.Random(7)
    pieces = [*vocab, "y" * 50, "  ", "\n", "é", "日本", "<|im_start|>", "abcdefghijklmnopqrstuvwxyz" * 3]
    for _ in range(200):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 400)))
        tokens = len(tokenizer.backend_tokenizer.encode(text, add_special_tokens=False).ids)
        assert min_prompt_tokens([user(text)], longest) <= tokens, text


def test_counted_text_is_what_every_template_renders():
    items = [user("  abc  "), {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "de"}]},
             {"type": "function_call_output", "call_id": "c", "output": "xyz"},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "not counted"}]},
             {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{\"a\": 1}"},
             {"type": "reasoning", "summary": [{"type": "summary_text", "text": "dropped by some templates"}]}]
    assert verbatim_chars(items) == 3 + 2 + 3
    assert min_prompt_tokens(items, None) == 0  # no bound known: no floor


def test_truncation_auto_counts_only_what_it_cannot_drop():
    items = [user("old"), {"type": "function_call_output", "call_id": "c", "output": "out"}, user("new")]
    assert kept_items(items, "disabled") == items
    assert kept_items(items, "auto") == items[2:]
    assert kept_items(items[1:2], "auto") == items[1:2]  # no user message: nothing can be dropped


async def test_an_input_that_cannot_fit_is_refused_before_it_is_rendered(tokenizer):
    stack = InProcessStack(tokenizer, max_model_len=4096)
    big = "y" * (4096 * max_token_chars(tokenizer) + 1000)
    with pytest.raises(ApiError) as e:
        await stack.run({"input": big}, SessionCache())
    assert e.value.code == "context_length_exceeded" and "at least" in e.value.message
    assert stack.render_jobs == []
    # Under the floor it is rendered and the real count decides.
    with pytest.raises(ApiError) as e:
        await stack.run({"input": "y" * 5000}, SessionCache())
    assert e.value.code == "context_length_exceeded" and "at least" not in e.value.message
    assert len(stack.render_jobs) == 1
    # A steer-sized delta (~1 MB) on a chained turn is refused the same way, unrendered.
    ok = await stack.run({"input": "hi"}, cache := SessionCache())
    with pytest.raises(ApiError) as e:
        await stack.run({"previous_response_id": ok["id"], "input": [user(big)]}, cache)
    assert "at least" in e.value.message and len(stack.render_jobs) == 2


def test_each_user_message_costs_its_templates_markers_at_least(tokenizer):
    """The floor counts the markers a template writes around each user message (measured from the
    template), and never exceeds the real prompt: random conversations of many user messages."""
    from cluster.core.render.tokenizer import renderer_for

    renderer = renderer_for(tokenizer)
    per_message = renderer.min_user_message_tokens
    assert per_message >= 3  # ChatML: <|im_start|>, user, newline, <|im_end|>, newline
    longest = max_token_chars(tokenizer)
    rng = random.Random(11)
    vocab = list(tokenizer.backend_tokenizer.get_vocab(with_added_tokens=False))
    for _ in range(30):
        texts = ["".join(rng.choice([*vocab[:2000], "", " ", "\n", "x"]) for _ in range(rng.randint(0, 6)))
                 for _ in range(rng.randint(1, 40))]
        messages = [{"role": "user", "content": t} for t in texts]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
        tokens = len(tokenizer.backend_tokenizer.encode(text, add_special_tokens=False).ids)
        assert min_prompt_tokens([user(t) for t in texts], longest, per_message) <= tokens, texts


async def test_ten_thousand_one_character_messages_are_refused_before_a_render(tokenizer):
    """300 KB of input that is ~50,000 tokens of role markers: refused before it is rendered (a render
    of all of it costs the render replica's CPU for every such request a key's rate limit admits)."""
    stack = InProcessStack(tokenizer, max_model_len=32768)
    with pytest.raises(ApiError) as e:
        await stack.run({"input": [user("a")] * 10_000}, SessionCache())
    assert e.value.code == "context_length_exceeded" and "at least" in e.value.message
    assert stack.render_jobs == []
    assert (await stack.run({"input": [user("a")] * 100}, SessionCache()))  # a conversation that fits runs


def test_the_floor_refuses_such_a_body_before_it_is_validated(tokenizer, monkeypatch):
    """Validating and copying 10,000 items costs the event loop ~70 ms; the floor on the body as it
    came costs ~1 ms and gives the same answer, so a key's rate limit no longer admits a core's worth
    of them a second."""
    from cluster.protocol.requests import ResponsesRequest, admit_create

    stack = InProcessStack(tokenizer, max_model_len=32768)
    validated = []
    real = ResponsesRequest.model_validate
    monkeypatch.setattr(ResponsesRequest, "model_validate",
                        classmethod(lambda cls, body: validated.append(1) or real(body)))
    for transport in ("http", "websocket"):
        with pytest.raises(ApiError) as e:
            admit_create({"input": [user("a")] * 10_000}, transport=transport, admit=None, max_input_items=10_000,
                         floor=stack.driver.preparer.check_body_floor)
        assert e.value.code == "context_length_exceeded" and "at least" in e.value.message
    assert validated == []
    ok = admit_create({"input": [user("a")] * 100, "instructions": "be brief"}, transport="http", admit=None,
                      max_input_items=10_000, floor=stack.driver.preparer.check_body_floor)
    assert len(ok.input) == 100 and validated == [1]


def test_an_operators_chat_template_replaces_the_tokenizers(tmp_path):
    """`model.chat_template`, as vLLM's --chat-template: a shipped name or a file, read at load; a file
    that cannot be read is a clear error naming it, not a render with the tokenizer's own template."""
    from cluster.config import LoopserveConfig
    from cluster.config.model import SHIPPED_TEMPLATES
    from cluster.core.render.tokenizer import load_tokenizer

    conversation = [{"role": "user", "content": "hi"}]
    shipped = load_tokenizer(LoopserveConfig(model={"chat_template": "deepseek-r1.jinja"}))
    assert shipped.chat_template == (SHIPPED_TEMPLATES / "deepseek-r1.jinja").read_text(encoding="utf-8")
    assert "<｜User｜>hi" in shipped.apply_chat_template(conversation, tokenize=False)
    own = tmp_path / "mine.jinja"
    own.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}", encoding="utf-8")
    assert load_tokenizer(LoopserveConfig(model={"chat_template": str(own)})).apply_chat_template(
        conversation, tokenize=False) == "[user] hi\n"
    assert "<|im_start|>user" in load_tokenizer(LoopserveConfig()).apply_chat_template(conversation, tokenize=False)
    with pytest.raises(ValueError, match="model.chat_template: cannot read '.*missing.jinja'"):
        load_tokenizer(LoopserveConfig(model={"chat_template": str(tmp_path / "missing.jinja")}))

"""What a request forces on a gpt-oss output: its grammars hold harmony token for token.

Checked with llguidance (vLLM's `guidance` backend, which runs these lark grammars) and the real
o200k harmony tokenizer: the control tokens must be the special tokens themselves (their text
spelled out is content to harmony's parser, so a call spelled so is never read as a call)."""

from __future__ import annotations

import pytest

from cluster.engines.vllm.constraints import harmony_call_grammar, harmony_final_json_grammar
from cluster.models.builtin import ensure_builtin
from cluster.models.names import TINY_GPTOSS
from cluster.models.o200k import harmony_encoding

llguidance = pytest.importorskip("llguidance")
TOOLS = [{"type": "function", "function": {"name": name, "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    for name in ("get_weather", "get_time")]


@pytest.fixture(scope="module")
def ll_tokenizer():
    import llguidance.hf
    from transformers import AutoTokenizer

    return llguidance.hf.from_tokenizer(AutoTokenizer.from_pretrained(ensure_builtin(TINY_GPTOSS, weights=False)))


def accepts(ll_tokenizer, grammar: str, text: str) -> bool:
    """Whether the grammar takes these tokens, to the end (harmony's own encoding of `text`)."""
    matcher = llguidance.LLMatcher(ll_tokenizer, llguidance.grammar_from("grammar", grammar))
    assert not matcher.is_error(), matcher.get_error()
    ids = harmony_encoding().encode(text, allowed_special="all")
    return all(matcher.consume_token(t) for t in ids) and matcher.is_accepting()


def spelled_out(text: str) -> list[int]:
    """`text` with its control tokens as plain text tokens."""
    return harmony_encoding().encode(text, disallowed_special=())


CALL = '<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>{args}<|call|>'


def test_a_forced_call_is_harmonys_call_token_for_token(ll_tokenizer):
    grammar = harmony_call_grammar(TOOLS, "required")
    for name in ("get_weather", "get_time"):
        assert accepts(ll_tokenizer, grammar, CALL.format(name=name, args='{"city":"Paris"}'))
    assert not accepts(ll_tokenizer, grammar, CALL.format(name="rm_rf", args='{"city":"Paris"}'))  # not offered
    assert not accepts(ll_tokenizer, grammar, CALL.format(name="get_weather", args='{"town":"Paris"}'))  # schema
    # a named choice takes that function only
    named = harmony_call_grammar(TOOLS, {"type": "function", "name": "get_time"})
    assert accepts(ll_tokenizer, named, CALL.format(name="get_time", args='{"city":"Oslo"}'))
    assert not accepts(ll_tokenizer, named, CALL.format(name="get_weather", args='{"city":"Oslo"}'))


def test_control_tokens_spelled_as_text_and_padded_json_are_refused(ll_tokenizer):
    grammar = harmony_call_grammar(TOOLS, "required")
    matcher = llguidance.LLMatcher(ll_tokenizer, llguidance.grammar_from("grammar", grammar))
    first = spelled_out("<|channel|>")[0]  # "<|" as text, where the special token must be
    assert not matcher.consume_token(first)
    # JSON as gpt-oss writes it: compact (free whitespace lets a model pad blank tokens to max_tokens)
    assert not accepts(ll_tokenizer, grammar, CALL.format(name="get_weather", args='{\n  "city": "Paris"\n}'))


def test_a_json_text_format_is_the_final_channels_message(ll_tokenizer):
    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"]}
    grammar = harmony_final_json_grammar(schema)
    assert accepts(ll_tokenizer, grammar, '<|channel|>final<|message|>{"city":"Rome"}<|return|>')
    assert not accepts(ll_tokenizer, grammar, '<|channel|>final<|message|>{"city":"Lima"}<|return|>')
    assert not accepts(ll_tokenizer, grammar, '{"city":"Rome"}')  # a harmony message opens with its channel

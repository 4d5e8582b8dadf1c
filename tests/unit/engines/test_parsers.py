"""Tool calls of each supported model family, decoded by vLLM's parsers while streaming.

The outputs below are recorded in each family's documented format; the
tokenizer is the tiny model's plus each family's marker tokens (the parsers
check their markers are in the vocabulary, as with the real models).
"""

import json

import pytest

from cluster.engines.output_parser import (
    StreamingOutputParser,
    TextPiece,
    ToolCallPiece,
    reasoning_tags,
    supported_tool_parsers,
    tool_format,
    vllm_tool_call_extractor,
)

RECORDED = {
    "hermes": 'Let me read it.<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py"}}\n</tool_call>',
    "qwen3_xml": "Let me read it.<tool_call>\n<function=read_file>\n<parameter=path>\na.py\n</parameter>\n"
                 "</function>\n</tool_call>",
    "qwen3_coder": "Let me read it.<tool_call>\n<function=read_file>\n<parameter=path>\na.py\n</parameter>\n"
                   "</function>\n</tool_call>",
    "llama3_json": 'Let me read it.<|python_tag|>{"name": "read_file", "parameters": {"path": "a.py"}}',
    "mistral": 'Let me read it.[TOOL_CALLS][{"name": "read_file", "arguments": {"path": "a.py"}}]',
}


@pytest.fixture(scope="module")
def family_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.add_tokens(["<|python_tag|>", "[TOOL_CALLS]"])
    return tok


def stream(parser, text, step=3):
    pieces = []
    for i in range(0, len(text), step):
        pieces += parser.feed(text[i: i + step])
    return pieces + parser.finish()


def test_every_supported_family_has_a_recording():
    assert sorted(RECORDED) == supported_tool_parsers()


@pytest.mark.parametrize("family", sorted(RECORDED))
def test_family_tool_call_becomes_a_function_call(family, family_tokenizer):
    fmt = tool_format(family)
    parser = StreamingOutputParser(vllm_tool_call_extractor(family, family_tokenizer),
                                   tool_open=fmt.start, tool_close=fmt.end)
    pieces = stream(parser, RECORDED[family])
    text = "".join(p.text for p in pieces if isinstance(p, TextPiece))
    calls = [p for p in pieces if isinstance(p, ToolCallPiece)]
    assert text == "Let me read it."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("read_file", {"path": "a.py"})]


def test_unknown_family_is_a_clear_config_error(family_tokenizer):
    with pytest.raises(ValueError, match="not supported"):
        vllm_tool_call_extractor("no_such_family", family_tokenizer)


@pytest.mark.parametrize("name", ["qwen3", "deepseek_r1"])
def test_reasoning_tags_come_from_vllms_reasoning_parser(name, family_tokenizer):
    start, end = reasoning_tags(name, family_tokenizer)
    assert (start, end) == ("<think>", "</think>")


def test_prompt_that_opens_think_starts_in_reasoning():
    from cluster.engines.output_parser import ReasoningPiece

    parser = StreamingOutputParser(start_in_reasoning=True)
    pieces = stream(parser, "weighing options</think>The answer.")
    assert isinstance(pieces[0], ReasoningPiece)
    assert "".join(p.text for p in pieces if isinstance(p, ReasoningPiece)) == "weighing options"
    assert "".join(p.text for p in pieces if isinstance(p, TextPiece)) == "The answer."

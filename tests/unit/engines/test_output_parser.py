"""The output parser (`engines/output_parser.py`): the streaming split into text, reasoning and
tool calls, and each supported model family's tool calls decoded by vLLM's parsers while
streaming. The families' outputs are recorded in each family's documented format; the tokenizer
is the tiny model's plus each family's marker tokens (the parsers check their markers are in the
vocabulary, as with the real models)."""

import json

import pytest

from cluster.engines.output_parser import (
    ReasoningPiece,
    StreamingOutputParser,
    TextPiece,
    ToolCallPiece,
    reasoning_tags,
    supported_tool_parsers,
    tool_format,
    vllm_tool_call_extractor,
)


def run(parser, chunks):
    """Feed chunks; merge adjacent text pieces (streaming emits them as they come)."""
    pieces = []
    for c in chunks:
        pieces += parser.feed(c)
    merged = []
    for p in pieces + parser.finish():
        if merged and type(p) is type(merged[-1]) and not isinstance(p, ToolCallPiece):
            merged[-1] = type(p)(merged[-1].text + p.text)
        else:
            merged.append(p)
    return merged


def char_chunks(s):
    return list(s)


@pytest.fixture(scope="module")
def hermes(tokenizer):
    from cluster.engines.output_parser import vllm_tool_call_extractor

    return vllm_tool_call_extractor("hermes", tokenizer)


def test_plain_text_streams_through():
    p = StreamingOutputParser()
    assert p.feed("hello ") == [TextPiece("hello ")]
    assert p.feed("world") == [TextPiece("world")]


def test_tool_call_split_across_tiny_deltas_with_vllm_hermes(hermes):
    text = 'Sure.<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py"}}\n</tool_call>'
    pieces = run(StreamingOutputParser(hermes), char_chunks(text))
    assert pieces == [TextPiece("Sure."), ToolCallPiece("read_file", json.dumps({"path": "a.py"}))]


def test_two_parallel_calls(hermes):
    call = '<tool_call>\n{"name": "%s", "arguments": {}}\n</tool_call>'
    pieces = run(StreamingOutputParser(hermes), [call % "a" + "\n" + call % "b"])
    calls = [p for p in pieces if isinstance(p, ToolCallPiece)]
    assert [c.name for c in calls] == ["a", "b"]


def test_partial_tag_is_held_back_then_released_as_text():
    p = StreamingOutputParser()
    assert p.feed("a <tool") == [TextPiece("a ")]
    assert p.feed("box> b") == [TextPiece("<toolbox> b")]


def test_malformed_block_becomes_text(hermes):
    pieces = run(StreamingOutputParser(hermes), ["<tool_call>not json</tool_call>"])
    assert pieces == [TextPiece("<tool_call>not json</tool_call>")]


def test_unterminated_block_at_the_end_is_text_unless_complete(hermes):
    pieces = run(StreamingOutputParser(hermes), ["<tool_call>{\"name\": \"x\", \"arg"])
    assert len(pieces) == 1 and isinstance(pieces[0], TextPiece)


def test_reasoning_then_answer():
    pieces = run(StreamingOutputParser(), char_chunks("<think>hmm</think>ok"))
    assert pieces == [ReasoningPiece("hmm"), TextPiece("ok")]


def test_tools_disabled_leaves_tags_as_text():
    pieces = run(StreamingOutputParser(tools_enabled=False), ['<tool_call>{"name":"a","arguments":{}}</tool_call>'])
    assert all(isinstance(p, TextPiece) for p in pieces)


async def test_coalesce_batches_while_the_consumer_is_busy_and_keeps_order():
    import asyncio

    from cluster.engines.stream import coalesce

    async def produce():
        for i in range(20):
            yield [{"t": "text", "v": str(i)}]
            await asyncio.sleep(0.001)

    batches = []
    async for batch in coalesce(produce()):
        batches.append(batch)
        await asyncio.sleep(0.01)  # a slow consumer
    flat = [p["v"] for b in batches for p in b]
    assert flat == [str(i) for i in range(20)]
    assert len(batches[0]) == 1 and len(batches) < 10


async def test_coalesce_min_interval_spaces_batches_but_never_holds_the_end():
    import asyncio
    import time

    from cluster.engines.stream import coalesce

    ended_at = {}

    async def produce():
        for i in range(40):
            yield [{"t": "text", "v": str(i)}]
            await asyncio.sleep(0.001)
        ended_at["t"] = time.perf_counter()
        yield [{"t": "done"}]

    stamps, batches = [], []
    async for batch in coalesce(produce(), min_interval_s=0.2):  # a fast consumer
        stamps.append(time.perf_counter())
        batches.append(batch)
    assert [p["v"] for b in batches for p in b if p["t"] == "text"] == [str(i) for i in range(40)]
    assert len(batches[0]) == 1  # the first token is not held
    assert len(batches) <= 3  # tokens of well under 0.2 s: the first one, then the rest together
    assert stamps[-1] - ended_at["t"] < 0.1  # the end left at once, not at the next 0.2 s step


async def test_coalesce_propagates_errors_and_cancels_the_producer():
    import asyncio

    from cluster.engines.stream import coalesce

    closed = []

    async def produce():
        try:
            yield [{"t": "text", "v": "a"}]
            await asyncio.sleep(10)
        finally:
            closed.append(True)

    gen = coalesce(produce())
    assert await gen.__anext__() == [{"t": "text", "v": "a"}]
    await gen.aclose()
    await asyncio.sleep(0)
    assert closed == [True]

    async def failing():
        yield [{"t": "text", "v": "a"}]
        raise RuntimeError("engine died")

    with pytest.raises(RuntimeError, match="engine died"):
        async for _ in coalesce(failing()):
            pass


# Each model family's tool-call format, through vLLM's own parsers.

RECORDED = {
    "hermes": 'Let me read it.<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py"}}\n</tool_call>',
    "qwen3_xml": "Let me read it.<tool_call>\n<function=read_file>\n<parameter=path>\na.py\n</parameter>\n"
                 "</function>\n</tool_call>",
    "qwen3_coder": "Let me read it.<tool_call>\n<function=read_file>\n<parameter=path>\na.py\n</parameter>\n"
                   "</function>\n</tool_call>",
    "llama3_json": 'Let me read it.<|python_tag|>{"name": "read_file", "parameters": {"path": "a.py"}}',
    "mistral": 'Let me read it.[TOOL_CALLS][{"name": "read_file", "arguments": {"path": "a.py"}}]',
    "deepseek_v3": "Let me read it.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>read_file\n"
                   '```json\n{"path": "a.py"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
}


@pytest.fixture(scope="module")
def family_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.add_tokens(["<|python_tag|>", "[TOOL_CALLS]", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>",
                    "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"])
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


@pytest.mark.parametrize("chunk", [1, 3, 7, 1000])
def test_newlines_around_reasoning_are_the_templates_layout_not_text(chunk):
    """`<think>\\n{reasoning}\\n</think>\\n\\n{content}`, as Qwen3 and DeepSeek-R1 write it: the reasoning
    and the call or answer come back without the layout's newlines, however the text is split,
    and no whitespace-only message stands between the reasoning and a call."""
    def parse(text: str) -> list:
        return run(StreamingOutputParser(), [text[i:i + chunk] for i in range(0, len(text), chunk)])

    call = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    assert parse("<think>\nLook.\n\nThen act.\n</think>\n\n" + call) == [
        ReasoningPiece("Look.\n\nThen act."), ToolCallPiece("f", "{}")]
    assert parse("<think>\nDone.\n</think>\n\nThe answer.\n") == [ReasoningPiece("Done."), TextPiece("The answer.\n")]


def test_xml_calls_are_typed_by_the_offered_tools_schema():
    """Qwen3-Coder writes every argument as text (`<parameter=n>\\n3\\n</parameter>`); vLLM's parser types
    it by the schema of the tool the request offered, so the call's arguments are the JSON a client expects."""
    from transformers import AutoTokenizer

    from cluster.engines.scripted.engine import written_calls
    from cluster.models.builtin import ensure_builtin
    from cluster.models.names import TINY_QWEN3_CODER

    pytest.importorskip("vllm")
    tokenizer = AutoTokenizer.from_pretrained(ensure_builtin(TINY_QWEN3_CODER, weights=False))
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "n": {"type": "integer"}, "exact": {"type": "boolean"}}}}}]
    text = "<think>\nWhich time?\n</think>\n\n" + written_calls("qwen3_xml", [("get_time", {"city": "Rome", "n": 3,
                                                                                       "exact": True})])
    pieces = run(StreamingOutputParser(vllm_tool_call_extractor("qwen3_xml", tokenizer), tools=tools), list(text))
    assert pieces == [ReasoningPiece("Which time?"),
                      ToolCallPiece("get_time", json.dumps({"city": "Rome", "n": 3, "exact": True}))]


def test_deepseek_r1s_calls_after_its_reasoning_are_read_by_vllms_parser():
    """What the scripted engine writes for DeepSeek-R1 (`<think>`, then two calls in its markers, each a
    ```json block) is what vLLM's deepseek_v3 parser reads back, with R1's real tokenizer."""
    from transformers import AutoTokenizer

    from cluster.engines.scripted.engine import written_calls
    from cluster.models.builtin import ensure_builtin
    from cluster.models.names import TINY_DEEPSEEK_R1

    pytest.importorskip("vllm")
    tokenizer = AutoTokenizer.from_pretrained(ensure_builtin(TINY_DEEPSEEK_R1, weights=False))
    fmt = tool_format("deepseek_v3")
    calls = [("read_file", {"path": "a.py"}), ("shell", {"cmd": "ls -la", "n": 2})]
    text = "<think>\nRead, then list.\n</think>\n\n" + written_calls("deepseek_v3", calls)
    for chunk in (1, 7, 10_000):
        parser = StreamingOutputParser(vllm_tool_call_extractor("deepseek_v3", tokenizer),
                                       tool_open=fmt.start, tool_close=fmt.end)
        assert run(parser, [text[i:i + chunk] for i in range(0, len(text), chunk)]) == [
            ReasoningPiece("Read, then list."), *(ToolCallPiece(n, json.dumps(a)) for n, a in calls)]


def test_a_llama_call_is_the_whole_output_as_json_without_its_tag():
    """Llama 3 writes a custom tool's call as the bare JSON object (`<|python_tag|>` is for its built-in
    tools); an answer that only contains braces stays text."""
    from transformers import AutoTokenizer

    from cluster.models.builtin import ensure_builtin
    from cluster.models.names import TINY_LLAMA3

    pytest.importorskip("vllm")
    extractor = vllm_tool_call_extractor("llama3_json", AutoTokenizer.from_pretrained(
        ensure_builtin(TINY_LLAMA3, weights=False)))
    fmt = tool_format("llama3_json")

    def parse(text, chunks):
        parser = StreamingOutputParser(extractor, tool_open=fmt.start, tool_close=fmt.end, bare_start=fmt.bare_start)
        return run(parser, [text[i:i + chunks] for i in range(0, len(text), chunks)])

    for chunks in (1, 5, 1000):
        assert parse(' {"name": "get_weather", "parameters": {"city": "Paris"}}', chunks) == [
            ToolCallPiece("get_weather", '{"city": "Paris"}')]
        assert parse("The set {1, 2} is small.", chunks) == [TextPiece("The set {1, 2} is small.")]
        assert parse("{not a call", chunks) == [TextPiece("{not a call")]

"""gpt-oss output read from its tokens: reasoning, tool calls and the answer as Responses pieces,
streamed; a model that loses the format loses nothing it wrote."""

from __future__ import annotations

from cluster.core.messages import ReasoningPiece, TextPiece, ToolCallPiece
from cluster.engines.harmony_output import HarmonyOutputParser
from cluster.models.o200k import harmony_encoding

ENC = harmony_encoding()


def parse(text: str, step: int = 1, tools: bool = True) -> list:
    ids = ENC.encode(text, allowed_special="all")
    parser, pieces = HarmonyOutputParser(ENC, tools_enabled=tools), []
    for k in range(0, len(ids), step):
        pieces += parser.feed("", ids[k:k + step])
    return pieces + parser.finish()


def joined(pieces: list) -> list:
    out: list = []
    for p in pieces:
        if out and type(out[-1]) is type(p) and not isinstance(p, ToolCallPiece):
            out[-1] = type(p)(out[-1].text + p.text)
        else:
            out.append(p)
    return out


def test_reasoning_then_two_calls_in_one_turn_token_by_token():
    text = ('<|channel|>analysis<|message|>List, then read.<|end|>'
            '<|start|>assistant<|channel|>commentary to=functions.shell <|constrain|>json<|message|>{"cmd": "ls"}<|call|>'
            '<|start|>assistant to=functions.read_file<|channel|>commentary json<|message|>{"path": "a.py"}<|call|>')
    pieces = parse(text)
    assert joined(pieces) == [ReasoningPiece("List, then read."), ToolCallPiece("shell", '{"cmd": "ls"}'),
                              ToolCallPiece("read_file", '{"path": "a.py"}')]
    assert sum(isinstance(p, ReasoningPiece) for p in pieces) > 1  # streamed, not held to the end


def test_a_final_answer_streams_as_text_and_a_preamble_too():
    pieces = parse("<|channel|>commentary<|message|>Checking. <|end|><|start|>assistant<|channel|>final<|message|>"
                   "The answer is 4.<|return|>", step=2)
    assert joined(pieces) == [TextPiece("Checking. The answer is 4.")]


def test_a_call_cut_off_by_max_tokens_and_lost_format_stay_text():
    cut = parse('<|channel|>commentary to=functions.shell <|constrain|>json<|message|>{"cmd": "l')
    assert joined(cut) == [TextPiece('{"cmd": "l')]
    assert joined(parse("plain words, no header at all")) == [TextPiece("plain words, no header at all")]
    broken = parse("<|channel|>final<|message|>ok<|end|><|message|>stray")
    assert "".join(p.text for p in broken) == "ok" + "<|message|>stray"


def test_without_tools_a_call_is_its_text():
    pieces = parse('<|channel|>commentary to=functions.shell <|constrain|>json<|message|>{"cmd": "ls"}<|call|>',
                   tools=False)
    assert joined(pieces) == [TextPiece('{"cmd": "ls"}')]

"""TurnProgress reads what the assembler's streams say: the type names it knows are the ones the
assembler sends (both come from the `openai` package's types), for every way a response ends."""

from cluster.core.events import EventAssembler, build_response, usage_object
from cluster.core.messages import Milestone, TurnProgress
from cluster.protocol.errors import ApiError
from cluster.protocol.requests import parse_request


def assembler():
    req = parse_request({"model": "m", "input": "hi"})
    return EventAssembler(build_response(response_id="resp_1", model="m", request=req, previous_response_id=None))


def observe(events):
    progress = TurnProgress()
    return progress, [progress.observe(ev) for ev in events]


def test_a_tool_calling_response():
    a = assembler()
    events = a.start() + a.text("Reading.") + a.tool_call("read_file", '{"path": "a.py"}', call_id="call_1")
    events += a.finish(usage_object(10, 0, 5))
    progress, steps = observe(events)
    assert steps[0] is Milestone.CREATED and steps[-1] is Milestone.TERMINAL
    assert steps.count(Milestone.CREATED) == 1 and steps.count(Milestone.TERMINAL) == 1
    assert steps.count(Milestone.ITEM_ADDED) == 2
    assert progress.last_item["type"] == "function_call" and progress.last_item["call_id"] == "call_1"
    assert progress.response_id == "resp_1" and progress.status == "completed"
    assert progress.final["output"][1]["name"] == "read_file" and progress.error is None


def test_a_failed_response_carries_its_error_event():
    a = assembler()
    events = a.start() + a.text("Par") + a.fail(ApiError(400, "Too long.", code="context_length_exceeded"))
    progress, steps = observe(events)
    assert steps[-2:] == [Milestone.ERROR, Milestone.TERMINAL]
    assert progress.status == "failed" and progress.error["error"]["code"] == "context_length_exceeded"


def test_a_stream_cut_before_its_end_has_no_final():
    a = assembler()
    progress, steps = observe(a.start() + a.text("Hel"))
    assert progress.response_id == "resp_1" and progress.final is None and progress.status is None
    assert Milestone.TERMINAL not in steps


def test_an_incomplete_response_is_terminal():
    a = assembler()
    events = a.start() + a.text("Hello") + a.finish(usage_object(3, 0, 1), incomplete_reason="max_output_tokens")
    progress, steps = observe(events)
    assert steps[-1] is Milestone.TERMINAL and progress.status == "incomplete"


def test_chunks_that_piled_up_go_on_as_one_with_their_text_joined_and_their_tokens_counted():
    from cluster.core.messages import EngineDone, EngineQueued, ReasoningPiece, TextPiece, TokenProgress, ToolCallPiece
    from cluster.core.messages import merged

    done = EngineDone(10, 4, 5, "stop", replica="r", engine_s=0.5, first_token_s=0.1)
    chunks = [[EngineQueued(2, 900)], [ReasoningPiece("hm"), TokenProgress(1)], [ReasoningPiece(" ok"), TokenProgress(1)],
              [TextPiece("hel"), TokenProgress(1)], [TextPiece("lo"), TokenProgress(2)],
              [ToolCallPiece("read", '{"p": 1}'), TokenProgress(3)], [TextPiece("!"), done]]
    assert merged(chunks) == [EngineQueued(2, 900), ReasoningPiece("hm ok"), TokenProgress(8), TextPiece("hello"),
                              ToolCallPiece("read", '{"p": 1}'), TextPiece("!"), done]
    assert merged([[TextPiece("a"), TokenProgress(1)]]) == [TextPiece("a"), TokenProgress(1)]  # one chunk: itself
    assert merged([]) == []

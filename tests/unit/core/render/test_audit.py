"""The render audit (core/render/audit.py): every one of a replica's first deltas is checked, then a
sample; a mismatch names where the renders part and turns deltas off; the app's ledger keeps the
verdicts, bounded. The template here cuts old tool outputs past 5,000 characters, beyond the
probe's texts, and the AST analysis is off: what only the audit can catch."""

from __future__ import annotations

from cluster.core.render.audit import MAX_VERDICTS, RenderAudit, TemplateVerdicts
from cluster.core.turn.cache import SessionCache
from cluster.core.turn.post_work import PostWorkQueue
from cluster.core.turn.turn import TurnRequest, TurnScope
from cluster.protocol.requests import parse_request
from tests.support.harness import InProcessStack
from tests.unit.core.render.test_probe import shortens_old_tool_outputs, tokenizer_with


def tool_round(call_id: str, output: str) -> list[dict]:
    return [{"type": "function_call", "call_id": call_id, "name": "read_file", "arguments": "{}"},
            {"type": "function_call_output", "call_id": call_id, "output": output}]


async def loop(stack, queue, outputs: list, cache=None) -> None:
    """A turn per output: a user message and a tool round with it (None: the user message alone)."""
    cache, prev = cache or SessionCache(), None
    for n, output in enumerate(outputs):
        body = {"input": [{"role": "user", "content": f"step {n}"},
                          *(tool_round(f"c{n}", output) if output is not None else [])],
                "previous_response_id": prev}
        events = [ev async for ev in stack.driver.run(TurnRequest(parse_request(body), TurnScope(cache, "s")))]
        prev = events[-1]["response"]["id"]
        await queue.drain()


def audited_stack(tiny_model_dir, first: int, every: int):
    queue = PostWorkQueue(retries=0)
    stack = InProcessStack(tokenizer_with(tiny_model_dir, shortens_old_tool_outputs(5000)), verify=False,
                           post_work=queue, analysis=False)
    audit = RenderAudit(stack.render, every, decode=stack.renderer.decode, first=first,
                        on_mismatch=stack.driver.preparer.render_fully)
    queue.add("render_audit", audit)
    return stack, queue, audit


async def test_the_first_deltas_are_all_checked_then_a_sample(tiny_model_dir):
    stack, queue, audit = audited_stack(tiny_model_dir, first=3, every=4)
    await loop(stack, queue, ["x"] * 10)  # nothing to cut: every delta is exact
    assert audit.deltas_seen == 9 and audit.checked == 3 + 2 and audit.mismatches == 0  # 1-3, then the 4th and 8th
    assert stack.driver.preparer.deltas_off is None


async def test_a_mismatch_names_the_message_that_renders_differently_and_turns_deltas_off(tiny_model_dir):
    stack, queue, audit = audited_stack(tiny_model_dir, first=100, every=64)
    # The second tool output makes the first one old, and the template cuts it: the delta, which
    # starts after the user message between them, sent it whole.
    await loop(stack, queue, ["A" * 6000, None, "B"])
    assert audit.mismatches == 1 and stack.driver.preparer.deltas_off is not None
    # user, assistant+calls, tool(A...), ...: the third message (index 2) is the one the template cut.
    assert "message 2 (tool) renders differently" in audit.last_mismatch, audit.last_mismatch
    assert "the newest step: assistant+calls -> tool" in audit.last_mismatch
    await loop(stack, queue, ["D"])
    assert stack.driver.metrics.timings[-1].full_render  # every turn in full from here on


def test_the_ledger_keeps_the_first_verdict_per_template_and_a_bounded_number():
    verdicts = TemplateVerdicts()
    assert verdicts.merge({"t1": "cut"}) == {"t1": "cut"}
    assert verdicts.merge({"t1": "another reason", "t2": "x" * 10_000}) == {"t1": "cut", "t2": "x" * 500}
    verdicts.merge({f"t{n}": "r" for n in range(100)})
    assert len(verdicts.found) == MAX_VERDICTS

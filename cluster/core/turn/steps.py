"""A response's later engine calls, after the step before ended in tool calls that need no
client round trip: a multi-agent response's injected tool outputs (the WebSocket's inbox), or
its server-run MCP calls (turn/mcp_steps.py). Each moves the turn on to its next engine call."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from cluster.core.messages import EngineDone, TurnTiming
from cluster.core.render.chat_messages import mcp_result
from cluster.core.turn.context import output_as_context
from cluster.protocol.requests import parse_request


async def after_injected(turn: Any, asm: Any, preparer: Any, done: EngineDone, injected: list[dict[str, Any]]) -> None:
    """The next engine call of a multi-agent response: its context gains this step's output
    and the injected tool outputs (rendered as a continuation: only those new items)."""
    output = asm.response["output"]
    parent = turn.snapshot(output[turn.steps.output_start:len(output) - len(injected)], asm.response, done.replica,
                           engine_ran=True, done=done)
    await continue_after(turn, asm, preparer, parent, turn.request, injected)


async def continue_after(turn: Any, asm: Any, preparer: Any, parent: Any, request: Any,
                         new_items: list[dict[str, Any]]) -> None:
    """The next engine call as a continuation of this response after its last step (`parent`):
    `request` with only `new_items` as input, rendered as a delta."""
    step_req = request.model_copy(update={"input": parse_request({"input": new_items}).input,
                                          "previous_response_id": turn.response_id})
    context, rendered = (await preparer.prepare(step_req, parent, TurnTiming(), turn.trace, turn.owner))[:2]
    advance(turn, asm, preparer, parent, context, rendered)


async def after_mcp_calls(turn: Any, asm: Any, preparer: Any, done: EngineDone) -> None:
    """The next engine call of a response whose step called only server-run MCP tools: its
    context gains the step's output, each call with its result. A step that ended in one call
    continues as a client-run loop does: the step as the model made it (the call, unanswered)
    is the parent, the call's result the only new input, rendered as a delta after the tokens
    the engine generated. Other shapes (several calls in one step) render whole: a call the
    server answered renders with its answer right after it, not after the step's last call."""
    output = asm.response["output"][turn.steps.output_start:]
    mcp_request = turn.steps.mcp.request
    last = output[-1] if output else None
    calls = [i for i in output if i.get("type") == "mcp_call" and not i.get("approval_request_id")]
    if calls == [last]:
        parent = turn.snapshot([*output[:-1], {**last, "output": None, "error": None}], asm.response, done.replica,
                               engine_ran=True, done=done)
        result = {"type": "function_call_output", "call_id": last["id"], "output": mcp_result(last)}
        await continue_after(turn, asm, preparer, parent, mcp_request, [result])
    else:
        context, rendered = (await preparer.prepare(mcp_request, None, TurnTiming(), turn.trace, turn.owner,
                                                    items=[*turn.context.items, *output_as_context(output)]))[:2]
        advance(turn, asm, preparer, None, context, rendered)
    if turn.steps.mcp.answer_only:  # the calls reached the response's bound: this step answers
        turn.generation = replace(turn.generation, tool_choice="none")


def advance(turn: Any, asm: Any, preparer: Any, parent: Any, context: Any, rendered: Any) -> None:
    """The turn moved on to its next engine call on `context` (its parent `parent`; None: whole)."""
    # max_output_tokens bounds the whole response; the context bounds each call.
    settings = preparer.settings
    budget = (turn.request.max_output_tokens or settings.default_max_tokens) - turn.steps.used[2] - turn.output_tokens
    turn.max_tokens = max(1, min(budget, settings.max_model_len - rendered.engine_len))
    steps = turn.steps
    if not steps.count:
        steps.first_span = (turn.context.new_start, len(turn.context.items))
    inputs, cached, outputs = steps.used
    steps.used = (inputs + turn.prompt_len, cached + turn.cached_tokens, outputs + turn.output_tokens)
    turn.parent, turn.context, turn.rendered = parent, context, rendered
    steps.count += 1
    steps.output_start = len(asm.response["output"])
    turn.cached_tokens = turn.output_tokens = 0

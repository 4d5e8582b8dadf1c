"""Engine deltas -> parsed output chunks (what an EngineReplica streams back)."""

from __future__ import annotations

from array import array
from typing import Any, AsyncIterator

from ..core.output_parser import ReasoningPiece, StreamingOutputParser, TextPiece, ToolCallExtractor, ToolCallPiece
from .base import Engine, EngineRequest


def pieces_to_dicts(pieces) -> list[dict[str, Any]]:
    out = []
    for p in pieces:
        if isinstance(p, TextPiece):
            out.append({"t": "text", "v": p.text})
        elif isinstance(p, ReasoningPiece):
            out.append({"t": "reasoning", "v": p.text})
        elif isinstance(p, ToolCallPiece):
            out.append({"t": "tool", "name": p.name, "args": p.arguments})
    return out


def engine_request(req: dict[str, Any]) -> EngineRequest:
    prompt = req["prompt_token_ids"]
    return EngineRequest(
        request_id=req["request_id"],
        session_key=req["session_key"],
        prompt_token_ids=prompt if isinstance(prompt, array) else array("i", prompt),
        max_tokens=req["max_tokens"],
        temperature=req.get("temperature"),
        top_p=req.get("top_p"),
        tools=req.get("tools") or [],
        tool_choice=req.get("tool_choice", "auto"),
        last_item=req.get("last_item", "user"),
    )


async def stream_chunks(
    engine: Engine,
    req: dict[str, Any],
    extractor: ToolCallExtractor,
    tags: tuple[str, str] = ("<tool_call>", "</tool_call>"),
) -> AsyncIterator[list[dict[str, Any]]]:
    """Run one request; yield lists of pieces, the last one ending with a `done` piece."""
    request = engine_request(req)
    if len(request.prompt_token_ids) >= engine.max_model_len:
        yield [
            {
                "t": "error",
                "status": 400,
                "code": "context_length_exceeded",
                "param": "input",
                "message": f"The prompt has {len(request.prompt_token_ids)} tokens; "
                f"the model's limit is {engine.max_model_len}.",
            }
        ]
        return
    parser = StreamingOutputParser(
        extractor,
        tool_open=tags[0],
        tool_close=tags[1],
        tools_enabled=bool(request.tools) and request.tool_choice != "none",
    )
    output_tokens = 0
    async for delta in engine.generate(request):
        output_tokens += delta.new_tokens
        chunk = pieces_to_dicts(parser.feed(delta.text)) if delta.text else []
        if delta.finished:
            chunk += pieces_to_dicts(parser.finish())
            chunk.append(
                {
                    "t": "done",
                    "prompt_tokens": delta.prompt_tokens,
                    "cached_tokens": delta.cached_tokens,
                    "output_tokens": output_tokens,
                    "finish_reason": delta.finish_reason,
                }
            )
        if chunk:
            yield chunk

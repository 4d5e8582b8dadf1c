"""Engine deltas -> parsed output chunks (what an EngineReplica streams back)."""

from __future__ import annotations

import time
from array import array
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Optional

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
        cache_salt=req.get("cache_salt"),
        prompt_token_ids=prompt if isinstance(prompt, array) else array("i", prompt),
        max_tokens=req["max_tokens"],
        temperature=req.get("temperature"),
        top_p=req.get("top_p"),
        tools=req.get("tools") or [],
        tool_choice=req.get("tool_choice", "auto"),
        last_item=req.get("last_item", "user"),
    )


@dataclass(frozen=True)
class OutputFormat:
    """How a model family marks tool calls and reasoning in its output text."""

    tool_open: str = "<tool_call>"
    tool_close: Optional[str] = "</tool_call>"
    think_open: str = "<think>"
    think_close: str = "</think>"


async def stream_chunks(
    engine: Engine,
    req: dict[str, Any],
    extractor: ToolCallExtractor,
    fmt: OutputFormat = OutputFormat(),
    *,
    replica: str = "",
    decode_tail: Optional[Callable[[array], str]] = None,
) -> AsyncIterator[list[dict[str, Any]]]:
    """Run one request; yield lists of pieces, the last one ending with a `done` piece.

    `decode_tail` decodes the prompt's last tokens: a prompt that ends inside an
    opened think tag (Qwen3-style templates) starts the output in reasoning.
    """
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
    tail = decode_tail(request.prompt_token_ids[-8:]) if decode_tail else ""
    parser = StreamingOutputParser(
        extractor,
        tool_open=fmt.tool_open,
        tool_close=fmt.tool_close,
        think_open=fmt.think_open,
        think_close=fmt.think_close,
        tools_enabled=bool(request.tools) and request.tool_choice != "none",
        start_in_reasoning=tail.rstrip().endswith(fmt.think_open),
    )
    output_tokens = 0
    # The engine's own clock: the connection actor subtracts it from what it
    # saw to get the cost of the handle hop (benchmarks, traces).
    started = time.perf_counter()
    first_token = 0.0
    # aclosing: leaving early (client gone, content filter) closes the engine's
    # generator now, which aborts the request, instead of whenever GC runs.
    async with aclosing(engine.generate(request)) as deltas:
        async for delta in deltas:
            output_tokens += delta.new_tokens
            if delta.new_tokens and not first_token:
                first_token = time.perf_counter() - started
            chunk = pieces_to_dicts(parser.feed(delta.text)) if delta.text else []
            if delta.new_tokens and not delta.finished:
                # Token progress: a turn stopped early (client gone, content filter)
                # still knows what it cost.
                chunk.append({"t": "tokens", "n": delta.new_tokens})
            if delta.finished:
                chunk += pieces_to_dicts(parser.finish())
                chunk.append(
                    {
                        "t": "done",
                        "prompt_tokens": delta.prompt_tokens,
                        "cached_tokens": delta.cached_tokens,
                        "output_tokens": output_tokens,
                        "finish_reason": delta.finish_reason,
                        "replica": replica,
                        "engine_s": time.perf_counter() - started,
                        "first_token_s": first_token,
                    }
                )
            if chunk:
                yield chunk


async def coalesce(chunks: AsyncIterator[list[dict[str, Any]]],
                   min_interval_s: float = 0.0) -> AsyncIterator[list[dict[str, Any]]]:
    """Adaptive batching for the handle stream: yield everything produced so far as one list.

    The first piece goes out at once; while the consumer (a Ray streaming call,
    ~1 ms of CPU per item) is busy, pieces pile up and leave together.
    `min_interval_s` > 0 also holds later pieces until that long after the
    previous batch (fewer stream items, each a little later), except that the
    end of the stream always leaves at once.
    """
    import asyncio

    queue: asyncio.Queue = asyncio.Queue()
    done = object()
    ended = asyncio.Event()

    async def produce() -> None:
        try:
            async for chunk in chunks:
                queue.put_nowait(chunk)
        except BaseException as exc:  # re-raised on the consumer side
            queue.put_nowait(exc)
        finally:
            queue.put_nowait(done)
            ended.set()

    loop = asyncio.get_running_loop()
    task = loop.create_task(produce())
    last = 0.0
    try:
        while True:
            wait = last + min_interval_s - loop.time()
            if wait > 0 and not ended.is_set():
                try:
                    await asyncio.wait_for(ended.wait(), wait)
                except asyncio.TimeoutError:
                    pass
            item = await queue.get()
            batch: list[dict[str, Any]] = []
            while True:
                if item is done:
                    if batch:
                        yield batch
                    return
                if isinstance(item, BaseException):
                    raise item
                batch.extend(item)
                if queue.empty():
                    break
                item = queue.get_nowait()
            last = loop.time()
            yield batch
    finally:
        task.cancel()
        try:
            await task
        except BaseException:
            pass

"""Engine deltas -> parsed output chunks (what an EngineReplica streams back)."""

from __future__ import annotations

import time
from array import array
from contextlib import aclosing
from dataclasses import astuple, dataclass
from typing import AsyncIterator, Callable, Optional

from cluster.core.messages import EngineChunk, EngineDone, EngineFailure, EngineRequest, TokenProgress, merged
from cluster.engines.base import Engine
from cluster.engines.vllm.grammar_gate import GrammarBusy
from cluster.engines.output_parser import OutputParser, StreamingOutputParser, ToolCallExtractor


@dataclass(frozen=True)
class OutputFormat:
    """How a model family marks tool calls and reasoning in its output text."""

    tool_open: str = "<tool_call>"
    tool_close: Optional[str] = "</tool_call>"
    think_open: str = "<think>"
    think_close: str = "</think>"
    bare_start: str = ""  # an output that opens with this is a call section without its tag (Llama 3's JSON)


async def stream_chunks(
    engine: Engine,
    request: EngineRequest,
    extractor: ToolCallExtractor,
    fmt: OutputFormat = OutputFormat(),
    *,
    replica: str = "",
    decode_raw: Optional[Callable[[array], str]] = None,
    parser: Optional[OutputParser] = None,
) -> AsyncIterator[EngineChunk]:
    """Run one request (whole prompt); yield lists of pieces, the last one ending with `EngineDone`.

    `decode_raw` decodes tokens with special tokens kept: the prompt's last tokens (a prompt
    that ends inside an opened think tag, as Qwen3-style templates do, starts the output in
    reasoning) and, at the end, the whole output (the next turn reuses its token ids). `parser`:
    a family's own parser of the output (harmony reads token ids); default: the text splitter.
    """
    prompt_tokens = request.engine_len
    if prompt_tokens >= engine.max_model_len:
        yield [EngineFailure(400, f"The prompt has {prompt_tokens} tokens; "
                                  f"the model's limit is {engine.max_model_len}.",
                             code="context_length_exceeded", param="input")]
        return
    tail = decode_raw(request.prompt_token_ids[-8:]) if decode_raw and parser is None else ""
    parser = parser or StreamingOutputParser(
        extractor,
        tool_open=fmt.tool_open,
        tool_close=fmt.tool_close,
        think_open=fmt.think_open,
        think_close=fmt.think_close,
        tools_enabled=bool(request.generation.tools) and request.generation.tool_choice != "none",
        start_in_reasoning=tail.rstrip().endswith(fmt.think_open),
        bare_start=fmt.bare_start,
        tools=request.generation.tools,
    )
    output_tokens = 0
    output_ids = array("i")
    # The engine's own clock: the connection actor subtracts it from what it
    # saw to get the cost of the handle hop (benchmarks, traces).
    started = time.perf_counter()
    first_token = 0.0
    # aclosing: leaving early (client gone, content filter) closes the engine's
    # generator now, which aborts the request, instead of whenever GC runs.
    async with aclosing(engine.generate(request)) as deltas:
        try:
            delta = await anext(deltas, None)
        except GrammarBusy as exc:
            yield [EngineFailure(429, f"{exc}; retry shortly, or send a schema it has compiled before.",
                                 code="rate_limit_exceeded", retry_after_s=exc.retry_after_s)]
            return
        except ValueError as exc:  # the engine refused the request (e.g. a schema structured outputs cannot compile)
            yield [EngineFailure(400, f"The request cannot be generated: {str(exc)[:300]}", code="invalid_value")]
            return
        # The deltas are read here directly (no generator chaining the first one back in front):
        # each delta climbs one async-generator layer fewer on its way to the turn.
        while delta is not None:
            output_tokens += delta.new_tokens
            output_ids.extend(delta.token_ids)
            if delta.new_tokens and not first_token:
                first_token = time.perf_counter() - started
            chunk: EngineChunk = list(parser.feed(delta.text, delta.token_ids)) if delta.text or delta.token_ids else []
            if delta.new_tokens and not delta.finished:
                chunk.append(TokenProgress(delta.new_tokens))
            if delta.finished:
                chunk += parser.finish()
                chunk.append(EngineDone(delta.prompt_tokens, delta.cached_tokens, output_tokens, delta.finish_reason,
                                        replica=replica, engine_s=time.perf_counter() - started,
                                        first_token_s=first_token, output_ids=output_ids.tobytes(),
                                        output_text=decode_raw(output_ids) if decode_raw else "",
                                        core=astuple(delta.core) if delta.core else ()))
            if chunk:
                yield chunk
            delta = await anext(deltas, None)


async def coalesce(chunks: AsyncIterator[list], min_interval_s: float = 0.0) -> AsyncIterator[list]:
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
            batch: list = []
            while True:
                if item is done:
                    if batch:
                        yield merged(batch)
                    return
                if isinstance(item, BaseException):
                    raise item
                batch.append(item)
                if queue.empty():
                    break
                item = queue.get_nowait()
            last = loop.time()
            yield merged(batch) if len(batch) > 1 else batch[0]
    finally:
        task.cancel()
        try:
            await task
        except BaseException:
            pass

"""EngineReplica: one engine (vLLM or scripted) + the model family's output parser."""

from __future__ import annotations

import asyncio
import logging
from contextlib import aclosing
from typing import Any, AsyncIterator, Optional

from ray import serve

from cluster.config import LoopserveConfig
from cluster.engines import Engine, engine_class
from cluster.engines.parsers import reasoning_tags, tool_format, vllm_tool_call_extractor
from cluster.engines.stream import OutputFormat, coalesce, stream_chunks

from cluster.tokenizer import load_tokenizer

log = logging.getLogger("loopserve.engine")


@serve.deployment(name="EngineReplica")
class EngineReplica:
    async def __init__(self, config: LoopserveConfig, engine_cls: Optional[type] = None) -> None:
        self.config = config
        self.tokenizer = await asyncio.to_thread(load_tokenizer, config)
        backend = self.tokenizer.backend_tokenizer
        cls = engine_cls or engine_class(config.engine)
        engine_cfg = config.engine.scripted if config.engine.backend == "scripted" else config.engine.vllm
        self.engine: Engine = cls(
            config.model,
            engine_cfg,
            encode=lambda s: backend.encode(s, add_special_tokens=False).ids,
            decode=lambda ids: backend.decode(ids, skip_special_tokens=True),
        )
        await self.engine.start()
        self.extractor = vllm_tool_call_extractor(config.model.tool_parser, self.tokenizer)
        tools = tool_format(config.model.tool_parser)
        think = reasoning_tags(config.model.reasoning_parser, self.tokenizer)
        self.format = OutputFormat(tools.start, tools.end, think[0], think[1])
        self._decode_tail = lambda ids: backend.decode(list(ids), skip_special_tokens=False)
        try:
            self.replica_id = serve.get_replica_context().replica_id.unique_id
        except Exception:  # constructed outside Serve (tests)
            self.replica_id = "local"

    async def generate(self, req: dict[str, Any]) -> AsyncIterator[list[dict[str, Any]]]:
        chunks = coalesce(stream_chunks(
            self.engine, req, self.extractor, self.format, replica=self.replica_id, decode_tail=self._decode_tail
        ))
        async with aclosing(chunks):
            async for chunk in chunks:
                yield chunk

    async def stats(self) -> dict[str, Any]:
        return {**self.engine.stats.as_dict(), "replica": self.replica_id}

    async def check_health(self) -> None:
        llm = getattr(self.engine, "llm", None)
        if llm is not None:
            await llm.check_health()

    async def __del__(self) -> None:
        try:
            await self.engine.shutdown()
        except Exception:
            pass

"""EngineReplica: one engine (vLLM or scripted) + the model family's output parser."""

from __future__ import annotations

import asyncio
import logging
from array import array
from typing import Any, AsyncIterator, Optional

from ray import serve

from cluster.config import LoopserveConfig
from cluster.core.output_parser import ReasoningPiece, StreamingOutputParser, TextPiece, ToolCallPiece
from cluster.engines import Engine, EngineRequest, engine_class
from cluster.engines.parsers import TAGS, vllm_tool_call_extractor

from .render import load_tokenizer

log = logging.getLogger("loopserve.engine")


def _pieces(pieces) -> list[dict[str, Any]]:
    out = []
    for p in pieces:
        if isinstance(p, TextPiece):
            out.append({"t": "text", "v": p.text})
        elif isinstance(p, ReasoningPiece):
            out.append({"t": "reasoning", "v": p.text})
        elif isinstance(p, ToolCallPiece):
            out.append({"t": "tool", "name": p.name, "args": p.arguments})
    return out


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
        self.tags = TAGS.get(config.model.tool_parser, ("<tool_call>", "</tool_call>"))

    async def generate(self, req: dict[str, Any]) -> AsyncIterator[list[dict[str, Any]]]:
        prompt = req["prompt_token_ids"]
        request = EngineRequest(
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
        parser = StreamingOutputParser(
            self.extractor,
            tool_open=self.tags[0],
            tool_close=self.tags[1],
            tools_enabled=bool(request.tools) and request.tool_choice != "none",
        )
        output_tokens = 0
        async for delta in self.engine.generate(request):
            output_tokens += delta.new_tokens
            chunk = _pieces(parser.feed(delta.text)) if delta.text else []
            if delta.finished:
                chunk += _pieces(parser.finish())
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

    async def stats(self) -> dict[str, Any]:
        return self.engine.stats.as_dict()

    async def check_health(self) -> None:
        if getattr(self.engine, "llm", None) is not None:
            await self.engine.llm.check_health()

    async def __del__(self) -> None:
        try:
            await self.engine.shutdown()
        except Exception:
            pass

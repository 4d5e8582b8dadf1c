"""The scripted engine's clock under an engine model (`cost_model.py`): one task runs steps as a
continuous-batching engine does, each taking every decoding request's next token and, within the
step's token budget, chunks of waiting prefills (first come, first served), for the time the
model gives that batch. A request's tokens are made whether or not its reader keeps up, as an
engine's are; a slow reader finds them waiting."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Optional

from cluster.engines.scripted.cost_model import EngineCostModel


@dataclass(eq=False)  # a job is itself (list.remove), whatever its numbers
class _Prefill:
    tokens: int  # still to compute
    context: int  # tokens before the next chunk
    done: asyncio.Future


@dataclass(eq=False)
class _Decode:
    context: int
    remaining: int
    made: int = 0  # tokens made and not yet taken
    ready: asyncio.Event = field(default_factory=asyncio.Event)


class StepClock:
    def __init__(self, model: EngineCostModel) -> None:
        self.model = model
        self._prefills: list[_Prefill] = []
        self._decodes: dict[str, _Decode] = {}
        self._task: Optional[asyncio.Task] = None
        self.steps = 0
        self.busy_s = 0.0  # engine time spent in steps (what the engine's utilisation is read from)

    async def prefill(self, tokens: int, context: int) -> None:
        """Returns when `tokens` after `context` cached ones are computed."""
        if tokens <= 0:
            return
        job = _Prefill(tokens, context, asyncio.get_running_loop().create_future())
        self._prefills.append(job)
        self._kick()
        try:
            await job.done
        finally:
            if job in self._prefills:  # cancelled while waiting: it leaves the batch
                self._prefills.remove(job)

    def start_decode(self, request_id: str, context: int, tokens: int) -> None:
        """`request_id` decodes `tokens` tokens from now, one a step."""
        if tokens > 0:
            self._decodes[request_id] = _Decode(context, tokens)
            self._kick()

    async def next_token(self, request_id: str) -> None:
        """Returns once the request's next token is made (at once when one waits)."""
        d = self._decodes.get(request_id)
        if d is None:
            return
        while not d.made:
            d.ready.clear()
            await d.ready.wait()
        d.made -= 1
        if not d.made and not d.remaining:
            self._decodes.pop(request_id, None)

    def stop(self, request_id: str) -> None:
        """The request decodes no more (finished, aborted or preempted)."""
        self._decodes.pop(request_id, None)

    def _kick(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(0)  # requests that asked in the same tick share the step
            decoding = [d for d in self._decodes.values() if d.remaining]
            budget = self.model.max_batched_tokens - len(decoding)
            chunks: list[tuple[_Prefill, int]] = []
            for job in self._prefills:
                if budget <= 0:
                    break
                n = min(job.tokens, budget)
                chunks.append((job, n))
                budget -= n
            if not decoding and not chunks:
                return
            dt = self.model.step_time([d.context for d in decoding], [(n, job.context) for job, n in chunks])
            await asyncio.sleep(dt)
            self.steps += 1
            self.busy_s += dt
            for d in decoding:
                d.remaining -= 1
                d.context += 1
                d.made += 1
                d.ready.set()
            for job, n in chunks:
                job.tokens -= n
                job.context += n
                if not job.tokens:
                    self._prefills.remove(job)
                    if not job.done.done():
                        job.done.set_result(None)

"""Structured-output grammars compiled under a time limit before vLLM sees them.

vLLM compiles a request's JSON schema (xgrammar) on a small executor in the engine: a schema
that takes a minute to compile holds every later grammar request of that replica behind it.
The static checks at the edge (`core.controls.check_grammar_cost`) catch the known shapes
(long patterns, large repetition counts); this catches everything else. Each new schema is
compiled once, by the same compiler with the model's tokenizer, in a worker process of this
replica; one that is not done within `grammar_compile_timeout_s` is refused (400) and the worker
is killed and replaced, so the engine never starts on it. Schemas that compiled are remembered
(agents send the same ones every turn) and pass at once.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import multiprocessing
from collections import OrderedDict
from typing import Any, Iterable, Optional

log = logging.getLogger("ray.serve")


class GrammarTooComplex(ValueError):
    """A schema the engine would take too long to compile (a 400 for the client)."""


class GrammarBusy(Exception):
    """New schemas of other requests fill the compiler for longer than a request may wait for it
    (a 429 with Retry-After): one client's stream of slow schemas does not queue everyone's."""

    def __init__(self, retry_after_s: float) -> None:
        super().__init__("the structured-output compiler of this engine replica is busy with other new schemas")
        self.retry_after_s = retry_after_s


def _worker(conn: Any, model_path: str) -> None:
    import cluster  # noqa: F401  (torch extension guard before transformers)
    import xgrammar as xgr
    from transformers import AutoTokenizer

    info = xgr.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(model_path))
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    conn.send(("ready", ""))
    while True:
        schema = conn.recv()
        try:
            compiler.compile_json_schema(schema, any_whitespace=True)
            conn.send(("ok", ""))
        except Exception as exc:  # the engine would refuse it too: its message, not ours
            conn.send(("error", str(exc)[:300]))


def request_schemas(text_format: Optional[dict[str, Any]], tools: Iterable[dict[str, Any]],
                    forced: bool) -> list[str]:
    """The JSON schemas a request makes the engine compile, as the engine gets them."""
    import json

    schemas = []
    if forced:
        # vLLM compiles one grammar over all the tools (a structural tag); their parameters as
        # one schema is the closest JSON-schema stand-in, and costs what the sum of them costs.
        params = [t["function"]["parameters"] for t in tools]
        if params:
            schemas.append(json.dumps(params[0] if len(params) == 1 else {"anyOf": params}))
    elif text_format and text_format.get("type") == "json_schema":
        schemas.append(json.dumps(text_format["schema"]))
    return schemas


class GrammarGate:
    def __init__(self, model_path: str, time_limit_s: float, remember: int = 1024) -> None:
        self.model_path = model_path
        self.time_limit_s = time_limit_s
        self.remember = remember
        self.refused = 0
        self._compiled: OrderedDict[bytes, None] = OrderedDict()
        self._lock = asyncio.Lock()  # one compile at a time: the worker has one thread
        self._proc: Optional[multiprocessing.process.BaseProcess] = None
        self._conn: Any = None
        self._up = False  # the worker said it is ready
        self._restarting: Optional[asyncio.Task] = None

    @property
    def ready(self) -> bool:
        """The worker is up: a new schema is compiled now, not after the worker starts."""
        return self._up and self._proc is not None and self._proc.is_alive()

    async def warm(self) -> None:
        """Start the worker ahead of the first schema (a process and a tokenizer: seconds)."""
        async with self._lock:
            if self._proc is None:
                await self._start()

    async def check(self, schemas: Iterable[str]) -> None:
        for schema in schemas:
            key = hashlib.blake2b(schema.encode(), digest_size=16).digest()
            if key in self._compiled:
                self._compiled.move_to_end(key)
                continue
            # A new schema waits for the compiler no longer than two compiles' time limit: past
            # that, a stream of slow schemas (each just under the limit) is queueing everyone.
            wait_s = 2 * self.time_limit_s
            if self._restarting is not None and not self._restarting.done():
                await asyncio.shield(self._restarting)  # a replacement worker starting is not a busy compiler
            try:
                await asyncio.wait_for(self._lock.acquire(), wait_s)
            except asyncio.TimeoutError:
                raise GrammarBusy(wait_s) from None
            try:
                await self._compile(schema)
            finally:
                self._lock.release()
            self._compiled[key] = None
            while len(self._compiled) > self.remember:
                self._compiled.popitem(last=False)

    async def _compile(self, schema: str) -> None:
        if self._restarting is not None and not self._restarting.done():
            await asyncio.shield(self._restarting)
        if self._proc is None or not self._proc.is_alive():
            await self._start()
        self._conn.send(schema)
        if not await asyncio.to_thread(self._conn.poll, self.time_limit_s):
            self._stop()
            self.refused += 1
            # Its replacement starts now, in the background (seconds: a process and a tokenizer),
            # not inside the next requester's wait.
            self._restarting = asyncio.get_running_loop().create_task(self._restart())
            raise GrammarTooComplex(
                f"the JSON schema's grammar did not compile within {self.time_limit_s:g} s; simplify it (fewer "
                "or shorter patterns, fewer properties)")
        status, detail = self._conn.recv()
        if status == "error":
            raise ValueError(f"the JSON schema cannot be compiled: {detail}")

    async def _restart(self) -> None:
        try:
            await self._start()
        except Exception as exc:  # noqa: BLE001 - the next new schema starts it again
            log.warning("grammar worker did not restart: %s", exc)

    async def _start(self) -> None:
        ctx = multiprocessing.get_context("spawn")  # no copy of the engine's threads and CUDA state
        parent, child = ctx.Pipe()
        self._proc = ctx.Process(target=_worker, args=(child, self.model_path), daemon=True,
                                 name="loopserve-grammar-gate")
        self._proc.start()
        child.close()
        self._conn = parent
        try:
            started = await asyncio.to_thread(parent.poll, 120)
        except BaseException:  # cancelled (the gate is closing): no worker left behind
            self._stop()
            raise
        if not started:
            self._stop()
            raise RuntimeError("the grammar worker did not start")
        parent.recv()
        self._up = True

    def _stop(self) -> None:
        self._up = False
        if self._proc is not None:
            self._proc.kill()
            self._proc.join(5)
        if self._conn is not None:
            self._conn.close()
        self._proc, self._conn = None, None

    def close(self) -> None:
        if self._restarting is not None and not self._restarting.done():
            self._restarting.cancel()
        self._stop()

"""Safety classification that only ever looks at content it has not seen.

`Classifier`s map texts to `Verdict`s; the turn driver sends them the new input
items before a turn (concurrently with prefill) and generated text in chunks
while it streams (`OutputMonitor`). How much was classified is kept in the
session state, so a continuation never re-classifies its history.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from cluster.core.render.chat_messages import compaction_text, content_text


def item_texts(items: Sequence[dict[str, Any]], tool_outputs: bool = False) -> list[str]:
    """The text of input items the model will read, to classify: every message (any
    role: a client can put words in the assistant's mouth too), function-call
    arguments, compaction summaries (rendered as a system message), and tool
    outputs if asked (they are the client's own data)."""
    texts = []
    for item in items:
        kind = item.get("type", "message")
        if kind == "message":
            text = content_text(item.get("content"))
        elif kind == "function_call":
            text = f"{item.get('name', '')}({item.get('arguments', '')})"
        elif kind == "compaction":
            text = compaction_text(item)
        elif kind == "function_call_output" and tool_outputs:
            text = content_text(item.get("output"))
        else:
            continue
        if text:
            texts.append(text)
    return texts


def turn_input_texts(items: Sequence[dict[str, Any]], instructions: Optional[str],
                     parent_instructions: Optional[str], tool_outputs: bool = False) -> list[str]:
    """What a turn classifies before its output is released: its new items, and its
    `instructions` unless the previous response ran under the same ones already."""
    texts = item_texts(items, tool_outputs)
    if instructions and instructions != parent_instructions:
        texts.insert(0, instructions)
    return texts


def first_flag(verdicts: Sequence[dict[str, Any]]) -> Optional[dict[str, Any]]:
    return next((v for v in verdicts if v.get("flagged")), None)


class OutputMonitor:
    """Cuts streamed output into chunks for classification.

    A chunk is released every `chunk_chars`, with `overlap` characters of the
    previous chunk prefixed so a phrase split across the cut is still seen.
    """

    def __init__(self, chunk_chars: int = 256, overlap: int = 48) -> None:
        self.chunk_chars = chunk_chars
        self.overlap = overlap
        self._pending = ""
        self._tail = ""
        self.classified_chars = 0

    def feed(self, text: str) -> Optional[str]:
        self._pending += text
        if len(self._pending) < self.chunk_chars:
            return None
        return self._cut()

    def flush(self) -> Optional[str]:
        return self._cut() if self._pending else None

    def _cut(self) -> str:
        chunk = self._tail + self._pending
        self.classified_chars += len(self._pending)
        self._tail = chunk[-self.overlap :] if self.overlap else ""
        self._pending = ""
        return chunk


# (texts) -> [verdict dicts]: a SafetyActor handle in production, a classifier in tests.
SafetyPort = Any


class TurnSafety:
    """One turn's safety: the input verdict gate and the output chunk checks.

    The input check starts once the engine call is on its way (`start_input`), so it
    overlaps prefill instead of holding the request back: local classifiers run on the
    replica's event loop, and a task made earlier ran before the engine request was sent
    (~1 ms for a 2 KB tool output). The driver awaits `gate()` before releasing the first
    output event. Output
    chunks are classified concurrently with streaming; a flag stops the stream.
    At most `max_unverified` chunks may be out for classification while more
    text is released: past that, `release_check()` waits for the oldest verdict.
    Without the bound, a slow classifier (a loaded safety replica, an engine that
    bursts a backlog of tokens) would let the whole answer out before a flag
    lands; with it, a flagged answer is cut within the flagged chunk and
    `max_unverified` more, however late the verdicts come.
    """

    def __init__(self, port: Optional[SafetyPort], input_texts: list[str], chunk_chars: int = 256, *,
                 tracer: Any = None, trace_parent: Any = None, max_unverified: int = 1) -> None:
        import asyncio

        self._asyncio = asyncio
        self._port = port
        self._tracer, self._trace_parent = tracer, trace_parent
        self.input_chars = sum(len(t) for t in input_texts) if port else 0
        self._input_texts = input_texts if port else []
        self._input: Optional[Any] = None
        self.input_seconds = 0.0
        self.monitor = OutputMonitor(chunk_chars)
        self._outputs: list[Any] = []
        self.max_unverified = max_unverified
        self.flag: Optional[dict[str, Any]] = None
        self.tail_text = ""  # generated text left for post-inference classification

    async def _traced(self, name: str, port: SafetyPort, texts: list[str]) -> list[dict[str, Any]]:
        # Runs as its own task: the span is made current there, so the port
        # (a handle call) propagates it to the safety deployment.
        if self._tracer is None:
            return await port(texts)
        with self._tracer.start_as_current_span(name, context=self._trace_parent) as span:
            span.set_attribute("loopserve.safety.chars", sum(len(t) for t in texts))
            verdicts = await port(texts)
            span.set_attribute("loopserve.safety.flagged", any(v.get("flagged") for v in verdicts))
            return verdicts

    async def _timed(self, port: SafetyPort, texts: list[str]) -> list[dict[str, Any]]:
        import time

        t0 = time.perf_counter()
        try:
            return await self._traced("safety.input", port, texts)
        finally:
            self.input_seconds = time.perf_counter() - t0

    @property
    def output_chars(self) -> int:
        return self.monitor.classified_chars

    def start_input(self) -> None:
        """Classify the turn's new input (once). Called right after the engine call was
        scheduled: a task made now runs after the one that sends the request."""
        if self._input_texts:
            texts, self._input_texts = self._input_texts, []
            self._input = self._asyncio.ensure_future(self._timed(self._port, texts))

    async def gate(self) -> Optional[dict[str, Any]]:
        self.start_input()
        if self._input is not None:
            task, self._input = self._input, None
            hit = first_flag(await task)
            if hit and self.flag is None:
                self.flag = {**hit, "stage": "input"}
        return self.flag

    def on_output(self, text: str) -> None:
        if self._port is None:
            return
        chunk = self.monitor.feed(text)
        if chunk:
            self._outputs.append(self._asyncio.ensure_future(self._traced("safety.output", self._port, [chunk])))

    async def release_check(self) -> Optional[dict[str, Any]]:
        """Before an output piece goes out: the input verdict, and the output
        verdicts that have come, waiting for the oldest while too many are out."""
        flag = await self.gate()
        while flag is None and len(self._outputs) > self.max_unverified:
            await self._asyncio.wait([self._outputs[0]])
            flag = self.check_output()
        return flag or self.check_output()

    def check_output(self) -> Optional[dict[str, Any]]:
        while self._outputs and self._outputs[0].done():
            hit = first_flag(self._outputs.pop(0).result())
            if hit and self.flag is None:
                self.flag = {**hit, "stage": "output"}
        return self.flag

    async def finish(self) -> Optional[dict[str, Any]]:
        """At the end of generation: the input verdict and the chunks already sent.

        The unclassified tail (shorter than a chunk, e.g. a whole tool-call
        turn) is *not* awaited here: it is classified as post-inference work
        (`tail_text`), so a clean turn's terminal event waits for nothing.
        """
        await self.gate()
        if self._port is not None:
            self.tail_text = self.monitor.flush() or ""
        if self._outputs:
            await self._asyncio.gather(*self._outputs)
        return self.check_output()

    def cancel(self) -> None:
        for task in ([self._input] if self._input else []) + self._outputs:
            task.cancel()

    def summary(self) -> dict[str, Any]:
        return {"input_chars": self.input_chars, "output_chars": self.output_chars, "flag": self.flag,
                "input_seconds": self.input_seconds, "tail": self.tail_text}

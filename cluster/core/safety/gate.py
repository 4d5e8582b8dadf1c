"""Safety classification that only ever looks at content it has not seen.

`Classifier`s map texts to `Verdict`s; the turn driver sends them the new input
items before a turn (concurrently with prefill) and generated text in chunks
while it streams (`OutputMonitor`). How much was classified is kept in the
session state, so a continuation never re-classifies its history.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from cluster.core.render.chat_messages import compaction_text, content_text, mcp_result


def item_texts(items: Sequence[dict[str, Any]], tool_outputs: bool = False) -> list[str]:
    """The text of input items the model will read, to classify: every message (any
    role: a client can put words in the assistant's mouth too), function-call
    arguments, compaction summaries (rendered as a system message), and tool
    outputs if asked (they are the client's own data; a server-run MCP call's result as well)."""
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
        elif kind == "mcp_call" and tool_outputs and (item.get("output") is not None or item.get("error")):
            text = mcp_result(item)  # a remote MCP server's answer, which the model reads next
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

    @property
    def room(self) -> int:
        """Characters the current chunk takes before it is cut."""
        return self.chunk_chars - len(self._pending)

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
    output event. Output chunks are classified concurrently with streaming; a flag stops
    the stream.

    What the client may hold unverified is bounded in characters, whatever size the
    engine's pieces come in (a consumer that fell behind gets what piled up as one
    piece; a plain answer comes in two): the stream releases a piece in `parts` that end
    where the monitor cuts its chunks, and `release_check(len(part))` waits for the
    oldest verdicts until the released-but-unverified text plus the part stays within
    `max_unverified_chars` (default: two chunks). A flagged answer is therefore cut
    within `max_unverified_chars` of where the flagged chunk begins, however late the
    verdicts come.
    """

    def __init__(self, port: Optional[SafetyPort], input_texts: list[str], chunk_chars: int = 256, *,
                 tracer: Any = None, trace_parent: Any = None, max_unverified_chars: Optional[int] = None,
                 hold_tail: bool = False) -> None:
        import asyncio

        self._asyncio = asyncio
        self._port = port
        self._tracer, self._trace_parent = tracer, trace_parent
        self.input_chars = sum(len(t) for t in input_texts) if port else 0
        self._input_texts = input_texts if port else []
        self._input: Optional[Any] = None
        self.input_seconds = 0.0
        self.monitor = OutputMonitor(chunk_chars)
        self._outputs: list[tuple[Any, int]] = []  # (verdict task, released characters its chunk ends at)
        # Never below one chunk: a part never waits on its own chunk's verdict.
        self.max_unverified_chars = max(chunk_chars, max_unverified_chars or 2 * chunk_chars)
        self.released_chars = 0  # generated characters handed to the client so far
        self.verified_chars = 0  # of those, the ones whose chunks' verdicts came back clean
        # Nobody reads a non-streamed or background answer before its end: classify its tail
        # before the terminal event too, so what it returns never holds unclassified text.
        self.hold_tail = hold_tail
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

    def add_input(self, texts: list[str]) -> None:
        """More input the model will read before its next engine call (a server-run MCP call's
        result): classified when that call starts, released output waiting on its verdict."""
        if self._port is not None and texts:
            self._input_texts = [*self._input_texts, *texts]
            self.input_chars += sum(len(t) for t in texts)

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

    @property
    def unverified_chars(self) -> int:
        return self.released_chars - self.verified_chars

    def parts(self, text: str) -> list[str]:
        """`text` cut where the monitor cuts its chunks: each part fills at most the current
        chunk, so every part can wait for the verdicts on all text before it."""
        room = self.monitor.room
        if self._port is None or len(text) <= room:
            return [text]
        size = self.monitor.chunk_chars
        return [text[:room]] + [text[i:i + size] for i in range(room, len(text), size)]

    def on_output(self, text: str) -> None:
        """`text` went out: count it unverified and classify the chunk it completes."""
        if self._port is None:
            return
        self.released_chars += len(text)
        chunk = self.monitor.feed(text)
        if chunk:
            self._classify_output(chunk)

    def _classify_output(self, chunk: str) -> None:
        """A verdict task for `chunk`, which ends at what was released so far."""
        task = self._asyncio.ensure_future(self._traced("safety.output", self._port, [chunk]))
        self._outputs.append((task, self.released_chars))

    async def release_check(self, size: int = 0) -> Optional[dict[str, Any]]:
        """Before `size` more generated characters go out: the input verdict, and the output
        verdicts that have come, waiting for the oldest while the unverified text would pass
        `max_unverified_chars`."""
        flag = await self.gate()
        while flag is None and self._outputs and self.unverified_chars + size > self.max_unverified_chars:
            await self._asyncio.wait([self._outputs[0][0]])
            flag = self.check_output()
        return flag or self.check_output()

    def check_output(self) -> Optional[dict[str, Any]]:
        while self._outputs and self._outputs[0][0].done():
            task, ends_at = self._outputs.pop(0)
            hit = first_flag(task.result())
            if hit and self.flag is None:
                self.flag = {**hit, "stage": "output"}
            if self.flag is None:
                self.verified_chars = ends_at
        return self.flag

    async def finish(self) -> Optional[dict[str, Any]]:
        """At the end of generation: the input verdict and the chunks already sent.

        The unclassified tail (shorter than a chunk, e.g. a whole tool-call
        turn) is *not* awaited here when the answer streams: it is classified as
        post-inference work (`tail_text`), so a clean turn's terminal event waits
        for nothing. A `hold_tail` answer (nobody reads it before its end) has its
        tail classified now, with the rest.
        """
        await self.gate()
        tail = self.monitor.flush() if self._port is not None else None
        if tail and self.hold_tail:
            self._classify_output(tail)
        elif tail:
            self.tail_text = tail
        if self._outputs:
            await self._asyncio.gather(*(task for task, _ in self._outputs))
        return self.check_output()

    def cancel(self) -> None:
        for task in ([self._input] if self._input else []) + [task for task, _ in self._outputs]:
            task.cancel()

    def summary(self) -> dict[str, Any]:
        return {"input_chars": self.input_chars, "output_chars": self.output_chars, "flag": self.flag,
                "input_seconds": self.input_seconds, "tail": self.tail_text}

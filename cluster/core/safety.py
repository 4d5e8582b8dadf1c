"""Safety classification that only ever looks at content it has not seen.

`Classifier`s map texts to `Verdict`s; the turn driver sends them the new input
items before a turn (concurrently with prefill) and generated text in chunks
while it streams (`OutputMonitor`). How much was classified is kept in the
session state, so a continuation never re-classifies its history.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Optional, Protocol, Sequence

from .render import _content_text, compaction_text


@dataclass(frozen=True)
class Verdict:
    flagged: bool
    category: Optional[str] = None
    score: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"flagged": self.flagged, "category": self.category, "score": self.score}


SAFE = Verdict(False)


class Classifier(Protocol):
    def classify(self, texts: Sequence[str]) -> list[Verdict]: ...


@dataclass
class PolicyClassifier:
    """Block lists and regular expressions per category (operator policy)."""

    patterns: dict[str, list[str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._compiled = [(cat, re.compile("|".join(f"(?:{p})" for p in pats), re.I)) for cat, pats in self.patterns.items() if pats]

    def classify(self, texts: Sequence[str]) -> list[Verdict]:
        out = []
        for text in texts:
            hit = next((cat for cat, rx in self._compiled if rx.search(text)), None)
            out.append(Verdict(True, hit, 1.0) if hit else SAFE)
        return out


class ProfanityClassifier:
    """The scikit-learn model shipped inside `alt-profanity-check` (no download).

    Its `predict_prob` goes through `CalibratedClassifierCV` (5 calibrated
    LinearSVCs, ~8 ms a call of sklearn overhead). The same arithmetic, done as
    one sparse product over the stacked coefficients, takes ~0.05 ms; a unit
    test checks both agree.
    """

    def __init__(self, threshold: float = 0.9) -> None:
        import numpy as np
        from profanity_check import profanity_check as pc

        self.threshold = threshold
        self._vectorizer = pc.vectorizer
        self._reference = pc.predict_prob
        folds = pc.model.calibrated_classifiers_
        if list(pc.model.classes_) != [0, 1] or any(len(f.calibrators) != 1 for f in folds):
            self._coef = None  # an unexpected model layout: use the package's own path
            return
        self._np = np
        self._coef = np.vstack([f.estimator.coef_[0] for f in folds]).T  # features x folds
        self._intercept = np.array([float(f.estimator.intercept_[0]) for f in folds])
        self._a = np.array([f.calibrators[0].a_ for f in folds])
        self._b = np.array([f.calibrators[0].b_ for f in folds])

    def probabilities(self, texts: Sequence[str]) -> list[float]:
        if self._coef is None:
            return [float(p) for p in self._reference(list(texts))]
        np = self._np
        decision = self._vectorizer.transform(list(texts)) @ self._coef + self._intercept
        # sklearn's sigmoid calibration: P(class 1) = 1 / (1 + exp(a * f + b)), averaged over folds
        return [float(p) for p in (1.0 / (1.0 + np.exp(self._a * decision + self._b))).mean(axis=1)]

    def classify(self, texts: Sequence[str]) -> list[Verdict]:
        if not texts:
            return []
        t = self.threshold
        return [Verdict(p >= t, "harassment" if p >= t else None, p) for p in self.probabilities(texts)]


@dataclass
class CombinedClassifier:
    """Flagged when any member flags; the first flagging member names the category."""

    members: list[Classifier]

    def classify(self, texts: Sequence[str]) -> list[Verdict]:
        verdicts = [SAFE] * len(texts)
        for member in self.members:
            for i, v in enumerate(member.classify(texts)):
                if v.flagged and not verdicts[i].flagged:
                    verdicts[i] = v
        return verdicts


def local_classifier(policy: dict[str, list[str]], kind: str, profanity_threshold: float) -> "CombinedClassifier":
    """The classifiers that run in-process: the operator's patterns, plus the shipped
    profanity model for `default` (a model-based guard runs on the engine tier instead)."""
    members: list[Classifier] = []
    if policy:
        members.append(PolicyClassifier(policy))
    if kind == "default":
        members.append(ProfanityClassifier(profanity_threshold))
    return CombinedClassifier(members)


GuardPort = Callable[[list[str]], Awaitable[list[Verdict]]]


class SafetyService:
    """Classifies texts and counts what it saw: inside the connection replica for the
    local classifiers (no hop before the first token), or inside the SafetyActor with
    a guard model consulted for what the local classifiers let through."""

    def __init__(self, classifier: Classifier, *, guard: Optional[GuardPort] = None, tracer: Any = None,
                 inline_chars: int = 8192) -> None:
        self.classifier = classifier
        self.guard = guard
        self.tracer = tracer
        self.inline_chars = inline_chars  # above this, classify on a thread (the caller's loop stays free)
        self.texts = 0
        self.chars = 0
        self.flagged = 0
        self.guard_unparseable = 0

    async def classify(self, texts: list[str], trace_parent: Any = None) -> list[dict[str, Any]]:
        import asyncio

        from .. import telemetry

        tracer = self.tracer or telemetry.tracer()
        with tracer.start_as_current_span("safety.classify", context=trace_parent,
                                          kind=telemetry.SpanKind.INTERNAL) as span:
            chars = sum(len(t) for t in texts)
            self.texts += len(texts)
            self.chars += chars
            if chars > self.inline_chars:
                verdicts = await asyncio.to_thread(self.classifier.classify, texts)
            else:
                verdicts = self.classifier.classify(texts)
            if self.guard is not None:
                judged = await self.guard(texts)
                verdicts = [v if v.flagged else g for v, g in zip(verdicts, judged)]
            flagged = sum(v.flagged for v in verdicts)
            self.flagged += flagged
            span.set_attribute("loopserve.safety.texts", len(texts))
            span.set_attribute("loopserve.safety.flagged", flagged)
            return [v.as_dict() for v in verdicts]

    def stats(self) -> dict[str, int]:
        return {"texts": self.texts, "chars": self.chars, "flagged": self.flagged,
                "guard_unparseable": self.guard_unparseable}


def item_texts(items: Sequence[dict[str, Any]], tool_outputs: bool = False) -> list[str]:
    """The text of input items the model will read, to classify: every message (any
    role: a client can put words in the assistant's mouth too), function-call
    arguments, compaction summaries (rendered as a system message), and tool
    outputs if asked (they are the client's own data)."""
    texts = []
    for item in items:
        kind = item.get("type", "message")
        if kind == "message":
            text = _content_text(item.get("content"))
        elif kind == "function_call":
            text = f"{item.get('name', '')}({item.get('arguments', '')})"
        elif kind == "compaction":
            text = compaction_text(item)
        elif kind == "function_call_output" and tool_outputs:
            text = _content_text(item.get("output"))
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

    The input check starts before the engine call, so it overlaps prefill; the
    driver awaits `gate()` before releasing the first output event. Output
    chunks are classified concurrently with streaming; a flag stops the stream.
    """

    def __init__(self, port: Optional[SafetyPort], input_texts: list[str], chunk_chars: int = 256, *,
                 tracer: Any = None, trace_parent: Any = None) -> None:
        import asyncio

        self._asyncio = asyncio
        self._port = port
        self._tracer, self._trace_parent = tracer, trace_parent
        self.input_chars = sum(len(t) for t in input_texts) if port else 0
        self._input = asyncio.ensure_future(self._timed(port, input_texts)) if port and input_texts else None
        self.input_seconds = 0.0
        self.monitor = OutputMonitor(chunk_chars)
        self._outputs: list[Any] = []
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

    async def gate(self) -> Optional[dict[str, Any]]:
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


GUARD_CATEGORIES = (
    "S1: Violent Crimes.\nS2: Non-Violent Crimes.\nS3: Sex Crimes.\nS4: Child Exploitation.\n"
    "S5: Defamation.\nS6: Specialized Advice.\nS7: Privacy.\nS8: Intellectual Property.\n"
    "S9: Indiscriminate Weapons.\nS10: Hate.\nS11: Self-Harm.\nS12: Sexual Content.\nS13: Elections."
)


def guard_prompt(text: str, role: str = "User") -> str:
    """The Llama Guard 3 task prompt for one piece of content."""
    return (
        f"Task: Check if there is unsafe content in '{role}' messages in conversations according to our "
        "safety policy with the below categories.\n\n<BEGIN UNSAFE CONTENT CATEGORIES>\n"
        f"{GUARD_CATEGORIES}\n<END UNSAFE CONTENT CATEGORIES>\n\n<BEGIN CONVERSATION>\n\n"
        f"{role}: {text}\n\n<END CONVERSATION>\n\nProvide your safety assessment for ONLY THE LAST {role} "
        "message in the above conversation:\n - First line must read 'safe' or 'unsafe'.\n"
        " - If unsafe, a second line must include a comma-separated list of violated categories."
    )


def parse_guard_output(text: str) -> Optional[Verdict]:
    """'safe' | 'unsafe\\nS1,S10' -> Verdict; anything else -> None (unparseable: the caller's policy decides)."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    first = lines[0].lower() if lines else ""
    if first == "unsafe":
        category = lines[1].split(",")[0].strip() if len(lines) > 1 else None
        return Verdict(True, category, 1.0)
    if first == "safe":
        return SAFE
    return None


def guard_verdict(text: str, on_unparseable: str) -> tuple[Verdict, bool]:
    """The verdict for a guard answer, and whether the answer was unparseable."""
    verdict = parse_guard_output(text)
    if verdict is not None:
        return verdict, False
    return (Verdict(True, "guard_unparseable", 1.0) if on_unparseable == "flag" else SAFE), True

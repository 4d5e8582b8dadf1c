"""Classifiers: texts in, `Verdict`s out. Local ones (a policy of words and patterns, a
profanity score) run inside the connection replica; a guard model, when configured, is asked
about what they let through (`SafetyService`, in the SafetyActor).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Optional, Protocol, Sequence

if TYPE_CHECKING:
    from cluster.core.render.chat_messages import ContentGuard


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
    LinearSVCs, ~8 ms a call of sklearn overhead). The same arithmetic is done here
    directly: the vectorizer's own analyzer, term counts looked up in its vocabulary,
    tf-idf with its norm, one product with the stacked coefficients of the terms
    present. sklearn's `transform` alone spent ~0.45 ms a call validating its sparse
    matrices (0.5 ms for a 2 KB tool output against 0.07 ms here), twice a turn; a unit
    test checks both agree with the package.
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
        v = self._vectorizer
        # The tf-idf variants sklearn's transform computes (anything else: its own transform).
        self._direct = (v.norm in ("l1", "l2", None) and getattr(v, "idf_", None) is not None and v.use_idf
                        and v.dtype in (np.float64, float))
        if self._direct:
            self._analyze = v.build_analyzer()
            self._vocabulary = v.vocabulary_
            self._idf = np.asarray(v.idf_, dtype=np.float64)

    def _decisions(self, texts: Sequence[str]):
        """Each text's decision value per fold: what `vectorizer.transform(texts) @ coef + intercept` gives."""
        np = self._np
        if not self._direct:
            return self._vectorizer.transform(list(texts)) @ self._coef + self._intercept
        v, vocabulary, out = self._vectorizer, self._vocabulary, []
        for text in texts:
            counts: dict[int, int] = {}
            for term in self._analyze(text):
                j = vocabulary.get(term)
                if j is not None:
                    counts[j] = counts.get(j, 0) + 1
            if not counts:
                out.append(self._intercept)
                continue
            idx = np.fromiter(counts.keys(), dtype=np.intp, count=len(counts))
            tf = np.fromiter(counts.values(), dtype=np.float64, count=len(counts))
            if v.binary:
                tf[:] = 1.0
            elif v.sublinear_tf:
                tf = np.log(tf) + 1.0
            x = tf * self._idf[idx]
            norm = float(np.sqrt(x @ x)) if v.norm == "l2" else float(np.abs(x).sum()) if v.norm == "l1" else 1.0
            if norm > 0:
                x /= norm
            out.append(x @ self._coef[idx] + self._intercept)
        return np.vstack(out)

    def probabilities(self, texts: Sequence[str]) -> list[float]:
        if self._coef is None:
            return [float(p) for p in self._reference(list(texts))]
        np = self._np
        decision = self._decisions(texts)
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

        from cluster import telemetry

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


def guard_prompt_ids(tokenizer: Any, content: "ContentGuard", text: str) -> list[int]:
    """The guard model's prompt for `text`, as token ids: the text a client or the model wrote stays
    text (`<|eot_id|>` in it must not end the guard's user turn and forge its answer)."""
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": content.escape(guard_prompt(text))}],
                                           tokenize=False, add_generation_prompt=True)
    return content.encode(prompt)


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

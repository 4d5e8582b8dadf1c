"""Checking delta renders against full renders, off the turn's critical path.

The start-up probe proves delta steps per kind of message on a battery of conversations, and the
AST analysis (template_analysis.py) refuses what it can read as content-dependent; neither proves
every content. A template can render an earlier message differently depending on what came later,
and then a delta render, which never re-renders earlier messages, sends the engine a prompt the
template's own full render would not produce. So continuations rendered as deltas are rendered
again in full, as post-inference work, and compared with the prefix the engine was sent: every
one of a replica's first `first` (a template's first sessions), then every `every`-th. On a
mismatch the replica renders fully from then on (`on_mismatch`), and the mismatch is counted,
logged once with the message where the renders part (its index and kind, and the newest step) and
exported; the connection replicas share the verdict (`TemplateVerdicts`). A delta that reused the
model's generated tokens is compared as text: those tokens may tokenize their text differently,
which is the point of reusing them.
"""

from __future__ import annotations

import hashlib
import json
import logging
from array import array
from typing import Any, Awaitable, Callable, Optional, Sequence

from cluster.core.messages import RenderJob
from cluster.core.render.chat_messages import message_kind, messages_from_items
from cluster.core.render.renderer import RenderResult

log = logging.getLogger("loopserve.render")

# A full render job -> its result (the RenderActor's port in production).
FullRender = Callable[[RenderJob], Awaitable[Optional[RenderResult]]]
MAX_VERDICTS = 16  # templates an app's ledger remembers verdicts for (an app serves one or two)


class RenderAudit:
    """Post-work hook: `await audit(record)` for each finished turn (a `TurnRecord`)."""

    def __init__(self, render: FullRender, every: int, *, on_mismatch: Callable[[str], None],
                 decode: Optional[Callable[[Sequence[int]], str]] = None,
                 on_checked: Optional[Callable[[bool], None]] = None, first: int = 0) -> None:
        if every < 1:
            raise ValueError("every must be >= 1")
        self.render, self.every, self.first, self.decode = render, every, first, decode
        self.on_mismatch, self.on_checked = on_mismatch, on_checked
        self.deltas_seen = 0
        self.checked = 0
        self.mismatches = 0
        self.last_mismatch = ""

    async def __call__(self, record: Any) -> None:
        state = record.state
        if state is None or record.timing.get("full_render", True) or state.rendered is None:
            return
        self.deltas_seen += 1
        if self.deltas_seen > self.first and self.deltas_seen % self.every:
            return
        rendered = state.rendered
        key = rendered.key
        items = list(state.items[: rendered.item_count])
        job = RenderJob(key.instructions, json.loads(key.tools_json), items=items,
                        reasoning_effort=key.reasoning_effort)
        full = await self.render(job)
        if full is None:
            return
        want, sent = full.assemble(None)[0], array("i", rendered.token_ids)
        exact = want == sent or (self.decode is not None and self.decode(want) == self.decode(sent))
        self.checked += 1
        if self.on_checked is not None:
            self.on_checked(exact)
        if exact:
            return
        self.mismatches += 1
        where = await self._where(job, items, sent, want)
        reason = (f"a delta render of response {record.response_id} differs from the template's full render "
                  f"({len(sent)} tokens sent, {len(want)} in the full render); {where}")
        self.last_mismatch = reason
        if self.mismatches == 1:
            log.error("chat template renders earlier messages depending on later content: %s; this replica "
                      "renders every turn in full from now on", reason)
        self.on_mismatch(reason)

    async def _where(self, job: RenderJob, items: list, sent: array, want: Sequence[int]) -> str:
        """The message of what was sent at which the full render departs from it (a few full
        renders of its prefixes, on a mismatch only), and the newest step, which brought the change."""
        messages, starts = messages_from_items(items)
        kinds = [message_kind(m) for m in messages]
        if not kinds:
            return "the conversation has no messages"
        parted = next((i for i, (a, b) in enumerate(zip(want, sent)) if a != b), min(len(want), len(sent)))
        low, high = 0, len(starts)  # the messages before starts[low] end at or before `parted` in what was sent
        while high - low > 1:
            mid = (low + high) // 2
            part = await self.render(RenderJob(job.instructions, job.tools, items=items[: starts[mid]],
                                               reasoning_effort=job.reasoning_effort))
            if part is not None and len(part.assemble(None)[0]) <= parted:
                low = mid
            else:
                high = mid
        step = f"{kinds[-2]} -> {kinds[-1]}" if len(kinds) > 1 else kinds[-1]
        return f"message {low} ({kinds[low]}) renders differently; the newest step: {step}"

    def stats(self) -> dict[str, Any]:
        return {"every": self.every, "first": self.first, "deltas_seen": self.deltas_seen, "checked": self.checked,
                "mismatches": self.mismatches, "last_mismatch": self.last_mismatch}


class ReplicaVerdict:
    """One connection replica's side of the verdicts: its template's digest, what it reports (why
    its deltas are off, once its audit found them inexact), and the app's verdicts applied."""

    def __init__(self, template_source: str, deltas_off: Callable[[], Optional[str]],
                 render_fully: Callable[[str], None]) -> None:
        self.digest = hashlib.sha256(template_source.encode()).hexdigest()
        self.deltas_off, self.render_fully = deltas_off, render_fully

    def report(self) -> dict[str, str]:
        off = self.deltas_off()
        return {self.digest: off} if off is not None else {}

    def apply(self, found: dict[str, str]) -> None:
        reason = found.get(self.digest)
        if reason is not None and self.deltas_off() is None:
            log.error("another connection replica found this chat template's delta renders inexact (%s); this "
                      "replica renders every turn in full from now on", reason)
            self.render_fully(f"another connection replica: {reason}")


class TemplateVerdicts:
    """Delta renders found inexact, by template digest, as one app-wide ledger keeps them: every
    connection replica reports its own and renders fully once any replica found its template's."""

    def __init__(self) -> None:
        self.found: dict[str, str] = {}

    def merge(self, reported: dict[str, str]) -> dict[str, str]:
        for digest, reason in reported.items():
            if digest not in self.found and len(self.found) < MAX_VERDICTS and isinstance(reason, str):
                self.found[str(digest)[:64]] = reason[:500]
        return dict(self.found)

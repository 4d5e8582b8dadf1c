"""A sampled check of delta renders against full renders, off the turn's critical path.

The start-up probe proves delta steps per kind of message on a battery of conversations; it cannot
prove them per content. A template can render an earlier message differently depending on what
came later (shorten an old tool output once a newer one exists, say), and then a delta render,
which never re-renders earlier messages, sends the engine a prompt the template's own full render
would not produce. So every `every`-th continuation that was rendered as a delta is rendered again
in full, as post-inference work, and compared with the prefix the engine was sent. On a mismatch
the replica renders fully from then on (`on_mismatch`), and the mismatch is counted, logged once
and exported. A delta that reused the model's generated tokens is compared as text: those tokens
may tokenize their text differently, which is the point of reusing them.
"""

from __future__ import annotations

import json
import logging
from array import array
from typing import Any, Awaitable, Callable, Optional, Sequence

from cluster.core.messages import RenderJob
from cluster.core.render.renderer import RenderResult

log = logging.getLogger("loopserve.render")

# A full render job -> its result (the RenderActor's port in production).
FullRender = Callable[[RenderJob], Awaitable[Optional[RenderResult]]]


class RenderAudit:
    """Post-work hook: `await audit(record)` for each finished turn (a `TurnRecord`)."""

    def __init__(self, render: FullRender, every: int, *, on_mismatch: Callable[[str], None],
                 decode: Optional[Callable[[Sequence[int]], str]] = None,
                 on_checked: Optional[Callable[[bool], None]] = None) -> None:
        if every < 1:
            raise ValueError("every must be >= 1")
        self.render, self.every, self.decode = render, every, decode
        self.on_mismatch, self.on_checked = on_mismatch, on_checked
        self.deltas_seen = 0
        self.checked = 0
        self.mismatches = 0

    async def __call__(self, record: Any) -> None:
        state = record.state
        if state is None or record.timing.get("full_render", True) or state.rendered is None:
            return
        self.deltas_seen += 1
        if self.deltas_seen % self.every:
            return
        rendered = state.rendered
        key = rendered.key
        job = RenderJob(key.instructions, json.loads(key.tools_json), items=list(state.items[: rendered.item_count]),
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
        reason = (f"a sampled delta render of response {record.response_id} differs from the template's full "
                  f"render ({len(sent)} tokens sent, {len(want)} in the full render)")
        if self.mismatches == 1:
            log.error("chat template renders earlier messages depending on later content: %s; this replica "
                      "renders every turn in full from now on", reason)
        self.on_mismatch(reason)

    def stats(self) -> dict[str, int]:
        return {"every": self.every, "deltas_seen": self.deltas_seen, "checked": self.checked,
                "mismatches": self.mismatches}

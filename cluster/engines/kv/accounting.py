"""What a turn asks of the KV budget: its output reservation and the tenant's shared prefix.

Plain logic beside `kv/budget.py` (which decides from these numbers):

- **Output from what was produced.** Reserving every turn's full `max_output_tokens` counts
  room that agent turns rarely use (a tool call is tens of tokens; the default budget is
  hundreds), so fewer sessions fit than the engine could hold. A turn reserves what its
  session's turns produced lately (a decaying maximum, with a margin), what the replica's
  turns produced for a session not seen yet, and its full budget before anything was seen.
  A turn that outgrows its reservation is still served: the engine finds the blocks, and
  under pressure it preempts, as it would without a budget (pins give way first).
- **A shared prefix once.** Sessions of one tenant usually start with the same instructions
  and tool list; the engine's prefix cache holds those blocks once (hashed per tenant salt),
  so the budget must count them once too, not once per session. Each tenant's first prompt
  is its *head*; a prompt's shared part is what it has in common with the head, in whole
  blocks. The head is kept (bounded: `MAX_HEAD_TOKENS` each, `MAX_TENANTS` heads, LRU) and
  replaced when the tenant's prompts stop sharing a block with it.
"""

from __future__ import annotations

import math
from array import array
from collections import Counter, OrderedDict
from typing import TYPE_CHECKING, Optional

from cluster.core.render.tokenizer import common_prefix

if TYPE_CHECKING:
    from cluster.engines.kv.policy import SessionHold

OUTPUT_DECAY = 0.8  # a turn's weight in the session's decaying maximum of outputs
OUTPUT_MARGIN = 1.25  # reserved over that maximum
# A session with no turns here yet reserves at least this share of its own `max_output_tokens`:
# the replica's recent outputs are other clients' (tiny outputs taught it to reserve
# ~nothing, then 30,000-token turns overran the budget and the engine preempted).
NEW_SESSION_SHARE = 0.25


class OutputReserve:
    """Tokens of output a session's turn reserves in the budget."""

    MAX_SESSIONS = 100_000

    def __init__(self) -> None:
        self._sessions: OrderedDict[str, float] = OrderedDict()  # session -> decaying max of its outputs
        self._replica: Optional[float] = None  # the same over every session's turns here

    def reserve(self, session: str, max_tokens: int, block: int = 1) -> int:
        own = self._sessions.get(session)
        high = own if own is not None else self._replica
        if high is None:
            return max_tokens  # nothing produced here yet: the full budget
        floor = block if own is not None else max(block, math.ceil(NEW_SESSION_SHARE * max_tokens))
        return max(1, min(max_tokens, max(floor, math.ceil(OUTPUT_MARGIN * high))))

    def observe(self, session: str, output_tokens: int) -> None:
        self._sessions[session] = self._decayed(self._sessions.pop(session, None), output_tokens)
        self._replica = self._decayed(self._replica, output_tokens)
        while len(self._sessions) > self.MAX_SESSIONS:
            self._sessions.popitem(last=False)

    @staticmethod
    def _decayed(high: Optional[float], tokens: int) -> float:
        return float(tokens) if high is None else max(float(tokens), OUTPUT_DECAY * high)


class SharedHeads:
    """Each tenant's head prompts, and how much of a new prompt is one of them."""

    MAX_HEADS = 128
    PER_TENANT = 4  # a tenant with several kinds of agent has several heads
    MAX_HEAD_TOKENS = 16384  # 64 KiB a head: 8 MiB in all

    def __init__(self, block: int = 1) -> None:
        self.block = max(1, block)
        self._heads: OrderedDict[str, array] = OrderedDict()  # "tenant\x00serial" -> head, LRU
        self._by_tenant: dict[str, list[str]] = {}
        self._serial = 0

    def shared(self, tenant: str, prompt: array) -> tuple[str, int]:
        """The head `prompt` starts with (a group name for the budget) and the tokens it shares
        with it, in whole blocks and never all of the prompt. A prompt that shares no block
        with any of its tenant's heads becomes a head (which it shares entirely)."""
        best, n = "", 0
        for name in self._by_tenant.get(tenant, ()):
            common = common_prefix(self._heads[name], prompt)
            if common > n:
                best, n = name, common
        n = min(n, len(prompt) - 1) // self.block * self.block
        if n < self.block:
            best = self._add(tenant, array(prompt.typecode, prompt[:self.MAX_HEAD_TOKENS]))
            n = min(len(self._heads[best]), len(prompt) - 1) // self.block * self.block
        self._heads.move_to_end(best)
        return best, max(0, n)

    def _add(self, tenant: str, head: array) -> str:
        self._serial += 1
        name = f"{tenant}\x00{self._serial}"
        self._heads[name] = head
        names = self._by_tenant.setdefault(tenant, [])
        names.append(name)
        if len(names) > self.PER_TENANT:
            self._drop(names[0])
        while len(self._heads) > self.MAX_HEADS:
            self._drop(next(iter(self._heads)))
        return name

    def _drop(self, name: str) -> None:
        del self._heads[name]
        tenant = name.rsplit("\x00", 1)[0]
        names = self._by_tenant[tenant]
        names.remove(name)
        if not names:
            del self._by_tenant[tenant]

    @property
    def nbytes(self) -> int:
        return sum(h.itemsize * len(h) for h in self._heads.values())


class Totals:
    """The budget's running totals (a mixin of `KvBudget`): every admission decision reads them,
    so they are O(1), not a walk over the replica's sessions. Every change to a hold's running,
    turns, retained or shared tokens goes through `_change`. A tenant's shared prefix is counted
    once, at the longest shared part among its resident sessions (all are prefixes of one head,
    `SessionHold.share_group`)."""

    capacity: int
    _used: int  # own footprints + each tenant's shared prefix once
    _running: int  # sum of running reservations
    _resident: int  # sessions holding a prefix or running a turn
    # tenant -> retained tokens beyond the shared head (`SessionHold.own_retained`): counted with
    # the head in every session, a tenant's 8 sessions sharing a 700-token head read ~5,000
    # tokens over what the pool holds, and the tenant cap ended retentions at the default share
    # (all of it) while room was free, least recently used first: the sessions due back next.
    _tenant_retained: "Counter[str]"
    _shared: "dict[str, Counter[int]]"  # head -> shared lengths of its resident sessions
    engine_excess: int  # tokens the engine has in use beyond the budget's count (`reconcile`)
    # Sessions retained between turns, in the order they became so (least recently used first):
    # what expiry, eviction and the tenant cap look at. Their number is bounded by the capacity
    # (each holds a prefix), where the sessions tracked for their pauses are up to `max_sessions`.
    _idle: "OrderedDict[str, None]"
    _idle_tokens: int
    _tenant_declared: "Counter[str]"  # tenant -> tokens idle under a declared lifetime, beyond the shared head
    _declared_idle_tokens: int

    def reconcile(self, engine_in_use: int) -> int:
        """The engine's own count of KV in use: what it holds beyond the budget (requests the
        budget never saw or has let go of, blocks not freed yet) is room the budget does not
        give out. Returns the drift (the budget's tokens minus the engine's)."""
        self.engine_excess = max(0, engine_in_use - self._used)
        return self._used - engine_in_use

    def _shared_counted(self, group: str) -> int:
        lengths = self._shared.get(group)
        return max(lengths) if lengths else 0

    def _extra(self, hold: "SessionHold", need: int) -> int:
        """Tokens a turn adds to the budget: a retained session's turn only its growth, a session
        sharing its tenant's head only what the head does not cover."""
        own = max(0, max(hold.running + need, hold.retained) - hold.shared)
        return own - hold.footprint + max(0, hold.shared - self._shared_counted(hold.share_group))

    def _change(self, hold: "SessionHold", *, running: int = 0, turns: int = 0, retained: Optional[int] = None,
                shared: Optional[tuple[str, int]] = None) -> None:
        footprint, resident, own_before = hold.footprint, bool(hold.retained or hold.turns), hold.own_retained
        idle_before = hold.retained if hold.idle_retained else 0
        before = (hold.share_group, hold.shared) if resident and hold.shared else None
        hold.running += running
        hold.turns += turns
        if retained is not None:
            hold.retained = retained
        if shared is not None:
            hold.share_group, hold.shared = shared
        if hold.own_retained != own_before:
            self._tenant_retained[hold.tenant] += hold.own_retained - own_before
            if not self._tenant_retained[hold.tenant]:
                del self._tenant_retained[hold.tenant]
        now_resident = bool(hold.retained or hold.turns)
        after = (hold.share_group, hold.shared) if now_resident and hold.shared else None
        self._used += hold.footprint - footprint
        if before != after:
            if before:
                self._count_shared(*before, -1)
            if after:
                self._count_shared(*after, 1)
        self._running += running
        self._resident += now_resident - resident
        idle_after = hold.retained if hold.idle_retained else 0
        self._idle_tokens += idle_after - idle_before
        declared = hold.own_retained if idle_after and hold.min_ttl > 0 else 0  # (as `_tenant_retained`)
        if declared != hold.declared_idle:
            self._tenant_declared[hold.tenant] += declared - hold.declared_idle
            self._declared_idle_tokens += declared - hold.declared_idle
            if not self._tenant_declared[hold.tenant]:
                del self._tenant_declared[hold.tenant]
            hold.declared_idle = declared
        if idle_after and not idle_before:
            self._idle[hold.key] = None
        elif idle_before and not idle_after:
            self._idle.pop(hold.key, None)

    def _count_shared(self, group: str, length: int, step: int) -> None:
        counted = self._shared_counted(group)
        lengths = self._shared.setdefault(group, Counter())
        lengths[length] += step
        if not lengths[length]:
            del lengths[length]
        if not lengths:
            del self._shared[group]
        self._used += self._shared_counted(group) - counted

"""A modelled KV cache for the scripted engine: a stand-in for vLLM's block pool.

Not an engine's memory, a model of one (named as such), so that KV pressure can be
studied with hundreds of sessions on a machine without a GPU. It follows vLLM v1
(0.32) where that decides hits and misses:

- a fixed pool of blocks of `block_size` tokens; full blocks are cached under a hash
  chained from the previous block's (and the tenant's salt), so a prompt hits the
  longest run of cached blocks from its start, and at least its last token is computed;
- a request holds its blocks while it runs; when it ends its blocks are freed in
  reverse order: cached ones to the tail of one free queue, uncached ones to its head;
  allocation takes from the head and evicts what it takes (least recently freed first);
- a running request that needs a block when none is free makes the scheduler preempt
  the newest running request (its blocks freed, recomputed when it runs again); a new
  request that does not fit waits;
- pins (`pin`/`unpin`) keep a finished request's cached blocks referenced, as the
  retaining scheduler does for vLLM (`vllm/retention.py`), dropped oldest first
  before any preemption;
- a lower tier (`LowerTier`, optional), as vLLM's offloading connector keeps blocks in
  host memory: a cached block evicted from the pool keeps its content there (LRU, its
  own capacity), and a prompt whose prefix continues there loads those blocks instead
  of computing them (the engine charges the transfer at the tier's rate, not prefill).

Plain logic: the scripted engine drives it and owns the waiting.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Optional


class LowerTier:
    """Block hashes held below the engine's pool (host memory), least recently used first."""

    def __init__(self, capacity_tokens: int, block_size: int) -> None:
        self.num_blocks = max(1, capacity_tokens // block_size)
        self.blocks: OrderedDict[int, None] = OrderedDict()
        self.stored = 0  # blocks written down
        self.loaded = 0  # blocks read back on a hit
        self.dropped = 0  # blocks the tier itself evicted (full)

    def store(self, block_hash: int) -> None:
        if block_hash in self.blocks:
            self.blocks.move_to_end(block_hash)
            return
        self.blocks[block_hash] = None
        self.stored += 1
        while len(self.blocks) > self.num_blocks:
            self.blocks.popitem(last=False)
            self.dropped += 1

    def take(self, block_hash: int) -> bool:
        """Read a block back (it stays stored: the engine's copy may be evicted again)."""
        if block_hash not in self.blocks:
            return False
        self.blocks.move_to_end(block_hash)
        self.loaded += 1
        return True


@dataclass
class Sequence:
    request_id: str
    salt: Optional[str]
    blocks: list[int] = field(default_factory=list)
    preempted: bool = False


class KvBlockPool:
    def __init__(self, capacity_tokens: int, block_size: int = 32, lower_tokens: int = 0) -> None:
        self.block_size = block_size
        self.lower: Optional[LowerTier] = LowerTier(lower_tokens, block_size) if lower_tokens else None
        self.last_loaded_tokens = 0  # of the last `allocate`: tokens read from the lower tier
        self.num_blocks = max(1, capacity_tokens // block_size)
        self.ref = [0] * self.num_blocks
        self.hash_of: list[Optional[int]] = [None] * self.num_blocks
        self.by_hash: dict[int, int] = {}
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(self.num_blocks))
        self.running: OrderedDict[str, Sequence] = OrderedDict()  # oldest first
        self.pins: OrderedDict[str, list[int]] = OrderedDict()
        self.preemptions = 0
        self.pins_dropped_under_pressure = 0

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def _hashes(self, salt: Optional[str], tokens: array, limit: Optional[int] = None) -> list[int]:
        bs = self.block_size
        n = len(tokens) // bs if limit is None else min(limit, len(tokens) // bs)
        out, parent = [], hash(salt)
        for i in range(n):
            parent = hash((parent, tokens[i * bs:(i + 1) * bs].tobytes()))
            out.append(parent)
        return out

    def _take(self, n: int) -> Optional[list[int]]:
        while len(self.free) < n and self.pins:
            self.pins_dropped_under_pressure += 1
            self.unpin(next(iter(self.pins)))
        if len(self.free) < n:
            return None
        taken = []
        for _ in range(n):
            block, _ = self.free.popitem(last=False)
            h = self.hash_of[block]
            if h is not None:  # evicted from the prefix cache (its content goes down a tier)
                self.hash_of[block] = None
                if self.by_hash.get(h) == block:
                    del self.by_hash[h]
                    if self.lower is not None:
                        self.lower.store(h)
            self.ref[block] = 1
            taken.append(block)
        return taken

    def _touch(self, blocks: list[int]) -> None:
        for b in blocks:
            if self.ref[b] == 0:
                del self.free[b]
            self.ref[b] += 1

    def _release(self, blocks: list[int]) -> None:
        for b in reversed(blocks):  # the tail of a prefix is evicted first
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free[b] = None
                if self.hash_of[b] is None:
                    self.free.move_to_end(b, last=False)  # uncached: reused first

    def allocate(self, request_id: str, salt: Optional[str], prompt: array) -> Optional[int]:
        """Start a request: the prompt tokens it finds cached (in the pool, then in the lower tier:
        `last_loaded_tokens` of them), or None when it does not fit (it waits; nothing changed)."""
        bs = self.block_size
        hits: list[int] = []
        hashes = self._hashes(salt, prompt, limit=max(0, len(prompt) - 1) // bs)
        for h in hashes:
            b = self.by_hash.get(h)
            if b is None:
                break
            hits.append(b)
        below = 0
        if self.lower is not None:
            while len(hits) + below < len(hashes) and hashes[len(hits) + below] in self.lower.blocks:
                below += 1
        need = -(-max(1, len(prompt)) // bs) - len(hits)
        self._touch(hits)
        new = self._take(need)
        if new is None:
            self._release(hits)
            return None
        loaded = 0
        for i in range(below):  # loaded: cached in the pool again, under their hashes
            h = hashes[len(hits) + i]
            if not self.lower.take(h):  # pushed out of the tier by what `_take` just evicted
                break
            if h not in self.by_hash:
                self.hash_of[new[i]], self.by_hash[h] = h, new[i]
            loaded += 1
        self.last_loaded_tokens = loaded * bs
        self.running[request_id] = Sequence(request_id, salt, hits + new)
        return (len(hits) + loaded) * bs

    def grow(self, request_id: str, tokens: int) -> bool:
        """The request now holds `tokens` tokens; False when a block is needed and none is free
        (the caller preempts: `preempt_newest`)."""
        seq = self.running[request_id]
        need = -(-tokens // self.block_size) - len(seq.blocks)
        if need <= 0:
            return True
        new = self._take(need)
        if new is None:
            return False
        seq.blocks += new
        return True

    def preempt_newest(self) -> Optional[str]:
        """Free the newest running request's blocks (vLLM's recompute preemption)."""
        if not self.running:
            return None
        request_id, seq = self.running.popitem(last=True)
        seq.preempted = True
        self.preemptions += 1
        self._release(seq.blocks)
        return request_id

    def finish(self, request_id: str, tokens: array, pin: str = "") -> None:
        """The request ended holding `tokens` (prompt + output): cache its full blocks, free
        them, and keep them referenced under `pin` when given."""
        seq = self.running.pop(request_id, None)
        if seq is None:
            return  # preempted and never rescheduled
        hashes = self._hashes(seq.salt, tokens, limit=len(seq.blocks))
        for b, h in zip(seq.blocks, hashes):
            if self.hash_of[b] is None and h not in self.by_hash:
                self.hash_of[b] = h
                self.by_hash[h] = b
        if pin:
            cached = [b for b in seq.blocks if self.hash_of[b] is not None]
            self._touch(cached)
            old = self.pins.pop(pin, None)
            self.pins[pin] = cached
            if old is not None:
                self._release(old)
        self._release(seq.blocks)

    def unpin(self, pin: str) -> None:
        blocks = self.pins.pop(pin, None)
        if blocks is not None:
            self._release(blocks)

    def is_running(self, request_id: str) -> bool:
        return request_id in self.running

    def stats(self) -> dict[str, int]:
        out = {"kv_capacity_tokens": self.capacity_tokens, "kv_free_blocks": len(self.free),
               "kv_pinned_blocks": sum(len(v) for v in self.pins.values()), "preemptions": self.preemptions,
               "pins_dropped_under_pressure": self.pins_dropped_under_pressure}
        if self.lower is not None:
            low = self.lower
            out.update({"lower_tier_tokens": len(low.blocks) * self.block_size,
                        "lower_tier_capacity_tokens": low.num_blocks * self.block_size,
                        "lower_tier_stored_tokens": low.stored * self.block_size,
                        "lower_tier_loaded_tokens": low.loaded * self.block_size,
                        "lower_tier_dropped_tokens": low.dropped * self.block_size})
        return out

"""The retaining scheduler's pins (cluster/engines/vllm/retention.py) over a named fake of the vLLM
scheduler it is mixed into: the real mixin, a stand-in base with the methods it overrides (vLLM's
own scheduler needs a whole engine config; the real one runs in tests/integration/test_kv_retention.py)."""

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from cluster.engines.vllm.retention import HINT, RetainingMixin  # noqa: E402


class FakeBlock:
    def __init__(self, n):
        self.is_null, self.block_hash, self.n = False, f"h{n}", n


class FakeKvManager:
    """A stand-in for vLLM's KVCacheManager + BlockPool: references per block."""

    def __init__(self):
        self.blocks = {}  # request id -> blocks
        self.refs = {}
        self.block_pool = SimpleNamespace(touch=self.touch, free_blocks=self.free_blocks)

    def allocate_slots(self, request):
        self.blocks[request.request_id] = [FakeBlock(i) for i in range(3)]
        for b in self.blocks[request.request_id]:
            self.refs[b.block_hash] = self.refs.get(b.block_hash, 0) + 1
        return self.blocks[request.request_id]

    def get_blocks(self, request_id):
        return SimpleNamespace(blocks=[self.blocks[request_id]])

    def touch(self, blocks):
        for b in blocks:
            self.refs[b.block_hash] += 1

    def free_blocks(self, blocks):
        for b in blocks:
            self.refs[b.block_hash] -= 1

    def free(self, request):
        self.free_blocks(self.blocks[request.request_id])


class FakeScheduler:
    """The part of vLLM 0.32's Scheduler the mixin overrides: preemption frees a request's blocks
    through `_free_request_blocks`, as vLLM's does."""

    def __init__(self):
        self.kv_cache_manager = FakeKvManager()

    def add_request(self, request):
        self.kv_cache_manager.allocate_slots(request)

    def schedule(self):
        return None

    def _free_request_blocks(self, request):
        self.kv_cache_manager.free(request)

    def _preempt_request(self, request, timestamp=0.0):
        self._free_request_blocks(request)

    def finish_requests(self, request_ids, status):
        return None

    def reset_prefix_cache(self):
        return True


class Retaining(RetainingMixin, FakeScheduler):
    pass


def _request(rid, session, ttl=60.0):
    return SimpleNamespace(request_id=rid, sampling_params=SimpleNamespace(
        extra_args={HINT: {"pin": session, "ttl": ttl}}))


def test_a_preempted_request_is_not_pinned_and_its_real_end_is():
    sched = Retaining()
    req = _request("r1", "s1")
    sched.add_request(req)
    sched._preempt_request(req)  # vLLM frees a preempted request's blocks: it runs again later
    assert "s1" not in sched._pins
    assert set(sched.kv_cache_manager.refs.values()) == {0}
    sched.kv_cache_manager.allocate_slots(req)  # rescheduled
    sched._free_request_blocks(req)  # its real end
    assert "s1" in sched._pins
    assert set(sched.kv_cache_manager.refs.values()) == {1}  # the pin's reference keeps the blocks


def test_an_unpin_riding_on_the_next_request_lets_the_blocks_go():
    sched = Retaining()
    first = _request("r1", "s1")
    sched.add_request(first)
    sched._free_request_blocks(first)
    nxt = SimpleNamespace(request_id="r2", sampling_params=SimpleNamespace(extra_args={HINT: {"unpin": ["s1"]}}))
    sched.add_request(nxt)
    assert "s1" not in sched._pins
    assert all(sched.kv_cache_manager.refs[f"h{i}"] == 1 for i in range(3))  # only r2's own references

"""Safety gate, incremental classification and post-inference work, no Ray."""

import asyncio

import pytest

from cluster.core.safety.classifiers import (
    CombinedClassifier,
    PolicyClassifier,
    ProfanityClassifier,
    Verdict,
    guard_verdict,
    parse_guard_output,
)
from cluster.core.safety.gate import OutputMonitor
from cluster.core.turn.cache import SessionCache
from cluster.core.turn.post_work import PostWorkQueue, TurnRecord, UsageMeter
from cluster.core.turn.turn import TurnRequest, TurnScope
from cluster.protocol.errors import ApiError
from cluster.protocol.requests import parse_request
from tests.support.harness import CountingSafety, InProcessStack
from tests.support.peer import Peer

POLICY = PolicyClassifier({"secrets": [r"BEGIN RSA PRIVATE KEY"], "violence": [r"\bbuild a bomb\b"]})
ANSWER = ("Here is the plan. First we read the config and the tests. " * 3
          + "Then we build a bomb of logs. " + "Afterwards we tidy up the workspace and report back. " * 4)


async def run(stack, body, cache=None):
    cache = SessionCache() if cache is None else cache
    return [ev async for ev in stack.driver.run(TurnRequest(parse_request(body), TurnScope(cache, session_key="s")))]


def test_classifiers():
    assert [v.flagged for v in POLICY.classify(["hello", "-----BEGIN RSA PRIVATE KEY-----"])] == [False, True]
    prof = ProfanityClassifier(0.9)
    verdicts = CombinedClassifier([POLICY, prof]).classify(["read the file please", "you are a fucking idiot"])
    assert [v.flagged for v in verdicts] == [False, True]
    assert verdicts[1].category == "harassment"
    assert parse_guard_output("unsafe\nS10,S1").category == "S10"
    assert parse_guard_output(" safe ").flagged is False
    assert parse_guard_output("garbage") is None  # unparseable: never silently safe
    assert guard_verdict("garbage", "flag") == (Verdict(True, "guard_unparseable", 1.0), True)
    assert guard_verdict("garbage", "allow") == (Verdict(False), True)
    assert guard_verdict("safe", "flag") == (Verdict(False), False)


def test_output_monitor_chunks_with_overlap():
    m = OutputMonitor(chunk_chars=10, overlap=4)
    assert m.feed("abcde") is None
    assert m.feed("fghijk") == "abcdefghijk"
    assert m.feed("lmnopqrstu") == "hijklmnopqrstu"
    assert m.flush() is None and m.classified_chars == 21


async def test_blocked_input_streams_no_model_output(tokenizer):
    safety = CountingSafety(POLICY, delay=0.1)  # slower than the engine's first token
    stack = InProcessStack(tokenizer, safety=safety, tokens_per_second=500)
    evs = await run(stack, {"input": "here is my key -----BEGIN RSA PRIVATE KEY----- abc"})
    types = [e["type"] for e in evs]
    assert types == ["response.created", "response.in_progress", "response.incomplete"]
    resp = evs[-1]["response"]
    assert resp["incomplete_details"] == {"reason": "content_filter"} and resp["output"] == []
    # generation was stopped: at most what was in flight while the verdict came
    assert stack.engine.stats.aborted == 1
    assert stack.engine.stats.output_tokens < 64
    # a blocked response is not continued
    with pytest.raises(ApiError) as e:
        await run(stack, {"input": "more", "previous_response_id": resp["id"]})
    assert e.value.code == "previous_response_not_found"


async def test_allowed_input_adds_no_latency_to_the_first_token(tokenizer):
    # A 0.3 s input check and a ~0.3 s prefill: run one after the other, the
    # first token would come at ~0.6 s; overlapped, at ~0.3 s.
    safety = CountingSafety(POLICY, delay=0.3)
    stack = InProcessStack(tokenizer, safety=safety, prefill_tokens_per_second=50)
    evs = await run(stack, {"input": "please read the config"})
    assert evs[-1]["type"] == "response.completed"
    prompt = evs[-1]["response"]["usage"]["input_tokens"]
    assert 0.25 < prompt / 50 < 0.4
    timing = stack.driver.metrics.timings[-1]
    assert 0.3 <= timing.first_token < 0.5, timing


class EngineRequestsAtCheck:
    """A safety port that notes how many engine requests had gone out when each check began."""

    def __init__(self) -> None:
        self.stack = None
        self.seen: list[int] = []

    async def __call__(self, texts):
        self.seen.append(len(self.stack.engine_requests))
        return [v.as_dict() for v in POLICY.classify(texts)]


@pytest.mark.parametrize("transport", ["http", "websocket"])
async def test_the_input_check_starts_after_the_engine_request_went_out(tokenizer, transport):
    """Local classifiers run on the replica's event loop: a check that ran first would hold the
    engine request back by its whole classification time (~1 ms for a 2 KB tool output), when it
    is meant to overlap the prefill."""
    port = EngineRequestsAtCheck()
    stack = port.stack = InProcessStack(tokenizer, safety=port)
    body = {"model": "loopserve-tiny", "input": "please read the config", "store": False}
    if transport == "websocket":
        p = Peer(stack)
        await p.frame({"type": "response.create", **body})
        await p.idle()
        assert p.types()[-1] == "response.completed"
    else:
        events = []
        async for ev in stack.driver.run(TurnRequest(parse_request(body), TurnScope(SessionCache(), session_key="s"))):
            events.append(ev)
            await asyncio.sleep(0)  # a transport's send gives the loop away between events
        assert events[-1]["type"] == "response.completed"
    # The input check came once the request was out; a plain (unstreamed) answer's tail is also
    # classified before it is returned, a streamed one's after its terminal event.
    assert port.seen == ([1] if transport == "websocket" else [1, 1])


@pytest.mark.parametrize("classifier_delay", [0.0, 0.3], ids=["prompt-verdicts", "verdicts-lag-the-engine"])
async def test_flagged_output_stops_the_stream_mid_way(tokenizer, classifier_delay):
    # With a classifier slower than the engine (0.3 s a chunk, a 32-character
    # chunk every ~10 ms), the stream waits for verdicts instead of running
    # ahead: the cut lands in the same place either way.
    safety = CountingSafety(POLICY, delay=classifier_delay)
    stack = InProcessStack(tokenizer, safety=safety, chunk_chars=32, answer_text=ANSWER, max_output_tokens=400,
                           tokens_per_second=1000)
    evs = await run(stack, {"input": "what is the plan?", "max_output_tokens": 400})
    resp = evs[-1]["response"]
    assert evs[-1]["type"] == "response.incomplete"
    assert resp["incomplete_details"] == {"reason": "content_filter"}
    streamed = "".join(e["delta"] for e in evs if e["type"] == "response.output_text.delta")
    # What was released is the answer's beginning, cut within the flagged chunk
    # and the one after it (a chunk is cut once 32 characters are pending, so it
    # can run one token past 32).
    assert ANSWER.startswith(streamed)
    flagged_end = ANSWER.index("build a bomb") + len("build a bomb")
    longest_token = max(len(tokenizer.decode([t])) for t in tokenizer(ANSWER)["input_ids"])
    assert flagged_end <= len(streamed) <= flagged_end + 2 * (32 + longest_token)
    assert stack.engine.stats.aborted == 1


async def test_thirty_turn_loop_classifies_only_new_content(tokenizer):
    safety = CountingSafety(POLICY)
    stack = InProcessStack(tokenizer, safety=safety)
    cache = SessionCache()
    prev, per_turn = None, []
    for turn in range(30):
        before = safety.chars
        evs = await run(stack, {"input": f"turn {turn:02d}: please continue with the next file " * 3,
                                "previous_response_id": prev}, cache)
        assert evs[-1]["type"] == "response.completed"
        prev = evs[-1]["response"]["id"]
        per_turn.append(safety.chars - before)
    # new message (~150 chars) + the answer's output chunk(s); flat, not growing with history
    assert per_turn[0] == per_turn[29]
    assert max(per_turn) == min(per_turn)


async def test_slow_post_work_does_not_delay_the_next_turn(tokenizer):
    done = []

    async def slow_hook(record):
        await asyncio.sleep(1.0)
        done.append(record.response_id)

    queue = PostWorkQueue({"slow": slow_hook})
    stack = InProcessStack(tokenizer, post_work=queue)
    p = Peer(stack)
    await p.frame({"type": "response.create", "input": "one"})
    await p.frame({"type": "response.create", "input": "two"})
    await p.idle()
    times = p.sent
    ends = [i for i, e in enumerate(times) if e["type"] == "response.completed"]
    assert len(ends) == 2 and not done  # both turns finished while post-work still runs
    assert queue.pending == 2
    await queue.drain()
    assert len(done) == 2 and queue.completed == 2
    await p.session.shutdown()


async def test_post_work_survives_client_disconnect(tokenizer):
    meter = UsageMeter()
    gate = asyncio.Event()

    async def blocking_hook(record):
        await gate.wait()

    queue = PostWorkQueue({"usage": meter, "slow": blocking_hook})
    stack = InProcessStack(tokenizer, post_work=queue, tokens_per_second=50)
    p = Peer(stack)
    await p.frame({"type": "response.create", "input": "finish me"})
    await p.idle()
    await p.frame({"type": "response.create", "input": "abandon me"})
    await asyncio.sleep(0.2)
    await p.session.shutdown()  # client vanished mid-response
    gate.set()
    await queue.drain()
    totals = meter.snapshot()
    assert totals[0]["requests"] == 2  # the abandoned turn was metered too
    assert queue.completed == 4 and queue.failed == 0


async def test_failing_hook_is_retried():
    calls = []

    async def flaky(record):
        calls.append(1)
        if len(calls) < 3:
            raise RuntimeError("store unavailable")

    queue = PostWorkQueue({"flaky": flaky}, retries=3, backoff_s=0.01)
    queue.schedule(TurnRecord("r", "m", None, "completed", {}, True))
    await queue.drain()
    assert len(calls) == 3 and queue.retried == 2 and queue.completed == 1


async def test_hook_with_a_deadline_is_retried_until_it_then_counted():
    calls = []

    async def down(record):  # e.g. the store during an outage
        calls.append(1)
        raise RuntimeError("store unavailable")

    async def back_after_five(record):
        calls.append(2)
        if calls.count(2) < 6:  # more attempts than `retries` allows
            raise RuntimeError("store unavailable")

    queue = PostWorkQueue(retries=1, backoff_s=0.01)
    queue.add("down", down, retry_for_s=0.3)
    queue.add("back", back_after_five, retry_for_s=5)
    queue.schedule(TurnRecord("r", "m", None, "completed", {}, True))
    await queue.drain()
    assert queue.failed_by == {"down": 1} and queue.completed == 1
    assert queue.retried_by["back"] == 5 and calls.count(1) > 2


def test_fast_profanity_path_matches_the_package():
    from profanity_check import predict_prob

    import random

    rng = random.Random(7)
    words = ("you are a fucking idiot damn shit read the file please kill process restart broken build "
             "ünïcödé 漢字 🚀 the and of IDIOT Damn's").split()
    texts = ["read the file please", "you are a fucking idiot", "kill the process and restart it",
             "this damn build is broken again", "", "x" * 3000, "def f(x):\n    return x  # the idiot fix\n" * 60]
    texts += [" ".join(rng.choice(words) for _ in range(rng.randint(0, 200))) for _ in range(100)]
    prof = ProfanityClassifier(0.9)
    assert prof.probabilities(texts) == pytest.approx([float(p) for p in predict_prob(texts)], abs=1e-9)


async def test_short_output_is_checked_after_the_terminal_event_and_blocks_continuation(tokenizer):
    from cluster.core.turn.post_work import OutputTailCheck, SafetyLedger

    safety = CountingSafety(PolicyClassifier({"leak": [r"task is complete"]}))
    ledger = SafetyLedger()
    queue = PostWorkQueue()
    queue.add("output_safety", OutputTailCheck(safety, ledger))
    stack = InProcessStack(tokenizer, safety=safety, post_work=queue)
    cache = SessionCache()
    evs = await run(stack, {"input": "status?", "stream": True}, cache)
    # the answer (shorter than a chunk) streamed without waiting for its check
    assert evs[-1]["type"] == "response.completed"
    assert safety.calls == [["status?"]]
    await queue.drain()
    assert ledger.flagged == {"output-late:leak": 1}
    with pytest.raises(ApiError) as e:
        await run(stack, {"input": "go on", "previous_response_id": evs[-1]["response"]["id"]}, cache)
    assert e.value.code == "previous_response_blocked" and "content filter" in e.value.message
    with pytest.raises(ApiError) as again:  # every retry gets the same answer (not a replayable not-found)
        await run(stack, {"input": "go on", "previous_response_id": evs[-1]["response"]["id"]}, cache)
    assert again.value.code == "previous_response_blocked"


async def test_a_plain_answers_short_flagged_output_is_withheld_before_it_returns(tokenizer):
    """Nobody reads a plain (unstreamed) answer before its end: its tail is classified first, and a
    flag there returns `incomplete` with no output (no post-inference window for it to leak in)."""
    safety = CountingSafety(PolicyClassifier({"leak": [r"task is complete"]}))
    stack = InProcessStack(tokenizer, safety=safety)
    evs = await run(stack, {"input": "status?"})
    resp = evs[-1]["response"]
    assert evs[-1]["type"] == "response.incomplete" and resp["incomplete_details"] == {"reason": "content_filter"}
    assert resp["output"] == []
    assert len(safety.calls) == 2 and "task is complete" in safety.calls[1][0]


class PiledUpStack(InProcessStack):
    """The engine's pieces as a consumer that fell behind receives them (`messages.merged`, as the
    channel's reader and the handle stream's coalesce join them): the whole answer in one piece, or
    in two (first and last: a plain vLLM answer)."""

    def __init__(self, tokenizer, *, split: str, **kw) -> None:
        super().__init__(tokenizer, **kw)
        self.split = split

    async def engine_stream(self, req):
        from cluster.core.messages import merged

        chunks = [chunk async for chunk in super().engine_stream(req)]
        if self.split == "two":
            yield merged(chunks[:1])
            chunks = chunks[1:]
        yield merged(chunks)


@pytest.mark.parametrize("classifier_delay", [0.0, 0.2], ids=["inline", "slow-actor"])
@pytest.mark.parametrize("split", ["one", "two"])
@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "plain"])
async def test_a_piled_up_piece_goes_out_no_further_than_the_unverified_bound(tokenizer, classifier_delay, split,
                                                                               stream):
    """A piece of any size is released in chunk-sized parts, each after the verdicts
    that keep the unverified text within `max_unverified_chars` (two 32-character chunks here); the
    final response of a flagged answer carries none of it."""
    safety = CountingSafety(POLICY, delay=classifier_delay)
    stack = PiledUpStack(tokenizer, split=split, safety=safety, chunk_chars=32, answer_text=ANSWER,
                         max_output_tokens=400)
    evs = await run(stack, {"input": "what is the plan?", "max_output_tokens": 400, "stream": stream})
    resp = evs[-1]["response"]
    assert evs[-1]["type"] == "response.incomplete" and resp["incomplete_details"] == {"reason": "content_filter"}
    assert resp["output"] == []
    released = "".join(e["delta"] for e in evs if e["type"] == "response.output_text.delta")
    assert ANSWER.startswith(released)
    flagged_end = ANSWER.index("build a bomb") + len("build a bomb")
    assert len(released) <= flagged_end + 2 * 32 < len(ANSWER) - 100
    # every chunk before the flag was classified before the text after it went out
    assert sum(len(t) for call in safety.calls[1:] for t in call) >= len(released) - 2 * 32


async def test_safety_off_keeps_a_piled_up_piece_whole(tokenizer):
    stack = PiledUpStack(tokenizer, split="one", answer_text=ANSWER, max_output_tokens=400)
    evs = await run(stack, {"input": "what is the plan?", "max_output_tokens": 400, "stream": True})
    deltas = [e["delta"] for e in evs if e["type"] == "response.output_text.delta"]
    assert deltas == [ANSWER]

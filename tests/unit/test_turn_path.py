"""How far one chained WebSocket turn travels through the code, measured in process: the files
with a Python call in them, the asyncio tasks it starts (each a handoff a chunk or a frame
waits on), and calls back into a module up the stack (none). Ceilings, so a change that adds a file or a task to every turn's path shows here
with the path it took.

In process means the `WebSocketSession` with the driver, renderer, safety gate and the scripted
engine behind `stream_chunks` (tests/support/harness.py); a served turn adds the route
(actors/routes.py), the engine channel (engines/channel.py, serving/clients.py) and the engine
replica (actors/engine.py)."""

from __future__ import annotations

import asyncio
import inspect
import sys
from collections import Counter
from pathlib import Path

from tests.support.harness import InProcessStack
from tests.support.peer import TOOLS, Peer, wait_for

ROOT = Path(__file__).resolve().parents[2]
SOURCES = (str(ROOT / "cluster"), str(ROOT / "actors"))
# A turn answered with a tool call: 22 files on the connection's side (core/generation.py the
# one source of the sampling the engine runs and the response reports) and 4 of the scripted
# engine's (engines/scripted/engine.py, engines/stream.py, prompts.py, base.py). A module every
# turn passes through for one helper belongs with the module of its concern; the count's history
# is in docs/benchmarks-history.md ("The turn's path").
MAX_FILES = 26
MAX_TASKS = 2  # the lane's task, and the engine stream's reader that lets a stop cut it
# Async generators a chunk climbs: each is one more `__anext__` resumed for every chunk. 3 on the
# engine's side and 3 on the turn's: the first delta is read in `stream_chunks` itself and the
# driver's start is a coroutine, not a generator.
MAX_GENERATOR_LAYERS = 6


# Leaf utilities a turn calls from anywhere: a call into them is no re-entry.
LEAVES = frozenset({"cluster/telemetry.py", "cluster/protocol/errors.py", "cluster/protocol/ids.py"})


def _reentry(frame) -> str | None:
    """A call back into a module the turn left on its way here: the callee's file is on the
    stack below, with another module's frame between (A -> B -> A). None for anything else."""
    callee = frame.f_code.co_filename
    caller = frame.f_back
    while caller is not None and not caller.f_code.co_filename.startswith(SOURCES):
        caller = caller.f_back
    if caller is None or caller.f_code.co_filename == callee:
        return None
    below = caller.f_back
    while below is not None:
        if below.f_code.co_filename == callee:
            left = Path(caller.f_code.co_filename).relative_to(ROOT)
            return f"{left}:{caller.f_code.co_name} -> {Path(callee).relative_to(ROOT)}:{frame.f_code.co_name}"
        below = below.f_back
    return None


def _generator_layers(frame) -> int:
    n = 0
    while frame is not None:
        n += bool(frame.f_code.co_flags & inspect.CO_ASYNC_GENERATOR)
        frame = frame.f_back
    return n


def _create(i: int, prev: dict | None) -> dict:
    text = f"turn {i}\n" + "x = 1\n" * 200
    body = {"type": "response.create", "model": "loopserve-tiny", "tools": TOOLS, "store": False,
            "input": [{"type": "message", "role": "user", "content": text}]}
    if prev is not None:
        body["previous_response_id"] = prev["id"]
        calls = [o for o in prev["output"] if o["type"] == "function_call"]
        if calls:
            body["input"] = [{"type": "function_call_output", "call_id": c["call_id"], "output": text} for c in calls]
    return body


async def test_a_chained_websocket_turn_stays_on_a_short_path(tokenizer):
    peer = Peer(InProcessStack(tokenizer))
    loop = asyncio.get_running_loop()
    files: Counter[str] = Counter()
    tasks: list[str] = []
    reentries: Counter[str] = Counter()
    # the deepest stack of async generators where the engine makes a chunk, and where the turn
    # makes an event of it (the two sides run in different tasks)
    layers = {"engine": 0, "turn": 0}
    engine_generate = str(ROOT / "cluster/engines/scripted/engine.py"), "generate"
    turn_event = str(ROOT / "cluster/core/events.py"), "_ev"

    def on_call(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(SOURCES):
            name = str(Path(frame.f_code.co_filename).relative_to(ROOT))
            files[name] += 1
            if name not in LEAVES and (back := _reentry(frame)) is not None:
                reentries[back] += 1
            where = (frame.f_code.co_filename, frame.f_code.co_name)
            side = "engine" if where == engine_generate else "turn" if where == turn_event else None
            if side:
                layers[side] = max(layers[side], _generator_layers(frame))

    def task_factory(loop, coro, **kw):
        tasks.append(getattr(coro, "__qualname__", repr(coro)))
        return asyncio.Task(coro, loop=loop, **kw)

    prev = None
    for i in range(5):  # the last one measured: a cache hit on a warm path, as in a long loop
        measured = i == 4
        if measured:
            loop.set_task_factory(task_factory)
            sys.setprofile(on_call)
        try:
            await peer.frame(_create(i, prev))
            await wait_for(peer, "response.completed", i + 1)
        finally:
            sys.setprofile(None)
            loop.set_task_factory(None)
        assert "error" not in peer.types(), peer.sent[-1]
        prev = [e for e in peer.sent if e["type"] == "response.completed"][-1]["response"]
        await peer.idle()
    assert prev["usage"]["input_tokens_details"]["cached_tokens"] > 0  # the path measured is the cached one
    assert len(files) <= MAX_FILES, "\n".join(f"{n:5d} {f}" for f, n in sorted(files.items()))
    assert len(tasks) <= MAX_TASKS, tasks
    # No call back into a module up the stack: each module hands the turn on and gets back what
    # it asked for (the last one, the turn's commit calling the session's `on_state` to learn
    # that a response was stored, went when the protocol read that off the terminal event).
    assert reentries == Counter(), "\n".join(f"{n:5d} {r}" for r, n in reentries.most_common())
    assert layers["engine"] and layers["turn"], layers  # both sides seen
    assert layers["engine"] + layers["turn"] <= MAX_GENERATOR_LAYERS, layers

"""The render port without render replicas (`render_in_connection`): full renders run in a worker
thread of the connection replica, deltas on its loop, and the result is the renderer's own."""

import asyncio
import threading

import pytest
from pydantic import ValidationError

from cluster.config import LoopserveConfig
from cluster.core.messages import INLINE_RENDER_MAX_BYTES, RenderJob
from cluster.core.render.renderer import render_job
from cluster.core.render.tokenizer import renderer_for
from cluster.core.retry import RetryPolicy
from cluster.core.turn.cache import items_nbytes
from cluster.serving.clients import RenderClient

ITEMS = [{"type": "message", "role": "user", "content": "List the files in src/"}]


class ThreadSpy:
    """The real renderer, recording which thread each render ran on."""

    def __init__(self, renderer):
        self.renderer, self.threads = renderer, []

    def __getattr__(self, name):
        attr = getattr(self.renderer, name)
        if name in ("full", "delta"):
            def call(*args, **kwargs):
                self.threads.append(threading.get_ident())
                return attr(*args, **kwargs)
            return call
        return attr


def test_full_render_runs_off_the_loop_and_equals_the_renderers(tokenizer):
    spy = ThreadSpy(renderer_for(tokenizer, probe=False))
    client = RenderClient(None, RetryPolicy(retries=0), spy)
    job = RenderJob("Be brief.", [], items=ITEMS)

    async def go():
        return await client(job), threading.get_ident()

    result, loop_thread = asyncio.run(go())
    want, _ = render_job(renderer_for(tokenizer, probe=False), job)
    assert result.full and result.assemble(None)[0] == want.assemble(None)[0]
    assert spy.threads and all(t != loop_thread for t in spy.threads), "a full render blocked the event loop"
    # Stats come from the local renderer: there is no RenderActor to ask.
    stats = asyncio.run(client.stats())
    assert stats == client.local_stats() and stats["mismatches"] == 0


def test_delta_render_stays_on_the_loop(tokenizer):
    renderer = renderer_for(tokenizer, probe=False)
    first = renderer.full(ITEMS, None, [])
    new = [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "src/a.py"}]},
           {"type": "message", "role": "user", "content": "Open it."}]
    spy = ThreadSpy(renderer)
    client = RenderClient(None, RetryPolicy(retries=0), spy)
    job = RenderJob(None, [], delta=True, anchor_items=ITEMS[first.anchor_start:], new_items=new,
                    anchor_start=first.anchor_start)

    async def go():
        return await client(job), threading.get_ident()

    result, loop_thread = asyncio.run(go())
    assert result is not None and not result.full
    assert spy.threads == [loop_thread]


def test_a_large_delta_renders_off_the_loop(tokenizer):
    """A delta whose new items are large (a ~1 MB tool output) is tokenized in a worker thread: on
    the loop it would stall every socket of the replica and its health checks."""
    renderer = renderer_for(tokenizer, probe=False)
    first = renderer.full(ITEMS, None, [])
    new = [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "src/a.py"}]},
           {"type": "message", "role": "user", "content": "y" * (INLINE_RENDER_MAX_BYTES + 1)}]
    spy = ThreadSpy(renderer)
    client = RenderClient(None, RetryPolicy(retries=0), spy)
    job = RenderJob(None, [], delta=True, anchor_items=ITEMS[first.anchor_start:], new_items=new,
                    anchor_start=first.anchor_start, new_bytes=items_nbytes(new))
    assert not job.inline_ok

    async def go():
        return await client(job), threading.get_ident()

    result, loop_thread = asyncio.run(go())
    assert result is not None and not result.full and result.delta_tokens > INLINE_RENDER_MAX_BYTES
    assert spy.threads and all(t != loop_thread for t in spy.threads), "a large delta blocked the event loop"


def test_a_render_port_needs_somewhere_to_render():
    with pytest.raises(ValueError, match="RenderActor handle or a local renderer"):
        RenderClient(None, RetryPolicy(retries=0), None)


def test_render_in_connection_needs_the_connection_tokenizer():
    assert LoopserveConfig(render_in_connection=True).render_in_connection
    with pytest.raises(ValidationError, match="render_in_connection needs inline_delta_render"):
        LoopserveConfig(render_in_connection=True, inline_delta_render=False)

"""The production render path is exact: what the engine is given for a continuation
(a delta render inside the connection actor, appended to the cached tokens) is the
same token sequence a full render of the whole context gives (the RenderActor's
path for a stateless request). Checked from outside: the engine replica's digest
of each prompt it was sent, for a WebSocket loop and for the same contexts re-sent
statelessly. The apps run with production settings (no `verify_renders`)."""

import asyncio
import json

import httpx
import pytest
from websockets.asyncio.client import connect

from tests.support.local_cluster import stats as server_stats
from tests.support.ws import TERMINAL, ws_url

pytestmark = pytest.mark.integration

TOOLS = [{"type": "function", "name": "read_file", "description": "Read a file",
          "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}]
INSTRUCTIONS = "You are a careful coding agent. Use tools to read files."


async def _ws_loop(url: str, headers: dict, turns: int) -> list[tuple[str, list[dict]]]:
    """A tool loop on one socket; returns (response id, the context its prompt was rendered from)."""
    context: list[dict] = []
    out = []
    prev = None
    new_items: list[dict] = [{"type": "message", "role": "user", "content": "Find the bug in src/app.py"}]
    async with connect(ws_url(url), additional_headers=headers,
                       open_timeout=30) as ws:
        for turn in range(turns):
            body = {"type": "response.create", "model": "loopserve-tiny", "input": new_items, "tools": TOOLS,
                    "instructions": INSTRUCTIONS, "store": False, "max_output_tokens": 24}
            if prev:
                body["previous_response_id"] = prev
            await ws.send(json.dumps(body))
            while (ev := json.loads(await asyncio.wait_for(ws.recv(), 120)))["type"] not in TERMINAL + ("error",):
                pass
            assert ev["type"] in ("response.completed", "response.incomplete"), ev
            resp = ev["response"]
            context = context + new_items
            out.append((resp["id"], list(context)))
            context = context + resp["output"]
            calls = [o for o in resp["output"] if o["type"] == "function_call"]
            new_items = [{"type": "function_call_output", "call_id": c["call_id"], "output": f"line {turn}\n" * 20}
                         for c in calls]
            new_items.append({"type": "message", "role": "user", "content": f"Good. Step {turn}: keep going."})
            prev = resp["id"]
    return out


def assert_continuations_render_exactly(url: str, api_key: str = "sk-test", turns: int = 6,
                                        compare: str = "prompt_digests") -> None:
    """`compare`: token ids (`prompt_digests`), or the prompts' text (`prompt_text_digests`) where
    a continuation may hold the previous turn's generated tokens, which a re-tokenization of their
    text need not reproduce (a random-weight model's output)."""
    headers = {"authorization": f"Bearer {api_key}"}
    loop = asyncio.run(_ws_loop(url, headers, turns))
    stateless = []
    for _, context in loop:
        r = httpx.post(url + "/v1/responses", headers=headers, timeout=120,
                       json={"model": "loopserve-tiny", "input": context, "tools": TOOLS,
                             "instructions": INSTRUCTIONS, "store": False, "max_output_tokens": 1})
        assert r.status_code == 200, r.text
        stateless.append(r.json()["id"])
    digests = server_stats(url)["engine"][compare]
    before = server_stats(url, last=1024)
    delta_turns = [t for t in before["turns"] if t["response_id"] in {rid for rid, _ in loop[1:]}]
    assert delta_turns and not any(t["full_render"] for t in delta_turns), "continuations must use delta renders"
    for (rid, _), sid in zip(loop, stateless):
        assert digests[rid] == digests[sid], f"turn {rid}: the engine got a different prompt than a full render"


def test_scripted_app_production_path_is_exact(scripted_url):
    assert_continuations_render_exactly(scripted_url, turns=8)

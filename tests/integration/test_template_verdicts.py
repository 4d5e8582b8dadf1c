"""A delta render found inexact on one connection replica turns incremental rendering off on every
connection replica of the app (issue: exact for any content). Two connection replicas behind the
proxy; the model's chat template cuts old tool outputs past 5,000 characters, beyond the start-up
probe's texts, and the AST analysis is off, so only the render audit can catch it: a WebSocket
loop on one replica sends the delta, the audit finds it, and the ledger carries the verdict."""

import asyncio
import shutil
import time

import pytest
from websockets.asyncio.client import connect

from tests.support.local_cluster import stats as server_stats
from tests.support.apps import module_app, scripted_app
from tests.support.ws import turn, ws_url
from tests.unit.core.render.test_probe import shortens_old_tool_outputs

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def verdicts_url(serve_instance, tiny_model_dir, tmp_path_factory):
    model = tmp_path_factory.mktemp("cut-template-model")
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json", "generation_config.json"):
        shutil.copy(tiny_model_dir / name, model / name)
    (model / "chat_template.jinja").write_text(shortens_old_tool_outputs(5000))
    args = scripted_app(model={"path": str(model)}, template_analysis=False, render_audit_first=100,
                        connection={"num_replicas": 2, "ray_actor_options": {"num_cpus": 0.05}},
                        limits={"shared_across_replicas": True})
    yield from module_app("template-verdicts", "/verdicts", args, serve_instance, 180)


def tool_round(call_id: str, output: str) -> list[dict]:
    return [{"type": "function_call", "call_id": call_id, "name": "read_file", "arguments": "{}"},
            {"type": "function_call_output", "call_id": call_id, "output": output}]


async def _loop(url: str) -> None:
    async with connect(ws_url(url), open_timeout=30, max_size=None) as ws:
        prev = None
        # The second tool output makes the first one old and the template cuts it; the delta of that
        # turn starts after the user message between them, so it sends the first output whole.
        for n, new in enumerate([[{"role": "user", "content": "Read it."}, *tool_round("c0", "A" * 6000)],
                                 [{"role": "user", "content": "Ok."}],
                                 [{"role": "user", "content": "And the other."}, *tool_round("c2", "B")]]):
            body = {"type": "response.create", "input": new, "store": False, "max_output_tokens": 8}
            if prev:
                body["previous_response_id"] = prev
            events = await turn(ws, body)
            assert events[-1]["type"] in ("response.completed", "response.incomplete"), events[-1]
            prev = events[-1]["response"]["id"]


def test_an_inexact_delta_found_on_one_replica_turns_deltas_off_on_both(verdicts_url):
    asyncio.run(_loop(verdicts_url))
    seen: dict[int, object] = {}
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (len(seen) == 2 and all(seen.values())):
        s = server_stats(verdicts_url)  # whichever replica the proxy picks
        seen[s["pid"]] = s["render_audit"]["deltas_off"]
        time.sleep(0.3)
    assert len(seen) == 2, seen
    offs = list(seen.values())
    assert all(offs), seen
    assert any("message 2 (tool) renders differently" in off for off in offs), offs
    assert any(off.startswith("another connection replica:") for off in offs), offs

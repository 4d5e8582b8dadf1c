"""The ingress's bounded JSON bodies: too large (413) or too complex to parse (400) is refused
before `json.loads` holds the event loop."""

import json

import pytest
from starlette.requests import Request

from actors.http import json_body
from cluster.protocol.errors import ApiError


def request_with(body: bytes) -> Request:
    chunks = [body[i:i + 65536] for i in range(0, len(body), 65536)] or [b""]

    async def receive():
        chunk = chunks.pop(0) if chunks else b""
        return {"type": "http.request", "body": chunk, "more_body": bool(chunks)}

    return Request({"type": "http", "method": "POST", "path": "/v1/responses", "headers": []}, receive)


async def test_a_body_of_400k_tiny_items_is_refused_without_parsing(monkeypatch):
    from actors import http

    body = json.dumps({"input": [{"role": "user", "content": "a"}] * 400_000}).encode()  # 13.6 MB
    parsed = []
    monkeypatch.setattr(http.json, "loads", lambda raw: parsed.append(raw))
    with pytest.raises(ApiError) as err:
        await json_body(request_with(body), limit=16 * 1024 * 1024)
    assert (err.value.status, err.value.code) == (400, "json_too_complex") and parsed == []


async def test_an_ordinary_large_body_parses():
    items = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "x" * 500}]}] * 10_000
    body = json.dumps({"input": items}).encode()
    assert len((await json_body(request_with(body)))["input"]) == 10_000


def post(headers: dict[str, str]) -> Request:
    async def receive():
        return {"type": "http.request", "body": b"{}", "more_body": False}

    raw = [(k.encode(), v.encode()) for k, v in headers.items()]
    return Request({"type": "http", "method": "POST", "path": "/v1/responses", "headers": raw}, receive)


@pytest.mark.parametrize("headers,closes", [
    ({"content-length": str(13_600_000)}, True),  # 13.6 MB the server would read only to discard
    ({"transfer-encoding": "chunked"}, True),  # of unknown length
    ({"content-length": "2000"}, False),  # small: read and discarded, the connection kept
])
def test_a_request_refused_before_its_body_is_read_closes_its_connection_when_the_body_is_large(headers, closes):
    from actors.http import error_response

    err = ApiError(429, "Rate limit reached.", code="rate_limit_exceeded", retry_after_s=3.0)
    response = error_response(err, post(headers))
    assert response.status_code == 429 and response.headers["retry-after"] == "3"
    assert (response.headers.get("connection") == "close") is closes


async def test_a_refusal_after_the_body_was_read_keeps_the_connection():
    from actors.http import error_response

    request = post({"content-length": str(200_000)})
    await json_body(request)
    response = error_response(ApiError(400, "Bad input.", code="invalid_value"), request)
    assert "connection" not in response.headers

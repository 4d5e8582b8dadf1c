"""The ingress's bounded JSON bodies: too large (413) or too complex to parse (400) is refused
before `json.loads` holds the event loop (audit-2 N5)."""

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

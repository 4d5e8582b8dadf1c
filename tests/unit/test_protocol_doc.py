"""docs/protocol.md names every event type and every error code the server sends: a new one in
the code fails here until the page says what it is and why."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "protocol.md").read_text()
CLIENT_FRAMES = {"response.create", "response.interrupt", "response.steer", "response.inject", "response.processed",
                 "response.append"}
# Strings that look like event types but are not events: endpoint and item names.
NOT_EVENTS = {"response.compaction", "response.deleted", "response.input_tokens"}


def sources() -> str:
    return "\n".join(p.read_text() for top in ("cluster", "actors") for p in (ROOT / top).rglob("*.py")
                     if "bench" not in p.parts)


def test_every_event_type_the_server_sends_is_documented():
    sent = set(re.findall(r'"((?:response|responsesapi)\.[a-z_]+(?:\.[a-z_]+)*)"', sources()))
    sent -= CLIENT_FRAMES | NOT_EVENTS
    assert sent, "found no event types: the pattern no longer matches the code"
    assert sorted(t for t in sent if f"`{t}`" not in DOC) == []


def test_every_error_code_the_server_sends_is_documented():
    code = sources()
    codes = set(re.findall(r'code="([a-z]+(?:_[a-z]+)*)"', code))
    codes |= set(re.findall(r'SteerRejected\("([a-z_]+)"', code))
    codes |= set(re.findall(r'refusal = \("([a-z_]+)"', code))
    codes |= set(re.findall(r'code, message = \(\("([a-z_]+)"', code))  # inject refusals: (code, message)
    codes |= set(re.findall(r'else \("([a-z_]+)", f?"', code))
    codes |= set(re.findall(r'failed_steer\(\s*\w+, "([a-z_]+)"', code))
    assert len(codes) > 30, "found few error codes: the patterns no longer match the code"
    assert sorted(c for c in codes if f"`{c}`" not in DOC) == []

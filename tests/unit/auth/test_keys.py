"""Per-key limits: creates and reads have windows of their own (reads were unlimited)."""

import pytest

from cluster.auth import Authenticator, Principal
from cluster.config import AuthConfig
from cluster.protocol.errors import ApiError


def test_reads_are_limited_in_a_window_of_their_own():
    auth = Authenticator(AuthConfig())
    p = Principal("t", "key1", max_connections=4, requests_per_minute=2, reads_per_minute=3)
    for _ in range(3):
        auth.admit_read(p, now=100.0)
    with pytest.raises(ApiError) as err:
        auth.admit_read(p, now=101.0)
    assert (err.value.status, err.value.code) == (429, "rate_limit_exceeded") and "3 reads per minute" in str(err.value)
    assert err.value.retry_after_s == pytest.approx(59.0)
    auth.admit_request(p, now=101.0)  # polling did not eat the create budget
    auth.admit_request(p, now=101.0)
    with pytest.raises(ApiError):
        auth.admit_request(p, now=101.5)
    auth.admit_read(p, now=160.5)  # the window slides


def test_a_key_removed_from_the_keys_file_stops_working_without_a_restart(tmp_path):
    """Keys_file was read once, at start; a revoked key kept working until a restart
    (on open sockets, up to their 60 minutes)."""
    import yaml

    from cluster.auth import KEYS_FILE_CHECK_S, key_sha256

    keys = tmp_path / "keys.yaml"
    keys.write_text(yaml.safe_dump({"keys": [{"sha256": key_sha256("sk-a"), "tenant": "a"},
                                             {"sha256": key_sha256("sk-b"), "tenant": "b"}]}))
    auth = Authenticator(AuthConfig(keys_file=str(keys), require_keys=True))
    b = auth.authenticate("Bearer sk-b")  # a socket of b's opens
    auth.admit_request(b)
    keys.write_text(yaml.safe_dump({"keys": [{"sha256": key_sha256("sk-a"), "tenant": "a"}]}) + "\n# revoked b\n")
    auth.refresh(now=__import__("time").monotonic() + KEYS_FILE_CHECK_S + 1)
    with pytest.raises(ApiError) as revoked:
        auth.authenticate("Bearer sk-b")
    assert revoked.value.status == 401
    with pytest.raises(ApiError) as on_open_socket:  # its open socket's next create
        auth.admit_request(b)
    assert on_open_socket.value.status == 401 and "revoked" in on_open_socket.value.message
    assert auth.authenticate("Bearer sk-a").tenant == "a"
    # A broken or emptied file keeps the keys in force: a server with keys never turns keyless.
    keys.write_text("keys: []\n")
    auth.refresh(now=__import__("time").monotonic() + 2 * KEYS_FILE_CHECK_S + 2)
    assert auth.enabled and auth.authenticate("Bearer sk-a").tenant == "a"
    with pytest.raises(ApiError):
        auth.authenticate(None)


def test_reads_are_also_limited_by_the_bytes_they_sent():
    from cluster.auth.limits import LimitReports

    auth = Authenticator(AuthConfig())
    p = Principal("t", "key1", max_connections=4, requests_per_minute=2, reads_per_minute=100,
                  read_bytes_per_minute=10_000)
    auth.admit_read(p, now=100.0)
    auth.charge_read(p, 6_000, now=100.0)
    auth.admit_read(p, now=101.0)  # under the budget: one read may overshoot by its own size
    auth.charge_read(p, 6_000, now=101.0)
    with pytest.raises(ApiError) as err:
        auth.admit_read(p, now=102.0)
    assert (err.value.status, err.value.code) == (429, "rate_limit_exceeded")
    assert "10000 bytes read per minute" in str(err.value) and err.value.retry_after_s == pytest.approx(58.0)
    assert auth.held(now=102.0)["key1/read_bytes"] == 12_000  # what the other replicas are told
    auth.admit_read(p, now=160.5)  # the first read left the window
    # What other replicas' reads sent counts here too (limits shared across replicas).
    other = Authenticator(AuthConfig())
    other.shared = LimitReports()
    other.shared.heard({"key1/read_bytes": 10_000}, now=100.0)
    with pytest.raises(ApiError):
        other.admit_read(p, now=101.0)


def test_creates_are_also_limited_by_the_bytes_they_send():
    """A count of creates let one key fill a replica's loop with creates of 10,000 items (~25 ms
    each): their bytes count too, before they are parsed."""
    auth = Authenticator(AuthConfig())
    p = Principal("t", "key1", max_connections=4, requests_per_minute=100, input_bytes_per_minute=10_000)
    auth.admit_request(p, 20_000, now=100.0)  # larger than the whole minute's bytes: let through an empty window
    with pytest.raises(ApiError) as err:
        auth.admit_request(p, 10, now=101.0)
    assert (err.value.status, err.value.code) == (429, "rate_limit_exceeded")
    assert "10000 input bytes sent per minute" in str(err.value) and err.value.retry_after_s == pytest.approx(59.0)
    auth.admit_request(p, 6_000, now=160.5)
    auth.charge_input(p, 3_000, now=161.0)  # a chunked body, charged as read
    with pytest.raises(ApiError):
        auth.admit_request(p, 1_001, now=162.0)
    auth.admit_request(p, 1_000, now=162.0)
    assert auth.held(now=162.0)["key1/input_bytes"] == 10_000 and auth.held(now=162.0)["key1"] == 2


def test_a_key_held_in_memory_is_one_entry_per_admission_and_gone_a_minute_later():
    """What a client can make the limits hold: refused requests add nothing, and a quiet key's
    windows are dropped, so the tables stay as small as the keys in use."""
    auth = Authenticator(AuthConfig())
    p = Principal("t", "key1", max_connections=4, requests_per_minute=3, reads_per_minute=2,
                  input_bytes_per_minute=1 << 20)
    admitted = 0
    for i in range(50):
        now = 100.0 + i / 100
        try:
            auth.admit_request(p, 100, now=now)
            admitted += 2  # the create and its bytes
        except ApiError:
            pass
        try:
            auth.admit_read(p, now=now)
            auth.charge_read(p, 10, now=now)
            admitted += 2  # the read and what it sent
        except ApiError:
            pass
    assert admitted == 3 * 2 + 2 * 2 and auth.entries() == admitted
    assert auth.held(now=170.0) == {} and auth.entries() == 0

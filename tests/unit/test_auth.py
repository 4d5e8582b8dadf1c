"""Per-key limits: creates and reads have windows of their own (audit-2 N12: reads were unlimited)."""

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

"""The version guard of session pins (cluster/engines/vllm/retention_guard.py)."""

from cluster.engines.vllm.retention_guard import REQUIRED, check_installed, unsupported_reason, version_tuple


class _Complete:
    pass


for _role, _attr in REQUIRED:
    setattr(_Complete, _attr, lambda self: None)

ALL = {"Scheduler": _Complete, "KVCacheManager": _Complete, "BlockPool": _Complete}


def test_versions_parse_as_vllm_and_its_cpu_build_spell_them():
    assert version_tuple("0.32.0+cpu") == (0, 32, 0)
    assert version_tuple("0.33.1rc1") == (0, 33, 1)
    assert version_tuple("0.10.0.dev5") == (0, 10, 0)


def test_a_vllm_outside_the_tested_range_runs_without_pins_and_says_why():
    assert unsupported_reason("0.32.0", ALL) is None
    assert "outside the range" in unsupported_reason("0.33.0", ALL)
    assert "outside the range" in unsupported_reason("0.10.2", ALL)


def test_a_missing_internal_is_named():
    class Partial:
        touch = staticmethod(lambda: None)

    reason = unsupported_reason("0.32.0", {**ALL, "BlockPool": Partial})
    assert reason is not None and "BlockPool.free_blocks" in reason and "BlockPool.touch" not in reason


def test_the_installed_vllm_has_what_pins_use():
    assert check_installed() is None

"""The adapter against the real source of one SGLang release per line (one subprocess each)."""

from __future__ import annotations

import pytest

from tests.sglang.conftest import RELEASES

EXPECTED_LAYOUT = {
    "0.4.9.post6": "A", "0.4.10.post2": "A", "0.5.1": "A", "0.5.3": "A",
    "0.5.4": "B", "0.5.9": "B", "0.5.11": "C", "0.5.12.post1": "C",
    "0.5.13": "D", "0.5.15": "D", "0.5.23": "D",
}

pytestmark = pytest.mark.parametrize("version", RELEASES)


def _ok(section: dict) -> dict:
    assert "error" not in section, section.get("traceback", section)
    return section


def test_version_detected_from_distribution_metadata(release_report, version):
    rep = release_report(version)
    assert rep["sglang_version"] == version
    assert rep["detected"] == {"value": version, "source": "distribution sglang", "known": True}
    assert rep["layout"] == EXPECTED_LAYOUT[version]


def test_patch_set_applies_completely(release_report, version):
    boot = release_report(version)["bootstrap"]
    assert boot["status"] == "applied", boot
    assert boot["failed"] == []
    applied = set(boot["applied"])
    assert f"leak-check-{EXPECTED_LAYOUT[version]}" in applied
    assert any(name.startswith("elastic-mha-buffers") for name in applied)
    assert {n.rsplit("-pkg", 1)[0] for n in applied if "token-allocator" in n} == {
        f"elastic-token-allocator-{m}" for m in ("available_size", "alloc", "free", "clear")}


def test_patch_set_reverts_exactly(release_report, version):
    rev = _ok(release_report(version)["revert"])
    assert rev["conflicts"] == [] and rev["mismatched"] == []
    assert rev["restored"] == len(release_report(version)["bootstrap"]["applied"])


def test_pool_and_allocator_run_on_kvcached(release_report, version):
    pool = _ok(release_report(version)["pool"])
    assert pool["elastic"] and pool["k_shape"] == [4097, 8, 128]
    assert pool["available0"] == 4096 and pool["available1"] == 4091
    assert sorted(pool["alloc5"]) == [1, 2, 3, 4, 5]
    assert pool["mapped_grew"] and pool["readback"]
    assert pool["pages_in_use"] >= 3  # 1505 tokens of 2 KiB rows over 1 MiB pages
    assert pool["available2"] == 4096 and pool["pages_in_use_after"] == 1  # null block's page


def test_idle_leak_check(release_report, version):
    leak = _ok(release_report(version)["leak"])
    # The elastic pool can back fewer slots than a static pool would have free ...
    assert leak["available"] < leak["logical"] == 4096 - 100
    # ... which SGLang's unpatched check reports as a leak,
    assert "memory leak detected" in leak["unpatched_consistent"]
    # while the patched check passes for the consistent state,
    assert leak["patched_consistent"] == "passed"
    assert leak["patched_consistent_again"] == "passed"
    # still reports a leaked request slot,
    assert "req_to_token_pool memory leak detected" in leak["patched_req_leak"]
    # and still reports KV slots that nothing holds (a genuine leak).
    assert "memory leak detected" in leak["patched_kv_leak"]
    assert "req_to_token_pool" not in leak["patched_kv_leak"]
    assert "3989" in leak["patched_kv_leak"]

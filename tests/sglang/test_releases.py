"""The adapter against the real source of one SGLang release per line (one subprocess each)."""

from __future__ import annotations

import re

import pytest

from tests.sglang.conftest import RELEASES

EXPECTED_LAYOUT = {
    "0.4.9.post6": "A", "0.4.10.post2": "A", "0.5.1": "A", "0.5.3": "A",
    "0.5.4": "B", "0.5.9": "B", "0.5.11": "C", "0.5.12.post1": "C",
    "0.5.13": "D", "0.5.15": "D", "0.5.23": "D",
}

#: Inline in ``MLATokenToKVPool.__init__`` up to 0.5.5, ``_create_buffers`` from 0.5.6.
EXPECTED_MLA_PATCH = {v: "elastic-mla-init" for v in ("0.4.9.post6", "0.4.10.post2", "0.5.1",
                                                      "0.5.3", "0.5.4")}
EXPECTED_MLA_PATCH.update({v: "elastic-mla-buffers" for v in RELEASES
                           if v not in EXPECTED_MLA_PATCH})

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
    assert applied & {"elastic-mla-init", "elastic-mla-buffers"} == {EXPECTED_MLA_PATCH[version]}
    backup = set() if version == "0.5.23" else {"backup_state", "restore_state"}
    assert {re.sub(r"-(pkg|sink)$", "", n) for n in applied if "token-allocator" in n} == {
        f"elastic-token-allocator-{m}" for m in {"available_size", "alloc", "free", "clear"} | backup}
    paged = {"available_size", "alloc", "alloc_extend", "alloc_decode", "free", "clear"} | backup
    if version == "0.5.23":
        paged.add("release_page_ids")  # the sink of free_page_ids / free_segment / groups
    assert {re.sub(r"-(pkg|sink)$", "", n) for n in applied if "paged-allocator" in n} == {
        f"elastic-paged-allocator-{m}" for m in paged}


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
    if version != "0.5.23":  # backup_state / restore_state: gone in 0.5.23
        assert pool["restore_frees_draft"] and pool["restore_kept_older"]


#: Releases whose model runner refuses interpreted Triton kernels at import
#: (``CachedKernel`` asserts a compiled ``JITFunction``), so under ``TRITON_INTERPRET=1``
#: the patch set cannot import its profile target there.
INTERPRETER_REJECTED = {"0.5.3", "0.5.4"}


def test_paged_allocator_runs_on_kvcached(paged_report, version):
    """Page size 16 through SGLang's own alloc_extend / alloc_decode kernels."""
    rep = paged_report(version)
    if version in INTERPRETER_REJECTED:
        assert rep["bootstrap"]["status"] == "failed"
        assert "model_runner" in rep["bootstrap"]["reason"], rep["bootstrap"]
        pytest.skip(f"SGLang {version} rejects Triton's interpreter; its paged patches apply "
                    "in test_patch_set_applies_completely")
    assert rep["bootstrap"]["status"] == "applied", rep["bootstrap"]
    paged = _ok(rep["paged"])
    assert paged["elastic"] and paged["patched"]
    assert paged["available0"] == 4096
    # 67 slots: A's 32 on 2 new pages; B's 35 continue its 5-token page, then 2 new pages.
    assert paged["extend"] == {"n": 67, "unique": True, "b_continues_prefix": True,
                               "positions_match": True, "pages_from_kvcached": True,
                               "new_pages": 4}
    assert paged["available1"] == 4096 - 5 * 16 and paged["readback"]
    assert paged["decode"] == {"a_new_page": True, "b_next_slot": True}
    assert paged["available2"] == 4096 - 6 * 16
    assert paged["deferred_in_group"] and paged["freed_at_group_end"]
    assert paged["via"] == ("free_page_ids" if version == "0.5.23" else "free")
    assert paged["available3"] == 4096 and paged["free_pages_left"] == 0
    assert paged["pages_in_use_after"] == 1  # the null block's page


def test_sliding_window_pools_run_on_kvcached(release_report, version):
    """SWAKVPool's full and window MHA pools, and SWATokenToKVPoolAllocator's sub-allocators."""
    swa = _ok(release_report(version)["swa"])
    assert swa["elastic"] == [True, True] and swa["found_by_wrapper"]
    assert swa["available0"] == [4096, 1024]  # full, window
    assert swa["after_alloc"] == [300, 300] and swa["mapped"] == [True, True]
    assert swa["readback"]
    assert swa["after_free_swa"] == [300, 100]  # window slots freed, full slots kept
    assert swa["after_free"] == [0, 0] and swa["available1"] == [4096, 1024]
    assert swa["pages_in_use"] == [1, 1]  # the null blocks' pages


def test_linear_attention_hybrid_pool_runs_on_kvcached(release_report, version):
    """HybridLinearKVPool (Mamba / linear-attention models): the full-attention KV on kvcached."""
    hyb = _ok(release_report(version)["hybrid_linear"])
    if version in ("0.4.9.post6", "0.4.10.post2", "0.5.1"):
        assert hyb == {"skipped": "no HybridLinearKVPool in this release"}
        return
    assert hyb["elastic"] and hyb["available0"] == 2048 and hyb["used"] == 100
    assert hyb["readback"]  # global layer 3 is the full-attention pool's layer 1
    assert hyb["available1"] == 2048 and hyb["pages_in_use"] == 1


def test_changed_mla_signature_rolls_the_set_back(release_report, version):
    sig = _ok(release_report(version)["mla_signature"])
    assert sig["status"] == "failed" and sig["applied"] == [] and sig["not_restored"] == []
    assert EXPECTED_MLA_PATCH[version] in sig["reason"]
    assert "MLATokenToKVPool" in sig["reason"] and version in sig["reason"]
    assert "kv_lora_rank" in sig["reason"] and "rolled back" in sig["reason"]


def test_mla_pool_runs_on_kvcached(release_report, version):
    mla = _ok(release_report(version)["mla"])
    # One latent buffer per layer, K and V packed: kv_lora_rank + qk_rope_head_dim = 576.
    assert mla["elastic"] and mla["buffers"] == 1 and mla["virtual"]
    assert mla["kv_shape"] == [4097, 1, 576] and mla["layers"] == 2 and mla["size"] == 4096
    assert mla.get("data_ptrs_match", True)
    assert mla["mem_usage_gb"] == pytest.approx(2 * 4097 * 1152 / (1 << 30))
    # 1152-byte rows over 1 MiB pages: the 4 rows that straddle a page boundary are never
    # handed out, so 4092 of the 4096 slots can be backed.
    assert mla["available0"] == 4092 and mla["available1"] == 4087
    assert sorted(mla["alloc5"]) == [1, 2, 3, 4, 5]
    assert mla["readback_key"] and mla["readback_value"] and mla["other_layer_untouched"]
    assert mla["mapped_grew"] and mla["pages_in_use"] >= 2 and mla["ids_below_rows"]
    assert mla["available2"] == 4092 and mla["pages_in_use_after"] == 1  # null block's page
    # Pools with buffers kvcached does not cover keep SGLang's: subclasses, NSA/DSA.
    assert mla["subclass_static"]
    flag = "use_dsa" if version in ("0.5.13", "0.5.15", "0.5.23") else (
        None if version in ("0.4.9.post6", "0.4.10.post2", "0.5.1") else "use_nsa")
    assert mla["dsa_flag"] == flag
    if flag is not None:
        assert mla["dsa_static"]


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


def test_memory_profile_is_taken_as_if_alone(release_report, version):
    """SGLang's own profiling code, run with the device view that leaves other processes out."""
    prof = _ok(release_report(version)["profile"])
    if version in ("0.5.23",):  # KVCacheConfigurator: covered by the engine test
        assert prof == {"skipped": "no profiling method on ModelRunner"}
        return
    # The method SGLang calls is the one the release's profile patch installed.
    assert prof["patched"] in ("virtual-profile-tokens", "virtual-profile-bytes"), prof
    assert prof["recorded"].endswith(prof["method"])
    # total * mem_fraction_static - own, with total and own as the view read them.
    assert prof["virtual"] == prof["expected"], prof
    # A pool kvcached would not back (hierarchical cache here) keeps SGLang's measured profile.
    assert prof["static"] <= prof["real"] * 1.05 and not prof["static_recorded"], prof

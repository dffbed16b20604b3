"""The patch table in :mod:`kvcached_sglang.patches`' docstring is the patch set it builds."""

from __future__ import annotations

import kvcached_sglang
import kvcached_sglang.patches as patches
from tests.patch_tables import assert_no_differences, differences, expand, placeholders


def _differences(doc: str) -> list[str]:
    return differences(doc, "SGLang", {"": patches.build_patches(None)},
                       kvcached_sglang.SUPPORTED_VERSIONS, kvcached_sglang.COVERED_RELEASES)


def test_docstring_table_matches_the_registered_patches():
    assert_no_differences(_differences(patches.__doc__), "kvcached_sglang/patches.py")


def test_the_table_check_names_a_wrong_row():
    doc = patches.__doc__.replace("leak-check-C                                   0.5.11 - 0.5.12",
                                  "leak-check-C                                   0.5.11 - 0.5.13")
    doc = doc.replace("(optional)       ``utils:add_prometheus_middleware``",
                      "                 ``utils:add_prometheus_middleware``")
    assert doc.count("0.5.11 - 0.5.13") == 1
    problems = _differences(doc)
    assert len(problems) == 2, problems
    assert problems[0].startswith("row 'leak-check-C' ('0.5.11 - 0.5.13')")
    assert "excludes 0.5.13" in problems[0]
    assert problems[1] == ("row 'kvcached-metrics' ('0.4.9 - 0.5.2'): 'kvcached-metrics' is "
                           "optional, the row says required")


def test_placeholders_stand_for_the_method_families():
    legend = placeholders(patches.__doc__)
    assert legend["backup"] == ("backup_state", "restore_state")
    assert set(legend["alloc"]) < set(legend["paged"])
    assert expand("elastic-token-allocator-<backup>-pkg", legend) == [
        "elastic-token-allocator-backup_state-pkg", "elastic-token-allocator-restore_state-pkg"]

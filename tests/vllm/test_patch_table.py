"""The patch table in :mod:`kvcached_vllm.patches`' docstring is the patch set it builds."""

from __future__ import annotations

import kvcached_vllm
import kvcached_vllm.patches as patches
from tests.patch_tables import assert_no_differences, differences, row_specifier, table_rows


def _differences(doc: str) -> list[str]:
    lists = {"CPU": patches.build_patches(None, device_type="cpu"),
             "GPU": patches.build_patches(None, device_type="cuda")}
    return differences(doc, "vLLM", lists, kvcached_vllm.SUPPORTED_VERSIONS,
                       kvcached_vllm.COVERED_RELEASES)


def test_docstring_table_matches_the_registered_patches():
    assert_no_differences(_differences(patches.__doc__), "kvcached_vllm/patches.py")


def test_the_table_check_names_a_wrong_row():
    doc = patches.__doc__.replace("elastic-block-pool                     < 0.34",
                                  "elastic-block-pool                     < 0.33")
    assert doc != patches.__doc__
    problems = _differences(doc)
    assert len(problems) == 1 and problems[0].startswith("row 'elastic-block-pool' ('< 0.33')")
    assert "includes 0.33" in problems[0]  # the row stops before 0.33, the gate does not


def test_the_table_says_what_it_means():
    rows = {row.patch: row for row in table_rows(patches.__doc__, "vLLM")}
    assert rows["elastic-allocate-kv-cache-v2"].versions == "0.29 - 0.33"
    assert rows["elastic-allocate-kv-cache-v2"].devices == {"GPU"}
    whole = kvcached_vllm.SUPPORTED_VERSIONS
    assert str(row_specifier("0.29 - 0.33", whole)) == "<0.34.dev0,>=0.29.dev0"
    assert str(row_specifier(">= 0.34", whole)) == ">=0.34.dev0"

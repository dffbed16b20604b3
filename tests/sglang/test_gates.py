"""Bad input without SGLang: versions outside the declared range, placeholders, strict mode."""

from __future__ import annotations

import pytest

from tests.sglang.conftest import run_probe


@pytest.fixture(scope="module")
def gates(dist_record):
    return run_probe(None, dist_record, "gates", timeout=120)


@pytest.mark.parametrize("label", ["out_of_range", "too_old"])
def test_release_outside_range_runs_vanilla_and_strict_refuses(gates, label):
    assert gates[label]["status"] == "unsupported"
    assert "vanilla" in gates[label]["reason"] or "not in" in gates[label]["reason"]
    assert gates[label + "_strict"].startswith("refused")


def test_placeholder_version_is_unknown_not_skipped(gates):
    assert gates["placeholder"]["status"] == "unknown-version"
    assert "0.0.0.dev0" in gates["placeholder"]["reason"]
    assert gates["placeholder_strict"].startswith("refused")


def test_missing_module_version_falls_back_to_metadata(gates):
    assert gates["no_module_version"] == {"value": "0.5.12.post1", "source": "distribution sglang"}

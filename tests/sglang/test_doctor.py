"""``kvctl doctor`` with the SGLang adapter installed beside a real SGLang release."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from packaging.version import Version

from kvcached_testing.sglang_release import ROOT, release_env
from tests.sglang.conftest import skip_unless_installed
from tests.sglang.test_releases import EXPECTED_LAYOUT, EXPECTED_MLA_PATCH

#: One release per leak-check layout.
VERSIONS = ("0.4.9.post6", "0.5.9", "0.5.12.post1", "0.5.23")


def _doctor(version: str, dist_record) -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "kvcached_core.cli.kvctl", "doctor", "--json", "--import-engines"],
        env=release_env(version, dist_record), capture_output=True, text=True, timeout=300,
        cwd=str(ROOT),
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.mark.parametrize("version", VERSIONS)
def test_doctor_shows_the_adapter_release_and_patches(dist_record, prefetched, version):
    skip_unless_installed(version)
    report = prefetched.get(("doctor", version),
                            [("doctor", v) for v in VERSIONS],
                            lambda key: _doctor(key[1], dist_record))
    assert report["ok"] is True and report["problems"] == [], report["problems"]
    [engine] = [e for e in report["engines"] if e["name"] == "sglang"]
    assert engine["distribution"] == "kvcached-sglang"
    assert engine["installed"] is True and engine["in_range"] is True
    assert engine["version"]["value"] == version
    assert engine["version"]["source"] == "distribution sglang"
    verdicts = {p["name"]: p["verdict"] for p in engine["patches"]}
    layout = EXPECTED_LAYOUT[version]
    applies = {name for name, verdict in verdicts.items() if verdict == "would-apply"}
    assert f"leak-check-{layout}" in applies
    assert {f"leak-check-{other}" for other in "ABCD" if other != layout} <= {
        name for name, verdict in verdicts.items() if verdict == "skip"}
    assert EXPECTED_MLA_PATCH[version] in applies
    assert any(name.startswith("elastic-mha-buffers") for name in applies)
    suffix = "-pkg" if Version(version) >= Version("0.5.13") else ""  # allocator package
    assert {f"elastic-token-allocator-{m}{suffix}" for m in
            ("available_size", "alloc", "free", "clear")} <= applies

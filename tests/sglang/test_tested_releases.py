"""Which SGLang releases the suite runs: ``KVCACHED_TEST_SGLANG_RELEASES``."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvcached_sglang import COVERED_RELEASES
from kvcached_testing.sglang_release import DEFAULT_TESTED, ROOT, TESTED_ENV
from kvcached_testing.sglang_release import tested_releases as select


def test_by_default_one_release_of_each_class_oldest_and_newest_included():
    assert select(COVERED_RELEASES, "") == DEFAULT_TESTED
    assert set(DEFAULT_TESTED) < set(COVERED_RELEASES)
    assert DEFAULT_TESTED[0] == COVERED_RELEASES[0] and DEFAULT_TESTED[-1] == COVERED_RELEASES[-1]


def test_all_and_lists_in_the_covered_order():
    assert select(COVERED_RELEASES, "all") == COVERED_RELEASES
    assert select(COVERED_RELEASES, " 0.5.15, 0.5.11 ") == ("0.5.11", "0.5.15")


def test_an_unknown_release_is_named_with_the_variable():
    with pytest.raises(ValueError) as err:
        select(COVERED_RELEASES, "0.5.11,0.6.0")
    assert str(err.value).startswith(f"{TESTED_ENV}='0.5.11,0.6.0': 0.6.0 not among")


def test_setup_installs_what_the_tests_run():
    """scripts/setup.sh installs the releases this module prints."""
    env_all = subprocess.run([sys.executable, "-m", "kvcached_testing.sglang_release"],
                             capture_output=True, text=True, cwd=str(ROOT), check=True,
                             env={"PATH": "/usr/bin:/bin", TESTED_ENV: "all"})
    assert env_all.stdout.split() == list(COVERED_RELEASES)
    default = subprocess.run([sys.executable, "-m", "kvcached_testing.sglang_release"],
                             capture_output=True, text=True, cwd=str(ROOT), check=True,
                             env={"PATH": "/usr/bin:/bin"})
    assert default.stdout.split() == list(DEFAULT_TESTED)

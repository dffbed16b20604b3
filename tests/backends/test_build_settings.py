"""setup.py's build settings: a bad value stops the build with a message naming it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _setup_name(**env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("KVCACHED_")}
    return subprocess.run([sys.executable, "setup.py", "--name"], cwd=REPO, env={**base, **env},
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("var,value,message", [
    ("KVCACHED_BACKENDS", "cuda,rocm", "unknown backend(s) ['rocm']"),
    ("KVCACHED_BACKENDS", " , ", "names no backend"),
    ("KVCACHED_BUILD_JOBS", "two", "whole number of compile jobs"),
    ("KVCACHED_BUILD_JOBS", "-1", "whole number of compile jobs"),
])
def test_bad_value_is_named(var, value, message):
    result = _setup_name(**{var: value})
    assert result.returncode != 0
    assert f"{var}={value!r}" in result.stderr and message in result.stderr, result.stderr


@pytest.mark.parametrize("jobs", ["", "0", "1", "3"])
def test_build_jobs_accepted(jobs):
    result = _setup_name(KVCACHED_BUILD_JOBS=jobs)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "kvcached-core"

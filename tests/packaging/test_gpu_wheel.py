"""On a CUDA machine: the kvcached-core wheel built with every CUDA header hidden maps pages on cuda:0.

Runs scripts/gpu_wheel_check.sh (see its header) with this interpreter: on the H200 host
(Python 3.12, offline) set ``KVCACHED_TEST_WHEEL_TOOLS`` to the directory that
``scripts/gpu_wheel_check.sh --fetch-tools DIR`` filled where PyPI is reachable.
Marked ``gpu`` (skipped without a CUDA GPU) and ``slow`` (it builds a wheel).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.packaging.conftest import REPO, clean_env

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def test_wheel_built_without_cuda_headers_maps_pages_on_cuda0(tmp_path):
    out = tmp_path / "out"
    tools = os.environ.get("KVCACHED_TEST_WHEEL_TOOLS")
    cmd = ["bash", str(REPO / "scripts" / "gpu_wheel_check.sh")] + ([tools] if tools else [])
    run = subprocess.run(cmd, cwd=REPO, env=clean_env(PYTHON=sys.executable, OUT=str(out)),
                         capture_output=True, text=True, timeout=1800)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    build_log = (out / "build.log").read_text()
    if os.geteuid() == 0:
        assert "NOT hidden" not in build_log and "fails, as it should" in build_log, build_log[-3000:]
    result = json.loads((out / "result.json").read_text().strip().splitlines()[-1])
    assert result["backends"] == ["cuda", "hip", "host"]
    assert result["backend"] == "cuda" and result["mapped"] == [0, 1, 5] and result["unmapped"]
    if "torch" in result:
        elements = result["page_size"] // 2
        assert result["tensor_device"] == "cuda:0" and result["same_address"]
        assert result["sum_pages_0_1"] == 1.5 * 2 * elements
        assert result["sum_page_5"] == 2.0 * elements
        assert result["matmul_ok"]

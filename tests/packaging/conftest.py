"""Fixtures of the packaging tests: wheels built once per session by scripts/build_wheels.sh.

``KVCACHED_TEST_WHEELHOUSE=DIR`` reuses wheels built before (for this Python) instead of
building them again.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TAG = f"cp{sys.version_info[0]}{sys.version_info[1]}"


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without what points Python at the checkout."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP")
           and not k.startswith(("KVCACHED_", "PYTEST_"))}
    env.update(extra)
    return env


def wheels(directory: Path) -> dict[str, Path]:
    found = {
        "core": sorted(directory.glob(f"kvcached_core-*-{TAG}-{TAG}-manylinux*_x86_64.whl")),
        "vllm": sorted(directory.glob("kvcached_vllm-*-py3-none-any.whl")),
        "sglang": sorted(directory.glob("kvcached_sglang-*-py3-none-any.whl")),
    }
    return {name: paths[-1] for name, paths in found.items() if paths}


@pytest.fixture(scope="session")
def wheelhouse(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory with the three wheels for this Python."""
    given = os.environ.get("KVCACHED_TEST_WHEELHOUSE")
    if given:
        directory = Path(given)
        assert len(wheels(directory)) == 3, f"KVCACHED_TEST_WHEELHOUSE={given} lacks wheels for {TAG}"
        return directory
    directory = tmp_path_factory.mktemp("wheelhouse")
    result = subprocess.run(["bash", str(REPO / "scripts" / "build_wheels.sh"), str(directory)],
                            env=clean_env(PYTHON=sys.executable), capture_output=True, text=True,
                            timeout=900)
    assert result.returncode == 0, f"build_wheels.sh failed:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    assert len(wheels(directory)) == 3, result.stdout
    return directory

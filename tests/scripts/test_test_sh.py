"""scripts/test.sh: the .venv group and the vLLM group side by side, every failure counted.

The script runs in a copy of its folder beside stand-in interpreters (``.venv*/bin/python``
that log their arguments and exit as told), so what is checked is the script's own order,
concurrency, output and exit status, not the suite it would run.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENVS = (".venv", ".venv-vllm", ".venv-vllm-028")
STAND_IN = """#!/bin/sh
# $0 -m pytest -q -p no:cacheprovider ARGS...
echo "$(basename "$(dirname "$(dirname "$0")")") start $*" >> "$TRACE"
sleep "${{SLEEP:-0}}"
echo "$(basename "$(dirname "$(dirname "$0")")") end" >> "$TRACE"
echo "output of {env}"
case " $* " in *" {fail} "*) exit 1 ;; esac
exit 0
"""


def tree(tmp_path: Path, fail: str = "-never-") -> Path:
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "test.sh", tmp_path / "scripts" / "test.sh")
    for env in ENVS:
        py = tmp_path / env / "bin" / "python"
        py.parent.mkdir(parents=True)
        py.write_text(STAND_IN.format(env=env, fail=fail))
        py.chmod(0o755)
    return tmp_path


def run(root: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    e = {**os.environ, "TRACE": str(root / "trace"), "TMPDIR": str(root), **env}
    return subprocess.run(["bash", str(root / "scripts" / "test.sh"), *args], env=e,
                          capture_output=True, text=True, timeout=60)


def trace(root: Path) -> list[str]:
    return (root / "trace").read_text().splitlines()


def test_the_groups_run_side_by_side_and_all_pass(tmp_path):
    root = tree(tmp_path)
    res = run(root, "-m", "not slow", SLEEP="1")
    assert res.returncode == 0, res.stdout + res.stderr
    lines = trace(root)
    starts = [ln for ln in lines if " start " in ln]
    # Every run got the extra arguments; the vLLM group's three runs in their order.
    assert all(ln.endswith("-m not slow") for ln in starts), starts
    vllm = [ln.split(" start ")[0] + " " + ln.split("pytest -q -p no:cacheprovider ")[1]
            for ln in starts if not ln.startswith(".venv start")]
    assert vllm == [".venv-vllm tests/vllm -m not slow",
                    ".venv-vllm-028 tests/vllm -m not newest_vllm -m not slow",
                    ".venv-vllm tests/serve -m not slow"], vllm
    # .venv's run started before the vLLM group's first run ended: side by side.
    assert lines.index(next(ln for ln in lines if ln.startswith(".venv start"))) < \
        lines.index(next(ln for ln in lines if ln.startswith(".venv-vllm end")))
    out = res.stdout
    assert out.index("output of .venv\n") < out.index("the vLLM group's output:") < \
        out.index("output of .venv-vllm-028")
    assert "== test.sh: passed after" in out
    assert not list(root.glob("kvcached-test-vllm.*"))  # its log is removed


@pytest.mark.parametrize("fail", ["--ignore=tests/serve", "not newest_vllm", "tests/serve"])
def test_a_failing_run_in_either_group_fails_the_script_and_the_rest_still_run(tmp_path, fail):
    root = tree(tmp_path, fail=fail)
    res = run(root)
    assert res.returncode == 1, res.stdout
    assert "== test.sh: FAILED after" in res.stdout
    assert len([ln for ln in trace(root) if " end" in ln]) == 4  # every run ran


def test_one_job_runs_the_groups_in_turn(tmp_path):
    root = tree(tmp_path)
    res = run(root, KVCACHED_TEST_JOBS="1", SLEEP="0.2")
    assert res.returncode == 0, res.stdout + res.stderr
    envs = [ln.split()[0] for ln in trace(root)]
    assert envs == [".venv", ".venv", ".venv-vllm", ".venv-vllm", ".venv-vllm-028",
                    ".venv-vllm-028", ".venv-vllm", ".venv-vllm"]


def test_a_bad_job_count_is_named(tmp_path):
    root = tree(tmp_path)
    res = run(root, KVCACHED_TEST_JOBS="4")
    assert res.returncode == 2
    assert "KVCACHED_TEST_JOBS must be 1 or 2" in res.stderr and "'4'" in res.stderr
    assert not (root / "trace").exists()  # nothing ran

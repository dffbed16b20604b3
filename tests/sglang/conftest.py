"""Fixtures for the SGLang adapter tests.

Tests that need a release run it in a subprocess whose environment
``kvcached_testing.sglang_release`` builds (the release from ``.sglang/<version>``,
the shims, a generated ``kvcached-sglang`` distribution record, the adapter
source). A release that is not installed skips with the command that installs it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from kvcached_testing.sglang_release import (ADAPTER_SRC, ROOT, release_env, release_installed,
                                             tested_releases, write_dist_record)

PROBE = Path(__file__).resolve().parent / "_probe.py"
if str(ADAPTER_SRC) not in sys.path:
    sys.path.insert(0, str(ADAPTER_SRC))  # the adapter's package imports without SGLang

from kvcached_sglang import COVERED_RELEASES  # noqa: E402

#: The releases under test: by default one of each class the adapter's gates tell apart
#: (``KVCACHED_TEST_SGLANG_RELEASES=all``: every covered release).
RELEASES = tested_releases(COVERED_RELEASES)


def skip_unless_installed(version: str) -> None:
    if not release_installed(version):
        pytest.skip(f"SGLang {version} is not installed in .sglang/{version}; "
                    f"run scripts/setup_sglang.sh {version}")


@pytest.fixture(scope="session")
def dist_record(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_dist_record(tmp_path_factory.mktemp("kvcached_sglang_dist"))


def run_engine_process(command: list[str], env: dict[str, str], cwd: Path,
                       timeout: float) -> subprocess.CompletedProcess:
    """Run an engine runner in a session of its own; whatever it started (SGLang's scheduler
    and detokenizer share the session's process group) is killed when it returns."""
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=str(cwd), start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def run_probe(version: str | None, dist_dir: Path, *args: str, timeout: float = 600,
              **extra_env: str) -> dict[str, Any]:
    """Run ``_probe.py`` for ``version``; returns its JSON report (fails with its stderr)."""
    proc = subprocess.run(
        [sys.executable, str(PROBE), *args], env=release_env(version, dist_dir, **extra_env),
        capture_output=True, text=True, timeout=timeout, cwd=str(ROOT),
    )
    out = [ln for ln in proc.stdout.splitlines() if ln.startswith("PROBE-JSON ")]
    if proc.returncode != 0 or not out:
        pytest.fail(f"probe for SGLang {version} failed (rc={proc.returncode}):\n"
                    f"{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return json.loads(out[-1][len("PROBE-JSON "):])


class Prefetched:
    """Reports of independent probe subprocesses, made ahead of the tests that read them.

    Each probe imports a whole SGLang release (10-15 s of one core). The first request for
    one report starts the probes of every key of its family (``keys``, the requested one
    first), as many at a time as this machine has cores (at most four): on two cores a
    family takes about 0.6 of its time one by one. Keys are ``(family, version, ...)``;
    only installed releases that some selected test is parametrized with are probed. A
    probe's failure or skip is raised to the test that reads its report, and only to it.
    """

    def __init__(self, selected_versions: set[str]) -> None:
        workers = max(1, min(4, len(os.sched_getaffinity(0))))
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="sglang-probe")
        self._futures: dict[tuple, Future] = {}
        self._selected = selected_versions

    def get(self, key: tuple, keys: Iterable[tuple],
            make: Callable[[tuple], dict[str, Any]]) -> dict[str, Any]:
        ahead = (k for k in keys if k[1] in self._selected and release_installed(k[1]))
        for k in [key, *ahead]:
            if k not in self._futures:
                self._futures[k] = self._pool.submit(make, k)
        return self._futures[key].result()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


@pytest.fixture(scope="session")
def prefetched(request: pytest.FixtureRequest):
    pool = Prefetched({item.callspec.params["version"] for item in request.session.items
                       if "version" in getattr(getattr(item, "callspec", None), "params", {})})
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def release_report(dist_record: Path, prefetched: Prefetched):
    """``release_report(version)``: the probe's report for a release (one subprocess each)."""

    def make(key: tuple[str, str]) -> dict[str, Any]:
        return run_probe(key[1], dist_record, "release", key[1], KVCACHED_PAGE_SIZE_MB="1",
                         KVCACHED_PREALLOC="0", KVCACHED_IDLE_TRIM_S="0")

    def get(version: str) -> dict[str, Any]:
        skip_unless_installed(version)
        return prefetched.get(("release", version),
                              [("release", v) for v in RELEASES], make)

    return get


@pytest.fixture(scope="session")
def paged_report(dist_record: Path, prefetched: Prefetched):
    """``paged_report(version)``: the paged allocator probe (kernels run by Triton's interpreter)."""

    def make(key: tuple[str, str]) -> dict[str, Any]:
        return run_probe(key[1], dist_record, "paged", key[1], KVCACHED_PAGE_SIZE_MB="1",
                         KVCACHED_PREALLOC="0", KVCACHED_IDLE_TRIM_S="0",
                         # SGLang's paged-allocator kernels are Triton; this CPU has no Triton
                         # backend, Triton's interpreter runs the same kernels on CPU tensors.
                         TRITON_INTERPRET="1")

    def get(version: str) -> dict[str, Any]:
        skip_unless_installed(version)
        return prefetched.get(("paged", version),
                              [("paged", v) for v in RELEASES], make)

    return get

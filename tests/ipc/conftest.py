"""Fixtures of the IPC tests: private temporary directories and real worker processes."""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvcached_core.ipc.paths import socket_path

# The worker entry point must be importable by module name in spawned children,
# however pytest names this directory: put it on sys.path (children inherit it).
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ipc_worker_proc import serve  # noqa: E402

_CTX = mp.get_context("spawn")


@pytest.fixture
def ipc_base(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A fresh 0700 directory as ``KVCACHED_IPC_DIR`` (short, for the socket-path limit)."""
    path = Path(tempfile.mkdtemp(prefix="kvt-", dir="/tmp"))
    monkeypatch.setenv("KVCACHED_IPC_DIR", str(path))
    monkeypatch.delenv("KVCACHED_IPC_NAME", raising=False)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@dataclass
class Workers:
    """Worker processes serving in one namespace."""

    paths: list[str]
    procs: list[Any]

    def shutdown(self) -> None:
        """SIGTERM each worker (it closes its listener), SIGKILL one that lingers."""
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
        for proc in self.procs:
            proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join(5)


def start_workers(base: Path, n: int, options: dict[int, dict[str, Any]] | None = None,
                  name: str = "t") -> Workers:
    """Spawn ``n`` worker processes (rank ``r`` gets ``options[r]``) and wait until they listen."""
    options = options or {}
    paths = [os.fspath(socket_path(name, r, options.get(r, {}).get("pp_stage", 0), base))
             for r in range(n)]
    readies = [_CTX.Event() for _ in range(n)]
    procs = [_CTX.Process(target=serve, args=(paths[r], r, options.get(r, {}), readies[r]),
                          daemon=True) for r in range(n)]
    for proc in procs:
        proc.start()
    workers = Workers(paths, procs)
    for r, ready in enumerate(readies):
        if not ready.wait(60):
            workers.shutdown()
            raise RuntimeError(f"worker {r} did not start (exit code {procs[r].exitcode})")
    return workers


@pytest.fixture
def spawn_workers(ipc_base: Path) -> Iterator[Callable[..., Workers]]:
    """A factory: ``spawn_workers(n, options)`` starts workers, all stopped at teardown."""
    started: list[Workers] = []

    def factory(n: int, options: dict[int, dict[str, Any]] | None = None) -> Workers:
        workers = start_workers(ipc_base, n, options)
        started.append(workers)
        return workers

    yield factory
    for workers in started:
        workers.shutdown()


@pytest.fixture(scope="module")
def two_workers() -> Iterator[Workers]:
    """Two workers shared by a module.

    Rank 1 fails any map or unmap touching page 13; both run out of memory on page 15.
    """
    base = Path(tempfile.mkdtemp(prefix="kvm-", dir="/tmp"))
    workers = start_workers(base, 2, {0: {"oom_page": 15}, 1: {"fail_page": 13, "oom_page": 15}},
                            name="shared")
    yield workers
    workers.shutdown()
    shutil.rmtree(base, ignore_errors=True)

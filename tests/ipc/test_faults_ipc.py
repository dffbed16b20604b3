"""Injected IPC faults between a scheduler's WorkerGroup and a worker's native page server."""

from __future__ import annotations

import os
import time

import pytest

from kvcached_core import _native, faults
from kvcached_core.errors import WorkerError, WorkerOutOfMemoryError
from kvcached_core.ipc import WorkerGroup, WorkerListener
from kvcached_core.vmm import open_mapper

PAGE = 64 * 1024
PAGES = 8


@pytest.fixture
def served(ipc_base):
    faults.configure(None)
    mapper = open_mapper("cpu", PAGE)
    buf = mapper.reserve(PAGES * PAGE)
    server = _native.PageServer(mapper, 0)
    server.add_group(0, [(buf, [0])], PAGES)
    path = os.fspath(ipc_base / "w.sock")
    listener = WorkerListener(path, lambda op, g, p: server.apply(op, g, p), rank=0,
                              server=server, label="native").start()
    try:
        yield buf, path
    finally:
        faults.configure(None)
        listener.close()


def test_a_stalled_worker_is_a_timeout_error_and_the_group_stays_failed(served):
    buf, path = served
    with WorkerGroup([path], timeout=0.5, connect_timeout=5) as group:
        group.map(0, [0])
        faults.configure("ipc:1:stall=1.5")
        t0 = time.monotonic()
        with pytest.raises(WorkerError, match=r"no reply within 0.5 s \(KVCACHED_IPC_TIMEOUT_S\)"):
            group.map(0, [1])
        assert time.monotonic() - t0 < 1.4
        with pytest.raises(WorkerError, match="failed earlier"):
            group.map(0, [2])
        time.sleep(1.2)  # the stalled request still completes in the worker
        group.reset()
        assert group.query(0) == [[0, 1]]


def test_a_dropped_connection_names_the_worker_and_reconnect_works(served):
    buf, path = served
    with WorkerGroup([path], timeout=5, connect_timeout=5) as group:
        faults.configure("ipc:1:fail")
        with pytest.raises(WorkerError, match="closed the connection.*still running") as info:
            group.map(0, [3])
        assert not isinstance(info.value, WorkerOutOfMemoryError) and info.value.rank == 0
        assert not buf.is_mapped(3)
        group.reset()
        group.map(0, [3])
        assert buf.is_mapped(3)


def test_a_map_that_fails_in_the_worker_is_out_of_memory_for_the_scheduler(served):
    buf, path = served
    with WorkerGroup([path], timeout=5, connect_timeout=5) as group:
        faults.configure("map:1:fail")
        with pytest.raises(WorkerOutOfMemoryError, match="injected fault"):
            group.map(0, [4, 5])
        assert group.query(0) == [[]]
        group.map(0, [4, 5])  # the connection stayed usable
        assert group.query(0) == [[4, 5]]


def test_an_injected_call_failure_breaks_the_schedulers_connections(served):
    _, path = served
    with WorkerGroup([path], timeout=5, connect_timeout=5) as group:
        group.ping()
        faults.configure("call:2:fail")
        group.ping()
        with pytest.raises(WorkerError, match="injected fault"):
            group.ping()
        assert group.failed is not None
        group.reset()
        group.ping()

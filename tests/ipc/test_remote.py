"""RemoteKVTensors: a page allocator driving worker memory, with GPU headroom from their readings."""

from __future__ import annotations

import os
import threading
from types import SimpleNamespace

import pytest

from kvcached_core import _native
from kvcached_core.allocator import KVBlockManager, KVLayout, PageAllocator
from kvcached_core.device import Device
from kvcached_core.errors import WorkerOutOfMemoryError
from kvcached_core.ipc import Endpoint, RemoteKVTensors, WorkerListener
from kvcached_core.vmm import open_mapper

PAGE = 64 << 10
PAGES = 32
REGIONS = 2
BUNDLE = PAGE * REGIONS  # one page id in one worker
GIB = 1 << 30


class Worker:
    """A worker in this process: a real host page server, and a device reading we choose."""

    def __init__(self, path: str, rank: int) -> None:
        self.mapper = open_mapper("cpu", PAGE)
        self.vt = self.mapper.reserve(REGIONS * PAGES * PAGE)
        self.server = _native.PageServer(self.mapper, 0)
        self.server.add_group(0, [(self.vt, [0, PAGES])], PAGES)
        self.total = 100 * BUNDLE
        self.used = 0  # bytes "other processes" hold
        self.oom_at: int | None = None

    def handler(self, op, group, pages):
        if op == "meminfo":  # what a GPU worker would read from its driver
            mapped = self.mapper.stats().mapped_pages * PAGE
            return [max(0, self.total - self.used - mapped), self.total, 0]
        if op == "map" and self.oom_at is not None and self.oom_at in pages:
            raise MemoryError(f"out of memory mapping page {self.oom_at}")
        result = self.server.apply(op, group, pages)
        return result if op == "query" else None


@pytest.fixture
def workers(ipc_base):
    made, listeners = [], []
    for rank in range(2):
        path = os.fspath(ipc_base / f"w{rank}.sock")
        w = Worker(path, rank)
        # Python listeners (no native server) so that the handler decides every answer.
        listeners.append(WorkerListener(path, w.handler, rank=rank).start())
        made.append(SimpleNamespace(worker=w, endpoint=Endpoint(rank, path)))
    yield made
    for listener in listeners:
        listener.close()


def _stack(workers, utilization=0.9, **options):
    layout = KVLayout(num_layers=REGIONS, buffer_bytes=PAGES * PAGE, page_size=PAGE, num_buffers=1)
    kv = RemoteKVTensors(layout, [w.endpoint for w in workers], 0,
                         device=Device("cuda", 0, "cuda"), timeout=10, connect_timeout=10)
    pages = PageAllocator(kv, prealloc=False, idle_trim_s=0, min_reserved=0, max_reserved=0,
                          gpu_utilization=utilization, mem_info_ttl_s=0.0, **options)
    return kv, pages


def test_maps_reach_every_worker_and_unmaps_return_the_memory(workers):
    kv, pages = _stack(workers)
    try:
        got = pages.alloc_pages(3)
        for w in workers:
            assert sorted(w.worker.server.apply("query", 0, [])) == got
        pages.free_pages(got)
        assert all(w.worker.mapper.stats().mapped_pages == 0 for w in workers)
        assert kv.mapped_pages == 0
    finally:
        pages.close()
        kv.close()


def test_headroom_from_the_fullest_worker(workers):
    kv, pages = _stack(workers, utilization=0.9)  # keep 10 bundles of 100 free
    try:
        workers[1].worker.used = 80 * BUNDLE  # another process took most of rank 1's device
        assert kv.free_device_pages(0.9) == 10  # 20 free, 10 kept: the smaller reading wins
        assert pages.available_pages() == 10
        got = pages.alloc_pages(10)
        assert got is not None and pages.alloc_pages(1) is None  # a scheduling miss
        blocks = KVBlockManager(pages, PAGE, num_blocks=None, reserve_null_block=False)
        assert blocks.available_size() == 0 and blocks.alloc(1) is None
        workers[1].worker.used = 0  # the other process let go
        assert blocks.alloc(1) is not None
        pages.free_pages(got)
    finally:
        pages.close()
        kv.close()


def test_a_worker_out_of_memory_is_no_space_and_rolled_back_everywhere(workers):
    kv, pages = _stack(workers)
    try:
        workers[1].worker.oom_at = 0
        with pytest.raises(WorkerOutOfMemoryError):
            kv.map_pages([0, 1])
        assert all(w.worker.mapper.stats().mapped_pages == 0 for w in workers)
        assert pages.alloc_pages(2) is None  # the allocator: no space, nothing changed
        assert pages.stats().in_use == 0 and kv.mapped_pages == 0
        workers[1].worker.oom_at = None
        assert pages.alloc_pages(2) == [0, 1]
    finally:
        pages.close()
        kv.close()


def test_each_thread_has_connections_of_its_own(workers):
    kv, pages = _stack(workers)
    try:
        seen = {}

        def other():
            kv.map_pages([5])
            seen["group"] = kv._connections()

        t = threading.Thread(target=other)
        t.start()
        t.join(10)
        assert seen["group"] is not kv._connections() and kv.is_mapped(5)
        kv.unmap_pages([5])
        groups = list(kv._groups)
    finally:
        pages.close()
        kv.close()
    assert len(groups) == 2 and all(g._closed for g in groups)  # close() reaches every thread's


def test_a_worker_in_this_process_is_served_directly(ipc_base):
    w = Worker(os.fspath(ipc_base / "w.sock"), 0)
    calls = []
    path = os.fspath(ipc_base / "w.sock")
    with WorkerListener(path, lambda *a: calls.append(a), rank=0, server=w.server):
        layout = KVLayout(num_layers=REGIONS, buffer_bytes=PAGES * PAGE, page_size=PAGE,
                          num_buffers=1)
        kv = RemoteKVTensors(layout, [Endpoint(0, path)], device=Device("cuda", 0, "cuda"),
                             local_server=w.server)
        pages = PageAllocator(kv, prealloc=False, idle_trim_s=0, min_reserved=0,
                              max_reserved=0, mem_info_ttl_s=0.0)
        try:
            got = pages.alloc_pages(2)
            assert sorted(w.server.apply("query", 0, [])) == got
            assert kv.free_device_pages(0.5) > 0  # the device reading of the host mapper
            pages.free_pages(got)
            assert w.mapper.stats().mapped_pages == 0
            assert w.server.served == 0 and kv._groups[0].connected is False  # no socket used
        finally:
            pages.close()
            kv.close()
    assert calls == []
    with pytest.raises(ValueError, match="exactly one worker"):
        RemoteKVTensors(layout, [Endpoint(0, path), Endpoint(1, path + "1")],
                        local_server=w.server)

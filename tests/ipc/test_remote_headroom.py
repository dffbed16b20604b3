"""GPU headroom through a worker's page server on a real device (``pytest -m gpu``)."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")

from kvcached_core import _native  # noqa: E402
from kvcached_core.allocator import KVLayout, PageAllocator  # noqa: E402
from kvcached_core.device import Device  # noqa: E402
from kvcached_core.ipc import Endpoint, RemoteKVTensors, WorkerListener  # noqa: E402
from kvcached_core.vmm import open_mapper  # noqa: E402

pytestmark = pytest.mark.gpu
PAGE = 2 << 20
REGIONS = 4
PAGES = 64


@pytest.fixture
def worker(tmp_path, monkeypatch):
    tmp_path.chmod(0o700)
    torch.cuda.init()
    mapper = open_mapper("cuda:0", PAGE)
    vts = [mapper.reserve(PAGES * PAGE) for _ in range(REGIONS)]
    server = _native.PageServer(mapper, 0)
    server.add_group(0, [(vt, [0]) for vt in vts], PAGES)
    path = os.fspath(tmp_path / "w.sock")
    listener = WorkerListener(path, lambda op, g, p: server.apply(op, g, p), rank=0,
                              server=server).start()
    yield mapper, Endpoint(0, path)
    listener.close()


def test_mapping_stops_at_the_headroom_the_worker_reports(worker):
    mapper, endpoint = worker
    layout = KVLayout(num_layers=REGIONS, buffer_bytes=PAGES * PAGE, page_size=PAGE, num_buffers=1)
    kv = RemoteKVTensors(layout, [endpoint], device=Device("cuda", 0, "cuda"), timeout=30,
                         connect_timeout=10)
    free, total = mapper.mem_info()
    room = 5  # leave all but five page bundles of the device free
    utilization = 1 - (free - room * layout.page_bytes) / total
    pages = PageAllocator(kv, prealloc=False, idle_trim_s=0, min_reserved=0, max_reserved=0,
                          gpu_utilization=utilization, mem_info_ttl_s=0.0)
    try:
        assert kv.free_device_pages(utilization) in (room, room - 1)  # the driver's own use moves
        got = pages.alloc_pages(kv.free_device_pages(utilization))
        assert got is not None and pages.alloc_pages(1) is None  # a miss, not an error
        assert mapper.stats().mapped_pages == len(got) * REGIONS
        pages.free_pages(got)
        assert pages.alloc_pages(1) is not None
    finally:
        pages.close()
        kv.close()

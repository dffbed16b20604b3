"""The allocator on a real CUDA GPU (run with ``pytest -m gpu`` on a GPU machine)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kvcached_core.allocator import K, V, KVBlockManager, KVLayout, KVTensors, PageAllocator  # noqa: E402

from tests.allocator.conftest import QUIET  # noqa: E402

pytestmark = pytest.mark.gpu
PAGE = 2 << 20
BLOCK = 16 * 8 * 128 * 2  # 16 tokens x 8 heads x 128 dims x fp16: 32 KiB


@pytest.mark.parametrize("contiguous", [False, True], ids=["per-layer", "contiguous"])
def test_blocks_are_cuda_memory_end_to_end(contiguous):
    kv = KVTensors.open("cuda:0", KVLayout(4, 32 * PAGE, PAGE, contiguous=contiguous))
    with PageAllocator(kv, settings=QUIET) as pa:
        bm = KVBlockManager(pa, BLOCK)
        ids = bm.alloc(100)
        assert ids is not None and kv.mapped_pages == bm.num_held_pages == 2
        rows = torch.tensor(ids, device="cuda:0")
        for layer in range(4):
            for kind in (K, V):
                view = kv.block_view(layer, kind, BLOCK, torch.float16)
                assert view.device == torch.device("cuda:0")
                view[rows] = float(layer * 2 + kind + 1)
        torch.cuda.synchronize()
        for layer in range(4):
            for kind in (K, V):
                view = kv.block_view(layer, kind, BLOCK, torch.float16)
                assert torch.all(view[rows] == layer * 2 + kind + 1)
        bm.free(ids)
        bm.trim()
        assert kv.mapped_pages == 1  # the null block's page


def test_device_headroom_is_a_scheduling_miss_not_a_driver_error():
    kv = KVTensors.open("cuda:0", KVLayout(2, 64 * PAGE, PAGE))
    free, total = kv.mapper.mem_info()
    # Leave room for exactly 3.5 pages above the kept-free share of the device.
    util = 1.0 - (free - 3.5 * kv.page_bytes) / total
    pa = PageAllocator(kv, settings=QUIET, gpu_utilization=util, mem_info_ttl_s=3600.0)
    assert pa.available_pages() == 3
    got = pa.alloc_pages(3)
    assert got is not None and pa.alloc_page() is None and pa.alloc_pages(2) is None
    pa.free_pages(got)  # into the reserve: still mapped, reusable
    assert pa.available_pages() == 3 and pa.alloc_pages(3) is not None
    pa.close()


def test_real_device_out_of_memory_rolls_back():
    kv = KVTensors.open("cuda:0", KVLayout(1, 16 * PAGE, PAGE, num_buffers=1))
    # No headroom and a reading that never refreshes: the allocator will
    # believe in memory that someone else takes behind its back.
    pa = PageAllocator(kv, settings=QUIET, gpu_utilization=1.0, mem_info_ttl_s=3600.0)
    assert pa.available_pages() == 16
    hog = []
    for chunk in (1 << 30, PAGE):
        while True:
            try:
                hog.append(torch.empty(chunk, dtype=torch.uint8, device="cuda:0"))
            except torch.cuda.OutOfMemoryError:
                break
    try:
        hog[-3:] = []  # room for about three pages
        torch.cuda.empty_cache()
        assert pa.alloc_pages(10) is None  # the driver's no, rolled back
        st = pa.stats()
        assert (st.in_use, st.free, kv.mapped_pages) == (0, 16, 0)
        assert pa.available_pages() == 0  # it trusts no stale reading after that
    finally:
        hog.clear()
        torch.cuda.empty_cache()
    pa.close()


def test_memory_another_allocation_takes_gets_cached_pages_back():
    """A device short of its headroom (here: plain torch memory, no kvcached pool) gets
    the pool's cached pages back, as many as it is short, within a poll or two."""
    from tests.allocator.test_budget_giveback import FakeCache, wait_until

    kv = KVTensors.open("cuda:0", KVLayout(2, 64 * PAGE, PAGE))
    free, total = kv.mapper.mem_info()
    # Room for 24 page ids above the kept-free share of the device.
    util = 1.0 - (free - 24 * kv.page_bytes) / total
    pa = PageAllocator(kv, settings=QUIET, gpu_utilization=util, cache_idle_s=0.0)
    cache = FakeCache(pa)
    pa.set_evictor(cache.evict)
    used = pa.alloc_pages(2)
    cache.cached = pa.alloc_pages(16)
    assert used is not None and cache.cached is not None
    blob = torch.empty(12 * kv.page_bytes, dtype=torch.uint8, device="cuda:0")  # 6 pages short
    wait_until(lambda: kv.free_device_pages(util) >= 0, timeout=5.0)
    evicted = 16 - len(cache.cached)
    assert 6 <= evicted <= 9  # what the headroom was short of, not the whole cache
    assert all(pa.page_state(p) == "in use" for p in used)
    assert any(g["kind"] == "headroom" for g in pa.givebacks)
    del blob
    pa.close()

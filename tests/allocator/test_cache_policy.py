"""When an engine's prefix-cached pages go back: idle spells and a device short of its headroom.

Cached pages stay mapped otherwise (the engine's own prefix cache); budget asks
and limits are in ``test_budget_giveback.py``.
"""

from __future__ import annotations

import time

from kvcached_core.allocator import KVLayout, KVTensors, PageAllocator

from tests.allocator.conftest import PAGE, QUIET
from tests.allocator.test_budget_giveback import FakeCache, wait_until


def test_cached_pages_stay_until_the_pool_idles_for_cache_idle_s(make_stack):
    a = make_stack(block_bytes=None, cache_idle_s=0.3, idle_trim_s=0.05, max_reserved=2).pages
    cache = FakeCache(a)
    a.set_evictor(cache.evict)
    used = a.alloc_pages(2)
    cache.cached = a.alloc_pages(5)
    start = time.monotonic()
    time.sleep(0.15)  # the reserve's idle trim ran; the cache is untouched
    assert len(cache.cached) == 5 and a.num_in_use == 7
    took = wait_until(lambda: not cache.cached and a.num_mapped == 2, timeout=5.0)
    assert time.monotonic() - start >= 0.3 - 0.01 and took < 2.0
    # Only the cache went; its pages did not stay in the reserve.
    assert a.num_in_use == 2
    assert all(a.page_state(p) == "in use" for p in used)
    # The thread records the giveback once its pages are back: on a busy host, a moment later.
    wait_until(lambda: any(g["kind"] == "idle-cache" for g in a.givebacks), timeout=5.0)
    [trim] = [g for g in a.givebacks if g["kind"] == "idle-cache"]
    assert trim["pages"] == 5
    # Once per idle spell: a later allocation starts a new one.
    cache.cached = a.alloc_pages(1)
    wait_until(lambda: [g["kind"] for g in a.givebacks].count("idle-cache") == 2, timeout=5.0)
    assert not cache.cached


def test_activity_postpones_the_idle_cache_trim_and_zero_never_trims(make_stack):
    a = make_stack(block_bytes=None, cache_idle_s=0.4).pages
    cache = FakeCache(a)
    a.set_evictor(cache.evict)
    cache.cached = a.alloc_pages(3)
    for _ in range(5):  # busy for 0.75 s: allocations and frees keep the cache
        time.sleep(0.15)
        a.free_pages(a.alloc_pages(1))
    assert len(cache.cached) == 3
    b = make_stack(block_bytes=None, cache_idle_s=0.0).pages
    kept = FakeCache(b)
    b.set_evictor(kept.evict)
    kept.cached = b.alloc_pages(3)
    wait_until(lambda: not cache.cached, timeout=5.0)
    assert len(kept.cached) == 3 and kept.calls == []


class _SharedDevice(KVTensors):
    """Real host pages on a device of ``capacity`` pages above its headroom, shared with
    another process (no kvcached pool) that holds ``taken`` of them."""

    capacity = 20
    taken = 0

    def free_device_pages(self, utilization: float) -> int:
        return self.capacity - self.mapped_pages - self.taken


def test_a_device_short_of_its_headroom_gets_the_reserve_then_cached_pages():
    kv = _SharedDevice.open("cpu", KVLayout(2, 16 * PAGE, PAGE, 2))
    pa = PageAllocator(kv, settings=QUIET, max_reserved=3, cache_idle_s=0.0)
    cache = FakeCache(pa)
    pa.set_evictor(cache.evict)
    used = pa.alloc_pages(2)
    cache.cached = pa.alloc_pages(6)
    pa.free_pages(pa.alloc_pages(3))  # 3 reserved
    assert kv.free_device_pages(0.95) == 9
    time.sleep(1.2)  # a poll or two with room to spare: nothing goes
    assert len(cache.cached) == 6 and pa.num_reserved == 3
    kv.taken = 14  # another process takes memory: the device is 5 pages short
    wait_until(lambda: len(cache.cached) <= 4, timeout=3.0)
    assert pa.num_reserved == 0  # the reserve went first, then 2 cached pages
    assert len(cache.cached) == 4 and all(pa.page_state(p) == "in use" for p in used)
    wait_until(lambda: any(g["kind"] == "headroom" for g in pa.givebacks), timeout=5.0)
    kv.taken = 0  # it let go: the rest of the cache stays
    time.sleep(1.2)
    assert len(cache.cached) == 4
    pa.close()

"""The step fence and the GPU reserve policy of the page allocator, on the host backend."""

from __future__ import annotations

import time

import pytest

from kvcached_core.allocator import PageAllocator
from kvcached_core.allocator.fence import StepFence
from kvcached_core.allocator.page_allocator import DEMAND_WINDOW_S, REFILL_BATCH

from tests.allocator.test_page_allocator import mapped, wait_until


def test_fence_counts_steps():
    fence = StepFence()
    assert fence.step_scheduled() == 1 and fence.step_scheduled() == 2
    assert fence.is_safe(0) and not fence.is_safe(1)
    fence.step_completed(1)
    assert fence.is_safe(1) and not fence.is_safe(2) and fence.completed == 1
    fence.step_completed(1)  # a repeat changes nothing
    fence.step_completed()  # no number: the next step
    assert fence.completed == 2 and fence.is_safe(2)
    fence.step_completed()  # never past what was scheduled
    assert fence.completed == 2


def test_freed_pages_stay_mapped_until_their_step_completed(make_stack):
    fence = StepFence()
    s = make_stack(block_bytes=None, fence=fence, max_reserved=1)
    pa = s.pages
    fence.step_scheduled()  # step 1 reads the pages allocated now
    got = pa.alloc_pages(4)
    seq = fence.step_scheduled()  # step 2 is on its way when step 1's requests finish
    fence.step_completed(1)
    pa.free_pages(got)
    # Step 2 may still read them: nothing is unmapped, they wait in the reserve.
    assert pa.wait_idle(5) and mapped(s) == 4 and pa.num_reserved == 4
    again = pa.alloc_pages(1)  # and a new allocation may take one back at once
    assert again[0] in got and mapped(s) == 4
    pa.free_pages(again)
    fence.step_completed(seq)  # step 2 is done: the background unmaps down to the cap
    assert wait_until(lambda: mapped(s) == 1 and pa.num_reserved == 1)
    assert pa.stats().in_use == 0


def test_a_lowered_limit_waits_for_the_fence_too(make_stack):
    fence = StepFence()
    s = make_stack(block_bytes=None, fence=fence, max_reserved=8)
    pa = s.pages
    fence.step_scheduled()
    pa.free_pages(pa.alloc_pages(4))
    pa.set_memory_limit(2 * pa.page_bytes)
    assert pa.wait_idle(5) and mapped(s) == 4  # the running step may read them
    assert pa.alloc_pages(1) is not None  # taken from the reserve: no new memory
    fence.step_completed(1)
    assert wait_until(lambda: mapped(s) == 2)  # the in-use page and one reserved
    assert pa.stats().in_use == 1


def test_idle_trim_does_not_wait_for_the_fence(make_stack):
    fence = StepFence()
    s = make_stack(block_bytes=None, fence=fence, idle_trim_s=0.2, max_reserved=8)
    pa = s.pages
    fence.step_scheduled()
    pa.free_pages(pa.alloc_pages(3))
    # Nothing allocated or freed for idle_trim_s: no step that could read them is pending.
    assert wait_until(lambda: mapped(s) == 0)


def test_without_a_fence_frees_unmap_at_once(make_stack):
    s = make_stack(block_bytes=None, max_reserved=1)
    s.pages.free_pages(s.pages.alloc_pages(4))
    assert mapped(s) == 1


def test_the_reserve_follows_the_allocation_rate(make_stack):
    s = make_stack(block_bytes=None, num_pages=64, prealloc=True, follow_demand=True,
                   min_reserved=1, max_reserved=12)
    pa = s.pages
    pa.alloc_pages(10)  # a busy engine: 10 pages within the window
    assert pa.wait_idle(5)
    # Refilled to the recent demand, in batches, up to max_reserved.
    assert pa.num_reserved == 10 and mapped(s) == 20
    pa.alloc_pages(10)  # the next step finds them mapped
    assert pa.wait_idle(5) and pa.num_reserved == 12  # 20 in the window, capped at 12
    time.sleep(DEMAND_WINDOW_S + 0.05)
    pa.free_pages(pa.alloc_pages(1))  # quiet again: the target falls to min_reserved
    assert pa.wait_idle(5)
    assert pa.stats().reserved <= 12


def test_gpu_backings_follow_demand_by_default(make_stack):
    from kvcached_core.allocator import KVTensors
    from kvcached_core.device import Device

    class DeviceLike(KVTensors):  # host memory that says it is a GPU's, with room to spare
        device = Device("cuda", 0, "cuda:0")

        def free_device_pages(self, utilization: float) -> int:
            return 1000

    s = make_stack(block_bytes=None)
    assert s.pages._follow is False  # host memory: the fixed reserve
    gpu = PageAllocator(DeviceLike(s.kv.mapper, s.kv.layout), prealloc=False, idle_trim_s=0)
    try:
        assert gpu._follow is True and gpu.available_pages() == s.kv.layout.num_pages
    finally:
        gpu.close()


def test_device_readings_leave_the_scheduling_thread(make_stack):
    """A stale reading of free device memory is re-read by the background
    thread: the driver query (milliseconds) never delays an allocation."""
    import threading

    from kvcached_core.allocator import KVTensors
    from kvcached_core.device import Device

    readers: list[threading.Thread] = []
    room = [1000]

    class DeviceLike(KVTensors):
        device = Device("cuda", 0, "cuda:0")

        def free_device_pages(self, utilization: float) -> int:
            readers.append(threading.current_thread())
            return room[0]

    s = make_stack(block_bytes=None)
    gpu = PageAllocator(DeviceLike(s.kv.mapper, s.kv.layout), prealloc=True, idle_trim_s=0,
                        min_reserved=0, max_reserved=0, mem_info_ttl_s=0.0)
    try:
        assert gpu.alloc_pages(1) is not None  # the first reading: on this thread
        assert readers[0] is threading.current_thread()
        first = len(readers)
        room[0] = 3  # another process took the device
        deadline = time.monotonic() + 5
        while gpu.available_pages() > 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert gpu.available_pages() <= 3  # the new reading landed ...
        assert gpu.wait_idle(5)
        assert len(readers) > first  # ... read there, not on this thread
        assert threading.current_thread() not in readers[1:]
        got = gpu.alloc_pages(3)
        assert got is not None and gpu.alloc_pages(1) is None  # a scheduling miss
    finally:
        gpu.close()


def test_an_allocation_waits_for_a_refill_that_covers_it(make_stack):
    s = make_stack(block_bytes=None, num_pages=64, prealloc=True, follow_demand=True,
                   min_reserved=0, max_reserved=32)
    pa = s.pages
    pa.alloc_pages(8)
    assert pa.wait_idle(5)
    created = s.kv.mapper.stats().handles_created
    got = pa.alloc_pages(8)  # all from the reserve
    assert len(got) == 8 and s.kv.mapper.stats().handles_created == created


def test_pages_expected_are_mapped_before_they_are_asked_for(make_stack):
    """An engine's queued requests: their pages are mapped ahead, so the allocation that
    follows takes mapped pages (no driver call on the allocating thread)."""
    s = make_stack(block_bytes=None, num_pages=64, prealloc=True, follow_demand=False,
                   min_reserved=0, max_reserved=12, idle_trim_s=0)
    pa = s.pages
    pa.free_pages(pa.alloc_pages(1))  # the background thread is running, the reserve empty
    pa.trim()
    assert mapped(s) == 0
    pa.expect(10)
    assert wait_until(lambda: pa.num_reserved == 10)
    created = s.kv.mapper.stats().handles_created
    got = pa.alloc_pages(10)
    assert len(got) == 10 and s.kv.mapper.stats().handles_created == created
    pa.expect(40)  # more than the reserve may hold: capped at max_reserved
    assert wait_until(lambda: pa.num_reserved == 12) and pa.wait_idle(5)
    assert pa.num_reserved == 12


def test_an_expectation_lapses_and_goes_with_the_idle_trim(make_stack):
    s = make_stack(block_bytes=None, num_pages=64, prealloc=True, follow_demand=False,
                   min_reserved=0, max_reserved=8, idle_trim_s=0.3, idle_keep=0)
    pa = s.pages
    pa.free_pages(pa.alloc_pages(1))
    assert wait_until(lambda: mapped(s) == 0)  # idle: trimmed
    pa.expect(6)  # a hint after the idle trim still maps ...
    assert wait_until(lambda: pa.num_reserved == 6)
    time.sleep(DEMAND_WINDOW_S + 0.05)
    assert pa._refill_target_locked(time.monotonic()) == 0  # ... lapses ...
    assert wait_until(lambda: mapped(s) == 0)  # ... and, unused, goes with the next idle trim
    pa.expect(0)  # withdrawing nothing is a no-op
    assert pa.num_reserved == 0


def test_an_expectation_stays_within_the_limit_and_without_prealloc_does_nothing(make_stack):
    s = make_stack(block_bytes=None, num_pages=64, prealloc=True, follow_demand=False,
                   min_reserved=0, max_reserved=16, idle_trim_s=0)
    pa = s.pages
    pa.set_memory_limit(5 * pa.page_bytes)
    pa.free_pages(pa.alloc_pages(2))
    pa.expect(16)
    assert pa.wait_idle(5)
    time.sleep(0.1)
    assert mapped(s) == 5  # the limit bounds what is mapped ahead
    off = make_stack(block_bytes=None, num_pages=64, prealloc=False, min_reserved=0,
                     max_reserved=16, idle_trim_s=0)
    off.pages.expect(8)
    time.sleep(0.1)
    assert mapped(off) == 0


def test_the_block_manager_expects_pages_for_blocks_beyond_its_free_ones(make_stack):
    s = make_stack(num_pages=64, prealloc=True, follow_demand=False, min_reserved=0,
                   max_reserved=32, idle_trim_s=0)
    blocks, pa = s.blocks, s.pages
    per_page = len(blocks.blocks_in_page(1))  # blocks a page holds
    blocks.free(blocks.alloc(1))
    pa.trim()
    free = blocks.num_free_blocks_in_pages
    blocks.expect(free)  # what held pages already hold asks for nothing
    time.sleep(0.1)
    assert pa.num_reserved == 0
    blocks.expect(free + 3 * per_page)
    assert wait_until(lambda: pa.num_reserved == 3)


@pytest.mark.parametrize("n", [0, 3])
def test_one_fence_serves_several_allocators_and_holds_none(n):
    import gc

    from kvcached_core.allocator import KVLayout, KVTensors

    from tests.allocator.conftest import PAGE, QUIET

    fence = StepFence()
    allocs = [PageAllocator(KVTensors.open("cpu", KVLayout(1, 8 * PAGE, PAGE)), settings=QUIET,
                            fence=fence, max_reserved=0) for _ in range(2)]
    for _ in range(n):
        fence.step_scheduled()
    for pa in allocs:
        pa.free_pages(pa.alloc_pages(2))
    if n:
        assert all(pa.wait_idle(5) and pa.num_mapped == 2 for pa in allocs)
    fence.step_completed(n)
    assert all(wait_until(lambda pa=pa: pa.num_mapped == 0) for pa in allocs)
    for pa in allocs:
        pa.close()
    del pa, allocs
    gc.collect()
    assert len(fence._waiters) == 0  # a dead allocator is not kept alive by the fence

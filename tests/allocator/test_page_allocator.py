"""PageAllocator semantics on the real host backend."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from dataclasses import replace

import pytest

from kvcached_core.allocator import KVLayout, KVTensors, PageAllocator
from kvcached_core.errors import KVCachedConfigError, KVCachedError, MappingError

from tests.allocator.conftest import QUIET  # noqa: E402


def mapped(stack) -> int:
    """Pages really mapped, asked of the mapper itself."""
    return stack.kv.mapped_pages


def wait_until(predicate, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def test_reserve_first_then_lowest_free(make_stack):
    s = make_stack(block_bytes=None, max_reserved=2)
    pa = s.pages
    assert pa.alloc_pages(3) == [0, 1, 2]
    pa.free_pages([0, 1, 2])
    st = pa.stats()
    assert (st.in_use, st.reserved, st.mapped) == (0, 2, 2) and mapped(s) == 2
    assert pa.page_state(2) == "free" and pa.page_state(1) == "reserved"
    assert pa.alloc_page() == 1  # newest reserved page, no driver call
    assert pa.alloc_pages(2) == [0, 2]
    assert pa.alloc_pages(0) == [] and pa.num_in_use == 3
    with pytest.raises(ValueError):
        pa.alloc_pages(-1)


def test_unmapped_handles_are_kept_spare_up_to_the_reserve_size(make_stack):
    s = make_stack(block_bytes=None, max_reserved=1)
    pa = s.pages
    pa.free_pages(pa.alloc_pages(8))
    assert pa.num_reserved == 1 and mapped(s) == 1
    assert s.kv.mapper.stats().pooled_handles <= 1 * s.kv.handles_per_page
    assert pa.trim() == 1 and mapped(s) == 0
    assert s.kv.mapper.stats().pooled_handles == 0


def test_exhaustion_is_none_and_all_or_nothing(make_stack):
    s = make_stack(block_bytes=None, num_pages=4, max_reserved=4)
    pa = s.pages
    first = pa.alloc_pages(2)
    pa.free_pages(first)
    assert pa.alloc_pages(5) is None
    assert pa.num_reserved == 2 and pa.num_in_use == 0 and mapped(s) == 2
    assert sorted(pa.alloc_pages(4)) == [0, 1, 2, 3]
    assert pa.alloc_page() is None and pa.available_pages() == 0


def test_limit_caps_mapped_pages(make_stack):
    s = make_stack(block_bytes=None, max_reserved=4)
    pa = s.pages
    assert pa.set_memory_limit(3 * pa.page_bytes + pa.page_bytes - 1) == 3  # whole pages
    assert pa.memory_limit == 4 * pa.page_bytes - 1 and pa.limit_pages == 3
    got = pa.alloc_pages(2)
    assert pa.available_pages() == 1 and pa.alloc_pages(2) is None
    assert pa.alloc_page() is not None and pa.alloc_page() is None
    pa.free_pages(got)
    assert pa.num_reserved == 2 and mapped(s) == 3
    pa.set_memory_limit(None)
    assert pa.limit_pages == pa.num_pages and pa.alloc_pages(5) is not None


@pytest.mark.parametrize("bad", [-1, 1.5, "1G", True])
def test_limit_rejects_non_byte_counts(make_stack, bad):
    pa = make_stack(block_bytes=None).pages
    with pytest.raises(KVCachedConfigError, match="not a byte count"):
        pa.set_memory_limit(bad)


def test_strict_limit_below_usage_names_the_value(make_stack):
    s = make_stack(block_bytes=None)
    pa = s.pages
    pa.alloc_pages(5)
    limit = 2 * pa.page_bytes
    pattern = rf"memory limit {limit} bytes \(2 pages.*5 pages\) in use"
    with pytest.raises(KVCachedConfigError, match=pattern):
        pa.set_memory_limit(limit, strict=True)
    assert pa.limit_pages == pa.num_pages  # unchanged
    assert pa.set_memory_limit(5 * pa.page_bytes, strict=True) == 5


def test_limit_below_usage_is_a_deferred_shrink(make_stack):
    s = make_stack(block_bytes=None, max_reserved=4)
    pa = s.pages
    pages = pa.alloc_pages(6)
    pa.free_pages(pa.alloc_pages(2))  # two reserved
    assert mapped(s) == 8
    pa.set_memory_limit(3 * pa.page_bytes)
    # The reserve goes at once, the pages in use stay, nothing new is mapped.
    assert pa.num_reserved == 0 and mapped(s) == 6 and pa.shrink_pending
    assert s.kv.mapper.stats().pooled_handles == 0
    assert pa.alloc_page() is None and pa.available_pages() == 0
    pa.free_pages(pages[:2])  # still over: unmapped, not reserved
    assert mapped(s) == 4 and pa.num_reserved == 0 and pa.shrink_pending
    pa.free_pages(pages[2:4])  # 2 in use: one page back under the limit may stay reserved
    assert mapped(s) == 3 and pa.num_reserved == 1 and not pa.shrink_pending
    assert pa.alloc_pages(2) is None and pa.alloc_page() is not None
    pa.set_memory_limit(None)
    assert pa.alloc_pages(4) is not None


def test_memory_limit_comes_from_settings(make_stack):
    s = make_stack(block_bytes=None, settings=replace(QUIET, memory_limit=3 << 20))
    assert s.pages.memory_limit == 3 << 20
    assert s.pages.limit_pages == (3 << 20) // s.pages.page_bytes
    assert make_stack(block_bytes=None, memory_limit=None).pages.memory_limit is None


def test_bad_frees_raise_and_change_nothing(make_stack):
    pa = make_stack(block_bytes=None).pages
    got = pa.alloc_pages(2)
    with pytest.raises(MappingError, match="page 5: it is free"):
        pa.free_pages([got[0], 5])
    with pytest.raises(MappingError, match="given twice"):
        pa.free_pages([got[1], got[1]])
    with pytest.raises(MappingError, match="outside 0..15"):
        pa.free_page(16)
    assert pa.num_in_use == 2
    pa.free_pages(got)
    with pytest.raises(MappingError, match="not in use"):
        pa.free_page(got[0])


def test_claim_page(make_stack):
    s = make_stack(block_bytes=None, max_reserved=2)
    pa = s.pages
    assert pa.claim_page(7) and pa.page_state(7) == "in use"
    with pytest.raises(MappingError, match="page 7 is in use"):
        pa.claim_page(7)
    pa.free_page(7)
    assert pa.claim_page(7) and pa.num_reserved == 0  # taken back from the reserve
    pa.set_memory_limit(pa.page_bytes)
    assert not pa.claim_page(3)


def test_settings_are_validated(make_stack):
    with pytest.raises(KVCachedConfigError, match="min_reserved=3, max_reserved=2"):
        make_stack(block_bytes=None, min_reserved=3, max_reserved=2)
    kv = KVTensors.open("cpu", KVLayout(1, 4 << 16, 1 << 16))
    with pytest.raises(KVCachedConfigError, match="num_pages=5 must be in 1..4"):
        PageAllocator(kv, 5, settings=QUIET)
    with pytest.raises(KVCachedConfigError, match="gpu_utilization=0"):
        PageAllocator(kv, settings=QUIET, gpu_utilization=0)


def test_background_prealloc_refills_the_reserve(make_stack):
    s = make_stack(block_bytes=None, prealloc=True, min_reserved=3, max_reserved=4)
    pa = s.pages
    assert pa._thread is None  # nothing runs before the first allocation
    pa.alloc_page()
    assert pa.wait_idle(5)
    assert pa.num_reserved == 3 and mapped(s) == 4
    assert pa._thread.daemon and pa._thread.name == "kvcached-pages-host0"
    got = pa.alloc_pages(3)  # from the reserve; refilled behind our back
    assert pa.wait_idle(5) and pa.num_reserved == 3 and mapped(s) == 7
    pa.set_memory_limit(5 * pa.page_bytes)  # the refill respects the limit
    pa.alloc_page()
    assert pa.wait_idle(5) and mapped(s) <= 5
    thread = pa._thread
    pa.close()
    assert not thread.is_alive() and pa.num_reserved == 0
    with pytest.raises(KVCachedError, match="closed"):
        pa.alloc_page()
    pa.free_pages(got)  # freeing after close unmaps at once
    assert pa.num_reserved == 0


def test_idle_trim_releases_reserve_and_pool(make_stack):
    s = make_stack(block_bytes=None, idle_trim_s=0.2, max_reserved=4)
    pa = s.pages
    pa.free_pages(pa.alloc_pages(3))
    assert pa.num_reserved == 3
    assert wait_until(lambda: mapped(s) == 0 and s.kv.mapper.stats().pooled_handles == 0)
    assert pa.num_reserved == 0
    pa.free_pages(pa.alloc_pages(2))  # activity starts a new idle spell
    assert pa.num_reserved == 2
    assert wait_until(lambda: mapped(s) == 0)


def test_idle_trim_keeps_idle_keep_pages_mapped(make_stack):
    s = make_stack(block_bytes=None, idle_trim_s=0.2, max_reserved=4, idle_keep=1)
    pa = s.pages
    pa.free_pages(pa.alloc_pages(3))
    assert wait_until(lambda: mapped(s) == 1 and s.kv.mapper.stats().pooled_handles == 0)
    (kept,) = pa._reserved
    assert pa.page_state(kept) == "reserved"
    created = s.kv.mapper.stats().handles_created
    assert pa.alloc_pages(1) == [kept]  # the next burst starts without a map
    assert mapped(s) == 1 and s.kv.mapper.stats().handles_created == created
    with pytest.raises(KVCachedConfigError, match="idle_keep=-1"):
        make_stack(block_bytes=None, idle_keep=-1)


def test_thread_ends_with_the_allocator(make_stack):
    kv = KVTensors.open("cpu", KVLayout(1, 4 << 16, 1 << 16))
    pa = PageAllocator(kv, settings=replace(QUIET, prealloc=True, min_reserved_pages=1))
    pa.alloc_page()
    thread = pa._thread
    assert pa.wait_idle(5)
    del pa
    gc.collect()
    thread.join(5)
    assert not thread.is_alive()


def test_forked_child_refuses_the_parents_allocator(make_stack):
    pa = make_stack(block_bytes=None, prealloc=True, min_reserved=2).pages
    pa.alloc_page()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # the child: must fail fast, never hang on the parent's lock
        code = 1
        try:
            pa.alloc_page()
        except KVCachedError as exc:
            code = 0 if "fork" in str(exc) else 2
        pa.close()  # returns without joining a thread that is not here
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    assert pa.alloc_page() is not None  # the parent is unaffected


def test_concurrent_alloc_and_free_never_share_a_page(make_stack):
    s = make_stack(block_bytes=None, num_pages=64, prealloc=True, min_reserved=2, max_reserved=3)
    pa = s.pages
    pa.set_memory_limit(40 * pa.page_bytes)
    held: list[set[int]] = [set() for _ in range(4)]
    errors: list[BaseException] = []

    def worker(mine: set[int], seed: int) -> None:
        try:
            for i in range(300):
                if (i * 7 + seed) % 3 and len(mine) < 12:
                    got = pa.alloc_pages(1 + (i + seed) % 3)
                    if got:
                        mine.update(got)
                elif mine:
                    pa.free_pages([mine.pop() for _ in range(min(len(mine), 2))])
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(held[i], i)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    everything = [p for mine in held for p in mine]
    assert len(everything) == len(set(everything)) == pa.num_in_use
    assert pa.wait_idle(5) and mapped(s) == pa.num_mapped <= 40
    for mine in held:
        pa.free_pages(mine)
    pa.close()
    assert mapped(s) == 0


OOM_SCRIPT = textwrap.dedent(
    """
    import resource, signal
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    from kvcached_core.allocator import KVBlockManager, KVLayout, KVTensors, PageAllocator
    page = 64 << 10
    kv = KVTensors.open("cpu", KVLayout(2, 16 * page, page))
    pa = PageAllocator(kv, prealloc=False, idle_trim_s=0, min_reserved=0, max_reserved=2,
                       memory_limit=None)
    bm = KVBlockManager(pa, 16 << 10)
    # The host backend commits a page file; cap it at 3 page ids (4 handles each).
    resource.setrlimit(resource.RLIMIT_FSIZE, (3 * 4 * page, resource.RLIM_INFINITY))
    a = bm.alloc(8)                      # page 0 has 3 free blocks; pages 1 and 2 map
    assert a is not None and pa.num_in_use == 3, a
    before = (bm.allocated_ids(), pa.stats(), kv.mapper.stats().mapped_pages)
    assert bm.alloc(9) is None           # needs 3 more pages: out of memory
    assert pa.alloc_pages(1) is None     # straight from the page allocator too
    after = (bm.allocated_ids(), pa.stats(), kv.mapper.stats().mapped_pages)
    assert before == after, (before, after)
    assert after[2] == 12 and pa.stats().free == 13
    bm.free(a)                           # pages go to the reserve (handles stay)
    assert bm.alloc(11) is not None      # the same memory serves again
    print("ok")
    """
)


def test_real_out_of_memory_is_no_space_and_rolls_back():
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    proc = subprocess.run(
        [sys.executable, "-B", "-c", OOM_SCRIPT],
        capture_output=True, text=True, env=env, timeout=60,
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr

"""PageAllocator with a device budget: claims, giveback in cost order, live limits."""

from __future__ import annotations

import time

import pytest

from kvcached_core.cli.kvctl import main as kvctl
from kvcached_core.ipc import budget as bud
from kvcached_core.ipc import shm

from tests.allocator.conftest import PAGE  # noqa: E402

PAGE_BYTES = PAGE * 2 * 2  # 2 layers x 2 buffers


def wait_until(predicate, timeout: float = 5.0) -> float:
    """Seconds until ``predicate()`` held (fails the test after ``timeout``)."""
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout, "timed out"
        time.sleep(0.002)
    return time.monotonic() - start


class FakeCache:
    """An engine's prefix cache: whole pages nobody uses that the evictor may free."""

    def __init__(self, pages):
        self.pa = pages
        self.cached: list[int] = []
        self.calls: list[tuple[int, int]] = []  # (pages asked, reserved pages at the call)

    def evict(self, n: int) -> int:
        self.calls.append((n, self.pa.num_reserved))
        victims, self.cached = self.cached[:n], self.cached[n:]
        if victims:
            self.pa.free_pages(victims)
        return len(victims)


@pytest.fixture
def record(shm_base):
    rec = bud.BudgetRecord.open("host", shm_base)
    yield rec
    rec.close()


def test_a_miss_for_budget_is_a_miss_and_nothing_leaks(make_stack, record):
    record.set_capacity(3 * PAGE_BYTES)
    a = make_stack(block_bytes=None, budget=record.join("a/kv0")).pages
    assert a.alloc_pages(3) is not None
    assert a.alloc_pages(1) is None  # the budget, not the pool, is full
    st = a.stats()
    assert (st.in_use, st.mapped) == (3, 3) and a.budget.mapped == 3 * PAGE_BYTES
    a.free_pages(a.alloc_pages(0) or [])
    record.set_capacity(bud.NO_BUDGET)
    assert a.alloc_pages(2) is not None and a.budget.mapped == 5 * PAGE_BYTES


def test_giveback_goes_reserve_first_then_cached_pages_never_used_ones(make_stack, record):
    record.set_capacity(10 * PAGE_BYTES)
    a = make_stack(block_bytes=None, max_reserved=4, budget=record.join("a/kv0")).pages
    b = make_stack(block_bytes=None, budget=record.join("b/kv0"), budget_wait_s=0).pages
    cache = FakeCache(a)
    a.set_evictor(cache.evict)
    used = a.alloc_pages(2)
    cache.cached = a.alloc_pages(2)
    a.free_pages(a.alloc_pages(4))  # four reserved pages: A maps 8 of 10
    assert a.stats().mapped == 8 and a.num_reserved == 4

    def gave(n):  # A answered n asks (after unmapping and releasing its pages)
        return {s.name: s for s in record.read().slots}["a/kv0"].givebacks == n

    assert b.alloc_pages(3) is None  # room 2: a miss that asks A (for twice as much)
    wait_until(lambda: gave(1))
    assert a.num_reserved == 0
    assert cache.calls == []  # the reserve was enough: the cache is untouched
    assert b.alloc_pages(3) is not None  # B's retry (its next step)

    assert b.alloc_pages(4) is None  # room 3: A has nothing reserved, so the cache goes
    wait_until(lambda: gave(2))
    assert not cache.cached
    assert cache.calls[0] == (5, 0)  # 2 x 4 pages wanted, 3 there: 5 more, reserve empty
    assert b.alloc_pages(4) is not None
    assert a.num_in_use == len(used)  # used pages stayed
    assert all(a.page_state(p) == "in use" for p in used)
    reading = record.read()
    assert reading.mapped <= reading.capacity
    mine = {s.name: s for s in reading.slots}
    assert mine["a/kv0"].given_bytes == 6 * PAGE_BYTES
    assert mine["b/kv0"].misses == 2
    assert mine["a/kv0"].max_giveback_ns < 200e6


def test_a_miss_waits_for_an_idle_pools_giveback_within_200ms(make_stack, record):
    record.set_capacity(12 * PAGE_BYTES)
    a = make_stack(block_bytes=None, budget=record.join("a/kv0")).pages
    b = make_stack(block_bytes=None, budget=record.join("b/kv0")).pages
    cache = FakeCache(a)
    a.set_evictor(cache.evict)
    cache.cached = a.alloc_pages(10)
    time.sleep(0.1)  # A idles
    start = time.monotonic()
    assert b.alloc_pages(8) is not None  # waited for A instead of missing
    assert time.monotonic() - start < 0.2
    assert len(cache.cached) <= 4 and record.read().mapped <= 12 * PAGE_BYTES
    assert b.alloc_pages(8) is None  # A has nothing left to give: a miss, no long wait
    assert time.monotonic() - start < 0.4


def test_live_limit_reaches_an_idle_pool_and_raising_restores_growth(
        make_stack, shm_base, capsys):
    a = make_stack(block_bytes=None, max_reserved=4).pages
    seg = shm.PoolSegment.create("eng", "kv0", capacity=16 * PAGE_BYTES)
    seg.set_device_total(64 * PAGE_BYTES)
    cache = FakeCache(a)
    a.set_evictor(cache.evict)
    a.watch_limit(seg)
    used = a.alloc_pages(3)
    cache.cached = a.alloc_pages(5)
    a.free_pages(a.alloc_pages(3))  # 3 reserved: 11 mapped
    time.sleep(0.1)  # idle
    assert kvctl(["limit", "eng", "kv0", str(2 * PAGE_BYTES)]) == 0  # below the 3 in use
    took = wait_until(lambda: a.num_mapped == 3 and not cache.cached, timeout=1.0)
    assert took < 0.2
    # Every cached page and the reserve went at once; no used page did.
    assert a.num_mapped == 3 and a.num_in_use == 3 and a.shrink_pending
    assert all(a.page_state(p) == "in use" for p in used)
    assert a.alloc_pages(1) is None  # over the limit: a miss
    a.free_pages(used[:1])
    assert a.num_mapped == 2 and not a.shrink_pending  # shrinks as pages are freed
    assert kvctl(["limit", "eng", "kv0", "25%"]) == 0  # 16 pages of the 64-page device
    wait_until(lambda: a.limit_pages == 16, timeout=1.0)
    assert a.alloc_pages(10) is not None
    assert kvctl(["limit", "eng", "kv0", "none"]) == 0
    wait_until(lambda: a.memory_limit is None, timeout=1.0)
    assert a.alloc_pages(2) is not None
    capsys.readouterr()
    seg.close()


def test_lifting_a_live_limit_returns_to_the_configured_one(make_stack, shm_base, capsys):
    a = make_stack(block_bytes=None, max_reserved=0, memory_limit=6 * PAGE_BYTES).pages
    seg = shm.PoolSegment.create("eng", "kv0", capacity=16 * PAGE_BYTES)
    a.watch_limit(seg)
    assert kvctl(["limit", "eng", "kv0", str(2 * PAGE_BYTES)]) == 0
    wait_until(lambda: a.limit_pages == 2, timeout=1.0)
    assert kvctl(["limit", "eng", "kv0", "none"]) == 0
    wait_until(lambda: a.limit_pages == 6, timeout=1.0)  # KVCACHED_MEMORY_LIMIT's 6 pages
    assert a.memory_limit == 6 * PAGE_BYTES
    assert a.alloc_pages(6) is not None and a.alloc_pages(1) is None
    capsys.readouterr()
    seg.close()


@pytest.mark.parametrize("args, message", [
    (["limit", "eng", "kv0", "12XB"], "is not a size"),
    (["limit", "eng", "kv0", "--", "-5%"], "within 0..100%"),
    (["limit", "eng", "kv0", "101%"], "within 0..100%"),
    (["limit", "eng", "kv0", "--", "-1G"], "negative"),
    (["limit", "nope", "kv0", "1G"], "no pool kv0 in namespace nope"),
    (["limit", "eng", "kv9", "1G"], "no pool kv9 in namespace eng"),
    (["limit", "eng", "kv0", "50%"], "device's size is unknown"),
    (["budget", "--device", "host", "12XB"], "is not a size"),
    (["budget", "--device", "host", "150%"], "within 0..100%"),
])
def test_kvctl_bad_input_is_a_clear_message(shm_base, capsys, args, message):
    seg = shm.PoolSegment.create("eng", "kv0", capacity=1 << 20)
    assert kvctl(args) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert seg.limit == shm.NO_LIMIT
    seg.close()


def test_kvctl_budget_sets_and_shows(shm_base, capsys, record):
    slot = record.join("eng/kv0")
    assert slot.claim(3 << 20)
    assert kvctl(["budget", "--device", "host", "8M"]) == 0
    assert record.capacity == 8 << 20
    assert kvctl(["budget", "--json"]) == 0
    out = capsys.readouterr().out
    assert '"capacity": 8388608' in out and '"eng/kv0"' in out
    assert kvctl(["budget", "--device", "host", "none"]) == 0
    assert record.capacity == bud.NO_BUDGET

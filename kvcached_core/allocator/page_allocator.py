"""Page allocator: which page ids of one KV group are backed, and by whom.

Every page id is in exactly one state:

=============  ===============================================================
free           not mapped
reserved       mapped, not handed out: the next :meth:`PageAllocator.alloc_pages`
               takes it without a driver call
in use         handed out (to the block manager)
in flight      being mapped or unmapped by some thread, outside the lock
broken         an unmap failed and left it (partly) mapped: never reused,
               still counted as mapped so the limit stays honest
=============  ===============================================================

*Mapped* pages are all but the free ones; the memory limit bounds them.

Reserve policy
--------------
``alloc_pages`` takes reserved pages first (newest first), then maps free
pages (lowest id first) in one all-or-nothing batch. ``free_pages`` keeps
freed pages in the reserve up to ``max_reserved`` and unmaps the rest. With
``prealloc`` on, a background thread refills the reserve to ``min_reserved``
after allocations drain it, in batches of at most :data:`REFILL_BATCH` pages.
With ``follow_demand`` (the default on GPUs, whose engines take pages far
faster than one batch) the refill target is the number of pages allocated in
the last :data:`DEMAND_WINDOW_S` seconds (between ``min_reserved`` and
``max_reserved``), so the pages a busy engine will take next are mapped while
its current step runs; an allocation that a refill in flight will cover waits
for it instead of mapping the same amount again. An engine that knows what its
queued requests will take tells :meth:`PageAllocator.expect`: the refill target
is then at least those pages (within ``max_reserved``, for
:data:`DEMAND_WINDOW_S` or until the next hint), so a burst's next steps find
their pages mapped before they ask, not only once the allocation rate shows it.
Unmapped handles stay with the
mapper as *spare handles* for the next map, and the allocator trims them to
``max_reserved`` pages' worth after each unmap, so the physical footprint is at
most in-use + 2 x ``max_reserved`` pages. After ``idle_trim_s`` seconds without
a page allocation or free the thread unmaps the reserve down to ``idle_keep``
pages and releases every spare handle (once per idle spell): the first allocation of the next
burst then takes a kept page instead of waiting for a map.

Step fence
----------
With a :class:`~kvcached_core.allocator.fence.StepFence` an engine that
schedules ahead tells the allocator when device work that may read a freed
page has finished. A freed page then stays mapped (in the reserve, where an
allocation may take it again) until the fence passes the step during which it
was freed, and the background thread unmaps the reserve's excess (beyond
``max_reserved``, or beyond the memory limit) once the fence allows, off the
engine's scheduling path. The idle trim needs no fence: after ``idle_trim_s``
without an allocation or free no step that could read those pages is pending.
Without a fence, ``free_pages`` unmaps the excess at once.

Memory limit
------------
``set_memory_limit(bytes)`` caps mapped pages at ``bytes // page_bytes``.
A limit below what is in use is, by default, a *deferred shrink*: the reserve
and the spare handles are released at once, no page is mapped while at or over the
limit, and pages freed later are unmapped until the pool is under it. At all
times (between calls) ``mapped <= max(limit, in_use)``, and once the pool is
under the limit it stays there. With ``strict=True`` such a limit raises
:class:`~kvcached_core.errors.KVCachedConfigError` naming the value instead.

Out of memory
-------------
Running out of device memory is a scheduling miss: ``alloc_pages`` returns
``None`` with every page back where it was (a ``MemoryError`` from the backing,
such as :class:`~kvcached_core.errors.DeviceOutOfMemoryError` or a worker's
:class:`~kvcached_core.errors.WorkerOutOfMemoryError`). The pages the device
can still back are read through the backing's ``free_device_pages``, keeping
``1 - gpu_utilization`` of the device free; spare handles count as
available. On the host backend the device is the memory this process may
still commit: ``MemAvailable`` and the limits of its memory cgroups (v2
``memory.max - memory.current``), so a CPU engine in a memory-limited
container misses a schedule instead of being OOM-killed. Such a reading is a
driver or system query (a millisecond or more on a GPU, a round trip to each
worker for remote backings), so it never runs on the caller's thread once the
background thread exists: a caller that finds the reading older than
``mem_info_ttl_s`` uses it and asks the thread for a new one. Until it lands,
the allocator's own maps and unmaps since the reading are accounted for; what
other processes took shows at the next reading (a map that then fails is a
scheduling miss, as below).

Device budget, giveback, live limits
------------------------------------
With a ``budget`` (a :class:`~kvcached_core.ipc.budget.BudgetSlot`: this pool's
share of a budget every pool on the device draws from) fresh pages are claimed
in the budget before they are mapped and released after they are unmapped; a
claim the budget refuses asks the other pools for memory and, while they hold
enough, waits up to :data:`BUDGET_WAIT_S` for them to give it; then it is a
scheduling miss, like out of memory (after a wait that got nothing, misses
return at once for :data:`~kvcached_core.ipc.budget.FRUITLESS_WAIT_PAUSE_S`).
Every allocator with a budget watches for such asks from its background thread
(every :data:`CONTROL_POLL_S` seconds, a memory read) and gives back, cheapest
first, until the budget has room for what was asked: its reserve and the
backing's spare handles, then whole pages of evictable prefix cache through the
*evictor* the engine adapter registers (:meth:`PageAllocator.set_evictor`; it
runs on the background thread, so it must take whatever lock guards the engine's
block pool). A page in use is never given back. With a *limit source*
(:meth:`PageAllocator.watch_limit`, e.g. the pool's shared-memory segment that
``kvctl limit`` writes) the same poll applies a new limit at once, also on an
idle engine: the reserve goes, evictable pages are evicted down to the limit,
pages in use shrink as they are freed.

Prefix cache
------------
Pages an engine keeps for its prefix cache (blocks nobody uses that hold a
cached prefix) are *in use* here, as in the engine without kvcached: its
prefix-cache hits are its own while memory is not contended. The engine
adapter registers an *evictor* (:meth:`PageAllocator.set_evictor`) that frees
whole pages of such blocks, least recently used first; the background thread
calls it when there is a reason for memory to go back:

* the pool has been idle (no page allocated or freed) for ``cache_idle_s``
  (``KVCACHED_CACHE_IDLE_S``): every such page goes, after the reserve's
  own idle trim;
* another pool or the device budget asks, or a limit is set (below);
* the device's free memory falls below the headroom ``gpu_utilization``
  keeps (read every :data:`HEADROOM_POLL_S` seconds while the pool holds
  pages), so a process that is no kvcached pool, such as a training job,
  gets memory back too: the reserve and spare handles go first, then as many
  cached pages as the headroom is short of.

The backing
-----------
The allocator drives its ``kv_tensors`` through one small interface:
``num_pages``, ``page_bytes``, ``handles_per_page``, ``device``,
``map_pages``, ``unmap_pages``, ``is_mapped``, ``trim_spare_handles`` and
``free_device_pages`` (negative: pages the device is short of its headroom).
:class:`~kvcached_core.allocator.KVTensors` implements
it over local memory, :class:`~kvcached_core.ipc.remote.RemoteKVTensors` over
the memory of worker processes.

Threads and fork
----------------
All state sits behind one lock; driver work (map, unmap, spare-handle trim) runs
outside it, on pages marked in flight. The background thread (daemon; the
*refiller*, ``kvcached-pages-<device>``) starts on the first allocation, only
when ``prealloc`` or idle trim is on, never at import or construction.
:meth:`PageAllocator.close` stops and joins it; it also ends by itself once
the allocator is garbage-collected. After ``fork()``
the child has no thread and must not use the parent's allocator (GPU
mappings do not survive fork either): every call there raises
:class:`~kvcached_core.errors.ForkedProcessError` before touching the lock, which
the parent's thread may have held at the fork. Create a new one in the child.
"""

from __future__ import annotations

import heapq
import logging
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from kvcached_core.allocator.fence import StepFence
from kvcached_core.allocator.kv_tensors import KVTensors
from kvcached_core.config import Settings, check_range, load_settings
from kvcached_core.errors import (
    ForkedProcessError,
    KVCachedConfigError,
    KVCachedError,
    MappingError,
)
from kvcached_core.sentinel import UNSET as _UNSET

__all__ = ["BUDGET_WAIT_S", "CONTROL_POLL_S", "DEMAND_WINDOW_S", "GIVEBACK_FACTOR",
           "HEADROOM_POLL_S", "REFILL_BATCH", "PageAllocator", "PageStats"]

#: Pages one background refill maps in one backing call (the reserve grows in
#: such batches, so an allocation that needs a fresh map waits for at most one).
REFILL_BATCH = 4
#: With ``follow_demand``, the refill target is the pages allocated this long back.
DEMAND_WINDOW_S = 0.2
#: How often the background thread looks at the budget's asks and the limit source.
CONTROL_POLL_S = 0.025
#: How long an allocation that missed for budget waits for other pools to give back
#: (only while they hold enough): a running request's next block then arrives a
#: little late instead of the engine preempting it.
BUDGET_WAIT_S = 0.1
#: How often the background thread reads the device's free memory while the pool holds
#: pages, to give cached pages back when the headroom is short (see the module docs).
HEADROOM_POLL_S = 1.0
#: A giveback makes room for this many times what was asked (the asking pool's
#: next steps want about as much again).
GIVEBACK_FACTOR = 2

_log = logging.getLogger(__name__)

_FREE, _RESERVED, _IN_USE, _MAPPING, _UNMAPPING, _BROKEN = range(6)
_STATE_NAMES = ("free", "reserved", "in use", "being mapped", "being unmapped", "broken")

_WAIT, _STOP, _REFILL, _TRIM, _RETIRE, _READ, _CONTROL, _CACHE_TRIM, _HEADROOM = range(9)


@dataclass(frozen=True)
class PageStats:
    """A consistent snapshot of a :class:`PageAllocator`'s page counts."""

    num_pages: int
    in_use: int
    reserved: int
    free: int
    in_flight: int
    broken: int
    limit_pages: int
    page_bytes: int

    @property
    def mapped(self) -> int:
        """Pages backed by physical memory (everything but free)."""
        return self.num_pages - self.free

    @property
    def mapped_bytes(self) -> int:
        return self.mapped * self.page_bytes


def _sooner(a: float | None, b: float) -> float:
    return b if a is None else min(a, b)


def _wake(cond: threading.Condition) -> None:
    """Finalizer: let a waiting refiller notice that its allocator is gone."""
    with cond:
        cond.notify_all()


def _refiller_loop(ref: weakref.ref[PageAllocator], cond: threading.Condition) -> None:
    """Background refill and idle trim; holds the allocator only while acting."""
    while True:
        with cond:
            alloc = ref()
            if alloc is None:
                return
            action, timeout = alloc._decide_locked(time.monotonic())
            if action == _WAIT:
                del alloc
                if ref() is None:
                    return
                cond.wait(timeout)
                continue
        if action == _STOP:
            return
        try:
            if action == _REFILL:
                alloc._refill()
            elif action == _RETIRE:
                alloc._retire()
            elif action == _READ:
                alloc._read_phys()
            elif action == _CONTROL:
                alloc._control()
            elif action == _CACHE_TRIM:
                alloc._trim_cache()
            elif action == _HEADROOM:
                alloc._keep_headroom()
            else:
                alloc.trim(alloc._idle_keep)
        except Exception:  # keep the thread alive; the next activity retries
            _log.exception("kvcached page allocator background work failed")
        finally:
            alloc._work_done()
        del alloc


class PageAllocator:
    """Hands out page ids of one KV group and keeps them mapped while in use.

    Args:
        kv_tensors: The group's buffers; their mapper does the driver work.
        num_pages: Page ids to manage, ``0 .. num_pages-1`` (default: all).
        settings: Defaults for the options below (default: :func:`load_settings`).
        prealloc: Refill the reserve in a background thread.
        min_reserved: Refill the reserve to this many pages.
        max_reserved: Keep at most this many mapped-but-unused pages.
        idle_trim_s: Release the reserve after this long idle (0: never).
        idle_keep: Reserved pages the idle trim leaves mapped (at most ``max_reserved``).
        cache_idle_s: Evict the prefix cache's pages after this long idle (0: never;
            needs an evictor, see :meth:`set_evictor`).
        memory_limit: Cap on mapped bytes (``None``: no cap).
        gpu_utilization: Leave ``1 - x`` of device memory free (on the host: of
            the memory this process may commit).
        sync_on_unmap: Wait for queued device work before unmapping.
        mem_info_ttl_s: How long a device free-memory reading stays valid.
        fence: Keep freed pages mapped until the engine's device work that may
            read them has finished (see the module docs).
        follow_demand: Refill the reserve to the recent allocation rate
            (default: on GPU backings).
        budget: This pool's slot in the device's shared budget (see the
            module docs), or ``None``.
        budget_wait_s: How long an allocation the budget refuses waits for
            other pools to give back (default :data:`BUDGET_WAIT_S`; 0: a miss at once).

    Raises:
        KVCachedConfigError: A setting is out of range.
    """

    def __init__(
        self,
        kv_tensors: KVTensors,
        num_pages: int | None = None,
        *,
        settings: Settings | None = None,
        prealloc: bool | None = None,
        min_reserved: int | None = None,
        max_reserved: int | None = None,
        idle_trim_s: float | None = None,
        idle_keep: int | None = None,
        cache_idle_s: float | None = None,
        memory_limit: int | None = _UNSET,
        gpu_utilization: float | None = None,
        sync_on_unmap: bool = True,
        mem_info_ttl_s: float = 0.1,
        fence: StepFence | None = None,
        follow_demand: bool | None = None,
        budget: Any = None,
        budget_wait_s: float | None = None,
    ) -> None:
        s = settings if settings is not None else load_settings()
        total = kv_tensors.num_pages
        n = total if num_pages is None else num_pages
        if not 1 <= n <= total:
            raise KVCachedConfigError(f"num_pages={num_pages} must be in 1..{total}")
        lo = s.min_reserved_pages if min_reserved is None else min_reserved
        hi = s.max_reserved_pages if max_reserved is None else max_reserved
        if lo < 0 or hi < lo:
            raise KVCachedConfigError(
                f"reserve bounds min_reserved={lo}, max_reserved={hi} need 0 <= min <= max"
            )
        trim_s = s.idle_trim_s if idle_trim_s is None else idle_trim_s
        keep = s.idle_keep_pages if idle_keep is None else idle_keep
        if keep < 0:
            raise KVCachedConfigError(f"idle_keep={keep} must be >= 0")
        util = s.gpu_utilization if gpu_utilization is None else gpu_utilization
        check_range("idle_trim_s", trim_s, "KVCACHED_IDLE_TRIM_S")  # a wait beyond it overflows
        cache_s = s.cache_idle_s if cache_idle_s is None else cache_idle_s
        check_range("cache_idle_s", cache_s, "KVCACHED_CACHE_IDLE_S")
        if not 0 < util <= 1:
            raise KVCachedConfigError(f"gpu_utilization={util} must be in (0, 1]")
        self._kv = kv_tensors
        self._num_pages = n
        self._page_bytes = kv_tensors.page_bytes
        self._prealloc = s.prealloc if prealloc is None else bool(prealloc)
        self._min_reserved = min(lo, n)
        self._max_reserved = min(hi, n)
        self._idle_trim_s = float(trim_s)
        self._idle_keep = min(keep, self._max_reserved)
        self._cache_idle_s = float(cache_s)
        self._sync_on_unmap = sync_on_unmap
        self._fence = fence
        self._stamps: dict[int, int] = {}  # reserved page -> fence step it was freed in
        self._retire_wanted = False  # the reserve exceeds its cap or the limit
        self._follow = kv_tensors.device.is_gpu if follow_demand is None else bool(follow_demand)
        self._demand: deque[tuple[float, int]] = deque()  # (time, pages) of recent allocations
        self._demand_sum = 0
        self._expected = 0  # pages the engine's queued requests will take (expect())
        self._expected_until = 0.0

        self._cond = threading.Condition(threading.RLock())
        self._state = bytearray(n)  # all _FREE
        self._free = list(range(n))  # a heap: lowest id first
        self._reserved: list[int] = []
        self._n_in_use = 0
        self._n_mapping = 0
        self._n_unmapping = 0
        self._n_prefetch = 0  # of _n_mapping: background refill in flight
        self._n_broken = 0
        self._limit_pages = n
        self._limit_bytes: int | None = None
        #: Bumped on every memory-limit change (lets callers cache available_pages()).
        self.limit_changes = 0

        self._headroom = util
        self._mem_ttl = mem_info_ttl_s
        self._phys_pages: int | None = None  # pages the device (or host) can still back
        self._phys_at = float("-inf")
        self._phys_wanted = False  # a caller found the reading stale: the thread re-reads

        self._last_activity = time.monotonic()
        self._idle_trimmed = False
        self._cache_trimmed = False  # the prefix cache went back in this idle spell
        self._next_headroom = 0.0  # when the background thread next reads the headroom
        self._refill_wanted = False
        self._refiller_busy = False
        self._stop = False
        self._closed = False
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()
        self._budget = budget
        self._budget_wait_s = BUDGET_WAIT_S if budget_wait_s is None else float(budget_wait_s)
        self._limit_source: Any = None
        self._evictor: Callable[[int], int] | None = None
        self._next_poll = 0.0
        self._pending_limit: int | None = _UNSET
        self._pending_pressure = 0
        #: Giveback / live-limit counters (for tests and benchmarks).
        self.givebacks: list[dict[str, float]] = []
        weakref.finalize(self, _wake, self._cond)
        if fence is not None:
            ref = weakref.ref(self)

            def on_step_completed() -> None:
                alloc = ref()
                if alloc is not None and alloc._retire_wanted:
                    with alloc._cond:
                        alloc._cond.notify_all()

            fence.subscribe(self, on_step_completed)

        limit = s.memory_limit if memory_limit is _UNSET else memory_limit
        #: The limit the pool was configured with: lifting a live limit returns to it.
        self._configured_limit = limit
        if limit is not None:
            self.set_memory_limit(limit)

    def __repr__(self) -> str:
        st = self.stats()
        return (
            f"<PageAllocator {self._kv.device.torch_device} pages={st.num_pages} "
            f"in_use={st.in_use} reserved={st.reserved} limit={st.limit_pages}>"
        )

    def __enter__(self) -> PageAllocator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ properties

    @property
    def kv_tensors(self) -> KVTensors:
        return self._kv

    @property
    def num_pages(self) -> int:
        return self._num_pages

    @property
    def page_bytes(self) -> int:
        """Physical bytes behind one page id (all layers and buffers)."""
        return self._page_bytes

    @property
    def min_reserved(self) -> int:
        return self._min_reserved

    @property
    def max_reserved(self) -> int:
        return self._max_reserved

    @property
    def memory_limit(self) -> int | None:
        """The limit in bytes as last set, or ``None``."""
        return self._limit_bytes

    @property
    def limit_pages(self) -> int:
        """Most pages that may be mapped (``num_pages`` without a limit)."""
        return self._limit_pages

    @property
    def num_in_use(self) -> int:
        return self._n_in_use

    @property
    def num_reserved(self) -> int:
        return len(self._reserved)

    @property
    def num_mapped(self) -> int:
        with self._cond:
            return self._mapped_locked()

    @property
    def shrink_pending(self) -> bool:
        """Whether more pages are mapped than the limit allows (a deferred shrink)."""
        with self._cond:
            return self._mapped_locked() > self._limit_pages

    def stats(self) -> PageStats:
        """A consistent snapshot of the page counts."""
        with self._cond:
            return PageStats(
                num_pages=self._num_pages,
                in_use=self._n_in_use,
                reserved=len(self._reserved),
                free=len(self._free),
                in_flight=self._n_mapping + self._n_unmapping,
                broken=self._n_broken,
                limit_pages=self._limit_pages,
                page_bytes=self._page_bytes,
            )

    def page_state(self, page_id: int) -> str:
        """``"free"``, ``"reserved"``, ``"in use"``, ``"being mapped"``, ... of one page."""
        self._check_page(page_id)
        return _STATE_NAMES[self._state[page_id]]

    def available_pages(self) -> int:
        """Pages :meth:`alloc_pages` could hand out now (limit and device memory allowing)."""
        self._refresh_phys()
        with self._cond:
            return len(self._reserved) + self._n_prefetch + self._room_locked()

    # ------------------------------------------------------------ allocation

    def alloc_pages(self, n: int) -> list[int] | None:
        """Take ``n`` pages, all or nothing; ``None`` when there is no space.

        No space means: the limit, the page count or device memory does not
        allow it, or mapping ran out of device memory (then everything is
        rolled back). Other driver errors propagate, also after a rollback.
        """
        if n <= 0:
            if n == 0:
                return []
            raise ValueError(f"cannot allocate {n} pages")
        self._check_owner()
        self._refresh_phys()
        self._ensure_refiller()
        with self._cond:
            if self._closed:
                raise KVCachedError("this PageAllocator is closed")
            now = time.monotonic()
            if self._follow:
                self._demand.append((now, n))
                self._demand_sum += n
            while True:
                from_reserve = min(n, len(self._reserved))
                fresh_n = n - from_reserve
                if not fresh_n:
                    break
                # A refill in flight that covers what is missing lands sooner than a
                # fresh map of the same pages (which would queue behind it anyway).
                if fresh_n > self._n_prefetch and fresh_n <= self._room_locked():
                    break
                if not self._n_prefetch:
                    return None
                self._cond.wait()  # a background refill is landing; count again
            taken = self._reserved[len(self._reserved) - from_reserve :]
            del self._reserved[len(self._reserved) - from_reserve :]
            if self._stamps:
                for p in taken:
                    self._stamps.pop(p, None)
            fresh = self._take_free_locked(fresh_n)
            self._set_locked(taken, _IN_USE)
            self._n_in_use += from_reserve
            self._touch_locked(now)
            if (
                self._prealloc
                and len(self._reserved) + self._n_prefetch < self._refill_target_locked(now)
                and self._free
            ):
                self._refill_wanted = True
                self._cond.notify_all()
        if not fresh:
            return taken
        return taken + fresh if self._map_fresh(taken, fresh) else None

    def expect(self, pages: int) -> None:
        """The engine's queued requests will take about ``pages`` more pages in its next steps.

        The background thread maps them ahead into the reserve (up to ``max_reserved``,
        where the limit and device memory have room and the budget has it without asking
        other pools), so the allocations of those steps take mapped pages instead of
        waiting for a map. A hint holds for :data:`DEMAND_WINDOW_S` or until the next one
        (``0`` withdraws it); pages mapped for a hint that no allocation takes go with the
        idle trim. Needs ``prealloc``; cheap enough to call at every scheduling step.
        """
        if pages <= 0 and not self._expected:
            return
        self._check_owner()
        if self._prealloc and pages > 0:
            self._ensure_refiller()
        with self._cond:
            if self._closed:
                return
            now = time.monotonic()
            self._expected = max(0, int(pages))
            self._expected_until = now + DEMAND_WINDOW_S
            if (
                self._prealloc
                and self._room_locked() > 0
                and len(self._reserved) + self._n_prefetch < self._refill_target_locked(now)
            ):
                self._touch_locked(now)  # pages are wanted and may come: an idle spell ends
                self._refill_wanted = True
                self._cond.notify_all()

    def alloc_page(self) -> int | None:
        """One page id, or ``None`` when there is no space."""
        pages = self.alloc_pages(1)
        return pages[0] if pages else None

    def claim_page(self, page_id: int) -> bool:
        """Take one specific page (e.g. page 0 for the null block).

        Returns ``False`` when it is free but there is no space to map it.

        Raises:
            MappingError: The page is already in use (or in flight, or broken).
        """
        self._check_page(page_id)
        self._check_owner()
        self._refresh_phys()
        self._ensure_refiller()
        with self._cond:
            if self._closed:
                raise KVCachedError("this PageAllocator is closed")
            state = self._state[page_id]
            if state == _RESERVED:
                self._reserved.remove(page_id)
                self._stamps.pop(page_id, None)
                self._set_locked([page_id], _IN_USE)
                self._n_in_use += 1
                self._touch_locked()
                return True
            if state != _FREE:
                raise MappingError(f"page {page_id} is {_STATE_NAMES[state]}, not free")
            if self._room_locked() < 1:
                return False
            self._free.remove(page_id)
            heapq.heapify(self._free)
            self._set_locked([page_id], _MAPPING)
            self._n_mapping += 1
            if self._phys_pages is not None:
                self._phys_pages -= 1
            self._touch_locked()
        return self._map_fresh([], [page_id])

    def free_pages(self, pages: Iterable[int]) -> None:
        """Give pages back: into the reserve up to ``max_reserved`` (and the limit), else unmapped.

        Raises:
            MappingError: A page is not in use or repeats; nothing changes then.
        """
        pages = list(pages)
        if not pages:
            return
        self._check_owner()
        with self._cond:
            seen: set[int] = set()
            for p in pages:
                self._check_page(p)
                if self._state[p] != _IN_USE or p in seen:
                    what = "given twice" if p in seen else _STATE_NAMES[self._state[p]]
                    raise MappingError(f"cannot free page {p}: it is {what}, not in use")
                seen.add(p)
            self._n_in_use -= len(pages)
            if self._fence is not None and not self._closed:
                # Steps up to the current one may still read these pages: keep them
                # mapped; the background thread unmaps the excess once the fence allows.
                stamp = self._fence.scheduled
                self._set_locked(pages, _RESERVED)
                self._reserved.extend(pages)
                for p in pages:
                    self._stamps[p] = stamp
                self._touch_locked()
                if self._excess_locked() > 0:
                    self._retire_wanted = True
                    self._cond.notify_all()
                return
            # A refill in flight lands in the reserve too: keep no more than leaves it room.
            cap = min(len(pages), 0 if self._closed else
                      max(0, self._max_reserved - len(self._reserved) - self._n_prefetch))
            limit_room = self._limit_pages - self._mapped_locked()  # without these pages
            keep = max(0, min(cap, limit_room))
            self._set_locked(pages[:keep], _RESERVED)
            self._reserved.extend(pages[:keep])
            drop = pages[keep:]
            self._begin_unmap_locked(drop)
            self._touch_locked()
        if drop:
            self._unmap(drop)
            # Unmapped for the limit: give the memory back to the device too.
            self._trim_spare_handles(0 if limit_room < cap else self._max_reserved)

    def free_page(self, page_id: int) -> None:
        """Give one page back (see :meth:`free_pages`)."""
        self.free_pages([page_id])

    # ------------------------------------------------------------ limit, trim

    def set_memory_limit(self, limit_bytes: int | None, *, strict: bool = False) -> int:
        """Cap the mapped bytes of this pool; returns the cap in pages.

        ``None`` lifts the cap. A cap below the bytes in use shrinks lazily
        (see the module docs), or with ``strict`` raises.

        Raises:
            KVCachedConfigError: The value is not a byte count, or ``strict``
                and it is below the bytes in use.
        """
        if limit_bytes is None:
            pages = self._num_pages
        elif isinstance(limit_bytes, bool) or not isinstance(limit_bytes, int) or limit_bytes < 0:
            raise KVCachedConfigError(f"memory limit {limit_bytes!r} is not a byte count >= 0")
        else:
            pages = min(self._num_pages, limit_bytes // self._page_bytes)
        self._check_owner()
        with self._cond:
            used = self._n_in_use + self._n_mapping - self._n_prefetch
            if strict and pages < used:
                raise KVCachedConfigError(
                    f"memory limit {limit_bytes} bytes ({pages} pages of {self._page_bytes} bytes) "
                    f"is below the {used * self._page_bytes} bytes ({used} pages) in use; free "
                    "KV blocks first, or set it without strict to shrink as they are freed"
                )
            lowered = pages < self._limit_pages
            self._limit_pages = pages
            self.limit_changes += 1
            self._limit_bytes = limit_bytes
            drop = self._pop_reserve_locked(self._mapped_locked() - pages, safe_only=True)
            if self._excess_locked() > 0:  # pages the fence still holds: retired later
                self._retire_wanted = True
                self._cond.notify_all()
        if drop:
            self._unmap(drop)
        if lowered:
            self._trim_spare_handles(0)
        return pages

    def trim(self, keep: int = 0) -> int:
        """Unmap the reserved pages beyond ``keep`` and release the mapper's spare handles.

        Returns the number of pages unmapped.
        """
        self._check_owner()
        with self._cond:
            drop = self._pop_reserve_locked(len(self._reserved) - keep)
        if drop:
            self._unmap(drop)
        self._trim_spare_handles(0)
        return len(drop)

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until no page is in flight and no background work is pending.

        Pages the step fence still holds are not pending work: they wait for the engine.
        """
        self._check_owner()
        with self._cond:
            return self._cond.wait_for(
                lambda: not (
                    self._n_mapping
                    or self._n_unmapping
                    or self._refill_wanted
                    or self._phys_wanted
                    or self._refiller_busy
                    or (self._retire_wanted and self._excess_locked() > 0
                        and self._safe_excess_locked())
                ),
                timeout,
            )

    def close(self) -> None:
        """Stop the background thread and release the reserve; idempotent.

        Pages in use stay mapped until freed (freeing after close unmaps at once).
        """
        if os.getpid() != self._pid:
            self._closed = True  # a forked child: no thread here, and not our memory
            return
        self.stop_background(closing=True)
        self.trim()

    def stop_background(self, *, closing: bool = False, timeout: float | None = None) -> bool:
        """Stop the background thread (refills, trims, limit and budget polls); idempotent.

        Mapped pages stay as they are: for a process about to end, whose
        workers may already be gone (``close`` also unmaps the reserve).
        ``timeout`` bounds the wait for a thread inside a call to a worker that
        stopped answering. Returns whether the thread has stopped.
        """
        with self._cond:
            self._stop = True
            self._closed = self._closed or closing
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
            return not thread.is_alive()
        return True

    # ------------------------------------------------------------ internals

    def _check_owner(self) -> None:
        if os.getpid() != self._pid:
            raise ForkedProcessError(
                f"this PageAllocator belongs to process {self._pid}; process {os.getpid()} "
                "is a fork of it and must create its own"
            )

    def _check_page(self, page_id: int) -> None:
        if not (isinstance(page_id, int) and 0 <= page_id < self._num_pages):
            raise MappingError(f"page id {page_id!r} outside 0..{self._num_pages - 1}")

    def _mapped_locked(self) -> int:
        return (
            self._n_in_use
            + len(self._reserved)
            + self._n_mapping
            + self._n_unmapping
            + self._n_broken
        )

    def _room_locked(self) -> int:
        """Free pages that may be newly mapped now."""
        room = min(len(self._free), self._limit_pages - self._mapped_locked())
        if self._phys_pages is not None:
            room = min(room, self._phys_pages)
        return max(room, 0)

    def _set_locked(self, pages: list[int], state: int) -> None:
        st = self._state
        for p in pages:
            st[p] = state

    def _take_free_locked(self, n: int) -> list[int]:
        pages = [heapq.heappop(self._free) for _ in range(n)]
        self._set_locked(pages, _MAPPING)
        self._n_mapping += n
        if self._phys_pages is not None:
            self._phys_pages -= n
        return pages

    def _begin_unmap_locked(self, pages: list[int]) -> None:
        self._set_locked(pages, _UNMAPPING)
        self._n_unmapping += len(pages)

    def _pop_reserve_locked(self, n: int, safe_only: bool = False) -> list[int]:
        """Take up to ``n`` reserved pages and mark them for unmapping.

        The newest go first; with ``safe_only`` only pages the fence allows,
        the oldest first (the newest are the likeliest to be taken again).
        """
        n = min(n, len(self._reserved))
        if n <= 0:
            return []
        stamps, fence = self._stamps, self._fence
        if safe_only and stamps and fence is not None:
            drop, keep = [], []
            for p in self._reserved:
                stamp = stamps.get(p)
                if len(drop) < n and (stamp is None or fence.is_safe(stamp)):
                    drop.append(p)
                else:
                    keep.append(p)
            self._reserved = keep
        else:
            drop = self._reserved[len(self._reserved) - n :]
            del self._reserved[len(self._reserved) - n :]
        if stamps:
            for p in drop:
                stamps.pop(p, None)
        self._begin_unmap_locked(drop)
        return drop

    def _excess_locked(self) -> int:
        """Reserved pages beyond the reserve's cap or the memory limit."""
        over_cap = len(self._reserved) - (0 if self._closed else self._max_reserved)
        over_limit = self._mapped_locked() - self._n_unmapping - self._limit_pages
        return min(len(self._reserved), max(over_cap, over_limit))

    def _refill_target_locked(self, now: float) -> int:
        """How many pages the reserve should hold now (see the module docs)."""
        want = 0
        if self._expected:
            if now < self._expected_until:
                want = self._expected
            else:
                self._expected = 0
        if self._follow:
            demand = self._demand
            while demand and now - demand[0][0] > DEMAND_WINDOW_S:
                self._demand_sum -= demand.popleft()[1]
            want = max(want, self._demand_sum)
        return max(self._min_reserved, min(want, self._max_reserved))

    def _touch_locked(self, now: float | None = None) -> None:
        self._last_activity = time.monotonic() if now is None else now
        if self._idle_trimmed or self._cache_trimmed:
            self._idle_trimmed = self._cache_trimmed = False
            self._cond.notify_all()  # the refiller waits without a deadline after a trim

    def _map_fresh(self, taken: list[int], fresh: list[int], prefetch: bool = False) -> bool:
        """Map ``fresh`` (marked in flight); on failure put everything back.

        Returns ``False`` for out of memory or a budget that has no room;
        other errors propagate.
        """
        budget, claimed = self._budget, 0
        if budget is not None:
            nbytes = len(fresh) * self._page_bytes
            try:
                ok = (budget.claim(nbytes, pressure=False) if prefetch
                      else budget.claim_waiting(nbytes, self._budget_wait_s))
            except Exception:  # a broken record must not stop the engine
                _log.exception("kvcached: claiming %d bytes in the device budget failed", nbytes)
                ok, nbytes = True, 0
            if not ok:
                self._rollback(taken, fresh, oom=False)
                return False
            claimed = nbytes
        try:
            self._kv.map_pages(fresh)
        except BaseException as exc:
            if claimed:
                self._release_budget(claimed)
            oom = isinstance(exc, MemoryError)
            self._rollback(taken, fresh, oom)
            if oom:
                return False
            raise
        with self._cond:
            self._n_mapping -= len(fresh)
            if prefetch:
                self._set_locked(fresh, _RESERVED)
                self._reserved.extend(fresh)
            else:
                self._set_locked(fresh, _IN_USE)
                self._n_in_use += len(fresh)
            self._cond.notify_all()
        return True

    def _release_budget(self, nbytes: int) -> None:
        try:
            self._budget.release(nbytes)
        except Exception:
            _log.exception("kvcached: releasing %d bytes in the device budget failed", nbytes)

    def _rollback(self, taken: list[int], fresh: list[int], oom: bool) -> None:
        """Put pages taken for an allocation whose fresh map did not happen back."""
        with self._cond:
            self._n_mapping -= len(fresh)
            self._set_locked(fresh, _FREE)
            for p in fresh:
                heapq.heappush(self._free, p)
            self._set_locked(taken, _RESERVED)
            self._reserved.extend(taken)
            self._n_in_use -= len(taken)
            if self._phys_pages is not None:
                # The device is fuller than the last reading: trust none until the next.
                self._phys_pages = 0 if oom else self._phys_pages + len(fresh)
            self._cond.notify_all()

    def _unmap(self, pages: list[int]) -> None:
        """Unmap pages marked in flight. A failure is logged, not raised: pages
        still mapped are quarantined as broken, the rest become free."""
        ok = True
        try:
            self._kv.unmap_pages(pages, self._sync_on_unmap)
        except Exception:
            ok = False
            _log.exception("kvcached: unmapping pages %s failed", pages)
        with self._cond:
            self._n_unmapping -= len(pages)
            freed = 0
            for p in pages:
                if ok or not self._kv.is_mapped(p):
                    self._state[p] = _FREE
                    heapq.heappush(self._free, p)
                    freed += 1
                else:
                    self._state[p] = _BROKEN
                    self._n_broken += 1
            if self._phys_pages is not None:
                self._phys_pages += freed
            self._cond.notify_all()
        if self._budget is not None and freed:
            self._release_budget(freed * self._page_bytes)

    def _trim_spare_handles(self, keep_pages: int) -> None:
        try:
            self._kv.trim_spare_handles(keep_pages)
        except Exception:
            _log.exception("kvcached: releasing spare page handles failed")

    def _refresh_phys(self) -> None:
        """Keep the reading of what the device can still back fresh.

        A stale reading is re-read by the background thread; only the first
        one, and every one when there is no thread, is read on this thread.
        """
        if time.monotonic() - self._phys_at < self._mem_ttl:
            return
        thread = self._thread
        if (thread is not None and self._phys_pages is not None
                and thread is not threading.current_thread()):
            if not self._phys_wanted:
                with self._cond:
                    self._phys_wanted = True
                    self._cond.notify_all()
            return
        self._read_phys()

    def _read_phys(self, force: bool = False) -> int:
        """Read what the device can still back now (a driver query, outside the lock).

        Returns the reading: pages the device can still back, negative when it
        is short of the headroom (0 when the reading is recent and not
        ``force``, or failed).
        """
        now = time.monotonic()
        if not force and now - self._phys_at < self._mem_ttl:
            return 0
        self._phys_at = now  # one reader at a time; others use the last reading
        try:
            pages = self._kv.free_device_pages(self._headroom)
        except Exception:
            _log.exception("kvcached: reading the device's free memory failed")
            return 0
        with self._cond:
            # Maps in flight may not show in the reading yet.
            self._phys_pages = max(0, pages - self._n_mapping)
            self._phys_at = time.monotonic()
        return pages

    # ------------------------------------------------------------ background

    def _ensure_refiller(self) -> None:
        if self._thread is not None or not (
            self._prealloc or self._idle_trim_s > 0 or self._fence is not None
            or self._budget is not None or self._limit_source is not None
            or self._evictor is not None
        ):
            return
        with self._cond:
            if self._thread is None and not self._stop:
                dev = self._kv.device
                self._thread = threading.Thread(
                    target=_refiller_loop,
                    args=(weakref.ref(self), self._cond),
                    name=f"kvcached-pages-{dev.backend}{dev.index}",
                    daemon=True,
                )
                self._thread.start()

    def _decide_locked(self, now: float) -> tuple[int, float | None]:
        """The refiller's next step, and how long to wait when there is none."""
        if self._stop:
            return _STOP, None
        if self._budget is None and self._limit_source is None:
            return self._decide_work_locked(now)
        if now >= self._next_poll:
            self._next_poll = now + CONTROL_POLL_S
            self._poll_control_locked()
        if self._pending_limit is not _UNSET or self._pending_pressure:
            self._refiller_busy = True
            return _CONTROL, None
        action, timeout = self._decide_work_locked(now)
        if action == _WAIT:
            left = max(0.0, self._next_poll - now)
            timeout = left if timeout is None else min(timeout, left)
        return action, timeout

    def _poll_control_locked(self) -> None:
        """Look at the limit source and the budget's asks (memory reads, no system call)."""
        try:
            if self._limit_source is not None:
                limit = self._limit_source.poll_limit()
                if limit is not None:
                    self._pending_limit = limit
            if self._budget is not None:
                gen = self._budget.pending_pressure()
                if gen:
                    self._pending_pressure = gen
        except Exception:
            _log.exception("kvcached: reading the pool's limit or the device budget failed")

    def _decide_work_locked(self, now: float) -> tuple[int, float | None]:
        if self._stop:
            return _STOP, None
        if self._phys_wanted:
            self._phys_wanted = False
            self._refiller_busy = True
            return _READ, None
        if self._retire_wanted:
            if self._excess_locked() <= 0:
                self._retire_wanted = False
            elif self._safe_excess_locked():
                self._refiller_busy = True
                return _RETIRE, None
        if self._refill_wanted:
            self._refill_wanted = False
            self._refiller_busy = True
            return _REFILL, None
        wait: float | None = None
        if self._evictor is not None and self._n_in_use:
            if now >= self._next_headroom:
                self._next_headroom = now + HEADROOM_POLL_S
                self._refiller_busy = True
                return _HEADROOM, None
            wait = self._next_headroom - now
        if self._idle_trim_s > 0 and not self._idle_trimmed:
            deadline = self._last_activity + self._idle_trim_s
            if now < deadline:
                return _WAIT, _sooner(wait, deadline - now)
            self._idle_trimmed = True
            self._refiller_busy = True
            return _TRIM, None
        if self._cache_idle_s > 0 and self._evictor is not None and not self._cache_trimmed:
            deadline = self._last_activity + self._cache_idle_s
            if now < deadline:
                return _WAIT, _sooner(wait, deadline - now)
            self._cache_trimmed = True
            self._refiller_busy = True
            return _CACHE_TRIM, None
        return _WAIT, wait

    def _trim_cache(self) -> None:
        """The pool idled for ``cache_idle_s``: every whole page of prefix cache goes back
        (background thread), then the reserve they landed in."""
        with self._cond:
            pages = self._n_in_use
        before = self.num_mapped
        start = time.monotonic()
        if self._evict(pages):
            self.trim(self._idle_keep)
        with self._cond:
            self._cache_trimmed = True  # the frees above were the trim's own, not activity
        given = before - self.num_mapped
        if given > 0:
            self.givebacks.append(dict(kind="idle-cache", pages=given,
                                       seconds=time.monotonic() - start))
            _log.info("kvcached: idle for %.0f s, gave back %d pages of prefix cache",
                      self._cache_idle_s, given)

    def _keep_headroom(self) -> None:
        """Give memory back while the device's free memory is below the headroom
        (background thread): the reserve and spare handles, then cached pages."""
        short = -self._read_phys(force=True)
        if short <= 0:
            return
        start = time.monotonic()
        before = self.num_mapped
        short -= self._drop_reserve()
        if short > 0 and self._evictor is not None and self._evict(short):
            self._drop_reserve()
        given = before - self.num_mapped
        if given > 0:
            self.givebacks.append(dict(kind="headroom", pages=given,
                                       seconds=time.monotonic() - start))
            _log.info("kvcached: the device's free memory is below the headroom "
                      "(gpu_utilization %.2f): gave back %d pages", self._headroom, given)

    def _work_done(self) -> None:
        with self._cond:
            self._refiller_busy = False
            self._cond.notify_all()

    def _safe_excess_locked(self) -> bool:
        """Whether some reserved page beyond the cap or the limit may be unmapped now."""
        fence, stamps = self._fence, self._stamps
        if fence is None or not stamps:
            return True
        return any(stamps.get(p, 0) <= fence.completed for p in self._reserved)

    # ------------------------------------------------------------ budget, live limits

    def watch_limit(self, source: Any) -> None:
        """Apply the limits ``source.poll_limit()`` reports (bytes; negative: the live
        limit is lifted and the configured one, ``KVCACHED_MEMORY_LIMIT`` or the
        constructor's, applies again; ``None`` when unchanged) from the background
        thread, within :data:`CONTROL_POLL_S` also when the engine is idle."""
        self._check_owner()
        with self._cond:
            self._limit_source = source
            self._next_poll = 0.0
            self._cond.notify_all()
        self._ensure_refiller()

    def set_evictor(self, evictor: Callable[[int], int] | None) -> None:
        """Register the engine's eviction of prefix-cached pages.

        ``evictor(n)`` frees the blocks of up to ``n`` whole pages that hold
        only evictable (cached, unused) blocks and returns how many pages it
        freed. It is called from the background thread, for a budget's ask, a
        lowered limit, an idle spell of ``cache_idle_s`` or a device short of
        its headroom (see the module docs).
        """
        with self._cond:
            self._evictor = evictor
            self._cond.notify_all()
        if evictor is not None:
            self._ensure_refiller()

    @property
    def budget(self) -> Any:
        """This pool's slot in the device budget, or ``None``."""
        return self._budget

    def _control(self) -> None:
        """Apply a new limit and answer the budget's ask (background thread)."""
        with self._cond:
            limit, self._pending_limit = self._pending_limit, _UNSET
            gen, self._pending_pressure = self._pending_pressure, 0
        if limit is not _UNSET:
            self._apply_limit(limit)
        if gen:
            self._give_back(gen)

    def _apply_limit(self, limit: int) -> None:
        start = time.monotonic()
        before = self.num_mapped
        try:
            pages = self.set_memory_limit(self._configured_limit if limit < 0 else limit)
        except KVCachedConfigError:
            _log.warning("kvcached: ignoring the bad memory limit %r", limit)
            return
        over = self.num_mapped - pages
        if over > 0 and self._evictor is not None:
            self._evict(over)
        self.givebacks.append(dict(kind="limit", limit=limit, pages=before - self.num_mapped,
                                   seconds=time.monotonic() - start))

    def _evict(self, pages: int) -> int:
        try:
            return int(self._evictor(pages) or 0)  # type: ignore[misc]
        except Exception:
            _log.exception("kvcached: evicting cached pages for the budget or limit failed")
            return 0

    def _drop_reserve(self) -> int:
        """Unmap every reserved page the fence allows and release the spare handles."""
        with self._cond:
            drop = self._pop_reserve_locked(len(self._reserved), safe_only=True)
        if drop:
            self._unmap(drop)
        self._trim_spare_handles(0)
        return len(drop)

    def _give_back(self, gen: int) -> None:
        """Give memory back until the budget has room for what another pool asked."""
        budget = self._budget
        start = time.monotonic()
        _gen, wanted, slot, raised_ns = budget.pressure()
        wanted *= GIVEBACK_FACTOR
        before = self.num_mapped
        if slot != budget.slot and budget.room() < wanted:
            self._drop_reserve()
            room = budget.room()
            if room < wanted and self._evictor is not None:
                need = -(-(wanted - room) // self._page_bytes)
                if self._evict(need):
                    self._drop_reserve()
        given = max(0, before - self.num_mapped)
        budget.answered(gen, given * self._page_bytes, raised_ns)
        if given:
            self.givebacks.append(dict(kind="budget", gen=gen, pages=given,
                                       seconds=time.monotonic() - start))
            _log.info("kvcached: gave %d pages (%d bytes) back to the device budget in %.1f ms",
                      given, given * self._page_bytes, 1e3 * (time.monotonic() - start))

    def _retire(self) -> None:
        """Unmap the reserve's excess that the fence allows (background thread)."""
        with self._cond:
            drop = self._pop_reserve_locked(min(self._excess_locked(), 4 * REFILL_BATCH),
                                            safe_only=True)
            lowered = self._mapped_locked() - len(drop) > self._limit_pages
        if drop:
            self._unmap(drop)
            self._trim_spare_handles(0 if lowered else self._max_reserved)

    def _refill(self) -> None:
        """Map one batch of pages into the reserve, towards its target (background thread)."""
        self._refresh_phys()
        with self._cond:
            target = self._refill_target_locked(time.monotonic())
            want = target - len(self._reserved) - self._n_prefetch
            k = min(want, self._room_locked(), REFILL_BATCH)
            if self._closed or k <= 0:
                return
            fresh = self._take_free_locked(k)
            self._n_prefetch += k
        ok = False
        try:
            ok = self._map_fresh([], fresh, prefetch=True)
        finally:
            with self._cond:
                self._n_prefetch -= k
                # The limit may have dropped while mapping, or freed pages filled the
                # reserve meanwhile: hand back what is beyond either.
                drop = self._pop_reserve_locked(self._excess_locked(), safe_only=True)
                if ok and not drop and len(self._reserved) + self._n_prefetch < target:
                    self._refill_wanted = True  # the next batch
                self._cond.notify_all()  # allocations waiting for this refill
            if drop:
                self._unmap(drop)

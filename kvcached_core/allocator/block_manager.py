"""KV block manager: engine-sized blocks carved out of allocator pages.

Geometry
--------
Block ``b`` of ``B = block_bytes`` occupies bytes ``[b*B, (b+1)*B)`` of every
layer buffer (in either layout, see :mod:`.kv_tensors`), so an engine indexes
its cache tensor with the block id at a uniform stride. A block is usable only
when it lies inside one page of ``P`` bytes: page ``p`` holds the blocks
``ceil(p*P/B) .. floor((p+1)*P/B) - 1``. When ``B`` divides ``P`` that is
exactly ``[p*bpp, (p+1)*bpp)`` with ``bpp = P // B``; otherwise the few ids
that would straddle a page boundary are never handed out.

Policy
------
* Block 0 is the null block (when ``reserve_null_block``): allocated at
  construction on page 0, which stays mapped; it is never returned by
  :meth:`KVBlockManager.alloc` and cannot be freed.
* :meth:`KVBlockManager.alloc` is all or nothing. When the mapped pages lack
  free blocks it first takes the missing pages from the page allocator
  (giving them all back if any request fails), then picks blocks best-fit:
  the page with the fewest free blocks that still covers what remains, else
  the page with the most, so a request touches few pages and nearly-full
  pages fill up first. The pick is O(1) per page touched (buckets by free
  count plus a bitmask of non-empty buckets), not O(#pages).
* A page whose blocks are all free goes back to the page allocator at once.
* ``None`` from ``alloc`` means "no space now" (limit, device memory or
  capacity): a scheduling miss, never a crash.

The block manager has its own lock, so calls from several threads are safe;
the hot path (blocks from mapped pages) makes no driver call and does not log.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from kvcached_core.allocator.page_allocator import PageAllocator
from kvcached_core.errors import KVCachedConfigError, MappingError

__all__ = ["KVBlockManager"]

MiB = 1 << 20


class KVBlockManager:
    """Allocates KV blocks of one group on top of a :class:`PageAllocator`.

    Args:
        page_allocator: The group's page allocator (used by this manager only).
        block_bytes: Bytes of one block in one layer buffer (e.g.
            ``block_size * num_kv_heads * head_dim * dtype_size``).
        num_blocks: Block ids ``0 .. num_blocks-1`` (default: every block the
            allocator's pages hold). The allocator must have no page beyond
            the last one these blocks need.
        reserve_null_block: Keep block 0 allocated as the engine's null block.

    Raises:
        KVCachedConfigError: A block does not fit in a page (the message names
            ``KVCACHED_PAGE_SIZE_MB`` and the size needed), or the block count
            and the allocator's page count disagree.
    """

    def __init__(
        self,
        page_allocator: PageAllocator,
        block_bytes: int,
        num_blocks: int | None = None,
        reserve_null_block: bool = True,
    ) -> None:
        layout = page_allocator.kv_tensors.layout
        page = layout.page_size
        self._check_geometry(block_bytes, page, page_allocator.kv_tensors.mapper.granularity)
        num_pages = page_allocator.num_pages
        most = num_pages * page // block_bytes
        n = most if num_blocks is None else num_blocks
        if not 1 <= n <= most:
            raise KVCachedConfigError(
                f"num_blocks={num_blocks} must be in 1..{most}: {num_pages} pages of {page} "
                f"bytes hold {most} blocks of {block_bytes} bytes"
            )
        # Page p holds the blocks lying wholly inside it (ids below n).
        starts = [-(-p * page // block_bytes) for p in range(num_pages)]
        ends = [min((p + 1) * page // block_bytes, n) for p in range(num_pages)]
        caps = [max(0, e - s) for s, e in zip(starts, ends, strict=True)]
        if caps[-1] == 0:
            used = next(p for p in range(num_pages - 1, -1, -1) if caps[p]) + 1
            raise KVCachedConfigError(
                f"{n} blocks of {block_bytes} bytes need {used} pages, but the page allocator "
                f"has {num_pages}; build it with num_pages={used}"
            )
        self._pa = page_allocator
        self._block_bytes = block_bytes
        self._page_size = page
        self._num_blocks = n
        self._starts = starts
        self._ends = ends
        self._caps = caps
        self._max_cap = max(caps)

        self._lock = threading.Lock()
        self._free_lists: list[list[int]] = [[] for _ in range(num_pages)]  # free ids by page
        self._held = bytearray(num_pages)  # 1: the page is mapped for this manager
        self._buckets: list[set[int]] = [set() for _ in range(self._max_cap + 1)]
        self._mask = 0  # bit k set iff _buckets[k] is non-empty (k >= 1)
        self._free_in_pages = 0
        self._held_pages = 0
        self._allocated: set[int] = set()  # handed out by alloc(): never the null block
        # Pages not held, counted by capacity: for a conservative available_size().
        self._unheld_by_cap: dict[int, int] = {}
        for c in caps:
            self._unheld_by_cap[c] = self._unheld_by_cap.get(c, 0) + 1

        self._null_block: int | None = None
        if reserve_null_block:
            if not page_allocator.claim_page(0):
                raise KVCachedConfigError(
                    "no room to map page 0 for the null block (memory limit "
                    f"{page_allocator.memory_limit} bytes, "
                    f"{page_allocator.page_bytes} bytes a page)"
                )
            self._add_pages_locked([0])
            self._null_block = self._take_locked(1)[0]  # page 0's lowest block: 0

    @staticmethod
    def _check_geometry(block_bytes: int, page: int, granularity: int) -> None:
        if isinstance(block_bytes, bool) or not isinstance(block_bytes, int) or block_bytes < 1:
            raise KVCachedConfigError(f"block_bytes={block_bytes!r} must be a positive integer")

        def fits(size: int) -> bool:
            # Every page then holds a whole block (with B > P/2 most would not).
            return block_bytes <= size and (size % block_bytes == 0 or 2 * block_bytes <= size)

        if fits(page):
            return
        step = max(MiB, granularity)
        need = -(-block_bytes // step) * step
        while not fits(need):
            need += step
        need_mib = need // MiB
        raise KVCachedConfigError(
            f"a KV block of {block_bytes} bytes per layer buffer does not fit the "
            f"{page}-byte page size ({page / MiB:g} MiB) usefully; set "
            f"KVCACHED_PAGE_SIZE_MB={need_mib} or more"
        )

    def __repr__(self) -> str:
        return (
            f"<KVBlockManager blocks={self._num_blocks} block_bytes={self._block_bytes} "
            f"allocated={self.num_allocated} pages={self._held_pages}>"
        )

    # ------------------------------------------------------------ properties

    @property
    def page_allocator(self) -> PageAllocator:
        return self._pa

    @property
    def block_bytes(self) -> int:
        return self._block_bytes

    @property
    def num_blocks(self) -> int:
        """Block ids are ``0 .. num_blocks-1`` (straddling ids are never used)."""
        return self._num_blocks

    @property
    def null_block(self) -> int | None:
        """The reserved null block id (0), or ``None``."""
        return self._null_block

    @property
    def num_allocated(self) -> int:
        """Blocks handed out, the null block included."""
        return len(self._allocated) + (self._null_block is not None)

    @property
    def num_free_blocks_in_pages(self) -> int:
        """Free blocks in pages this manager holds (no mapping needed to use them)."""
        return self._free_in_pages

    @property
    def num_held_pages(self) -> int:
        """Pages this manager holds (each has at least one allocated block)."""
        return self._held_pages

    @property
    def num_mapped_pages(self) -> int:
        """Pages mapped by the page allocator (held + reserve + in flight)."""
        return self._pa.num_mapped

    def capacity(self) -> int:
        """Blocks usable in total, the null block included."""
        return sum(self._caps)

    # ------------------------------------------------------------ block geometry

    def page_of(self, block_id: int) -> int:
        """The page holding ``block_id``."""
        return block_id * self._block_bytes // self._page_size

    def blocks_in_page(self, page_id: int) -> range:
        """Block ids that page ``page_id`` holds."""
        return range(self._starts[page_id], self._ends[page_id])

    def page_occupancy(self, page_id: int) -> int:
        """Allocated blocks in a page (0 when not held), for page-aware eviction."""
        with self._lock:
            if not self._held[page_id]:
                return 0
            return self._caps[page_id] - len(self._free_lists[page_id])

    # ------------------------------------------------------------ allocation

    def available_size(self) -> int:
        """Blocks :meth:`alloc` can hand out now.

        Free blocks in held pages, plus whole pages the page allocator can give
        (memory limit and device memory allowing), each counted at the
        smallest capacity a page may have, so the figure is never optimistic.
        """
        pages = self._pa.available_pages()
        with self._lock:
            total = self._free_in_pages
            for cap in sorted(self._unheld_by_cap):
                if pages <= 0:
                    break
                k = min(pages, self._unheld_by_cap[cap])
                total += k * cap
                pages -= k
            return total

    def alloc(self, n: int) -> list[int] | None:
        """``n`` block ids, or ``None`` when there is no space (nothing changes then)."""
        if n <= 0:
            if n == 0:
                return []
            raise ValueError(f"cannot allocate {n} blocks")
        with self._lock:
            if n == 1 and self._mask:  # the hot path: one block, from the fullest page
                mask = self._mask
                k = (mask & -mask).bit_length() - 1
                bucket = self._buckets[k]
                p = bucket.pop()
                if not bucket:
                    mask ^= 1 << k
                if k > 1:
                    bucket = self._buckets[k - 1]
                    if not bucket:
                        mask |= 1 << (k - 1)
                    bucket.add(p)
                self._mask = mask
                self._free_in_pages -= 1
                b = self._free_lists[p].pop()
                self._allocated.add(b)
                return [b]
            grown: list[int] = []
            if n > self._free_in_pages:
                grown = self._grow_locked(n - self._free_in_pages)
                if not grown:
                    return None
            out = self._take_locked(n)
            self._allocated.update(out)
            # Best-fit may leave a new page untouched when capacities differ: give it back.
            idle = [p for p in grown if len(self._free_lists[p]) == self._caps[p]]
            if idle:
                self._rebucket_locked({p: self._caps[p] for p in idle})
        if idle:
            self._pa.free_pages(idle)
        return out

    def free(self, block_ids: Sequence[int]) -> None:
        """Return blocks; a page left with no allocated block goes back at once.

        Raises:
            MappingError: A block is not allocated (double free, never
                allocated, out of range, the null block) or repeats; nothing
                changes then.
        """
        ids = block_ids if type(block_ids) is list else list(block_ids)
        if not ids:
            return
        with self._lock:
            if len(ids) == 1:  # the hot path: one block of a page that stays held
                b = ids[0]
                if b in self._allocated:
                    p = b * self._block_bytes // self._page_size
                    fl = self._free_lists[p]
                    old = len(fl)
                    if old + 1 < self._caps[p]:
                        self._allocated.remove(b)
                        fl.append(b)
                        mask = self._mask
                        if old:
                            bucket = self._buckets[old]
                            bucket.discard(p)
                            if not bucket:
                                mask ^= 1 << old
                        bucket = self._buckets[old + 1]
                        if not bucket:
                            mask |= 1 << (old + 1)
                        bucket.add(p)
                        self._mask = mask
                        self._free_in_pages += 1
                        return
            bad = self._check_free_locked(ids)
            if bad is not None:
                raise MappingError(bad)
            self._allocated.difference_update(ids)
            fls = self._free_lists
            bb, ps = self._block_bytes, self._page_size
            before: dict[int, int] = {}
            for b in ids:
                p = b * bb // ps
                fl = fls[p]
                if p not in before:
                    before[p] = len(fl)
                fl.append(b)
            self._free_in_pages += len(ids)
            release = self._rebucket_locked(before)
        if release:
            self._pa.free_pages(release)

    def clear(self) -> None:
        """Free every allocated block but the null block."""
        with self._lock:
            ids = list(self._allocated)
        self.free(ids)

    def trim(self) -> int:
        """Unmap the page allocator's reserve now; returns the pages unmapped."""
        return self._pa.trim()

    # ------------------------------------------------------------ internals

    def _check_free_locked(self, ids: Sequence[int]) -> str | None:
        """Why ``ids`` cannot be freed, or ``None`` when they can."""
        unique = set(ids)
        if len(unique) == len(ids) and unique <= self._allocated:
            return None
        seen: set[int] = set()
        for b in ids:
            if b in seen:
                return f"block {b} appears twice in one free"
            seen.add(b)
            if b == self._null_block:
                return f"block {b} is the null block; it is never freed"
            if b not in self._allocated:
                return f"block {b} is not allocated (double free, or never allocated)"
        return "bad free"  # unreachable

    def _rebucket_locked(self, before: dict[int, int]) -> list[int]:
        """Move touched pages to their new free-count bucket; returns emptied pages."""
        buckets, fls, caps = self._buckets, self._free_lists, self._caps
        release: list[int] = []
        for p, old in before.items():
            if old:
                bucket = buckets[old]
                bucket.discard(p)
                if not bucket:
                    self._mask ^= 1 << old
            new = len(fls[p])
            if new == caps[p]:
                release.append(p)
                continue
            bucket = buckets[new]
            if not bucket:
                self._mask |= 1 << new
            bucket.add(p)
        if release:
            for p in release:
                self._free_in_pages -= caps[p]
                fls[p] = []
                self._held[p] = 0
                self._unheld_by_cap[caps[p]] += 1
            self._held_pages -= len(release)
        return release

    def _add_pages_locked(self, pages: list[int]) -> None:
        """Start holding fresh pages: all their blocks are free."""
        for p in pages:
            cap = self._caps[p]
            start = self._starts[p]
            self._free_lists[p] = list(range(start + cap - 1, start - 1, -1))
            self._held[p] = 1
            bucket = self._buckets[cap]
            if not bucket:
                self._mask |= 1 << cap
            bucket.add(p)
            self._free_in_pages += cap
            self._unheld_by_cap[cap] -= 1
        self._held_pages += len(pages)

    def _grow_locked(self, deficit: int) -> list[int]:
        """Hold enough new pages for ``deficit`` more blocks, all or nothing.

        Returns the new pages, or ``[]`` (having given back any taken) when
        the page allocator has no space.
        """
        got: list[int] = []
        while deficit > 0:
            pages = self._pa.alloc_pages(-(-deficit // self._max_cap))
            if pages is None:
                if got:
                    self._pa.free_pages(got)
                return []
            got += pages
            deficit -= sum(self._caps[p] for p in pages)
        self._add_pages_locked(got)
        return got

    def _take_locked(self, n: int) -> list[int]:
        """Pop ``n`` free blocks, best-fit by page. The caller checked there are enough."""
        buckets, fls = self._buckets, self._free_lists
        mask = self._mask
        out: list[int] = []
        rem = n
        while rem:
            m = mask >> rem
            k = rem + (m & -m).bit_length() - 1 if m else mask.bit_length() - 1
            bucket = buckets[k]
            p = bucket.pop()
            if not bucket:
                mask ^= 1 << k
            fl = fls[p]
            if k <= rem:
                out += fl
                fl.clear()
                rem -= k
            else:
                left = k - rem
                out += fl[left:]
                del fl[left:]
                rem = 0
                bucket = buckets[left]
                if not bucket:
                    mask |= 1 << left
                bucket.add(p)
        self._mask = mask
        self._free_in_pages -= n
        return out

"""KV block manager: engine-sized blocks carved out of allocator pages.

Geometry
--------
Block ``b`` of ``B = block_bytes`` occupies bytes ``[o + b*B, o + (b+1)*B)`` of
every layer buffer (in either layout, see :mod:`.kv_tensors`), so an engine
indexes its cache tensor with the block id at a uniform stride; ``o`` is the
``block_offset`` where the engine's tensor starts (0 unless it was placed past
a page boundary). A block is usable only when it lies inside one page of ``P``
bytes: page ``p`` holds the blocks ``ceil((p*P - o)/B) .. floor(((p+1)*P - o)/B) - 1``.
When ``o`` is 0 and ``B`` divides ``P`` that is exactly ``[p*bpp, (p+1)*bpp)``
with ``bpp = P // B``; otherwise the few ids that would straddle a page
boundary (or run past the last page) are never handed out.

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
  count plus a bitmask of non-empty buckets), not O(#pages). Inside a page
  the lowest free ids go first (a free-block bitmap), so however blocks were
  freed, a request's blocks come out ascending and mostly adjacent: attention
  reads them in order, and a scattered block table measurably slows CPU
  attention (``benchmarks/bench_block_order.py``).
* A page whose blocks are all free goes back to the page allocator at once.
* ``None`` from ``alloc`` means "no space now" (limit, device memory or
  capacity): a scheduling miss, never a crash.

The bookkeeping is native (``_native.BlockTable``, csrc/block_table.cpp): each
call is atomic under the GIL, so calls from several threads are safe, and the
hot path (blocks from held pages) is one native call, with no driver call and no
logging.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from kvcached_core.allocator.page_allocator import PageAllocator
from kvcached_core import _native
from kvcached_core.errors import KVCachedConfigError

__all__ = ["KVBlockManager"]

MiB = 1 << 20

#: How long :meth:`KVBlockManager.available_size` reuses the page allocator's
#: count of pages it could still hand out. Schedulers ask once per request per
#: step; this manager's own page changes and a new memory limit refresh it at
#: once, device memory that other processes take or free shows within this
#: many seconds.
AVAILABLE_PAGES_TTL_S = 0.002


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
        block_offset: Bytes before block 0 in every layer buffer (the engine's
            tensor starts that far into the pages); less than ``block_bytes``.

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
        block_offset: int = 0,
    ) -> None:
        layout = page_allocator.kv_tensors.layout
        page = layout.page_size
        self._check_geometry(block_bytes, page, page_allocator.kv_tensors.granularity)
        if (isinstance(block_offset, bool) or not isinstance(block_offset, int)
                or not 0 <= block_offset < block_bytes):
            raise KVCachedConfigError(
                f"block_offset={block_offset!r} must be an integer in 0..{block_bytes - 1} "
                "(less than one block)"
            )
        num_pages = page_allocator.num_pages
        most = num_pages * page // block_bytes  # ids; past an offset the last may not fit
        n = (num_pages * page - block_offset) // block_bytes if num_blocks is None else num_blocks
        if not 1 <= n <= most:
            raise KVCachedConfigError(
                f"num_blocks={num_blocks} must be in 1..{most}: {num_pages} pages of {page} "
                f"bytes hold {most} blocks of {block_bytes} bytes"
            )
        # Page p holds the blocks lying wholly inside it (ids below n).
        o = block_offset
        starts = [max(0, -(-(p * page - o) // block_bytes)) for p in range(num_pages)]
        ends = [min(((p + 1) * page - o) // block_bytes, n) for p in range(num_pages)]
        caps = [max(0, e - s) for s, e in zip(starts, ends, strict=True)]
        if caps[-1] == 0:
            used = next(p for p in range(num_pages - 1, -1, -1) if caps[p]) + 1
            raise KVCachedConfigError(
                f"{n} blocks of {block_bytes} bytes need {used} pages, but the page allocator "
                f"has {num_pages}; build it with num_pages={used}"
            )
        self._pa = page_allocator
        self._block_bytes = block_bytes
        self._block_offset = block_offset
        self._page_size = page
        self._num_blocks = n
        self._starts = starts
        self._ends = ends
        self._caps = caps
        self._max_cap = max(caps)
        # Block bookkeeping is native (csrc/block_table.cpp): each call is atomic
        # under the GIL; the lock only serialises growing by whole pages.
        self._table = _native.BlockTable(starts, caps, n)
        self._grow_lock = threading.Lock()
        self._pages_left = 0  # page_allocator.available_pages(), read ...
        self._pages_left_until = 0.0  # ... until this time.monotonic() (0: stale) ...
        self._pages_left_limit = -1  # ... and while its limit_changes is this

        self._null_block: int | None = None
        if reserve_null_block:
            if not page_allocator.claim_page(0):
                raise KVCachedConfigError(
                    "no room to map page 0 for the null block (memory limit "
                    f"{page_allocator.memory_limit} bytes, "
                    f"{page_allocator.page_bytes} bytes a page)"
                )
            self._table.add_pages([0])
            self._null_block = self._table.alloc(1)[0]  # page 0's lowest block: 0
            self._table.set_null(self._null_block)

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
            f"allocated={self.num_allocated} pages={self.num_held_pages}>"
        )

    # ------------------------------------------------------------ properties

    @property
    def page_allocator(self) -> PageAllocator:
        return self._pa

    @property
    def block_bytes(self) -> int:
        return self._block_bytes

    @property
    def block_offset(self) -> int:
        """Bytes before block 0 in every layer buffer."""
        return self._block_offset

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
        return self._table.num_allocated + (self._null_block is not None)

    @property
    def num_free_blocks_in_pages(self) -> int:
        """Free blocks in pages this manager holds (no mapping needed to use them)."""
        return self._table.free_in_pages

    @property
    def num_held_pages(self) -> int:
        """Pages this manager holds (each has at least one allocated block)."""
        return self._table.held_pages

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
        return (self._block_offset + block_id * self._block_bytes) // self._page_size

    def blocks_in_page(self, page_id: int) -> range:
        """Block ids that page ``page_id`` holds."""
        return range(self._starts[page_id], self._ends[page_id])

    def page_occupancy(self, page_id: int) -> int:
        """Allocated blocks in a page (0 when not held), for page-aware eviction."""
        return self._table.page_occupancy(page_id)

    # ------------------------------------------------------------ allocation

    def available_size(self) -> int:
        """Blocks :meth:`alloc` can hand out now.

        Free blocks in held pages, plus whole pages the page allocator can give
        (memory limit and device memory allowing), each counted at the
        smallest capacity a page may have. This manager's own allocations and
        frees and a new memory limit show at once; device memory other
        processes take shows within ``AVAILABLE_PAGES_TTL_S`` (until then
        :meth:`alloc` may return ``None`` although this figure allowed it).
        """
        now = time.monotonic()
        pa = self._pa
        if now >= self._pages_left_until or pa.limit_changes != self._pages_left_limit:
            self._pages_left_limit = pa.limit_changes
            self._pages_left = pa.available_pages()
            self._pages_left_until = now + AVAILABLE_PAGES_TTL_S
        return self._table.available(self._pages_left)

    def alloc(self, n: int) -> list[int] | None:
        """``n`` block ids, or ``None`` when there is no space (nothing changes then)."""
        out = self._table.alloc(n)  # ValueError for n < 0
        if out is not None:  # the hot path: blocks of held pages, no driver call
            return out
        table = self._table
        with self._grow_lock:
            self._pages_left_until = 0.0  # pages change hands: count them again
            while True:
                out = table.alloc(n)
                if out is not None:
                    return out
                grown = self._grow(n - table.free_in_pages)
                if not grown:
                    return None
                table.add_pages(grown)
                out = table.alloc(n)
                # Best-fit may leave a new page untouched when capacities differ: give it back.
                idle = table.release_idle(grown)
                if idle:
                    self._pa.free_pages(idle)
                if out is not None:
                    return out

    def expect(self, blocks: int) -> None:
        """The engine will ask for about ``blocks`` more blocks in its next steps: the pages
        for those beyond the free blocks of held pages are mapped ahead
        (:meth:`PageAllocator.expect`)."""
        deficit = blocks - self._table.free_in_pages
        self._pa.expect(-(-deficit // self._max_cap) if deficit > 0 else 0)

    def free(self, block_ids: Sequence[int]) -> None:
        """Return blocks; a page left with no allocated block goes back at once.

        Raises:
            MappingError: A block is not allocated (double free, never
                allocated, out of range, the null block) or repeats; nothing
                changes then.
        """
        release = self._table.free(block_ids)
        if release:
            self._pa.free_pages(release)
            self._pages_left_until = 0.0

    def allocated_ids(self) -> list[int]:
        """Blocks handed out by :meth:`alloc` and not freed, ascending (no null block)."""
        return self._table.allocated_ids()

    def clear(self) -> None:
        """Free every allocated block but the null block."""
        self.free(self._table.allocated_ids())

    def trim(self) -> int:
        """Unmap the page allocator's reserve now; returns the pages unmapped."""
        return self._pa.trim()

    # ------------------------------------------------------------ internals

    def _grow(self, deficit: int) -> list[int]:
        """New pages for ``deficit`` more blocks, all or nothing (``[]`` when no space)."""
        got: list[int] = []
        while deficit > 0:
            pages = self._pa.alloc_pages(-(-deficit // self._max_cap))
            if pages is None:
                if got:
                    self._pa.free_pages(got)
                return []
            got += pages
            deficit -= sum(self._caps[p] for p in pages)
        return got

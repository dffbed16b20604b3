"""The scheduler-side elastic block pool: a real vLLM ``BlockPool`` subclass.

``ElasticBlockPool`` runs ``BlockPool.__init__`` so every piece of base state
exists (``blocks``, ``free_block_queue``, the hash maps, the null block 0,
event queue, metrics) and every inherited method keeps working. What changes is
who owns a block:

* **free** blocks belong to kvcached's :class:`~kvcached_core.allocator.KVBlockManager`
  (its page may be unmapped): they are *not* in ``free_block_queue``;
* **in use** blocks (``ref_cnt > 0``) are allocated in kvcached, as in vLLM;
* **evictable** blocks (``ref_cnt == 0`` but still holding a prefix-cache hash,
  or released by ``unpin_blocks``) stay allocated in kvcached, so their page stays
  mapped, and sit in ``free_block_queue`` in vLLM's LRU order. ``touch``,
  ``get_cached_block``, ``cache_full_blocks``, ``move_block_hashes`` ... work on
  them unchanged.

``get_num_free_blocks`` is kvcached's ``available_size()`` plus the evictable
blocks. Evicting goes page-aware: pages whose every allocated block is evictable
go first (LRU among them), so evicting actually unmaps memory. Evictable blocks
stay as long as vLLM would keep them (its prefix-cache hits are vLLM's own)
until kvcached asks for their pages (:meth:`ElasticBlockPool.give_back_pages`:
an idle spell, the device budget, a limit, a device short of its headroom), or
beyond an explicit ``KVCACHED_MAX_CACHED_TOKENS`` cap. The free queue counts its blocks
per page as they come and go, so finding whole pages costs a look at each page
the queue touches, not at each block: the requests that finish together at the
end of a burst each pay for what they evict, not for the size of the cache.

Block objects follow the memory used, not the address space: vLLM makes one
``KVCacheBlock`` per block at start (and links them all into its free queue);
kvcached's pool reserves far more blocks than it ever maps, so ``blocks`` here
is a :class:`LazyBlocks` that makes a block the first time its id is used. The
engine starts, collects garbage and exits with the blocks it has used.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue

from kvcached_core.allocator import KVBlockManager

from kvcached_vllm.errors import KVPoolExhausted

__all__ = ["ElasticBlockPool", "KVPoolExhausted", "LazyBlocks"]


class _PageCountingQueue(FreeKVCacheBlockQueue):
    """vLLM's free-block queue that also counts its blocks per page.

    Every change to the queue goes through these methods (vLLM's own code and
    the pool's alike), so ``per_page`` is exact; ``touched`` orders pages by the
    last time a block of theirs joined the queue (least recent first).
    """

    def __init__(self, page_of: Any) -> None:
        super().__init__([])
        self._page_of = page_of
        self.per_page: dict[int, int] = {}
        self.touched: dict[int, None] = {}  # insertion-ordered: least recently joined first

    def _joined(self, blocks: Iterable[Any]) -> None:
        per_page, touched, page_of = self.per_page, self.touched, self._page_of
        for block in blocks:
            page = page_of(block.block_id)
            per_page[page] = per_page.get(page, 0) + 1
            touched.pop(page, None)
            touched[page] = None

    def _left(self, blocks: Iterable[Any]) -> None:
        per_page, page_of = self.per_page, self._page_of
        for block in blocks:
            page = page_of(block.block_id)
            left = per_page[page] - 1
            if left:
                per_page[page] = left
            else:
                del per_page[page]
                self.touched.pop(page, None)

    def popleft(self) -> Any:
        block = super().popleft()
        self._left((block,))
        return block

    def popleft_n(self, n: int) -> list[Any]:
        blocks = super().popleft_n(n)
        self._left(blocks)
        return blocks

    def remove(self, block: Any) -> None:
        super().remove(block)
        self._left((block,))

    def append(self, block: Any) -> None:
        super().append(block)
        self._joined((block,))

    def append_n(self, blocks: Any) -> None:
        blocks = list(blocks)
        super().append_n(blocks)
        self._joined(blocks)

    def prepend_n(self, blocks: Any) -> None:
        blocks = list(blocks)
        super().prepend_n(blocks)
        self._joined(blocks)

class LazyBlocks(dict):
    """``BlockPool.blocks`` for a pool of ``n`` blocks whose objects are made on first use.

    Indexed by block id like vLLM's list (``blocks[i]`` makes block ``i`` the first time,
    through dict's ``__missing__``, so a hit costs a dict lookup); ``len`` is ``n``;
    iterating gives the blocks made so far, the only ones that can hold a hash.

    Args:
        n: The pool's block count (``num_gpu_blocks``).
        null: Block 0, vLLM's null block, already made.
        make: Makes block ``i`` (``KVCacheBlock(i, ...)`` as vLLM's pool would).
    """

    __slots__ = ("_n", "_make")

    def __init__(self, n: int, null: Any, make: Any) -> None:
        super().__init__()
        self._n = n
        self._make = make
        self[null.block_id] = null

    def __missing__(self, block_id: int) -> Any:
        if not 0 <= block_id < self._n:
            raise IndexError(f"block id {block_id} is outside the pool's {self._n} blocks")
        block = self[block_id] = self._make(block_id)
        return block

    def __len__(self) -> int:
        return self._n

    def __iter__(self) -> Any:
        return iter(self.values())

    def made(self) -> int:
        """How many block objects exist."""
        return dict.__len__(self)


def _block_maker(null: Any) -> Any:
    """Makes ``KVCacheBlock(i)`` naming the pool as the null block does (vLLM >= 0.30 blocks
    name their pool: the pool itself, or from 0.34 a weak reference to it)."""
    cls = type(null)
    if hasattr(null, "pool"):
        return lambda i: cls(i, pool=null.pool)
    return cls


log = logging.getLogger("kvcached.vllm")


class ElasticBlockPool(BlockPool):
    """A ``BlockPool`` whose blocks are backed page by page by kvcached.

    Args:
        *args, **kwargs: ``BlockPool``'s own arguments, passed through untouched.
        block_manager: kvcached's block manager for this pool; its block ids
            are vLLM's block ids and its null block is block 0.
        max_cached_blocks: Most evictable (prefix-cached) blocks kept mapped;
            ``None`` for no cap.
    """

    #: vLLM >= 0.32 sets its own in ``__init__`` (``unpin_blocks`` watchers).
    _reuse_watchers: dict | None = None

    def __init__(
        self,
        num_gpu_blocks: int,
        *args: Any,
        block_manager: KVBlockManager,
        max_cached_blocks: int | None = None,
        **kwargs: Any,
    ) -> None:
        # vLLM's own set-up for the null block alone: the other blocks are made on first use
        # and none is free in vLLM's queue (free blocks live in kvcached).
        super().__init__(1, *args, **kwargs)
        if block_manager.null_block != self.null_block.block_id:
            raise ValueError("kvcached's null block must be vLLM's null block 0")
        if block_manager.num_blocks != num_gpu_blocks:
            raise ValueError(
                f"kvcached manages {block_manager.num_blocks} blocks, vLLM {num_gpu_blocks}"
            )
        one = self.blocks
        self.num_gpu_blocks = num_gpu_blocks
        self.blocks = LazyBlocks(num_gpu_blocks, self.null_block, _block_maker(self.null_block))
        cached = self.cached_block_hash_to_block  # vLLM >= 0.34 maps hashes to block ids
        if getattr(cached, "_blocks", None) is one:
            cached._blocks = self.blocks
        self.free_block_queue = _PageCountingQueue(block_manager.page_of)
        self.kv_block_manager = block_manager
        self._kv_alloc = block_manager.alloc  # bound once: the hot path
        self._kv_free = block_manager.free
        # What this pool's blocks name as their pool (vLLM >= 0.30: the pool, from 0.34 a
        # weak reference to it; before, blocks name none).
        self._own_mark = getattr(self.null_block, "pool", None)
        self.max_cached_blocks = max_cached_blocks
        self._resetting = False

    # ------------------------------------------------------------ allocation

    def get_new_blocks(self, num_blocks: int) -> list:
        """``num_blocks`` fresh blocks (``ref_cnt`` 1), evicting cached ones if needed.

        Raises:
            KVPoolExhausted: kvcached cannot back them even after evicting.
        """
        ids = self._kv_alloc(num_blocks)  # the hot path: one native call
        if ids is None:
            ids = self._alloc_evicting(num_blocks)
        blocks = self.blocks
        if num_blocks == 1:  # the commonest request (one more block for a decode step)
            block = blocks[ids[0]]
            block.ref_cnt = 1
            ret = [block]
        else:
            ret = [blocks[i] for i in ids]
            for block in ret:
                block.ref_cnt = 1
        metrics = self.metrics_collector
        if metrics:
            for block in ret:
                metrics.on_block_allocated(block)
        return ret

    def _alloc_evicting(self, num_blocks: int) -> list[int]:
        """Block ids once evictable blocks made room; raises when they cannot."""
        kv = self.kv_block_manager
        ids = None
        queued = self.free_block_queue.num_free_blocks
        while ids is None and queued:
            self._evict(max(1, num_blocks - kv.available_size()))
            ids = kv.alloc(num_blocks)
            left = self.free_block_queue.num_free_blocks
            if left == queued:
                break
            queued = left
        if ids is None:
            raise KVPoolExhausted(
                f"kvcached cannot back {num_blocks} KV blocks now "
                f"({kv.available_size()} available; memory limit or device memory)"
            )
        return ids

    def free_blocks(self, ordered_blocks: Iterable[Any], evict_first: bool = False) -> None:
        """Drop one reference from each block; blocks no longer used go back to kvcached.

        Blocks still holding a prefix-cache hash stay mapped as evictable (LRU
        order as in vLLM) up to ``max_cached_blocks``; with ``evict_first`` (vLLM >=
        0.34) at the front of that order. A block still watched by
        ``unpin_blocks``'s caller is reported reused when it goes back. Blocks of
        another pool (vLLM >= 0.30 defers frees that may mix pools) go to their pool.
        """
        release: list[int] = []
        cached: list[Any] = []
        others: dict[Any, list[Any]] | None = None
        null = self.null_block
        caching = self.enable_caching
        me = self._own_mark
        for block in ordered_blocks:
            if me is not None:
                owner = block.pool
                if owner is not me and owner is not None:
                    pool = self._pool_of(owner)
                    if pool is not None:  # a pool already gone took its blocks with it
                        if others is None:
                            others = {}
                        others.setdefault(pool, []).append(block)
                    continue
            block.ref_cnt -= 1
            if not block.ref_cnt and block is not null:
                if caching and block.block_hash is not None:
                    cached.append(block)
                else:
                    release.append(block.block_id)
        self._put_back(release, cached, evict_first=evict_first)
        if others:
            for pool, blocks in others.items():
                if evict_first:
                    pool.free_blocks(blocks, evict_first=True)
                else:
                    pool.free_blocks(blocks)

    @staticmethod
    def _pool_of(owner: Any) -> Any:
        """The pool a block's ``pool`` field names (vLLM 0.30-0.33: the pool itself)."""
        return owner

    def _put_back(self, release: list[int], cached: list[Any], *,
                  evict_first: bool = False) -> None:
        """Blocks whose last reference went: the uncached ones back to kvcached, the cached
        ones into the free queue (at its front with ``evict_first``: first to be evicted),
        which is then held to ``max_cached_blocks``."""
        if release:
            if self._reuse_watchers:
                self._notify_reuse([self.blocks[i] for i in release])
            self._kv_free(release)
        if cached:
            queue = self.free_block_queue
            if evict_first:
                queue.prepend_n(cached)
                first = dict.fromkeys(queue._page_of(b.block_id) for b in cached)
                queue.touched = {**first, **{p: None for p in queue.touched if p not in first}}
            else:
                queue.append_n(cached)
            cap = self.max_cached_blocks
            if cap is not None and queue.num_free_blocks > cap:
                self._evict(queue.num_free_blocks - cap)

    def get_num_free_blocks(self) -> int:
        """Blocks ``get_new_blocks`` can hand out now: kvcached's room plus the evictable."""
        if self._resetting:
            return self.num_gpu_blocks - 1
        return self.kv_block_manager.available_size() + self.free_block_queue.num_free_blocks

    # ------------------------------------------------------------ eviction

    def _evict(self, n: int) -> int:
        """Evict at least ``n`` evictable blocks (fewer if there are not as many).

        Whole pages go first: a page whose allocated blocks are all evictable
        is unmapped once they are freed. Among such pages, and then among the
        rest, the least recently used go first (by the last time a block of
        the page became evictable). Returns the blocks evicted.
        """
        queue = self.free_block_queue
        if n <= 0 or not queue.num_free_blocks:
            return 0
        occupancy, per_page = self.kv_block_manager.page_occupancy, queue.per_page
        victims: list[Any] = []
        partly: list[int] = []
        # Least recently used first, and only as far as needed: with the address space full
        # of cached blocks every allocation evicts, and the first page usually suffices.
        for page in queue.touched:  # unchanged until the release below
            if per_page[page] == occupancy(page):
                victims += self._queued_in_page(page)
                if len(victims) >= n:
                    break
            else:
                partly.append(page)
        else:  # then blocks of partly evictable pages, only as many as needed
            for page in partly:
                if len(victims) >= n:
                    break
                victims += self._queued_in_page(page)[: n - len(victims)]
        self._release_evictable(victims)
        return len(victims)

    def _queued_in_page(self, page: int) -> list[Any]:
        """The blocks of ``page`` in the free queue (members have queue links)."""
        made = self.blocks.get  # a block never made is in no queue
        return [b for b in map(made, self.kv_block_manager.blocks_in_page(page))
                if b is not None and b.prev_free_block is not None and b.ref_cnt == 0]

    def give_back_pages(self, n: int) -> int:
        """Evict the cached blocks of up to ``n`` pages that hold nothing else (LRU first).

        The hook kvcached calls when the pool idles for ``KVCACHED_CACHE_IDLE_S``,
        the device budget asks for memory, a lower limit arrives or the device is
        short of its headroom: only whole pages free memory, so partly used pages
        keep their cached blocks. Returns the pages freed. Call it with the
        scheduler's lock held (the pool is not thread-safe).
        """
        queue = self.free_block_queue
        if n <= 0 or not queue.num_free_blocks:
            return 0
        occupancy, per_page = self.kv_block_manager.page_occupancy, queue.per_page
        victims: list[Any] = []
        pages = 0
        for page in list(queue.touched):  # least recently used first
            if pages >= n:
                break
            if per_page[page] == occupancy(page):
                victims += self._queued_in_page(page)
                pages += 1
        if victims:
            self._release_evictable(victims)
            log.debug("kvcached: evicted %d cached blocks (%d pages) to give memory back",
                      len(victims), pages)
        return pages

    def _release_evictable(self, victims: list[Any]) -> None:
        queue = self.free_block_queue
        for block in victims:
            queue.remove(block)
            self._maybe_evict_cached_block(block)
        if self._reuse_watchers:
            self._notify_reuse(victims)
        if victims:
            self.kv_block_manager.free([b.block_id for b in victims])

    def evict_blocks(self, block_ids: set[int]) -> None:
        """vLLM's eviction by id; evicted blocks nobody uses go back to kvcached at once."""
        super().evict_blocks(block_ids)
        blocks = self.blocks
        stale = [
            blocks[i]
            for i in block_ids
            if blocks[i].ref_cnt == 0
            and blocks[i].block_hash is None
            and blocks[i].prev_free_block is not None
        ]
        if stale:
            self._release_evictable(stale)

    def reset_prefix_cache(self) -> bool:
        """vLLM's reset, after returning every evictable block to kvcached."""
        kv = self.kv_block_manager
        in_use = kv.num_allocated - 1 - self.free_block_queue.num_free_blocks
        if in_use:
            log.warning("Failed to reset prefix cache because some blocks (%d) are not freed yet",
                        in_use)
            return False
        self._release_evictable(self.free_block_queue.get_all_free_blocks())
        self._resetting = True
        try:
            return super().reset_prefix_cache()
        finally:
            self._resetting = False

"""The elastic block pool for vLLM >= 0.34, whose blocks name their pool through a weak reference.

vLLM 0.34 changed two things :meth:`ElasticBlockPool.free_blocks` relies on:

* ``KVCacheBlock.pool`` holds ``weakref.ref(pool)`` (``BlockPool._weak_self``),
  no longer the pool: a block is this pool's when its ``pool`` *is*
  ``self._weak_self``, and a block of another pool (deferred frees may mix
  pools) is freed by the pool the reference still points to, or dropped with
  that pool;
* ``free_blocks(ordered_blocks, evict_first=False)``: with ``evict_first``
  (vLLM's simple CPU offload, for blocks another tier already holds) the
  freed cached blocks go to the front of the free queue, to be evicted before
  other cached blocks. kvcached evicts by page, so their pages move to the
  front of the queue's page order (least recently used first).

Everything else is :class:`~kvcached_vllm.block_pool.ElasticBlockPool`'s.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kvcached_vllm.block_pool import ElasticBlockPool

__all__ = ["ElasticBlockPool034"]


class ElasticBlockPool034(ElasticBlockPool):
    """:class:`ElasticBlockPool` for vLLM >= 0.34 (see the module docs)."""

    def free_blocks(self, ordered_blocks: Iterable[Any], evict_first: bool = False) -> None:
        """Drop one reference from each block; blocks no longer used go back to kvcached.

        As :meth:`ElasticBlockPool.free_blocks`, with vLLM 0.34's weak pool
        references and ``evict_first`` (see the module docs).
        """
        release: list[int] = []
        cached: list[Any] = []
        others: dict[Any, list[Any]] | None = None
        null = self.null_block
        caching = self.enable_caching
        me = self._weak_self
        for block in ordered_blocks:
            owner = block.pool
            if owner is not None and owner is not me:
                pool = owner()
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
                pool.free_blocks(blocks, evict_first=evict_first)

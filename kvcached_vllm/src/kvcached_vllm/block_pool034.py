"""The elastic block pool for vLLM >= 0.34, whose blocks name their pool through a weak reference.

vLLM 0.34 changed two things :meth:`ElasticBlockPool.free_blocks` relies on:

* ``KVCacheBlock.pool`` holds ``weakref.ref(pool)`` (``BlockPool._weak_self``),
  no longer the pool: a block is this pool's when its ``pool`` *is*
  ``self._weak_self``, and a block of another pool (deferred frees may mix
  pools) is freed by the pool the reference still points to, or dropped with
  that pool (this class: :meth:`_pool_of`);
* ``free_blocks(ordered_blocks, evict_first=False)``: with ``evict_first``
  (vLLM's simple CPU offload, for blocks another tier already holds) the
  freed cached blocks go to the front of the free queue, to be evicted before
  other cached blocks. kvcached evicts by page, so their pages move to the
  front of the queue's page order (least recently used first); the base
  class takes ``evict_first`` on every release.

Everything else is :class:`~kvcached_vllm.block_pool.ElasticBlockPool`'s.
"""

from __future__ import annotations

from typing import Any

from kvcached_vllm.block_pool import ElasticBlockPool

__all__ = ["ElasticBlockPool034"]


class ElasticBlockPool034(ElasticBlockPool):
    """:class:`ElasticBlockPool` for vLLM >= 0.34 (see the module docs)."""

    @staticmethod
    def _pool_of(owner: Any) -> Any:
        """The pool a block's weak ``pool`` reference points to (``None``: gone)."""
        return owner()

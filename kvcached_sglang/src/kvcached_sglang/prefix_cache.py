"""Returning prefix-cache memory at SGLang's idle points, when there is a reason.

SGLang's radix cache keeps every finished request's KV until memory pressure
evicts it; with kvcached it does the same (its hits are SGLang's own) until
the pool's allocator asks for pages back: another engine's ask for memory (the
device budget of :mod:`kvcached_core.ipc.budget`), a lowered ``kvctl limit``,
an idle spell of ``KVCACHED_CACHE_IDLE_S``, or a device short of its
``KVCACHED_GPU_UTILIZATION`` headroom. The allocator gives back its reserve at
once from its background thread and asks
:class:`~kvcached_sglang.memory_pool.ElasticKV` for whole pages of prefix
cache, which the scheduler evicts here, when it is idle (the same moments SGLang
runs its idle leak check, where :mod:`kvcached_sglang.patches` already hooks
in), through the cache's own ``evict`` (least recently used leaves first), and
unmaps right away. A busy scheduler gives back its cache when it next goes
idle. An explicit ``KVCACHED_MAX_CACHED_TOKENS`` cap (default: none) also
evicts the cached tokens beyond it at every idle point.

Only SGLang's plain radix cache over a pool kvcached backs is capped:
``RadixCache``, and from 0.5.2x the default ``UnifiedRadixCache`` when it holds
full-attention KV only (no SWA or Mamba component, no hierarchical tier).
Subclasses with other tiers (LMCache, hierarchical) and static pools keep
SGLang's behaviour.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from kvcached_core.config import max_cached_tokens

from kvcached_sglang.memory_pool import elastic_of

__all__ = ["trim_prefix_cache"]

_log = logging.getLogger("kvcached")
_failed = False
#: The tree caches kvcached trims: module -> class name (exact class, no subclass).
_CACHES = {"sglang.srt.mem_cache.radix_cache": "RadixCache",
           "sglang.srt.mem_cache.unified_radix_cache": "UnifiedRadixCache"}


def trim_prefix_cache(scheduler: Any) -> int:
    """Evict the idle scheduler's cached tokens beyond the cap; returns the tokens evicted.

    Never raises: trimming the cache is an optimisation, and the caller is
    SGLang's idle path.
    """
    global _failed
    if _failed:
        return 0
    try:
        return _trim(scheduler)
    except Exception:  # never disturb SGLang's idle path; say it once, then stop trying
        _failed = True
        _log.warning("kvcached: trimming the prefix cache failed; the cache keeps SGLang's "
                     "own eviction from now on", exc_info=True)
        return 0


def _trim(scheduler: Any) -> int:
    tree = getattr(scheduler, "tree_cache", None)
    cls = type(tree)
    if _CACHES.get(cls.__module__) != cls.__name__:
        return 0
    if getattr(tree, "cache_controller", None) is not None:  # a hierarchical tier
        return 0
    for other in ("supports_swa", "supports_mamba"):
        probe = getattr(tree, other, None)
        if probe is not None and probe():
            return 0
    allocator = getattr(scheduler, "token_to_kv_pool_allocator", None)
    get_kvcache = getattr(allocator, "get_kvcache", None)
    state = elastic_of(get_kvcache()) if get_kvcache is not None else None
    if state is None:
        return 0
    asked, ask = state.take_eviction_ask()
    cap = max_cached_tokens()
    before = int(tree.evictable_size())
    excess = max(0 if cap is None else before - cap, min(asked, before))
    if excess <= 0:
        return 0
    params = getattr(sys.modules[cls.__module__], "EvictParams", None)  # 0.5.9+
    mapped = state.pages.num_mapped
    tree.evict(params(num_tokens=excess) if params is not None else excess)
    evicted = before - int(tree.evictable_size())
    if asked:  # another engine waits: the emptied pages go now, not at the idle trim
        state.pages.trim()
        state.pool.gave_back(mapped - state.pages.num_mapped, ask)
    _log.debug("kvcached: idle, evicted %d cached tokens (cap %s, %d asked back)",
               evicted, cap, asked)
    return evicted

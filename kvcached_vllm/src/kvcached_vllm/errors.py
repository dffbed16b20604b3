"""Exceptions of the vLLM adapter (importable without vLLM)."""

from __future__ import annotations

from kvcached_core.errors import KVCachedError

__all__ = ["KVPoolExhausted"]


class KVPoolExhausted(KVCachedError, ValueError):
    """kvcached has no room for the KV blocks asked for (memory limit or device memory).

    ``KVCacheManager.allocate_slots`` turns it into ``None``: a scheduling miss
    (the request waits, or a running one is preempted), never a crash.
    """

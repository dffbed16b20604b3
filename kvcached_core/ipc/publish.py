"""Publishing a pool's usage and its map / unmap latency to its shared-memory segment.

:func:`publish_pool` wraps the ``map_pages`` / ``unmap_pages`` of a page
allocator's backing (local :class:`~kvcached_core.allocator.KVTensors` or
:class:`~kvcached_core.ipc.remote.RemoteKVTensors`) so that every call is timed
into the segment's latency histograms and followed by a fresh reading of the
allocator's bytes. ``kvctl``, ``kvtop`` and the Prometheus collector
(:mod:`kvcached_core.metrics`) read those records, so they agree with the
allocator and never create a device context of their own::

    segment = PoolSegment.create(namespace, "kv0", capacity=layout.total_bytes)
    pages.watch_limit(publish_pool(tensors, pages, segment))  # kvctl limit reaches it too
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["PoolPublisher", "publish_pool"]

_log = logging.getLogger("kvcached")

#: The backing's own state: the publisher its timed ``map_pages`` / ``unmap_pages`` report to.
_PUBLISHER_ATTR = "_kvcached_publisher"


class PoolPublisher:
    """What :func:`publish_pool` returns: publish now, or be the allocator's limit source.

    As the source of :meth:`PageAllocator.watch_limit` it also republishes the
    pool's bytes on every poll (every few tens of ms, from the allocator's
    background thread), so allocations served from the reserve, which map
    nothing, show up without waiting for the next map.
    """

    def __init__(self, pages: Any, segment: Any) -> None:
        self.pages = pages
        self.segment = segment
        # Only ever held around segment writes, never while taking the allocator's
        # lock: its background thread publishes while holding that lock.
        self._lock = threading.Lock()

    def publish(self, observed: tuple[str, float, int] | None = None) -> None:
        """Publish the allocator's bytes (and one timed call, if given)."""
        try:
            st = self.pages.stats()
            with self._lock:
                if observed is not None:
                    self.segment.observe(*observed)
                self.segment.update(used=st.in_use * st.page_bytes,
                                    reserved=st.reserved * st.page_bytes, mapped=st.mapped_bytes)
        except Exception:  # accounting must never break mapping
            _log.debug("kvcached: publishing pool stats failed", exc_info=True)

    def poll_limit(self) -> int | None:
        """Publish, then the segment's new limit (see :meth:`PoolSegment.poll_limit`)."""
        self.publish()
        return self.segment.poll_limit()


def publish_pool(backing: Any, pages: Any, segment: Any) -> PoolPublisher:
    """Time ``backing``'s map / unmap calls into ``segment`` and publish ``pages``' bytes.

    Pass the result to ``pages.watch_limit`` so that ``kvctl limit`` reaches the
    allocator and idle changes are published too. Publishing a backing again
    times its calls into the new segment (they are wrapped once).
    """
    publisher = PoolPublisher(pages, segment)
    page_bytes = int(backing.page_bytes)

    def timed(kind: str, call: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(call)
        def run(page_ids: Any, *args: Any, **kwargs: Any) -> Any:
            page_ids = list(page_ids)
            start = time.perf_counter()
            try:
                return call(page_ids, *args, **kwargs)
            finally:
                getattr(backing, _PUBLISHER_ATTR).publish(
                    (kind, time.perf_counter() - start, len(page_ids) * page_bytes))

        return run

    timed_already = getattr(backing, _PUBLISHER_ATTR, None) is not None
    setattr(backing, _PUBLISHER_ATTR, publisher)
    if not timed_already:
        backing.map_pages = timed("map", backing.map_pages)
        backing.unmap_pages = timed("unmap", backing.unmap_pages)
    publisher.publish()
    return publisher

"""Scheduler side: kvcached's page and block allocators driving the workers' memory.

The engine-core process owns no KV memory (the workers do, in other processes
on CPU and at TP > 1), so its allocator works on :class:`RemoteKVTensors`: a
stand-in for :class:`~kvcached_core.allocator.KVTensors` whose map / unmap are
broadcast to every worker (all TP ranks of all PP stages) over kvcached's IPC
sockets, and which publishes the pool's bytes to a shared-memory segment that
``kvctl`` reads and sets limits through.

:func:`scheduler_context` is entered around ``Scheduler.__init__`` (it has the
``VllmConfig`` and the ``KVCacheConfig``); :func:`make_block_pool` replaces the
``BlockPool`` name the KV cache coordinator instantiates and builds the
:class:`~kvcached_vllm.pool.ElasticBlockPool` when a context is active.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from kvcached_core.allocator import KVBlockManager, KVLayout, PageAllocator
from kvcached_core.device import Device
from kvcached_core.config import max_cached_tokens
from kvcached_core.errors import DeviceOutOfMemoryError, IPCError, WorkerError
from kvcached_core.ipc import PoolSegment, WorkerGroup

from kvcached_vllm.geometry import KVGeometry, block_offset_for

__all__ = [
    "ElasticRuntime",
    "RemoteKVTensors",
    "instance_namespace",
    "make_block_pool",
    "runtimes",
    "scheduler_context",
]

log = logging.getLogger("kvcached.vllm")

#: Default idle time before the reserve of mapped pages is released (vLLM adapter).
DEFAULT_IDLE_TRIM_S = 1.0
#: Default reserved pages the idle trim leaves mapped: the next burst's first
#: allocation takes one without waiting for the worker (the shrink target
#: allows one page bundle above the live data).
DEFAULT_IDLE_KEEP_PAGES = 1


def instance_namespace(vllm_config: Any) -> str:
    """The IPC namespace shared by the engine core and the workers of one engine.

    ``KVCACHED_IPC_NAME`` when set; else derived from vLLM's ``instance_id``
    (every process of an engine gets the same ``VllmConfig``) and the data
    parallel rank.
    """
    from kvcached_core.ipc import namespace

    dp = getattr(vllm_config.parallel_config, "data_parallel_rank", 0) or 0
    return namespace(f"vllm-{vllm_config.instance_id}-dp{dp}")


class _RemoteMapper:
    """The slice of the ``PageMapper`` interface the page allocator uses, for remote memory."""

    granularity = 4096
    backend = "host"
    device = 0

    def trim_pool(self, keep: int = 0) -> int:  # the workers keep their own pools small
        return 0

    def mem_info(self) -> tuple[int, int]:
        return (0, 0)


class RemoteKVTensors:
    """KV tensors that live in the workers: page map / unmap are broadcast to them.

    Duck-types :class:`~kvcached_core.allocator.KVTensors` for
    :class:`~kvcached_core.allocator.PageAllocator`. A worker that runs out of
    memory makes :meth:`map_pages` raise
    :class:`~kvcached_core.errors.DeviceOutOfMemoryError` after the workers that
    did map are rolled back, so the allocator reports "no space".

    Args:
        layout: The pool geometry (one "layer" per region, one buffer).
        workers: Connections to every worker of the engine.
        group: KV group id sent with each request.
        segment: Shared-memory segment to publish bytes to (optional).
    """

    def __init__(self, layout: KVLayout, workers: WorkerGroup, group: int = 0,
                 segment: PoolSegment | None = None) -> None:
        self.layout = layout
        self.workers = workers
        self.group = group
        self.segment = segment
        self.mapper = _RemoteMapper()
        self.device = Device("host", 0, "cpu")
        self._mapped: set[int] = set()
        self._lock = threading.RLock()
        self.allocator: PageAllocator | None = None  # set by the owner, for the segment

    num_pages = property(lambda self: self.layout.num_pages)
    page_bytes = property(lambda self: self.layout.page_bytes)
    handles_per_page = property(lambda self: self.layout.num_tensors)

    def map_pages(self, page_ids: Sequence[int]) -> None:
        pages = list(page_ids)
        try:
            self.workers.map(self.group, pages)
        except WorkerError as exc:
            if exc.succeeded:
                with contextlib.suppress(Exception):
                    self._unmap_on(exc.succeeded, pages)
            if "OutOfMemory" in exc.cause or "out of memory" in exc.cause.lower():
                raise DeviceOutOfMemoryError(str(exc)) from exc
            raise
        with self._lock:
            self._mapped.update(pages)
        self._publish()

    def _unmap_on(self, ranks: Sequence[tuple[int, int]], pages: list[int]) -> None:
        # A partial map cannot be undone per worker through the group API; unmap
        # everywhere and ignore "not mapped" answers from the workers that failed.
        try:
            self.workers.unmap(self.group, pages)
        except WorkerError:
            pass

    def unmap_pages(self, page_ids: Sequence[int], synchronize: bool = True) -> None:
        pages = list(page_ids)
        self.workers.unmap(self.group, pages)
        with self._lock:
            self._mapped.difference_update(pages)
        self._publish()

    def is_mapped(self, page_id: int) -> bool:
        return page_id in self._mapped

    @property
    def mapped_pages(self) -> int:
        return len(self._mapped)

    def _publish(self) -> None:
        seg, alloc = self.segment, self.allocator
        if seg is None or alloc is None:
            return
        try:
            with self._lock:  # the segment has one writer at a time
                st = alloc.stats()
                seg.update(used=st.in_use * st.page_bytes, reserved=st.reserved * st.page_bytes)
                limit = seg.poll_limit()
            if limit is not None:
                alloc.set_memory_limit(None if limit < 0 else limit)
        except Exception:  # accounting must never break scheduling
            log.debug("kvcached: publishing pool stats failed", exc_info=True)


@dataclass
class ElasticRuntime:
    """kvcached's state for one vLLM scheduler (one engine core)."""

    namespace: str
    geometry: KVGeometry
    workers: WorkerGroup
    tensors: RemoteKVTensors
    pages: PageAllocator
    blocks: KVBlockManager
    segment: PoolSegment | None
    max_cached_blocks: int | None

    def close(self) -> None:
        """Stop the background thread and drop the connections (workers keep their memory)."""
        self.pages.close()
        self.workers.close()
        if self.segment is not None:
            self.segment.close()


_RUNTIMES: list[ElasticRuntime] = []
_local = threading.local()


def runtimes() -> list[ElasticRuntime]:
    """The elastic runtimes created in this process (normally one)."""
    return list(_RUNTIMES)


def _max_cached_blocks(block_size: int) -> int | None:
    tokens = max_cached_tokens()
    return None if tokens is None else tokens // max(1, block_size)


def build_runtime(vllm_config: Any, kv_cache_config: Any) -> ElasticRuntime:
    """Connect to the workers and build the page and block allocators for one engine.

    Raises:
        KVCachedConfigError: The KV layout is not one kvcached can page.
        WorkerError: The workers are not listening (KV tensors not elastic).
    """
    geo = KVGeometry.from_config(
        kv_cache_config, block_offset=block_offset_for(vllm_config.device_config.device_type))
    ns = instance_namespace(vllm_config)
    par = vllm_config.parallel_config
    tp = int(par.tensor_parallel_size)
    pp = int(par.pipeline_parallel_size)
    workers = WorkerGroup.for_namespace(ns, tp_size=tp, pp_size=pp)
    layout = KVLayout(num_layers=geo.num_regions, buffer_bytes=geo.num_pages * geo.page_size,
                      page_size=geo.page_size, num_buffers=1)
    segment = None
    try:
        segment = PoolSegment.create(ns, "kv0", capacity=layout.total_bytes)
    except (IPCError, OSError) as exc:
        log.warning("kvcached: no shared-memory segment for kvctl (%s)", exc)
    tensors = RemoteKVTensors(layout, workers, 0, segment)
    overrides: dict[str, Any] = {}
    for var, key, value in (("KVCACHED_IDLE_TRIM_S", "idle_trim_s", DEFAULT_IDLE_TRIM_S),
                            ("KVCACHED_IDLE_KEEP_PAGES", "idle_keep", DEFAULT_IDLE_KEEP_PAGES)):
        if not os.environ.get(var, "").strip():
            overrides[key] = value
    pages = PageAllocator(tensors, **overrides)  # type: ignore[arg-type]
    tensors.allocator = pages
    blocks = KVBlockManager(pages, geo.block_bytes, num_blocks=geo.num_blocks,
                            block_offset=geo.block_offset)
    block_size = kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size
    rt = ElasticRuntime(ns, geo, workers, tensors, pages, blocks, segment,
                        _max_cached_blocks(block_size))
    _RUNTIMES.append(rt)
    log.info(
        "kvcached: elastic KV cache for vLLM: %d blocks of %d bytes (from byte %d) x %d regions, "
        "%d pages of %d MiB, TP=%d PP=%d, namespace %s, mapped now %d bytes", geo.num_blocks,
        geo.block_bytes, geo.block_offset, geo.num_regions, geo.num_pages, geo.page_size >> 20,
        tp, pp, ns,
        pages.num_mapped * geo.page_bytes)
    return rt


@contextlib.contextmanager
def scheduler_context(vllm_config: Any, kv_cache_config: Any) -> Iterator[None]:
    """While a ``Scheduler`` is built, :func:`make_block_pool` builds the elastic pool."""
    prev = getattr(_local, "pending", None)
    _local.pending = (vllm_config, kv_cache_config)
    try:
        yield
    finally:
        _local.pending = prev


def make_block_pool(original: type) -> Any:
    """The ``BlockPool`` the KV cache coordinator instantiates: elastic inside a scheduler."""

    def block_pool(*args: Any, **kwargs: Any) -> Any:
        pending = getattr(_local, "pending", None)
        if pending is None:
            return original(*args, **kwargs)
        _local.pending = None  # one pool per scheduler
        from kvcached_vllm.pool import ElasticBlockPool

        rt = build_runtime(*pending)
        return ElasticBlockPool(*args, block_manager=rt.blocks,
                                max_cached_blocks=rt.max_cached_blocks, **kwargs)

    block_pool.__wrapped__ = original  # type: ignore[attr-defined]
    block_pool.__qualname__ = "BlockPool"
    return block_pool

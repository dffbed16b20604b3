"""A page backing whose memory lives in worker processes.

An engine's scheduler process decides which KV pages are backed; its workers
(one per GPU, or the separate worker of a CPU engine) own the memory.
:class:`RemoteKVTensors` gives a :class:`~kvcached_core.allocator.PageAllocator`
the same backing interface as local :class:`~kvcached_core.allocator.KVTensors`,
with every map and unmap broadcast to all workers (every TP rank of every
pipeline stage) over kvcached's IPC sockets::

    kv = RemoteKVTensors(layout, endpoints, device=Device("cuda", 0, "cuda:0"))
    pages = PageAllocator(kv)         # keeps GPU headroom from the workers' readings

Each thread gets connections of its own, so the allocator's background work
(refills, unmapping) never queues a scheduling thread's map behind it. When
the only worker lives in this very process (one GPU: vLLM runs its worker in
the engine core), ``local_server`` is that worker's native page server and
requests go to it directly, without a socket round trip. A
worker that runs out of device memory makes :meth:`RemoteKVTensors.map_pages`
raise :class:`~kvcached_core.errors.WorkerOutOfMemoryError` (a ``MemoryError``,
which the allocator turns into "no space") after the workers that did map
have been rolled back. The free device memory the allocator keeps headroom
from is the smallest any worker reports.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence
from typing import Any

from kvcached_core.allocator.kv_tensors import KVLayout, _device_pages, host_memory_bytes
from kvcached_core.device import Device
from kvcached_core.errors import WorkerError
from kvcached_core.ipc.broadcast import Endpoint, WorkerGroup

__all__ = ["RemoteKVTensors"]

#: Mapping granularity assumed for remote memory (the workers check their own).
_GRANULARITY = 4096


class RemoteKVTensors:
    """KV tensors that live in the workers: page map / unmap are broadcast to them.

    Args:
        layout: The pool geometry in one worker (one "layer" per region).
        endpoints: The workers (see :class:`~kvcached_core.ipc.WorkerGroup`).
        group: KV group id sent with each request.
        device: The workers' device kind: on a GPU the allocator keeps
            headroom from what the workers report (``Device("host", 0, "cpu")``
            for CPU workers, the default).
        timeout, connect_timeout: As for :class:`~kvcached_core.ipc.WorkerGroup`.
        local_server: The native ``PageServer`` of the one worker, when it runs
            in this process: requests are applied to it directly.
    """

    def __init__(
        self,
        layout: KVLayout,
        endpoints: Sequence[Endpoint],
        group: int = 0,
        *,
        device: Device | None = None,
        timeout: float | None = None,
        connect_timeout: float | None = None,
        local_server: Any = None,
    ) -> None:
        if local_server is not None and len(endpoints) != 1:
            raise ValueError("a local page server stands for exactly one worker")
        self.layout = layout
        self._server = local_server
        self.group = group
        self.device = device or Device("host", 0, "cpu")
        self._endpoints = tuple(endpoints)
        self._timeouts = dict(timeout=timeout, connect_timeout=connect_timeout)
        self._local = threading.local()
        self._groups: list[WorkerGroup] = []
        self._mapped: set[int] = set()
        self._lock = threading.Lock()
        self.workers = self._connections()  # this thread's; also checks the endpoints

    num_pages = property(lambda self: self.layout.num_pages)
    page_bytes = property(lambda self: self.layout.page_bytes)
    handles_per_page = property(lambda self: self.layout.num_tensors)
    granularity = _GRANULARITY

    def _connections(self) -> WorkerGroup:
        """This thread's connections to every worker (opened on first use)."""
        workers = getattr(self._local, "workers", None)
        if workers is None:
            workers = WorkerGroup(self._endpoints, **self._timeouts)
            self._local.workers = workers
            with self._lock:
                self._groups.append(workers)
        return workers

    def connect(self) -> None:
        """Connect this thread to every worker now (instead of on the first request)."""
        self._connections().connect()

    def map_pages(self, page_ids: Sequence[int]) -> None:
        """Map ``page_ids`` on every worker, all or nothing.

        Raises:
            WorkerOutOfMemoryError: A worker had no memory (every worker is back
                where it was).
            WorkerError: A worker failed otherwise.
        """
        pages = list(page_ids)
        if self._server is not None:
            self._server.apply("map", self.group, pages)  # all or nothing, MemoryError typed
        else:
            try:
                self._connections().map(self.group, pages)
            except WorkerError as exc:
                if exc.succeeded:
                    with contextlib.suppress(WorkerError):
                        # Unmap everywhere; the workers that failed answer "not mapped".
                        self._connections().unmap(self.group, pages)
                raise
        with self._lock:
            self._mapped.update(pages)

    def unmap_pages(self, page_ids: Sequence[int], synchronize: bool = True) -> None:
        """Unmap ``page_ids`` on every worker (each waits for its queued device work)."""
        pages = list(page_ids)
        if self._server is not None:
            self._server.apply("unmap", self.group, pages)
        else:
            self._connections().unmap(self.group, pages)
        with self._lock:
            self._mapped.difference_update(pages)

    def is_mapped(self, page_id: int) -> bool:
        return page_id in self._mapped

    @property
    def mapped_pages(self) -> int:
        return len(self._mapped)

    def trim_spare_handles(self, keep_pages: int = 0) -> int:
        """The workers trim their own spare handles after every unmap: nothing to do."""
        return 0

    def _meminfo(self) -> list[tuple[int, int, int]]:
        """Each worker's ``(free, total, spare handles)`` reading of its device."""
        if self._server is not None:
            return [tuple(self._server.apply("meminfo", self.group, []))]
        return [tuple(r) for r in self._connections().meminfo(self.group)]

    def device_total(self) -> int:
        """Bytes of the smallest worker device (for host memory: the machine's memory)."""
        if not self.device.is_gpu:
            return host_memory_bytes()
        return min(int(total) for _, total, _ in self._meminfo())

    def free_device_pages(self, utilization: float) -> int:
        """Page ids every worker can still back while ``1 - utilization`` of its device stays
        free (negative: the pages the shortest is short of that headroom)."""
        return min(_device_pages(free, total, spare, utilization, self.page_bytes,
                                 self.handles_per_page) for free, total, spare in self._meminfo())

    def close(self) -> None:
        """Close every thread's connections (the workers keep their memory)."""
        with self._lock:
            groups, self._groups = self._groups, []
        for g in groups:
            g.close()

    def __repr__(self) -> str:
        return (f"<RemoteKVTensors {len(self._endpoints)} workers {self.device.torch_device} "
                f"pages={self.num_pages}x{self.page_bytes}B mapped={self.mapped_pages}>")


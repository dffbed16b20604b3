"""A plugin that serves a device type kvcached does not know, ``pymem``, from Python.

Its backend, ``pymem-mmap``, maps pages of anonymous host memory: a
reservation is one ``mmap`` region, mapping a page marks it backed (the kernel
commits it on first touch) and unmapping gives its memory back with
``MADV_DONTNEED``. Each ``pymem:N`` device holds :data:`CAPACITY` bytes, so
running out of it is a :class:`DeviceOutOfMemoryError` as on a GPU. It offers
what the allocator uses of a page mapper (:class:`kvcached_core.vmm.PageMapper`)
and nothing in kvcached_core knows about it.

Registered as ``[project.entry-points."kvcached.engines"] pymem =
"tests.plugins.pymem_backend"`` (the tests write that distribution), or with
``manager.add_plugin(pymem_backend, "pymem")``.
"""

from __future__ import annotations

import mmap
import threading
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

from kvcached_core import hookimpl
from kvcached_core.device import Device
from kvcached_core.errors import DeviceOutOfMemoryError, MappingError
from kvcached_core.plugins import BackendRecord

#: Bytes each ``pymem:N`` device can back.
CAPACITY = 64 << 20


class PyMemTensor:
    """One reservation: an anonymous mapping of ``size`` bytes."""

    def __init__(self, mapper: PyMemMapper, size: int) -> None:
        self.mapper = mapper
        self.size = size
        self.num_pages = size // mapper.page_size
        self._region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self._mapped: set[int] = set()
        self._view: Any = None

    @property
    def mapped_pages(self) -> int:
        return len(self._mapped)

    def is_mapped(self, page: int) -> bool:
        return page in self._mapped

    def dlpack(self) -> Any:
        """A uint8 torch tensor over the region (torch is imported on first use)."""
        if self._view is None:
            import torch

            self._view = torch.frombuffer(self._region, dtype=torch.uint8)
        return self._view

    def _release(self, page: int) -> None:
        size = self.mapper.page_size
        self._region.madvise(mmap.MADV_DONTNEED, page * size, size)


class PyMemGroup:
    """Reservations whose page ``p`` maps and unmaps together."""

    def __init__(self, mapper: PyMemMapper, tensors: Sequence[PyMemTensor]) -> None:
        for t in tensors:
            if not isinstance(t, PyMemTensor) or t.mapper is not mapper:
                raise MappingError(f"{t!r} is a tensor of another page mapper")
        self.mapper = mapper
        self.tensors = tuple(tensors)

    def map(self, pages: list[int]) -> None:
        self.mapper._map(self.tensors, pages)

    def unmap(self, pages: list[int], synchronize: bool = True) -> None:
        self.mapper._unmap(self.tensors, pages)


class PyMemMapper:
    """Pages of host memory for one ``pymem`` device (see the module docs)."""

    granularity = mmap.PAGESIZE

    def __init__(self, device: Device, page_size: int) -> None:
        if page_size % self.granularity:
            raise MappingError(
                f"page size {page_size} bytes is not a multiple of the granularity of "
                f"{self.granularity}"
            )
        self.backend = device.backend
        self.device = device.index
        self.torch_device = device.torch_device
        self.page_size = page_size
        self._lock = threading.Lock()
        self._mapped = 0  # pages backed, over every reservation
        self._created = self._released = 0

    def reserve(self, size: int) -> PyMemTensor:
        if size <= 0 or size % self.page_size:
            raise MappingError(f"size {size} bytes is not a multiple of the page size")
        return PyMemTensor(self, size)

    def group(self, tensors: Sequence[PyMemTensor]) -> PyMemGroup:
        return PyMemGroup(self, tensors)

    def map(self, tensors: Sequence[PyMemTensor], pages: list[int]) -> None:
        self.group(tensors).map(pages)

    def unmap(self, tensors: Sequence[PyMemTensor], pages: list[int],
              synchronize: bool = True) -> None:
        self.group(tensors).unmap(pages, synchronize)

    def _check(self, tensors: Sequence[PyMemTensor], pages: list[int], mapped: bool) -> None:
        if len(set(pages)) != len(pages):
            raise MappingError(f"a page appears twice in {pages}")
        for t in tensors:
            for p in pages:
                if not 0 <= p < t.num_pages:
                    raise MappingError(f"page {p} is outside a {t.num_pages}-page reservation")
                if (p in t._mapped) != mapped:
                    state = "already mapped" if not mapped else "not mapped"
                    raise MappingError(f"page {p} is {state}")

    def _map(self, tensors: Sequence[PyMemTensor], pages: list[int]) -> None:
        with self._lock:
            self._check(tensors, pages, mapped=False)
            wanted = len(pages) * len(tensors)
            if (self._mapped + wanted) * self.page_size > CAPACITY:
                raise DeviceOutOfMemoryError(
                    f"pymem:{self.device} cannot back {wanted} more pages of {self.page_size} bytes"
                )
            for t in tensors:
                t._mapped.update(pages)
            self._mapped += wanted
            self._created += wanted

    def _unmap(self, tensors: Sequence[PyMemTensor], pages: list[int]) -> None:
        with self._lock:
            self._check(tensors, pages, mapped=True)
            for t in tensors:
                for p in pages:
                    t._release(p)
                t._mapped.difference_update(pages)
            self._mapped -= len(pages) * len(tensors)
            self._released += len(pages) * len(tensors)

    def trim_pool(self, keep: int = 0) -> int:
        return 0  # nothing is pooled: an unmapped page goes straight back

    def mem_info(self) -> tuple[int, int]:
        with self._lock:
            return CAPACITY - self._mapped * self.page_size, CAPACITY

    def stats(self) -> SimpleNamespace:
        with self._lock:
            return SimpleNamespace(mapped_pages=self._mapped, pooled_handles=0,
                                   handles_created=self._created,
                                   handles_released=self._released, pool_limit=0)


@hookimpl
def kvcached_backends() -> BackendRecord:
    return BackendRecord(name="pymem-mmap", devices=("pymem",), torch_device="cpu",
                         description="host memory mapped from Python", factory=PyMemMapper)

"""Virtual tensors backed page by page: the Python face of the native mapper.

>>> mapper = open_mapper("cpu")                 # or "cuda:0", "hip:1"
>>> vt = mapper.reserve(64 << 20)               # address space only
>>> mapper.map([vt], [0, 1])                    # back pages 0 and 1
>>> t = as_tensor(vt, torch.float16)            # zero-copy torch view
>>> mapper.unmap([vt], [1])                     # page 1's handle is kept as a spare

An unmapped page's physical handle stays with the mapper as a *spare handle*
that the next map takes instead of creating one (the native mapper counts
them in ``stats().pooled_handles`` and releases them with ``trim_pool``).

``PageMapper.map`` raises :class:`~kvcached_core.errors.DeviceOutOfMemoryError`
when the device has no memory left (the batch is rolled back first), and
:class:`~kvcached_core.errors.MappingError` for a bad request.

A device served by a plugin's backend gets that backend's mapper, which offers
the part of the interface the allocator uses (:class:`PageMapper`).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from kvcached_core.device import Device, parse_device
from kvcached_core.env import shown
from kvcached_core.errors import KVCachedConfigError

if TYPE_CHECKING:
    import torch

DEFAULT_PAGE_SIZE = 2 << 20


def _native():
    from kvcached_core import _native

    return _native


#: The largest page size a mapper accepts (a compound page spans every layer).
MAX_PAGE_SIZE = 1 << 40


class VirtualTensor(Protocol):
    """One reservation of a :class:`PageMapper`, backed page by page."""

    @property
    def mapped_pages(self) -> int: ...

    def is_mapped(self, page: int) -> bool: ...

    def dlpack(self) -> Any:
        """What ``torch.from_dlpack`` takes: ``size`` uint8 bytes over the reservation."""


class PageGroup(Protocol):
    """Reservations mapped together: page ``p`` of each maps and unmaps at once."""

    def map(self, pages: list[int]) -> None:
        """Back ``pages`` in every reservation, all or nothing."""

    def unmap(self, pages: list[int], synchronize: bool = True) -> None: ...


class PageMapper(Protocol):
    """What the allocator uses of a page mapper.

    ``kvcached_core._native.PageMapper`` is the compiled one; a plugin backend's
    mapper offers the same, plus ``torch_device``, how torch names its device.
    """

    backend: str  #: the backend's name
    device: int  #: the device index
    page_size: int
    granularity: int  #: reservations are multiples of the page, pages of this

    def reserve(self, size: int) -> VirtualTensor:
        """Address space of ``size`` bytes (a multiple of the page), nothing mapped."""

    def group(self, tensors: Sequence[VirtualTensor]) -> PageGroup: ...

    def trim_pool(self, keep: int = 0) -> int:
        """Release recycled handles beyond ``keep``; how many were released."""

    def mem_info(self) -> tuple[int, int]:
        """``(free, total)`` bytes of the device."""

    def stats(self) -> Any:
        """At least ``mapped_pages`` and ``pooled_handles``."""


def open_mapper(device: Any = "cpu", page_size: int = DEFAULT_PAGE_SIZE) -> PageMapper:
    """A page mapper for one device: ``kvcached_core._native.PageMapper``, or
    the mapper of the plugin backend that serves the device.

    Raises:
        KVCachedConfigError: ``device`` is not a device string, or ``page_size``
            is not an integer in ``1..MAX_PAGE_SIZE``.
        MappingError: ``page_size`` is not a multiple of the device's granularity.
    """
    try:
        size = -1 if isinstance(page_size, bool) else operator.index(page_size)
    except TypeError:
        size = -1
    if not 0 < size <= MAX_PAGE_SIZE:
        raise KVCachedConfigError(
            f"page_size={shown(repr(page_size))} is not a page size in bytes "
            f"(an integer in 1..{MAX_PAGE_SIZE})"
        )
    dev = parse_device(device)
    if dev.provider is not None:
        return dev.provider.open_mapper(dev, size)
    return _native().PageMapper(dev.backend, dev.index, size)


def mapper_device(mapper: PageMapper) -> Device:
    """The :class:`Device` a mapper serves."""
    if mapper.backend == "host":
        return Device("host", 0, "cpu")
    named = getattr(mapper, "torch_device", None)  # a plugin backend's mapper names it
    return Device(mapper.backend, mapper.device, named or f"cuda:{mapper.device}")


def as_tensor(vt, dtype: "torch.dtype | None" = None) -> "torch.Tensor":
    """A 1-D zero-copy torch tensor over the whole virtual tensor.

    It keeps the reservation alive. Only mapped pages may be touched.
    """
    import torch

    t = torch.from_dlpack(vt.dlpack())
    return t if dtype is None or dtype == torch.uint8 else t.view(dtype)

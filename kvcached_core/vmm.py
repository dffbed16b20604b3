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
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING, Any

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


def open_mapper(device: Any = "cpu", page_size: int = DEFAULT_PAGE_SIZE):
    """A page mapper for one device (``kvcached_core._native.PageMapper``).

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
    return _native().PageMapper(dev.backend, dev.index, size)


def mapper_device(mapper) -> Device:
    """The :class:`Device` a mapper serves."""
    if mapper.backend == "host":
        return Device("host", 0, "cpu")
    return Device(mapper.backend, mapper.device, f"cuda:{mapper.device}")


def as_tensor(vt, dtype: "torch.dtype | None" = None) -> "torch.Tensor":
    """A 1-D zero-copy torch tensor over the whole virtual tensor.

    It keeps the reservation alive. Only mapped pages may be touched.
    """
    import torch

    t = torch.from_dlpack(vt.dlpack())
    return t if dtype is None or dtype == torch.uint8 else t.view(dtype)

"""The KV cache's virtual buffers: their layout, and page-level map / unmap.

A *page id* ``p`` names the same slice of every buffer of one KV group, so
backing page ``p`` makes block rows in every layer usable at once.

Two layouts
-----------
``per-layer`` (the default)
    One virtual tensor per (layer, buffer), each ``buffer_bytes`` (S) long:
    ``L * num_buffers`` tensors. Page ``p`` is the byte range
    ``[p*P, (p+1)*P)`` of each of them, where P is ``page_size``. The mapper is
    opened with page size P, and one page id costs ``L * num_buffers`` driver
    mappings.

``contiguous``
    ONE virtual tensor of ``S * L * num_buffers`` bytes, block-major: block
    ``b`` of layer ``l``, buffer ``k`` starts at
    ``b*L*kv*B + (l*kv + k)*B`` (B = bytes per block per buffer), so a layer's
    view is strided. Page ``p`` is a *compound* page of ``P * L * kv`` bytes:
    the mapper must be opened with :attr:`KVLayout.mapper_page_size`
    (``P * L * kv``), and one page id is one driver mapping.

In both layouts a block ``b`` of B bytes lives in page ``b*B // P`` and a page
id has the physical size :attr:`KVLayout.page_bytes` (``P * L * kv``), so the
block manager does the same arithmetic for either.

MLA (one latent buffer per layer) is ``num_buffers=1``: only one buffer is
reserved and mapped, never a phantom V half.

Groups and devices
------------------
A KV *group* is a set of layers sharing one page allocator: one
:class:`KVTensors` per group. Groups on one device may share a mapper when
their layouts agree on :attr:`KVLayout.mapper_page_size`. Several devices in
one process means one mapper each; nothing here is process-global.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvcached_core.config import contiguous_layout
from kvcached_core.device import Device
from kvcached_core.errors import KVCachedConfigError, MappingError
from kvcached_core.vmm import as_tensor, mapper_device, open_mapper

if TYPE_CHECKING:
    import torch

__all__ = ["K", "V", "KVLayout", "KVTensors"]

#: Buffer index of the keys (and of MLA's single latent buffer).
K = 0
#: Buffer index of the values.
V = 1


def _contiguous(explicit: bool | None) -> bool:
    """An explicit choice, else ``KVCACHED_CONTIGUOUS_LAYOUT`` (per-layer when unset)."""
    return contiguous_layout() if explicit is None else explicit


@dataclass(frozen=True)
class KVLayout:
    """Geometry of one KV group's virtual buffers.

    Attributes:
        num_layers: Layers in the group (L).
        buffer_bytes: Bytes of one layer's buffer (S), a multiple of ``page_size``.
        page_size: Bytes per page of one buffer (P): the unit of physical backing.
        num_buffers: 2 for separate K and V, 1 for MLA (one latent buffer).
        contiguous: One tensor for all layers with compound pages.
    """

    num_layers: int
    buffer_bytes: int
    page_size: int
    num_buffers: int = 2
    contiguous: bool = False

    def __post_init__(self) -> None:
        for name in ("num_layers", "buffer_bytes", "page_size", "num_buffers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise KVCachedConfigError(f"KVLayout {name}={value!r} must be a positive integer")
        if self.buffer_bytes % self.page_size:
            raise KVCachedConfigError(
                f"KVLayout buffer_bytes={self.buffer_bytes} is not a multiple of the page "
                f"size {self.page_size}"
            )

    @classmethod
    def for_bytes(
        cls,
        total_bytes: int,
        *,
        num_layers: int,
        page_size: int,
        num_buffers: int = 2,
        contiguous: bool | None = None,
    ) -> KVLayout:
        """The largest layout whose buffers together fit in ``total_bytes``.

        Raises:
            KVCachedConfigError: Not even one page per buffer fits.
        """
        per_buffer = total_bytes // (num_layers * num_buffers) // page_size * page_size
        if per_buffer <= 0:
            raise KVCachedConfigError(
                f"{total_bytes} bytes of KV cache do not hold one {page_size}-byte page for "
                f"each of {num_layers} layers x {num_buffers} buffers"
            )
        return cls(num_layers, per_buffer, page_size, num_buffers, _contiguous(contiguous))

    @classmethod
    def for_blocks(
        cls,
        num_blocks: int,
        block_bytes: int,
        *,
        num_layers: int,
        page_size: int,
        num_buffers: int = 2,
        contiguous: bool | None = None,
    ) -> KVLayout:
        """The smallest layout holding ``num_blocks`` usable blocks of ``block_bytes``.

        Usable blocks lie wholly inside one page; when ``block_bytes`` does not
        divide ``page_size`` the few that straddle a boundary are skipped, so
        the buffers may have a few more rows. Give the block manager
        ``num_blocks=None`` to use them all.
        """
        if num_blocks < 1 or not 1 <= block_bytes <= page_size:
            raise KVCachedConfigError(
                f"num_blocks={num_blocks} must be positive and block_bytes={block_bytes} "
                f"in 1..{page_size} (the page size)"
            )
        pages = whole = 0
        while whole < num_blocks:
            whole += (pages + 1) * page_size // block_bytes - -(-pages * page_size // block_bytes)
            pages += 1
        return cls(num_layers, pages * page_size, page_size, num_buffers, _contiguous(contiguous))

    @property
    def num_pages(self) -> int:
        """Page ids 0 .. num_pages-1."""
        return self.buffer_bytes // self.page_size

    @property
    def num_tensors(self) -> int:
        """Virtual tensors reserved: ``L * num_buffers`` per-layer, 1 contiguous."""
        return 1 if self.contiguous else self.num_layers * self.num_buffers

    @property
    def mapper_page_size(self) -> int:
        """The page size the mapper must be opened with: P, or ``P*L*kv`` contiguous."""
        if self.contiguous:
            return self.page_size * self.num_layers * self.num_buffers
        return self.page_size

    @property
    def page_bytes(self) -> int:
        """Physical bytes behind one page id, over all layers and buffers."""
        return self.page_size * self.num_layers * self.num_buffers

    @property
    def total_bytes(self) -> int:
        """Virtual bytes reserved for the whole group."""
        return self.buffer_bytes * self.num_layers * self.num_buffers


def host_memory_bytes() -> int:
    """The machine's physical memory: the device size of a pool in host memory."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _device_pages(free: int, total: int, spare_handles: int, utilization: float,
                  page_bytes: int, handles_per_page: int) -> int:
    """Pages a device with ``free`` of ``total`` bytes can still back, keeping ``1 - utilization``
    free; negative: the pages it is short of that headroom."""
    headroom = free - int(total * (1.0 - utilization))
    return headroom // page_bytes + spare_handles // max(1, handles_per_page)


class KVTensors:
    """The virtual tensors of one KV group, and page-id map / unmap over them.

    This is the *page backing* a :class:`~kvcached_core.allocator.PageAllocator`
    drives (local memory); :class:`~kvcached_core.ipc.remote.RemoteKVTensors`
    is the same interface over the memory of worker processes.

    Args:
        mapper: A ``PageMapper`` whose page size is ``layout.mapper_page_size``.
        layout: The group's geometry.

    Raises:
        KVCachedConfigError: The mapper's page size does not match the layout.
    """

    def __init__(self, mapper: Any, layout: KVLayout) -> None:
        if mapper.page_size != layout.mapper_page_size:
            kind = "contiguous" if layout.contiguous else "per-layer"
            raise KVCachedConfigError(
                f"a {kind} KV layout with {layout.page_size}-byte pages needs a mapper with "
                f"page size {layout.mapper_page_size}; this mapper has {mapper.page_size} "
                "(open it with KVTensors.open or open_mapper(device, layout.mapper_page_size))"
            )
        self._mapper = mapper
        self._layout = layout
        size = layout.total_bytes if layout.contiguous else layout.buffer_bytes
        self._tensors = [mapper.reserve(size) for _ in range(layout.num_tensors)]
        self._group = mapper.group(self._tensors)  # one page id spans every buffer
        self._device = mapper_device(mapper)

    @classmethod
    def open(cls, device: Any, layout: KVLayout) -> KVTensors:
        """Open a mapper for ``device`` sized for ``layout`` and reserve the buffers."""
        return cls(open_mapper(device, layout.mapper_page_size), layout)

    def __repr__(self) -> str:
        lay = self._layout
        kind = "contiguous" if lay.contiguous else "per-layer"
        return (
            f"<KVTensors {kind} {self._device.torch_device} layers={lay.num_layers} "
            f"buffers={lay.num_buffers} pages={lay.num_pages}x{lay.page_bytes}B>"
        )

    @property
    def mapper(self) -> Any:
        """The ``PageMapper`` behind these buffers."""
        return self._mapper

    @property
    def layout(self) -> KVLayout:
        return self._layout

    @property
    def device(self) -> Device:
        return self._device

    @property
    def num_pages(self) -> int:
        return self._layout.num_pages

    @property
    def page_bytes(self) -> int:
        """Physical bytes behind one page id."""
        return self._layout.page_bytes

    @property
    def handles_per_page(self) -> int:
        """Physical handles (driver allocations) behind one page id."""
        return self._layout.num_tensors

    @property
    def granularity(self) -> int:
        """The device's mapping granularity in bytes."""
        return self._mapper.granularity

    @property
    def virtual_tensors(self) -> tuple[Any, ...]:
        """The reserved ``VirtualTensor`` objects (one if contiguous)."""
        return tuple(self._tensors)

    def map_pages(self, page_ids: Sequence[int]) -> None:
        """Back ``page_ids`` with physical memory in every buffer, all or nothing.

        Raises:
            DeviceOutOfMemoryError: No physical memory; nothing stays mapped.
            MappingError: A page id is out of range, repeated or already mapped.
        """
        self._group.map(list(page_ids))

    def unmap_pages(self, page_ids: Sequence[int], synchronize: bool = True) -> None:
        """Return ``page_ids``' memory; with ``synchronize`` first wait for queued device work."""
        self._group.unmap(list(page_ids), synchronize)

    def is_mapped(self, page_id: int) -> bool:
        """Whether any buffer still has ``page_id`` mapped."""
        return any(t.is_mapped(page_id) for t in self._tensors)

    @property
    def mapped_pages(self) -> int:
        """Page ids mapped in the first buffer (all buffers agree outside a failure)."""
        return self._tensors[0].mapped_pages

    def trim_spare_handles(self, keep_pages: int = 0) -> int:
        """Release the mapper's spare handles beyond ``keep_pages`` pages' worth."""
        return self._mapper.trim_pool(keep_pages * self.handles_per_page)  # the native name

    def device_total(self) -> int:
        """Bytes of the device (for host memory: the machine's memory)."""
        return int(self._mapper.mem_info()[1]) if self._device.is_gpu else host_memory_bytes()

    def free_device_pages(self, utilization: float) -> int:
        """Page ids the device can still back while ``1 - utilization`` of it stays free;
        negative: the pages it is short of that headroom.

        Spare handles count: a page mapped with a spare takes no new memory.
        """
        free, total = self._mapper.mem_info()
        return _device_pages(free, total, self._mapper.stats().pooled_handles, utilization,
                             self.page_bytes, self.handles_per_page)

    # ------------------------------------------------------------------ views

    def _index(self, layer: int, kind: int) -> int:
        lay = self._layout
        if not 0 <= layer < lay.num_layers:
            raise MappingError(f"layer {layer} outside 0..{lay.num_layers - 1}")
        if not 0 <= kind < lay.num_buffers:
            raise MappingError(f"buffer {kind} outside 0..{lay.num_buffers - 1}")
        return layer * lay.num_buffers + kind

    def buffer(self, layer: int, kind: int = K, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A 1-D zero-copy view of one layer's buffer (per-layer layout only).

        Only the bytes of mapped pages may be touched.
        """
        if self._layout.contiguous:
            raise MappingError(
                "a contiguous KV layout has no per-layer 1-D buffer; use block_view()"
            )
        return as_tensor(self._tensors[self._index(layer, kind)], dtype)

    def block_view(
        self, layer: int, kind: int, block_bytes: int, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """A ``(num_blocks, block_bytes // itemsize)`` view of one layer's buffer.

        Row ``b`` is block ``b`` in either layout (strided for contiguous), so an
        engine adapter only reshapes the row into its own block shape.
        """
        import torch

        lay = self._layout
        index = self._index(layer, kind)
        dtype = dtype or torch.uint8
        item = torch.empty((), dtype=dtype).element_size()
        if block_bytes < 1 or block_bytes % item:
            raise MappingError(
                f"block_bytes={block_bytes} is not a multiple of {dtype}'s size {item}"
            )
        rows, width = lay.buffer_bytes // block_bytes, block_bytes // item
        if lay.contiguous:
            whole = as_tensor(self._tensors[0], dtype)
            stride = lay.num_layers * lay.num_buffers * width
            return whole.as_strided((rows, width), (stride, 1), index * width)
        return as_tensor(self._tensors[index], dtype)[: rows * width].view(rows, width)

"""Where vLLM's KV blocks lie in memory, read from its ``KVCacheConfig``.

kvcached backs vLLM's KV cache in *pages* of ``P`` bytes (``KVCACHED_PAGE_SIZE_MB``)
per *region*. A region is one layer's run of blocks: block ``b`` of every
region lies at ``region_start + b * block_bytes``. Page ``p`` is the byte range
``[p*P, (p+1)*P)`` of every region, so mapping page ``p`` makes the blocks it
holds usable in every layer at once, and scheduler and workers agree on page
ids without exchanging layouts.

On CPU the engine's tensor starts :data:`HOST_BLOCK_OFFSET` bytes into its
first page (``block_offset``), so block ``b`` lies at ``region_start +
block_offset + b * block_bytes`` and the one block per page that would cross
into the next page is never used.

Two generations of vLLM place regions differently:

* 0.29 and later (``KVCacheTensor.layers`` / ``layer_stride``): one backing
  buffer; layer ``l`` of a tensor starts at ``offset + l * layer_stride``. The
  layout must be layer-outer (LBHNC on CPU) and every region start a multiple
  of ``P``: :func:`align_num_blocks_unit` gives the block-count multiple that
  keeps ``layer_stride`` page-aligned.
* 0.27.1 and 0.28 (``KVCacheTensor.shared_by``): one buffer per tensor, each a
  region of its own starting at 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from kvcached_core.config import load_settings
from kvcached_core.errors import KVCachedConfigError

__all__ = ["HOST_BLOCK_OFFSET", "KVGeometry", "align_num_blocks_unit", "block_offset_for",
           "check_block_fits", "page_size"]

MiB = 1 << 20

#: Where a CPU engine's KV tensor starts inside its first page. torch's CPU
#: allocator hands out large buffers 64 bytes past a 4 KiB boundary; vLLM's CPU
#: decode attention measured 5-8 % slower per step with every block on a page
#: boundary (the same memory, moved 64 bytes, ran as fast as torch's buffer:
#: benchmarks/results/vllm-cpu-kv-alignment.json).
HOST_BLOCK_OFFSET = 64


def block_offset_for(device_type: str) -> int:
    """``block_offset`` for an engine on ``device_type`` (``"cpu"``, ``"cuda"``, ...)."""
    return HOST_BLOCK_OFFSET if str(device_type).split(":")[0] == "cpu" else 0


def page_size() -> int:
    """The kvcached page size in bytes (``KVCACHED_PAGE_SIZE_MB``)."""
    return load_settings().page_size


def check_block_fits(block_bytes: int, page: int) -> None:
    """Raise naming ``KVCACHED_PAGE_SIZE_MB`` when a block does not fit in a page."""
    if block_bytes > page:
        need = -(-block_bytes // MiB)
        raise KVCachedConfigError(
            f"a vLLM KV block of {block_bytes} bytes per layer is larger than the kvcached page "
            f"of {page} bytes; set KVCACHED_PAGE_SIZE_MB={need} or more"
        )


def align_num_blocks_unit(block_bytes: int, page: int) -> int:
    """Blocks per alignment unit: a multiple of this keeps ``num_blocks * block_bytes`` page-aligned."""
    return page // math.gcd(page, block_bytes)


@dataclass(frozen=True)
class KVGeometry:
    """The block geometry of one engine's KV cache, as kvcached pages it.

    Attributes:
        num_blocks: vLLM's block count (block 0 is the null block).
        block_bytes: Bytes of one block in one region.
        region_offsets: Byte offsets of the regions inside the one backing
            buffer (vLLM 0.29+), or ``()`` when each backing buffer is a region
            of its own (0.27.1, 0.28).
        num_buffers: Backing buffers vLLM allocates (``torch.zeros`` calls).
        page_size: The kvcached page size ``P``.
        block_offset: Bytes between a region's page-aligned start and its
            block 0 (each backing buffer starts that far into its reservation).
    """

    num_blocks: int
    block_bytes: int
    region_offsets: tuple[int, ...]
    num_buffers: int
    page_size: int
    block_offset: int = 0

    @property
    def num_regions(self) -> int:
        return len(self.region_offsets) or self.num_buffers

    @property
    def num_pages(self) -> int:
        """Page ids 0 .. num_pages-1 cover every block."""
        return -(-self.num_blocks * self.block_bytes // self.page_size)

    @property
    def page_bytes(self) -> int:
        """Physical bytes behind one page id in one worker (all regions)."""
        return self.page_size * self.num_regions

    @classmethod
    def from_config(cls, kv_cache_config: Any, page: int | None = None,
                    block_offset: int = 0) -> KVGeometry:
        """Read the geometry of a vLLM ``KVCacheConfig`` (blocks ``block_offset`` bytes in).

        Raises:
            KVCachedConfigError: The layout is one kvcached does not page (block
                outermost, mixed block sizes, packed per-tensor strides,
                unaligned regions) or a block exceeds a page.
        """
        page = page or page_size()
        tensors = list(kv_cache_config.kv_cache_tensors)
        num_blocks = int(kv_cache_config.num_blocks)
        if not tensors:
            raise KVCachedConfigError("this model has no KV cache tensors for kvcached to back")
        if hasattr(tensors[0], "layer_stride"):  # vLLM >= 0.29: one shared backing buffer
            strides = {int(t.block_stride) for t in tensors}
            if len(strides) != 1:
                raise KVCachedConfigError(
                    f"KV cache tensors with different block strides {sorted(strides)} (hybrid "
                    "models) are not supported by kvcached's vLLM adapter"
                )
            block = strides.pop()
            offsets: set[int] = set()
            for t in tensors:
                if len(t.layers) > 1 and int(t.layer_stride) < num_blocks * block:
                    raise KVCachedConfigError(
                        f"KV cache layout is block-outermost (layer_stride {t.layer_stride} < "
                        f"{num_blocks} blocks x {block} bytes); kvcached's vLLM adapter pages "
                        "layer-outer layouts only"
                    )
                offsets.update(int(t.offset) + i * int(t.layer_stride) for i in range(len(t.layers)))
            geo = cls(num_blocks, block, tuple(sorted(offsets)), 1, page, block_offset)
            bad = [o for o in geo.region_offsets if o % page]
            if bad:
                raise KVCachedConfigError(
                    f"KV cache regions at byte offsets {bad[:4]} are not multiples of the kvcached "
                    f"page size {page} (num_blocks={num_blocks}, block {block} bytes); the block "
                    f"count must be a multiple of {align_num_blocks_unit(block, page)}"
                )
        else:  # vLLM 0.27.1 / 0.28: a buffer per KVCacheTensor
            if any(getattr(t, "block_stride", 0) for t in tensors):
                raise KVCachedConfigError(
                    "packed KV cache tensors (block_stride > 0) are not supported by kvcached's "
                    "vLLM adapter"
                )
            sizes = {int(t.size) for t in tensors}
            if len(sizes) != 1 or next(iter(sizes)) % num_blocks:
                raise KVCachedConfigError(
                    f"KV cache tensor sizes {sorted(sizes)} are not one common multiple of "
                    f"{num_blocks} blocks"
                )
            geo = cls(num_blocks, sizes.pop() // num_blocks, (), len(tensors), page, block_offset)
        check_block_fits(geo.block_bytes, page)
        return geo

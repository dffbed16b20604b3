"""Fixtures for the allocator tests: real host-backend stacks with small pages."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from kvcached_core.allocator import KVBlockManager, KVLayout, KVTensors, PageAllocator
from kvcached_core.config import Settings

#: The host granularity is 4 KiB, so 64 KiB pages are legal and cheap.
PAGE = 64 << 10

#: Settings that ignore the environment: no background thread, no idle trim.
QUIET = Settings(
    page_size=PAGE,
    contiguous_layout=None,
    prealloc=False,
    min_reserved_pages=0,
    max_reserved_pages=2,
    idle_trim_s=0.0,
    memory_limit=None,
    gpu_utilization=0.95,
)


@dataclass
class Stack:
    """One KV group: buffers, page allocator and block manager."""

    kv: KVTensors
    pages: PageAllocator
    blocks: KVBlockManager | None


StackFactory = Callable[..., Stack]


@pytest.fixture
def make_stack() -> Iterator[StackFactory]:
    """Build host-backend stacks; every allocator is closed at teardown.

    Keyword arguments: ``num_layers`` (2), ``num_pages`` (16), ``num_buffers``
    (2), ``contiguous`` (False), ``page_size`` (64 KiB), ``block_bytes`` (16 KiB;
    ``None``: no block manager), ``num_blocks``, ``null_block`` (True), ``block_offset`` (0),
    ``mapper`` (share one), and any :class:`PageAllocator` option.
    """
    made: list[PageAllocator] = []

    def build(
        *,
        num_layers: int = 2,
        num_pages: int = 16,
        num_buffers: int = 2,
        contiguous: bool = False,
        page_size: int = PAGE,
        block_bytes: int | None = 16 << 10,
        num_blocks: int | None = None,
        null_block: bool = True,
        block_offset: int = 0,
        mapper: Any = None,
        **options: Any,
    ) -> Stack:
        layout = KVLayout(num_layers, num_pages * page_size, page_size, num_buffers, contiguous)
        kv = KVTensors(mapper, layout) if mapper is not None else KVTensors.open("cpu", layout)
        options.setdefault("settings", QUIET)
        pages = PageAllocator(kv, **options)
        made.append(pages)
        blocks = None
        if block_bytes is not None:
            blocks = KVBlockManager(pages, block_bytes, num_blocks, reserve_null_block=null_block,
                                    block_offset=block_offset)
        return Stack(kv, pages, blocks)

    yield build
    for pages in made:
        pages.close()

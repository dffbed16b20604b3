"""The allocator: page ids backed on demand, and KV blocks carved out of them.

One KV *group* (layers sharing a block table) is three objects::

    layout = KVLayout.for_bytes(8 << 30, num_layers=32, page_size=2 << 20)
    kv = KVTensors.open("cuda:0", layout)       # reserves address space only
    pages = PageAllocator(kv)                   # free / reserved / in-use pages
    blocks = KVBlockManager(pages, block_bytes=16 * 8 * 128 * 2)
    ids = blocks.alloc(4)                       # None: no space (a scheduling miss)
    blocks.free(ids)

Several groups or devices in one process are just several such stacks;
nothing here is process-global, and importing it starts no thread.
"""

from kvcached_core.allocator.block_manager import KVBlockManager
from kvcached_core.allocator.kv_tensors import K, V, KVLayout, KVTensors
from kvcached_core.allocator.page_allocator import PageAllocator, PageStats

__all__ = [
    "K",
    "V",
    "KVBlockManager",
    "KVLayout",
    "KVTensors",
    "PageAllocator",
    "PageStats",
]

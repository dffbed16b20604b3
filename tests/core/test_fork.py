"""Fork safety: a forked child never shares pages with its parent by accident.

A mapper (and everything built on it) belongs to the process that opened it.
In a forked child every call raises ForkedProcessError before touching the
mapper's lock or memory, and dropping the inherited objects in the child
releases nothing of the parent's.
"""

from __future__ import annotations

import ctypes
import os

import pytest
import torch

from kvcached_core.allocator import KVLayout, KVTensors, PageAllocator
from kvcached_core.config import Settings
from kvcached_core.errors import ForkedProcessError, KVCachedError
from kvcached_core.vmm import as_tensor, open_mapper

PAGE = 2 << 20


def in_child(body) -> int:
    """Run ``body()`` in a forked child; its exit status (0: it returned True)."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = 0 if body() else 3
        except BaseException:  # noqa: BLE001 - report through the status
            import traceback

            traceback.print_exc()
            code = 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def test_a_forked_child_cannot_map_through_the_parents_mapper():
    mapper = open_mapper("cpu", PAGE)
    vt = mapper.reserve(8 * PAGE)
    mapper.map([vt], [0])
    parent = as_tensor(vt)
    parent[:PAGE].fill_(7)

    def child() -> bool:
        for call in (lambda: mapper.map([vt], [1]), lambda: mapper.unmap([vt], [0]),
                     lambda: mapper.reserve(PAGE), lambda: mapper.trim_pool(0),
                     lambda: mapper.group([vt]).map([2])):
            with pytest.raises(ForkedProcessError, match=r"process \d+ .* fork"):
                call()
        # The parent's mapped page is not inherited: nothing of the page file is mapped here.
        return not any("kvcached-host" in line for line in open("/proc/self/maps"))

    assert in_child(child) == 0
    # The parent's next map gets a fresh slot, and its page 0 is untouched.
    mapper.map([vt], [1])
    parent[PAGE : 2 * PAGE].fill_(9)
    assert int(parent[:PAGE].min()) == int(parent[:PAGE].max()) == 7


def test_a_child_that_drops_inherited_tensors_releases_nothing_of_the_parents():
    mapper = open_mapper("cpu", PAGE)
    vt = mapper.reserve(4 * PAGE)
    mapper.map([vt], [0, 1])
    mapper.unmap([vt], [1])  # one handle in the pool
    parent = as_tensor(vt)
    parent[:PAGE].fill_(5)

    def child() -> bool:
        nonlocal mapper, vt
        del mapper, vt  # would unmap page 0 and punch the holes of its slot and the spare one
        import gc

        gc.collect()
        return True

    assert in_child(child) == 0
    assert int(parent[:PAGE].min()) == int(parent[:PAGE].max()) == 5
    mapper.map([vt], [1, 2])
    assert mapper.stats().mapped_pages == 3


def test_a_forked_child_cannot_use_the_parents_allocator():
    kv = KVTensors.open("cpu", KVLayout(1, 8 * PAGE, PAGE, 1, False))
    quiet = Settings(page_size=PAGE, contiguous_layout=None, prealloc=False, min_reserved_pages=0,
                     max_reserved_pages=2, idle_trim_s=0.0, memory_limit=None,
                     gpu_utilization=0.95)
    pages = PageAllocator(kv, settings=quiet)
    assert pages.alloc_pages(1) == [0]

    def child() -> bool:
        with pytest.raises(ForkedProcessError, match="fork"):
            pages.alloc_pages(1)
        with pytest.raises(ForkedProcessError, match="fork"):
            kv.map_pages([3])
        fresh = open_mapper("cpu", PAGE)  # the documented way: open its own
        vt = fresh.reserve(2 * PAGE)
        fresh.map([vt], [0])
        ctypes.memset(vt.address, 1, PAGE)  # (torch's OpenMP pool does not survive a fork)
        return ctypes.string_at(vt.address, 4) == b"\1" * 4

    assert in_child(child) == 0
    assert pages.alloc_pages(1) == [1]
    assert issubclass(ForkedProcessError, KVCachedError)
    pages.close()


def test_fork_error_is_not_a_memory_error():
    # An allocator turns MemoryError into "no space": a fork must not look like one.
    assert not issubclass(ForkedProcessError, MemoryError)
    assert torch is not None

"""The host backend end to end: real memfd pages in this process's address space."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from kvcached_core.errors import MappingError
from kvcached_core.vmm import as_tensor, open_mapper

PAGE = 2 << 20


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def page_file_bytes() -> int:
    """Bytes the host backends of this process hold committed in their memfds."""
    total = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("/memfd:kvcached-host"):
            total += os.stat(f"/proc/self/fd/{fd}").st_blocks * 512
    return total


def test_map_write_read_unmap_roundtrip():
    mapper = open_mapper("cpu", PAGE)
    vt = mapper.reserve(16 * PAGE)
    mapper.map([vt], [0, 5, 15])
    t = as_tensor(vt, torch.float32)
    per_page = PAGE // 4
    for p in (0, 5, 15):
        t[p * per_page : (p + 1) * per_page] = torch.arange(per_page, dtype=torch.float32) + p
    for p in (0, 5, 15):
        assert torch.equal(t[p * per_page : (p + 1) * per_page],
                           torch.arange(per_page, dtype=torch.float32) + p)
    assert vt.mapped_pages == 3 and vt.is_mapped(5) and not vt.is_mapped(4)
    mapper.unmap([vt], [5])
    assert vt.mapped_pages == 2 and not vt.is_mapped(5)
    assert mapper.stats().pooled_handles == 1


def test_tensor_is_zero_copy_and_keeps_reservation_alive():
    mapper = open_mapper("cpu", PAGE)
    vt = mapper.reserve(4 * PAGE)
    mapper.map([vt], [0])
    t = as_tensor(vt)
    assert t.data_ptr() == vt.address and t.numel() == vt.size and t.device.type == "cpu"
    address = vt.address
    del vt  # the torch tensor still owns the reservation
    t[:8] = 3
    assert t.data_ptr() == address and int(t[:8].sum()) == 24


def test_rss_rises_by_mapped_bytes_and_falls_after_unmap():
    mapper = open_mapper("cpu", PAGE)
    pages = 64  # 128 MiB
    vt = mapper.reserve(pages * PAGE)
    before = rss_bytes()
    mapper.map([vt], list(range(pages)))
    as_tensor(vt).fill_(1)
    grown = rss_bytes() - before
    assert grown >= 0.95 * pages * PAGE, grown
    mapper.unmap([vt], list(range(pages)))
    shrunk = rss_bytes() - before
    assert shrunk <= 0.05 * pages * PAGE, shrunk


def test_a_mapped_page_is_backed_before_the_engine_touches_it():
    """Like a GPU map, mapping fills the page tables (a background populate, so the engine's
    first touches take no page faults): RSS rises without any access."""
    import time

    mapper = open_mapper("cpu", PAGE)
    pages = 32  # 64 MiB
    vt = mapper.reserve(pages * PAGE)
    before = rss_bytes()
    mapper.map([vt], list(range(pages)))
    deadline = time.monotonic() + 10
    while rss_bytes() - before < 0.95 * pages * PAGE and time.monotonic() < deadline:
        time.sleep(0.01)
    assert rss_bytes() - before >= 0.95 * pages * PAGE
    mapper.unmap([vt], list(range(pages)))
    assert rss_bytes() - before <= 0.05 * pages * PAGE


def test_recycled_handles_then_trim_returns_memory():
    mapper = open_mapper("cpu", PAGE)
    vt = mapper.reserve(8 * PAGE)
    base = page_file_bytes()
    mapper.map([vt], list(range(8)))
    assert page_file_bytes() - base == 8 * PAGE  # committed at create
    mapper.unmap([vt], list(range(8)))
    stats = mapper.stats()
    assert stats.pooled_handles == 8 and stats.handles_created == 8
    mapper.map([vt], list(range(8)))  # reuses the pool: no new handle
    assert mapper.stats().handles_created == 8 and mapper.stats().pooled_handles == 0
    mapper.unmap([vt], list(range(8)))
    assert mapper.trim_pool(keep=2) == 6
    assert page_file_bytes() - base == 2 * PAGE
    mapper.set_pool_limit(0)
    assert page_file_bytes() - base == 0 and mapper.stats().pooled_handles == 0


def test_a_page_index_maps_the_same_range_in_every_tensor():
    mapper = open_mapper("cpu", PAGE)
    layers = [mapper.reserve(4 * PAGE) for _ in range(3)]
    mapper.map(layers, [2])
    assert all(v.is_mapped(2) and v.mapped_pages == 1 for v in layers)
    assert mapper.stats().mapped_pages == 3


def test_dropping_a_virtual_tensor_unmaps_its_pages():
    mapper = open_mapper("cpu", PAGE)
    vt = mapper.reserve(4 * PAGE)
    mapper.map([vt], [0, 1])
    del vt
    stats = mapper.stats()
    assert stats.mapped_pages == 0 and stats.pooled_handles == 2


def test_failed_batch_changes_nothing():
    mapper = open_mapper("cpu", PAGE)
    a, b = mapper.reserve(4 * PAGE), mapper.reserve(2 * PAGE)
    mapper.map([a], [1])
    # page 3 is inside a but outside b: the whole batch is refused up front
    with pytest.raises(MappingError, match="outside"):
        mapper.map([a, b], [0, 3])
    assert a.mapped_pages == 1 and b.mapped_pages == 0
    assert mapper.stats().handles_created == 1


def test_memory_info_reports_the_host():
    mapper = open_mapper("cpu", PAGE)
    free, total = mapper.mem_info()
    assert 0 < free <= total


def test_a_page_group_maps_its_tensors_together_and_is_checked_once():
    mapper = open_mapper("cpu", PAGE)
    layers = [mapper.reserve(4 * PAGE) for _ in range(4)]
    group = mapper.group(layers)
    group.map([0, 3])
    assert all(v.is_mapped(0) and v.is_mapped(3) and v.mapped_pages == 2 for v in layers)
    with pytest.raises(MappingError, match="page 3 .* already mapped"):
        group.map([3])
    group.unmap([3])
    assert all(not v.is_mapped(3) for v in layers) and mapper.stats().pooled_handles == 4
    with pytest.raises(MappingError, match="appears twice in one page group"):
        mapper.group([layers[0], layers[0]])
    with pytest.raises(MappingError, match="another page mapper"):
        mapper.group([open_mapper("cpu", PAGE).reserve(PAGE)])

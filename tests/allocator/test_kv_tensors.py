"""KV layouts and their buffers on the real host backend."""

from __future__ import annotations

import pytest
import torch

from kvcached_core.allocator import K, V, KVLayout, KVTensors
from kvcached_core.errors import KVCachedConfigError, MappingError
from kvcached_core.vmm import open_mapper

PAGE = 64 << 10  # the page size the conftest stacks use


def test_layout_arithmetic():
    lay = KVLayout(num_layers=4, buffer_bytes=8 * PAGE, page_size=PAGE)
    assert (lay.num_pages, lay.num_tensors, lay.mapper_page_size) == (8, 8, PAGE)
    assert lay.page_bytes == 8 * PAGE and lay.total_bytes == 64 * PAGE
    con = KVLayout(4, 8 * PAGE, PAGE, num_buffers=2, contiguous=True)
    assert (con.num_tensors, con.mapper_page_size, con.page_bytes) == (1, 8 * PAGE, 8 * PAGE)
    mla = KVLayout(4, 8 * PAGE, PAGE, num_buffers=1)
    assert (mla.num_tensors, mla.page_bytes) == (4, 4 * PAGE)


def test_layout_constructors_round_down_and_up():
    lay = KVLayout.for_bytes(100 * PAGE + 5, num_layers=3, page_size=PAGE)
    assert lay.buffer_bytes == 16 * PAGE  # 100 // 6 pages per buffer
    lay = KVLayout.for_blocks(9, 10_000, num_layers=2, page_size=PAGE)
    assert lay.num_pages == 2  # 6 whole blocks a page (the 7th straddles)
    assert KVLayout.for_blocks(12, 10_000, num_layers=1, page_size=PAGE).num_pages == 2
    assert KVLayout.for_blocks(13, 10_000, num_layers=1, page_size=PAGE).num_pages == 3
    assert KVLayout.for_blocks(8, 16 << 10, num_layers=1, page_size=PAGE).num_pages == 2
    with pytest.raises(KVCachedConfigError, match="do not hold one"):
        KVLayout.for_bytes(PAGE, num_layers=2, page_size=PAGE)


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        (dict(num_layers=0, buffer_bytes=PAGE, page_size=PAGE), "num_layers=0"),
        (dict(num_layers=1, buffer_bytes=PAGE + 1, page_size=PAGE), "not a multiple"),
        (dict(num_layers=1, buffer_bytes=PAGE, page_size=PAGE, num_buffers=0), "num_buffers"),
    ],
)
def test_layout_rejects_bad_geometry(kwargs, pattern):
    with pytest.raises(KVCachedConfigError, match=pattern):
        KVLayout(**kwargs)


def test_mapper_page_size_must_match_layout():
    lay = KVLayout(2, 4 * PAGE, PAGE, contiguous=True)
    with pytest.raises(KVCachedConfigError, match=f"page size {4 * PAGE}"):
        KVTensors(open_mapper("cpu", PAGE), lay)


def test_per_layer_map_write_read_unmap():
    kv = KVTensors.open("cpu", KVLayout(3, 4 * PAGE, PAGE))
    assert len(kv.virtual_tensors) == 6 and kv.handles_per_page == 6
    kv.map_pages([1, 3])
    assert kv.mapped_pages == 2 and kv.is_mapped(3) and not kv.is_mapped(0)
    rows = PAGE // 1024  # 1 KiB blocks: 64 per page
    for layer in range(3):
        for kind in (K, V):
            view = kv.block_view(layer, kind, 1024, torch.float32)
            assert view.shape == (4 * rows, 256)
            view[rows : 2 * rows] = layer * 10 + kind
            view[3 * rows] = -1
    for layer in range(3):
        for kind in (K, V):
            buf = kv.buffer(layer, kind, torch.float32)
            assert torch.all(buf[PAGE // 4 : PAGE // 2] == layer * 10 + kind)
            assert torch.all(buf[3 * PAGE // 4 : 3 * PAGE // 4 + 256] == -1)
    kv.unmap_pages([1])
    assert kv.mapper.stats().mapped_pages == 6 and not kv.is_mapped(1)
    kv.map_pages([1])  # the spare handles come back: no new ones
    assert kv.mapper.stats().mapped_pages == 12 and kv.mapper.stats().handles_created == 12


def test_contiguous_views_are_strided_into_compound_pages():
    layers, block = 2, 4096
    lay = KVLayout(layers, 4 * PAGE, PAGE, contiguous=True)
    kv = KVTensors.open("cpu", lay)
    assert kv.mapper.page_size == PAGE * layers * 2 and len(kv.virtual_tensors) == 1
    kv.map_pages([2])
    bpp = PAGE // block
    b = 2 * bpp + 5  # a block of page 2
    for layer in range(layers):
        for kind in (K, V):
            view = kv.block_view(layer, kind, block)
            assert view.shape == (4 * bpp, block)
            view[b] = 1 + layer * 2 + kind
    whole = torch.from_dlpack(kv.virtual_tensors[0].dlpack())
    row = b * layers * 2 * block  # blocks are [L, kv, block] records
    for index in range(layers * 2):
        start = row + index * block
        assert torch.all(whole[start : start + block] == 1 + index)
    with pytest.raises(MappingError, match="use block_view"):
        kv.buffer(0)


def test_mla_has_one_buffer_per_layer():
    kv = KVTensors.open("cpu", KVLayout(4, 2 * PAGE, PAGE, num_buffers=1))
    assert len(kv.virtual_tensors) == 4
    kv.map_pages([0, 1])
    assert kv.mapper.stats().mapped_pages == 8  # 2 pages x 4 layers, no phantom V
    kv.buffer(3, K)[:] = 7
    assert int(kv.buffer(3, K).sum()) == 7 * 2 * PAGE
    with pytest.raises(MappingError, match="buffer 1"):
        kv.buffer(0, V)
    with pytest.raises(MappingError, match="layer 4"):
        kv.block_view(4, K, 1024)


def test_groups_share_a_mapper_and_mappers_are_independent():
    mapper = open_mapper("cpu", PAGE)
    g1 = KVTensors(mapper, KVLayout(2, 4 * PAGE, PAGE))
    g2 = KVTensors(mapper, KVLayout(1, 2 * PAGE, PAGE, num_buffers=1))
    other = KVTensors.open("cpu", KVLayout(2, 4 * PAGE, PAGE))
    g1.map_pages([0])
    g2.map_pages([0, 1])
    other.map_pages([3])
    assert mapper.stats().mapped_pages == 4 + 2
    assert other.mapper.stats().mapped_pages == 4
    g1.buffer(0)[:PAGE] = 1
    g2.buffer(0)[:PAGE] = 2
    other.buffer(0)[3 * PAGE :] = 3
    assert int(g1.buffer(0)[:PAGE].sum()) == PAGE
    assert int(g2.buffer(0)[:PAGE].sum()) == 2 * PAGE
    with pytest.raises(MappingError, match="already mapped"):
        g1.map_pages([0])


def test_layout_follows_kvcached_contiguous_layout_unless_given(monkeypatch):
    monkeypatch.delenv("KVCACHED_CONTIGUOUS_LAYOUT", raising=False)
    assert not KVLayout.for_bytes(64 << 20, num_layers=2, page_size=1 << 20).contiguous
    monkeypatch.setenv("KVCACHED_CONTIGUOUS_LAYOUT", "1")
    assert KVLayout.for_bytes(64 << 20, num_layers=2, page_size=1 << 20).contiguous
    assert KVLayout.for_blocks(8, 4096, num_layers=2, page_size=1 << 20).contiguous
    assert not KVLayout.for_bytes(64 << 20, num_layers=2, page_size=1 << 20,
                                  contiguous=False).contiguous

"""KVBlockManager semantics on the real host backend."""

from __future__ import annotations

import pytest
import torch

from kvcached_core.allocator import K, V, KVBlockManager
from kvcached_core.errors import KVCachedConfigError, MappingError
from kvcached_core.vmm import open_mapper

PAGE = 64 << 10  # the page size the conftest stacks use
BLOCK = 16 << 10  # four blocks a page


def test_null_block_and_page_geometry(make_stack):
    s = make_stack()
    bm = s.blocks
    assert bm.null_block == 0 and bm.num_allocated == 1 and bm.num_held_pages == 1
    assert s.pages.page_state(0) == "in use" and s.kv.is_mapped(0)
    assert bm.num_blocks == 64 and bm.capacity() == 64
    assert bm.blocks_in_page(3) == range(12, 16) and bm.page_of(13) == 3
    ids = bm.alloc(63)
    assert sorted(ids) == list(range(1, 64)) and bm.alloc(1) is None
    with pytest.raises(MappingError, match="block 0 is the null block"):
        bm.free([0])
    bm.free(ids)
    assert bm.num_held_pages == 1 and s.pages.num_in_use == 1


def test_without_null_block_everything_is_usable(make_stack):
    bm = make_stack(null_block=False).blocks
    assert bm.null_block is None and bm.num_held_pages == 0
    assert sorted(bm.alloc(64)) == list(range(64))


def test_straddling_blocks_are_never_handed_out(make_stack):
    block = 24 << 10  # 64 KiB / 24 KiB: 2 or 1 whole blocks a page, never one across
    s = make_stack(block_bytes=block, num_pages=6)
    bm = s.blocks
    assert bm.blocks_in_page(0) == range(0, 2) and bm.blocks_in_page(1) == range(3, 5)
    assert bm.capacity() == sum(len(bm.blocks_in_page(p)) for p in range(6)) == 16 - 4
    n = bm.available_size()
    assert n == bm.capacity() - 1
    ids = bm.alloc(n)
    assert ids is not None and bm.alloc(1) is None
    for b in ids:
        assert b * block // PAGE == ((b + 1) * block - 1) // PAGE  # inside one page
        assert b in bm.blocks_in_page(bm.page_of(b))


def test_blocks_past_an_offset_stay_inside_their_pages(make_stack):
    # The engine's tensor starts 64 bytes into the first page: with 4 blocks a
    # page, the last block of each page would cross into the next one.
    s = make_stack(block_offset=64)
    bm, kv = s.blocks, s.kv
    assert bm.block_offset == 64 and bm.num_blocks == 63  # block 63 would run past page 15
    assert bm.blocks_in_page(0) == range(0, 3) and bm.blocks_in_page(1) == range(4, 7)
    assert bm.capacity() == 16 * 3 and bm.page_of(6) == 1 and bm.page_of(4) == 1
    ids = bm.alloc(bm.available_size())
    assert ids is not None and len(ids) == 47 and bm.alloc(1) is None
    assert not {b for b in ids if b % 4 == 3}  # no block crossing a page boundary
    flat = kv.block_view(0, K, BLOCK, torch.uint8).view(-1)
    for b in ids:  # every byte of every block is mapped memory (a touch would fault otherwise)
        assert bm.page_of(b) == (64 + (b + 1) * BLOCK - 1) // PAGE
        flat[64 + b * BLOCK: 64 + (b + 1) * BLOCK] = b % 251
    assert all(int(flat[64 + b * BLOCK + BLOCK - 1]) == b % 251 for b in ids)
    bm.free(ids)
    assert bm.num_held_pages == 1
    with pytest.raises(KVCachedConfigError, match=r"block_offset=16384 must be an integer in 0\.\.16383"):
        make_stack(block_offset=BLOCK)
    with pytest.raises(KVCachedConfigError, match="block_offset=-1"):
        make_stack(block_offset=-1)


def test_best_fit_prefers_the_tightest_page(make_stack):
    bm = make_stack(null_block=False).blocks
    full = bm.alloc(12)  # pages 0, 1, 2 full
    by_page = {p: [b for b in full if bm.page_of(b) == p] for p in range(3)}
    bm.free(by_page[0][:1] + by_page[1][:2] + by_page[2][:3])  # 1, 2, 3 free
    assert [bm.page_occupancy(p) for p in range(4)] == [3, 2, 1, 0]
    assert {bm.page_of(b) for b in bm.alloc(2)} == {1}
    assert {bm.page_of(b) for b in bm.alloc(1)} == {0}
    bm.free(by_page[0][1:2] + by_page[1][2:3])  # now 1, 1, 3 free
    got = bm.alloc(4)  # no page has 4: the emptiest (3) first, then a tight one (1)
    pages = sorted(bm.page_of(b) for b in got)
    assert pages.count(2) == 3 and len(set(pages)) == 2 and bm.num_held_pages == 3


@pytest.mark.parametrize("block, offset", [(1 << 10, 0), (512, 0), (3 << 10, 0), (1 << 10, 64)])
def test_lowest_free_blocks_of_a_page_go_first(make_stack, block, offset):
    # 64, 128 or 21 blocks a page (3 KiB: pages share bitmap words), offset
    # too: however blocks were freed, each page hands out its lowest free ids,
    # ascending, so a request's blocks come out in adjacent runs.
    import random

    bm = make_stack(block_bytes=block, null_block=False, num_pages=4,
                    block_offset=offset).blocks
    rng = random.Random(0)
    everything = bm.alloc(bm.available_size())
    for p in range(4):
        assert [b for b in everything if bm.page_of(b) == p] == list(bm.blocks_in_page(p))
    free = {p: set() for p in range(4)}
    for _ in range(30):
        held = [b for b in everything if b not in free[bm.page_of(b)]]
        gone = rng.sample(held, min(len(held), rng.randint(1, 40)))
        bm.free(gone)  # in a random order
        for b in gone:
            free[bm.page_of(b)].add(b)
        for p in range(4):  # a page freed whole left the table: all of it is free anew
            if bm.page_occupancy(p) == 0:
                free[p] = set(bm.blocks_in_page(p))
        got = bm.alloc(rng.randint(1, sum(map(len, free.values()))))
        for p in {bm.page_of(b) for b in got}:
            mine = [b for b in got if bm.page_of(b) == p]
            assert mine == sorted(free[p])[:len(mine)], (p, mine)
            free[p] -= set(mine)
    assert bm.alloc(sum(map(len, free.values()))) is not None and bm.alloc(1) is None


def test_empty_pages_go_back_and_trim_unmaps_them(make_stack):
    s = make_stack(null_block=False, max_reserved=2)
    bm = s.blocks
    ids = bm.alloc(20)
    assert bm.num_held_pages == 5 and bm.num_mapped_pages == 5
    bm.free(ids)
    assert bm.num_held_pages == 0 and s.pages.num_reserved == 2 and bm.num_mapped_pages == 2
    assert bm.trim() == 2 and s.kv.mapped_pages == 0


def test_alloc_is_all_or_nothing_under_the_limit(make_stack):
    s = make_stack(max_reserved=4)
    bm, pa = s.blocks, s.pages
    pa.set_memory_limit(3 * pa.page_bytes)
    assert bm.available_size() == 11
    taken = bm.alloc(5)
    before = (bm.num_allocated, pa.stats(), s.kv.mapped_pages)
    assert bm.alloc(7) is None  # needs a 4th page
    assert (bm.num_allocated, pa.stats(), s.kv.mapped_pages) == before
    assert bm.alloc(6) is not None and bm.available_size() == 0
    bm.free(taken)
    assert bm.available_size() == 5


def test_bad_frees_raise_and_change_nothing(make_stack):
    bm = make_stack().blocks
    ids = bm.alloc(3)
    for bad, pattern in [
        ([ids[0], ids[0]], f"block {ids[0]} appears twice"),
        ([ids[0], 40], "block 40 is not allocated"),
        ([1000], "block 1000 is not allocated"),
    ]:
        with pytest.raises(MappingError, match=pattern):
            bm.free(bad)
    assert bm.num_allocated == 4
    bm.free(ids[:1])
    with pytest.raises(MappingError, match="double free"):
        bm.free(ids[:1])
    bm.free(iter(ids[1:]))
    bm.free([])
    assert bm.num_allocated == 1


@pytest.mark.parametrize(
    "block, page_mb",
    [(PAGE + 1, 1), (40 << 10, 1), (3 << 19, 3)],  # too big; > P/2 and not dividing; 1.5 MiB
)
def test_block_that_does_not_fit_names_the_page_size_setting(make_stack, block, page_mb):
    with pytest.raises(KVCachedConfigError, match=f"KVCACHED_PAGE_SIZE_MB={page_mb} or more"):
        make_stack(block_bytes=block)


def test_num_blocks_bounds(make_stack):
    s = make_stack(num_pages=4, num_blocks=14)
    assert s.blocks.capacity() == 14 and s.blocks.blocks_in_page(3) == range(12, 14)
    assert max(s.blocks.alloc(13)) == 13
    with pytest.raises(KVCachedConfigError, match="need 3 pages, but the page allocator has 4"):
        make_stack(num_pages=4, num_blocks=12)
    with pytest.raises(KVCachedConfigError, match="num_blocks=17 must be in 1..16"):
        make_stack(num_pages=4, num_blocks=17)


def test_null_block_needs_room_for_page_zero(make_stack):
    with pytest.raises(KVCachedConfigError, match="null block"):
        make_stack(memory_limit=1)
    assert make_stack(memory_limit=1, null_block=False).blocks.alloc(1) is None


def test_clear_frees_all_but_the_null_block(make_stack):
    s = make_stack()
    s.blocks.alloc(30)
    s.blocks.clear()
    assert s.blocks.num_allocated == 1 and s.pages.num_in_use == 1
    assert s.blocks.page_occupancy(0) == 1 and s.blocks.page_occupancy(5) == 0


@pytest.mark.parametrize(
    "layout",
    [dict(), dict(contiguous=True), dict(num_buffers=1), dict(num_buffers=1, contiguous=True)],
    ids=["per-layer", "contiguous", "mla", "mla-contiguous"],
)
def test_blocks_are_writable_through_engine_views(make_stack, layout):
    s = make_stack(num_layers=3, **layout)
    bm, kv = s.blocks, s.kv
    ids = bm.alloc(9)
    kinds = range(kv.layout.num_buffers)
    views = {
        (layer, k): kv.block_view(layer, k, BLOCK, torch.float16)
        for layer in range(3)
        for k in kinds
    }
    for (layer, k), view in views.items():
        for b in ids:
            view[b] = b * 10 + layer * 2 + k
    for (layer, k), view in views.items():
        for b in ids:
            assert torch.all(view[b] == b * 10 + layer * 2 + k)
    assert kv.mapped_pages == bm.num_held_pages == 3
    bm.free(ids)
    assert kv.mapped_pages == s.pages.num_mapped


def test_groups_and_devices_are_independent(make_stack):
    shared = open_mapper("cpu", PAGE)
    full = make_stack(mapper=shared)
    mla = make_stack(mapper=shared, num_layers=1, num_buffers=1, block_bytes=8 << 10)
    other = make_stack(contiguous=True)  # its own mapper, as for a second device
    full.pages.set_memory_limit(2 * full.pages.page_bytes)
    assert full.blocks.alloc(8) is None and full.blocks.alloc(7) is not None
    assert mla.blocks.alloc(100) is not None and other.blocks.alloc(60) is not None
    assert shared.stats().mapped_pages == 2 * 4 + 13
    assert other.kv.mapper.stats().mapped_pages == 16


def test_block_manager_needs_its_own_page_zero(make_stack):
    s = make_stack(block_bytes=None)
    s.pages.claim_page(0)
    with pytest.raises(MappingError, match="page 0 is in use"):
        KVBlockManager(s.pages, BLOCK)
    assert K == 0 and V == 1


def test_threads_never_share_a_block_and_pages_come_back(make_stack):
    """Allocation from several threads at once (hot path and page growth racing)."""
    import threading

    s = make_stack(max_reserved=4)
    bm = s.blocks
    owner: dict[int, int] = {}
    clash: list[int] = []
    guard = threading.Lock()

    def worker(t: int) -> None:
        mine: list[list[int]] = []
        for i in range(400):
            ids = bm.alloc(1 + (i + t) % 5)
            if ids is not None:
                with guard:
                    for b in ids:
                        if owner.setdefault(b, t) != t:
                            clash.append(b)
                mine.append(ids)
            if mine and (ids is None or i % 3 == 0):
                gone = mine.pop(0)
                with guard:
                    for b in gone:
                        del owner[b]
                bm.free(gone)
        for ids in mine:
            with guard:
                for b in ids:
                    del owner[b]
            bm.free(ids)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not clash
    assert bm.num_allocated == 1 and bm.allocated_ids() == []
    assert bm.num_held_pages == 1 and s.pages.num_in_use == 1

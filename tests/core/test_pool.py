"""ElasticPool: one assembly of backing, pages, blocks, usage record and budget slot."""

from __future__ import annotations

import logging
import os
import time

import pytest

from kvcached_core import _native
from kvcached_core.allocator import KVLayout, KVTensors
from kvcached_core.allocator.kv_tensors import host_memory_bytes
from kvcached_core.config import load_settings
from kvcached_core.device import Device
from kvcached_core.errors import KVCachedConfigError
from kvcached_core.ipc import Endpoint, WorkerListener, list_pools
from kvcached_core.ipc import budget as bud
from kvcached_core.pool import ElasticPool
from kvcached_core.vmm import open_mapper

PAGE = 64 << 10
LAYERS = 2
PAGES = 16
BLOCK = 16 << 10
BUNDLE = PAGE * LAYERS * 2  # one page id over 2 layers x K/V


def wait_until(predicate, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def layout() -> KVLayout:
    return KVLayout(LAYERS, PAGES * PAGE, PAGE, 2, False)


def settings(**kw):
    return load_settings(**dict(dict(min_reserved_pages=0, max_reserved_pages=0, idle_keep_pages=0),
                                **kw))


def slots(shm_base):
    rec = bud.BudgetRecord.open(bud.device_key("host", 0), shm_base)
    try:
        return {s.name: s.mapped for s in rec.read().slots}
    finally:
        rec.close()


def test_a_published_pool_shows_in_kvctl_and_the_budget_and_close_removes_both(shm_base):
    pool = ElasticPool.local("cpu", layout(), block_bytes=BLOCK, namespace="ptest",
                             name="kv0", settings=settings())
    try:
        assert pool.device_total == host_memory_bytes()
        (rec,) = [p for p in list_pools("ptest")]
        assert rec.pool == "kv0" and rec.capacity == layout().total_bytes
        ids = pool.blocks.alloc(5)  # 4 blocks per page: two page ids, the null block included
        assert ids is not None
        assert slots(shm_base) == {"ptest/kv0": 2 * BUNDLE}
        # Republished by the allocator's background poll within tens of ms.
        assert wait_until(lambda: list_pools("ptest")[0].used == 2 * BUNDLE)
        rec = list_pools("ptest")[0]
        assert rec.mapped == 2 * BUNDLE
        assert rec.map_latency.count == 2 and rec.map_bytes == 2 * BUNDLE  # the null page's too
        pool.blocks.free(ids)
        assert pool.pages.wait_idle(5)
        assert slots(shm_base) == {"ptest/kv0": BUNDLE}  # the null block's page stays
    finally:
        pool.close()
    assert list_pools("ptest") == []
    assert slots(shm_base) == {}
    pool.close()  # idempotent


def test_an_unpublished_pool_touches_no_shared_memory(shm_base):
    pool = ElasticPool.local("cpu", layout(), block_bytes=BLOCK, settings=settings())
    try:
        assert pool.segment is None and pool.budget is None
        assert pool.blocks.alloc(3) is not None
        assert list(shm_base.iterdir()) == []
    finally:
        pool.close()


def test_the_budget_setting_caps_pools_and_the_evictor_gives_back(shm_base, monkeypatch):
    monkeypatch.setenv("KVCACHED_DEVICE_BUDGET", str(4 * BUNDLE))
    a = ElasticPool.local("cpu", layout(), block_bytes=BLOCK, namespace="pa", name="kv0",
                          settings=settings())
    b = ElasticPool.local("cpu", layout(), block_bytes=BLOCK, namespace="pb", name="kv0",
                          settings=settings())
    cached: list[int] = []

    def evict(pages: int) -> int:  # A's prefix cache: whole pages nobody uses
        victims = cached[:]
        cached.clear()
        a.blocks.free(victims)
        return len(victims) // 4

    try:
        a.set_evictor(evict)
        cached.extend(a.blocks.alloc(11))  # A's three page ids and B's null page: the budget
        assert slots(shm_base) == {"pa/kv0": 3 * BUNDLE, "pb/kv0": BUNDLE}
        got = None
        deadline = time.monotonic() + 30  # a loaded machine runs A's thread late
        while got is None and time.monotonic() < deadline:
            got = b.blocks.alloc(4)  # B's first tries miss and ask; A's thread gives back
        assert got is not None
        assert sum(slots(shm_base).values()) <= 4 * BUNDLE
        assert [g["kind"] for g in a.pages.givebacks] == ["budget"]
    finally:
        a.close()
        b.close()


def test_a_bad_budget_setting_names_the_variable_and_builds_nothing(shm_base, monkeypatch):
    monkeypatch.setenv("KVCACHED_DEVICE_BUDGET", "12XB")
    with pytest.raises(KVCachedConfigError, match="KVCACHED_DEVICE_BUDGET"):
        ElasticPool.local("cpu", layout(), block_bytes=BLOCK, namespace="pbad", name="kv0",
                          settings=load_settings())
    assert list_pools("pbad") == []


def test_an_unusable_shared_memory_directory_leaves_a_working_pool_or_refuses_in_strict_mode(
        tmp_path, monkeypatch, caplog):
    unsafe = tmp_path / "open"
    unsafe.mkdir(mode=0o777)
    os.chmod(unsafe, 0o777)  # world-writable: kvcached does not trust it
    monkeypatch.setenv("KVCACHED_SHM_DIR", str(unsafe))
    with caplog.at_level(logging.WARNING, logger="kvcached"):
        pool = ElasticPool.local("cpu", layout(), block_bytes=BLOCK, namespace="punsafe",
                                 name="kv0", settings=settings())
    try:
        assert pool.segment is None and pool.budget is None
        assert pool.blocks.alloc(3) is not None
        assert "no device budget for pool punsafe/kv0" in caplog.text
        assert "KVCACHED_SHM_DIR" in caplog.text
    finally:
        pool.close()
    monkeypatch.setenv("KVCACHED_STRICT", "1")
    with pytest.raises(KVCachedConfigError, match="KVCACHED_STRICT=1"):
        ElasticPool.local("cpu", layout(), block_bytes=BLOCK, namespace="punsafe", name="kv0",
                          settings=settings())


def test_a_remote_pool_maps_in_its_worker_and_reads_the_device_from_it(shm_base, tmp_path):
    base = tmp_path / "ipc"
    base.mkdir(mode=0o700)
    mapper = open_mapper("cpu", PAGE)
    vt = mapper.reserve(LAYERS * PAGES * PAGE)
    server = _native.PageServer(mapper, 0)
    server.add_group(0, [(vt, [0, PAGES])], PAGES)
    path = os.fspath(base / "w0.sock")
    listener = WorkerListener(path, lambda op, g, p: server.apply(op, g, p), rank=0,
                              server=server).start()
    lay = KVLayout(num_layers=LAYERS, buffer_bytes=PAGES * PAGE, page_size=PAGE, num_buffers=1)
    pool = ElasticPool.remote(lay, [Endpoint(0, path)], Device("host", 0, "cpu"),
                              block_bytes=BLOCK, namespace="premote", name="kv0",
                              settings=settings())
    try:
        assert pool.device_total == host_memory_bytes()
        ids = pool.blocks.alloc(7)  # with the null block: page ids 0 and 1
        assert mapper.stats().mapped_pages == 2 * LAYERS  # in both regions, in the worker
        assert slots(shm_base) == {"premote/kv0": 2 * LAYERS * PAGE}
        pool.blocks.free(ids)
        assert pool.pages.wait_idle(5)
        assert mapper.stats().mapped_pages == LAYERS  # the null block's page
    finally:
        pool.close()
        listener.close()
    assert slots(shm_base) == {}
    assert isinstance(KVTensors.open("cpu", layout()).device_total(), int)


def test_an_engine_that_evicts_on_its_own_thread_reports_what_it_gave_back(shm_base, monkeypatch):
    """SGLang's way: the ask only records how much is wanted; the engine's own thread evicts
    at its next idle moment, unmaps, and reports the pages as given back."""
    monkeypatch.setenv("KVCACHED_DEVICE_BUDGET", str(4 * BUNDLE))
    a = ElasticPool.local("cpu", layout(), block_bytes=BLOCK, namespace="pa", name="kv0",
                          settings=settings())
    b = ElasticPool.local("cpu", layout(), block_bytes=BLOCK, namespace="pb", name="kv0",
                          settings=settings(max_reserved_pages=4))
    asked: list[int] = []
    try:
        a.set_evictor(lambda pages: asked.append(a.budget_ask()) or 0)
        cached = a.blocks.alloc(11)
        assert b.blocks.alloc(4) is None  # the miss asks; nothing can be given at once
        assert wait_until(lambda: bool(asked))
        mapped = a.pages.num_mapped  # A's thread, idle now: evicts what was asked, unmaps it
        a.blocks.free(cached)
        a.pages.trim()
        a.gave_back(mapped - a.pages.num_mapped, asked[0])
        assert b.blocks.alloc(4) is not None
        rec = bud.BudgetRecord.open(bud.device_key("host", 0), shm_base)
        try:
            (slot,) = [s for s in rec.read().slots if s.name == "pa/kv0"]
        finally:
            rec.close()
        assert slot.given_bytes == 2 * BUNDLE and slot.givebacks == 1 and slot.last_giveback_ns > 0
        assert asked[0] > 0  # the evictor ran inside the answer to B's ask
        a.gave_back(1, 0)  # what a lowered limit made the engine evict is no giveback
        rec = bud.BudgetRecord.open(bud.device_key("host", 0), shm_base)
        try:
            (slot,) = [s for s in rec.read().slots if s.name == "pa/kv0"]
        finally:
            rec.close()
        assert slot.givebacks == 1
    finally:
        a.close()
        b.close()

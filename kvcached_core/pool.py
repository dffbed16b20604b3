"""One engine's elastic KV pool, assembled in one place.

An engine adapter describes its KV cache (a :class:`~kvcached_core.allocator.KVLayout`
and a block size) and where the memory lives; :class:`ElasticPool` builds the
rest of the stack the same way for every engine::

    layout → page backing → PageAllocator → KVBlockManager
                               ├── usage record (kvctl, kvtop, /metrics; kvctl limit)
                               └── slot in the device's budget (giveback between engines)

The page backing is local memory (:class:`~kvcached_core.allocator.KVTensors`,
the scheduler and the KV tensors share a process, as in SGLang) or the memory
of worker processes (:class:`~kvcached_core.ipc.remote.RemoteKVTensors`, as in
vLLM)::

    pool = ElasticPool.local("cuda:0", layout, block_bytes=bb, namespace=ns, name="mha-tp0")
    pool = ElasticPool.remote(layout, endpoints, Device("cuda", 0, "cuda"), block_bytes=bb,
                              namespace=ns, name="kv0", fence=StepFence())
    ids = pool.blocks.alloc(4)          # None: a scheduling miss
    pool.set_evictor(evict_cached)      # budget asks, limits, idle spells, headroom reach the prefix cache
    pool.close()

Without a ``namespace`` the pool publishes nothing and joins no budget (a pool
of a test or a tool). A pool whose record or budget cannot be opened (an unsafe
shared-memory directory, say) still works; it says why in the log, and with
``KVCACHED_STRICT=1`` a budget that cannot be joined refuses to start.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from kvcached_core.allocator import KVBlockManager, KVLayout, KVTensors, PageAllocator
from kvcached_core.allocator.fence import StepFence
from kvcached_core.config import Settings, load_settings
from kvcached_core.device import Device, torch_is_rocm
from kvcached_core.env import env_bool
from kvcached_core.errors import IPCError, KVCachedConfigError, KVCachedError
from kvcached_core.ipc.broadcast import Endpoint
from kvcached_core.ipc.budget import BudgetRecord, BudgetSlot, device_key
from kvcached_core.ipc.publish import publish_pool
from kvcached_core.ipc.remote import RemoteKVTensors
from kvcached_core.ipc.shm import PoolSegment

__all__ = ["ElasticPool", "join_device_budget"]

_log = logging.getLogger("kvcached")


def budget_device(device: Device) -> tuple[str, int]:
    """The memory whose budget ``device``'s pools share, as ``device_key`` takes it.

    A compiled backend's own device; a plugin backend's by how torch names its
    memory, so a plugin chosen for ``cpu`` or ``cuda:N`` (or one over host memory
    for a device type of its own) shares the budget of the engines kvcached's own
    backends run there: ``("host", 0)`` for torch's ``cpu``, ``cuda``/``hip`` (as
    kvcached picks for this torch) and the index for ``cuda:N``, else the torch
    device type and index (``xpu:1`` -> ``("xpu", 1)``).
    """
    if device.provider is None:
        return device.backend, device.index
    kind, _, index = device.torch_device.partition(":")
    if kind == "cpu":
        return "host", 0
    number = int(index) if index.isdigit() else device.index
    if kind == "cuda":
        return ("hip" if torch_is_rocm() else "cuda"), number
    return kind, number


def join_device_budget(device: Device, settings: Settings, total: int, name: str) -> BudgetSlot | None:
    """A slot named ``name`` in ``device``'s budget record (its capacity set from
    ``KVCACHED_DEVICE_BUDGET`` when given), or ``None`` when the record cannot be opened.

    Raises:
        KVCachedConfigError: The budget setting is wrong; or the record cannot be
            opened and ``KVCACHED_STRICT=1``.
    """
    try:
        record = BudgetRecord.open(device_key(*budget_device(device)))
        record.set_device_total(total)
        if settings.device_budget is not None:
            record.set_capacity(settings.device_budget.resolve(total))
        return record.join(name)
    except (IPCError, OSError, KVCachedConfigError) as exc:
        if isinstance(exc, KVCachedConfigError):
            raise
        if env_bool("KVCACHED_STRICT", False):
            raise KVCachedConfigError(f"kvcached: cannot join the device budget ({exc}), and "
                                      "KVCACHED_STRICT=1 refuses to run without it") from exc
        _log.warning("kvcached: no device budget for pool %s (%s)", name, exc)
        return None


def _device_total(backing: Any) -> int:
    """The backing's device size, 0 when it cannot be read (budget percentages then fail)."""
    try:
        return int(backing.device_total())
    except (KVCachedError, OSError, ValueError) as exc:
        _log.warning("kvcached: reading the size of %s failed (%s)", backing.device, exc)
        return 0


class ElasticPool:
    """The kvcached stack behind one engine KV pool, with one :meth:`close`.

    Args:
        backing: The page backing (``KVTensors`` or ``RemoteKVTensors``).
        block_bytes: Bytes of one engine block in one region.
        num_blocks: Blocks the engine addresses (default: as many as fit).
        block_offset: Bytes before block 0 in each region.
        reserve_null_block: Keep block 0 out of allocation (the engine's padding slot).
        namespace: The engine's IPC namespace; with it the pool publishes its
            usage record ``<namespace>.<name>`` and joins its device's budget.
        name: The pool's name inside the namespace (``kv0``, ``mha-tp0``).
        settings: kvcached's settings (default :func:`~kvcached_core.config.load_settings`;
            an adapter passes its defaults through ``load_settings(**defaults)``).
        fence: The engine's step fence, when its scheduler runs ahead of the device.

    Raises:
        KVCachedConfigError: A setting is out of range or the block geometry
            does not fit the layout.
    """

    def __init__(
        self,
        backing: KVTensors | RemoteKVTensors,
        *,
        block_bytes: int,
        num_blocks: int | None = None,
        block_offset: int = 0,
        reserve_null_block: bool = True,
        namespace: str | None = None,
        name: str = "kv0",
        settings: Settings | None = None,
        fence: StepFence | None = None,
    ) -> None:
        self.backing = backing
        self.namespace = namespace
        self.name = name
        self.settings = settings if settings is not None else load_settings()
        self.fence = fence
        self.device_total = _device_total(backing)
        self.budget: BudgetSlot | None = None
        self.segment: PoolSegment | None = None
        if namespace is not None:
            self.budget = join_device_budget(backing.device, self.settings, self.device_total,
                                             f"{namespace}/{name}")
        try:
            self.pages = PageAllocator(backing, settings=self.settings, fence=fence,  # type: ignore[arg-type]
                                       budget=self.budget)
            if namespace is not None:  # before the first map: every map is timed
                self.segment = self._publish()
            self.blocks = KVBlockManager(self.pages, block_bytes, num_blocks=num_blocks,
                                         reserve_null_block=reserve_null_block,
                                         block_offset=block_offset)
        except BaseException:
            self.close()
            raise

    @classmethod
    def local(cls, device: Any, layout: KVLayout, **kwargs: Any) -> ElasticPool:
        """A pool over memory of this process (``device``: ``"cuda:0"``, ``"cpu"``, ...)."""
        return cls(KVTensors.open(device, layout), **kwargs)

    @classmethod
    def remote(
        cls,
        layout: KVLayout,
        endpoints: Sequence[Endpoint],
        device: Device,
        *,
        group: int = 0,
        local_server: Any = None,
        timeout: float | None = None,
        connect_timeout: float | None = None,
        **kwargs: Any,
    ) -> ElasticPool:
        """A pool over the memory of an engine's workers (see :class:`RemoteKVTensors`)."""
        backing = RemoteKVTensors(layout, endpoints, group, device=device, timeout=timeout,
                                  connect_timeout=connect_timeout, local_server=local_server)
        try:
            return cls(backing, **kwargs)
        except BaseException:
            backing.close()
            raise

    def __repr__(self) -> str:
        where = f"{self.namespace}.{self.name}" if self.namespace is not None else "unpublished"
        return f"<ElasticPool {where} {self.backing!r} blocks={self.blocks.num_blocks}>"

    @property
    def layout(self) -> KVLayout:
        return self.backing.layout

    def _publish(self) -> PoolSegment | None:
        """The usage record ``kvctl`` / ``kvtop`` / Prometheus read and ``kvctl limit`` writes."""
        try:
            segment = PoolSegment.create(self.namespace, self.name,
                                         capacity=self.layout.total_bytes)
        except (IPCError, OSError) as exc:
            _log.warning("kvcached: no shared-memory record for pool %s.%s, kvctl will not "
                         "see it (%s)", self.namespace, self.name, exc)
            return None
        try:
            segment.set_device_total(self.device_total)
            self.pages.watch_limit(publish_pool(self.backing, self.pages, segment))
        except BaseException:
            segment.close()
            raise
        return segment

    def set_evictor(self, evictor: Callable[[int], int] | None) -> None:
        """The engine's eviction of whole prefix-cached pages (see
        :meth:`PageAllocator.set_evictor`): budget asks, limits, idle spells, a short headroom."""
        self.pages.set_evictor(evictor)

    def budget_ask(self) -> int:
        """The budget ask this pool is answering now (its generation), 0 if none: inside
        the evictor, tells another engine's ask from a lowered limit."""
        return self.budget.pending_pressure() if self.budget is not None else 0

    def gave_back(self, pages: int, ask: int) -> None:
        """Count ``pages`` unmapped for budget ask ``ask`` (from :meth:`budget_ask`) as
        given back, with the time since the latest ask, in the budget record: for an engine
        whose cache can only be evicted on its own thread, after the allocator answered."""
        if self.budget is not None and pages > 0 and ask:
            _gen, _wanted, _slot, raised_ns = self.budget.pressure()
            self.budget.answered(ask, pages * self.pages.page_bytes, raised_ns)

    def release_records(self) -> None:
        """Remove the usage record and free the budget slot; asks no worker anything.

        For an engine that is stopping or dying: the allocator's background
        thread, which polls both, is stopped first, though not waited for beyond
        a second if it is inside a call to a worker that stopped answering (its
        late writes to closed records are dropped).
        """
        pages = self.__dict__.get("pages")
        if pages is not None:
            pages.stop_background(timeout=1.0)
        if self.segment is not None:
            self.segment.close()
            self.segment = None
        if self.budget is not None:
            self.budget.close()
            self.budget.record.close()
            self.budget = None

    def close(self) -> None:
        """Stop the background work, unmap the reserve, release the records and drop
        the workers' connections (pages in use stay mapped; idempotent)."""
        pages = self.__dict__.get("pages")
        if pages is not None:
            pages.close()
        self.release_records()
        if isinstance(self.backing, RemoteKVTensors):
            self.backing.close()

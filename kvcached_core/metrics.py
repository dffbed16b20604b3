"""Prometheus metrics of every kvcached pool and device budget on this machine.

:class:`KVCachedCollector` reads the pools' shared-memory segments
(:mod:`kvcached_core.ipc.shm`) and the device budget records
(:mod:`kvcached_core.ipc.budget`) at every scrape, so it can live in any
process of the user that runs the engines (an engine's API server, a sidecar)
and needs no multi-process aggregation: the records are already the one
source of truth ``kvctl`` and ``kvtop`` read. It never creates a device context.

Metrics (labels ``namespace`` and ``pool``; budgets: ``device``)::

    kvcached_pool_mapped_bytes      bytes backed by memory now
    kvcached_pool_used_bytes        bytes of pages holding KV blocks
    kvcached_pool_reserved_bytes    bytes mapped ahead of demand
    kvcached_pool_limit_bytes       the pool's limit (absent when none is set)
    kvcached_pool_capacity_bytes    the pool's virtual size
    kvcached_pool_map_latency_seconds     histogram, one sample per map call
    kvcached_pool_unmap_latency_seconds   histogram, one sample per unmap call
    kvcached_pool_map_bytes_total         bytes mapped since the pool started (counter)
    kvcached_pool_unmap_bytes_total       bytes unmapped since the pool started (counter)
    kvcached_budget_capacity_bytes  the device budget (absent when none is set)
    kvcached_budget_mapped_bytes    bytes all live pools of the device map together

Records of dead processes are left out. ``register(registry)`` adds the
collector once per registry; ``prometheus_client`` is imported only then.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

__all__ = ["KVCachedCollector", "register"]

_log = logging.getLogger("kvcached")


class KVCachedCollector:
    """A ``prometheus_client`` collector over kvcached's shared-memory records.

    Args:
        directory: Where the records live (default: :func:`~kvcached_core.ipc.shm.shm_dir`).
    """

    def __init__(self, directory: Any = None) -> None:
        self.directory = directory

    def describe(self) -> list[Any]:
        return []  # metrics come and go with pools: no fixed description

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        from kvcached_core.ipc.budget import list_budgets
        from kvcached_core.ipc.shm import list_pools

        labels = ["namespace", "pool"]
        gauges = {
            key: GaugeMetricFamily(f"kvcached_pool_{key}_bytes", text, labels=labels)
            for key, text in (
                ("mapped", "KV bytes of the pool backed by memory now"),
                ("used", "KV bytes of the pool's pages that hold blocks"),
                ("reserved", "KV bytes the pool mapped ahead of demand"),
                ("limit", "the pool's memory limit in bytes (kvctl limit)"),
                ("capacity", "the pool's virtual size in bytes"),
            )
        }
        totals = {
            key: CounterMetricFamily(f"kvcached_pool_{key}_bytes", text, labels=labels)
            for key, text in (("map", "KV bytes mapped since the pool started"),
                              ("unmap", "KV bytes unmapped since the pool started"))
        }
        hists = {
            kind: HistogramMetricFamily(
                f"kvcached_pool_{kind}_latency_seconds",
                f"time of one {kind} call of the pool's allocator (a batch of pages, "
                "every worker)", labels=labels)
            for kind in ("map", "unmap")
        }
        try:
            pools = [p for p in list_pools(directory=self.directory) if p.alive]
        except Exception:
            _log.debug("kvcached: reading the pool records failed", exc_info=True)
            pools = []
        for p in pools:
            values = [p.namespace, p.pool]
            gauges["mapped"].add_metric(values, p.mapped)
            gauges["used"].add_metric(values, p.used)
            gauges["reserved"].add_metric(values, p.reserved)
            gauges["capacity"].add_metric(values, p.capacity)
            if p.has_limit:
                gauges["limit"].add_metric(values, p.limit)
            totals["map"].add_metric(values, p.map_bytes)
            totals["unmap"].add_metric(values, p.unmap_bytes)
            for kind, lat in (("map", p.map_latency), ("unmap", p.unmap_latency)):
                buckets = [("+Inf" if b == float("inf") else repr(b), n)
                           for b, n in lat.cumulative()]
                # The count is read first, buckets after: never report more in +Inf
                # than the count says (a call may land between the two reads).
                buckets[-1] = ("+Inf", max(lat.count, buckets[-1][1]))
                hists[kind].add_metric(values, buckets, lat.sum_ns / 1e9)
        yield from gauges.values()
        yield from totals.values()
        yield from hists.values()

        cap = GaugeMetricFamily("kvcached_budget_capacity_bytes",
                                "KV bytes every engine of this user may map on the device",
                                labels=["device"])
        mapped = GaugeMetricFamily("kvcached_budget_mapped_bytes",
                                   "KV bytes the live pools of the device map together",
                                   labels=["device"])
        try:
            budgets = list_budgets(self.directory)
        except Exception:
            _log.debug("kvcached: reading the budget records failed", exc_info=True)
            budgets = []
        for b in budgets:
            if b.has_budget:
                cap.add_metric([b.device], b.capacity)
            mapped.add_metric([b.device], b.mapped)
        yield cap
        yield mapped


def register(registry: Any = None, directory: Any = None) -> KVCachedCollector | None:
    """Add a :class:`KVCachedCollector` to ``registry`` (default: prometheus_client's
    global one), once per registry. ``None`` without ``prometheus_client``."""
    try:
        from prometheus_client import REGISTRY
    except ImportError:
        return None
    registry = REGISTRY if registry is None else registry
    existing = getattr(registry, "_kvcached_collector", None)
    if existing is not None:
        return existing
    collector = KVCachedCollector(directory)
    registry.register(collector)
    registry._kvcached_collector = collector
    return collector

"""One reading of every kvcached pool and device budget, grouped per device and engine.

What ``kvctl status`` prints and ``kvtop`` refreshes. Only the shared-memory
records are read (:mod:`kvcached_core.ipc.shm`, :mod:`kvcached_core.ipc.budget`):
no device context is created, no engine is contacted, nothing is written.
A pool belongs to the device whose budget record holds its slot
(``namespace/pool``); pools without one are listed under ``-``.
"""

from __future__ import annotations

import time
from typing import Any

__all__ = ["SCHEMA", "snapshot", "rates"]

SCHEMA = "kvcached.status/1"


def _pool(p: Any) -> dict[str, Any]:
    def lat(h: Any) -> dict[str, Any]:
        return {"count": h.count, "sum_s": h.sum_ns / 1e9,
                "mean_ms": (h.sum_ns / h.count / 1e6) if h.count else None}

    return {
        "pool": p.pool, "pid": p.pid, "alive": p.alive, "mapped": p.mapped, "used": p.used,
        "reserved": p.reserved, "limit": p.limit if p.has_limit else None,
        "capacity": p.capacity, "device_total": p.device_total or None,
        "map_bytes": p.map_bytes, "unmap_bytes": p.unmap_bytes,
        "map_latency": lat(p.map_latency), "unmap_latency": lat(p.unmap_latency),
        "updated_ns": p.updated_ns,
    }


def snapshot(namespace: str | None = None, directory: Any = None) -> dict[str, Any]:
    """Devices (budget, engines, pools) and stale records, as plain JSON-able data.

    Raises:
        KVCachedConfigError: ``namespace`` is not a valid name.
    """
    from kvcached_core.ipc import paths
    from kvcached_core.ipc.budget import list_budgets
    from kvcached_core.ipc.shm import list_pools

    if namespace is not None:
        paths.check_name(namespace, "namespace")
    pools = list_pools(namespace, directory=directory)
    budgets = list_budgets(directory)
    device_of: dict[str, str] = {}
    for b in budgets:
        for s in b.slots:
            if s.alive:
                device_of[s.name] = b.device
    devices: dict[str, dict[str, Any]] = {}
    for b in budgets:
        devices[b.device] = {
            "device": b.device, "budget": b.capacity if b.has_budget else None,
            "budget_mapped": b.mapped, "device_total": b.device_total or None,
            "misses": sum(s.misses for s in b.slots if s.alive),
            "engines": {}}
    stale = []
    for p in pools:
        if not p.alive:
            stale.append({"namespace": p.namespace, "pool": p.pool, "pid": p.pid,
                          "path": p.path})
            continue
        key = device_of.get(f"{p.namespace}/{p.pool}", "-")
        dev = devices.setdefault(key, {"device": key, "budget": None, "budget_mapped": None,
                                       "device_total": p.device_total or None, "misses": 0,
                                       "engines": {}})
        dev["engines"].setdefault(p.namespace, []).append(_pool(p))
    out = []
    for dev in devices.values():
        if namespace is not None and not dev["engines"]:
            continue
        engines = [{"namespace": ns, "pools": ps,
                    **{k: sum(x[k] for x in ps) for k in ("mapped", "used", "reserved")}}
                   for ns, ps in sorted(dev["engines"].items())]
        out.append({**dev, "engines": engines,
                    "mapped": sum(e["mapped"] for e in engines)})
    return {"schema": SCHEMA, "time_ns": time.time_ns(), "devices": out, "stale": stale}


def rates(prev: dict[str, Any] | None, now: dict[str, Any]) -> dict[tuple[str, str], float]:
    """Bytes mapped per second per ``(namespace, pool)`` between two snapshots."""
    if prev is None:
        return {}
    dt = (now["time_ns"] - prev["time_ns"]) / 1e9
    if dt <= 0:
        return {}
    before = {(e["namespace"], p["pool"], p["pid"]): p["map_bytes"]
              for d in prev["devices"] for e in d["engines"] for p in e["pools"]}
    out = {}
    for d in now["devices"]:
        for e in d["engines"]:
            for p in e["pools"]:
                old = before.get((e["namespace"], p["pool"], p["pid"]))
                if old is not None:
                    out[(e["namespace"], p["pool"])] = max(0, p["map_bytes"] - old) / dt
    return out

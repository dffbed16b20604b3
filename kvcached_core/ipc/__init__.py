"""Cross-process machinery: scheduler-to-worker map/unmap broadcast and pool accounting.

- :mod:`~kvcached_core.ipc.protocol`: the fixed binary frame format (no pickle).
- :mod:`~kvcached_core.ipc.paths`: owner-only socket directories, namespaces, socket paths.
- :mod:`~kvcached_core.ipc.worker`: :class:`WorkerListener`, run by each worker process.
- :mod:`~kvcached_core.ipc.broadcast`: :class:`WorkerGroup` / :class:`MapBroadcaster`,
  used by the scheduler.
- :mod:`~kvcached_core.ipc.remote`: :class:`RemoteKVTensors`, the page backing of a
  scheduler whose KV memory lives in its workers.
- :mod:`~kvcached_core.ipc.shm`: per-pool shared-memory segments read by ``kvctl`` and ``kvtop``.

Importing this package starts no thread and opens no socket or file.
"""

from kvcached_core.errors import IPCError, ProtocolError, WorkerError
from kvcached_core.ipc.broadcast import Endpoint, MapBroadcaster, WorkerGroup, namespace_endpoints
from kvcached_core.ipc.paths import namespace, socket_path
from kvcached_core.ipc.remote import RemoteKVTensors
from kvcached_core.ipc.shm import NO_LIMIT, PoolSegment, PoolStats, list_pools, set_limit
from kvcached_core.ipc.worker import WorkerListener

__all__ = [
    "Endpoint",
    "IPCError",
    "MapBroadcaster",
    "NO_LIMIT",
    "PoolSegment",
    "PoolStats",
    "ProtocolError",
    "RemoteKVTensors",
    "WorkerError",
    "WorkerGroup",
    "WorkerListener",
    "list_pools",
    "namespace",
    "namespace_endpoints",
    "set_limit",
    "socket_path",
]

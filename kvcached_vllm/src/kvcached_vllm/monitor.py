"""Reading an engine's KV memory from outside it (tests, the demo, dashboards).

A worker answers ``query`` requests on its kvcached socket with the pages it
has mapped, and its handshake names its pid, so any process of the same user
can see how much KV memory each worker has mapped and its resident set size::

    with KVMemoryMonitor("my-engine") as mon:     # KVCACHED_IPC_NAME of the engine
        for w in mon.read():
            print(w.rank, w.mapped_bytes, w.rss_bytes)
"""

from __future__ import annotations

from dataclasses import dataclass

from kvcached_core.ipc import WorkerGroup
from kvcached_core.ipc.protocol import MsgType

__all__ = ["KVMemoryMonitor", "WorkerMemory", "process_rss"]


def process_rss(pid: int) -> int:
    """Resident set size of ``pid`` in bytes (anonymous + file + shared memory)."""
    with open(f"/proc/{pid}/statm") as f:
        resident = int(f.read().split()[1])
    import os

    return resident * os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True)
class WorkerMemory:
    """One worker's KV memory at one instant."""

    rank: int
    pp_stage: int
    pid: int
    mapped_pages: int
    mapped_bytes: int
    rss_bytes: int


class KVMemoryMonitor:
    """Polls the workers of one engine instance.

    Args:
        namespace: The engine's IPC namespace (``KVCACHED_IPC_NAME``).
        page_bytes: Bytes behind one page id in one worker (all layers); the
            demo and tests take it from the engine log or pass the geometry.
        tp_size, pp_size: The engine's parallel sizes.
    """

    def __init__(self, namespace: str, page_bytes: int, tp_size: int = 1, pp_size: int = 1,
                 connect_timeout: float = 5.0) -> None:
        self.page_bytes = page_bytes
        self.group = WorkerGroup.for_namespace(namespace, tp_size, pp_size,
                                               connect_timeout=connect_timeout)
        self._pids: list[int] | None = None

    def pids(self) -> list[int]:
        """The workers' pids, from the handshake."""
        if self._pids is None:
            self._pids = [int(m.values[2]) for m in self.group.request(MsgType.HELLO)]
        return self._pids

    def read(self) -> list[WorkerMemory]:
        """Mapped KV pages and RSS of every worker now."""
        answers = self.group.query(0)
        out = []
        for ep, pid, pages in zip(self.group.endpoints, self.pids(), answers):
            out.append(WorkerMemory(ep.rank, ep.pp_stage, pid, len(pages),
                                    len(pages) * self.page_bytes, process_rss(pid)))
        return out

    def close(self) -> None:
        self.group.close()

    def __enter__(self) -> KVMemoryMonitor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

"""A tensor-parallel worker process: elastic K/V tensors on one device, served over IPC.

Used by ``tests/ipc/test_tp_broadcast.py`` and ``benchmarks/bench_tp_broadcast.py``. Each
worker (spawned, like an engine's GPU worker) opens a page mapper on its device,
reserves the virtual K and V tensors of :data:`LAYERS` layers and serves a
:class:`~kvcached_core.ipc.WorkerListener` whose :class:`MapperHandler` maps
and unmaps pages of KV group :data:`GROUP` in all of them. Rank ``r`` runs on
``cuda:{r % torch.cuda.device_count()}`` (several ranks share a GPU when there
are fewer GPUs than ranks), or on the host backend for ``cpu``.

Besides the socket, a worker answers "compute" requests on a
:func:`multiprocessing.Pipe`, as ``(op, pages)`` tuples:

``write``
    fill each given page of every tensor, viewed as int32, with
    :func:`pattern` ``(rank, tensor, page)`` (an ``index_put_`` kernel);
``read``
    read them back with other kernels: a per-page int64 ``sum``, and a
    float32 ``matmul`` of the page's first ``MM x MM`` block against a fixed
    plain tensor, totalled per page in float64. Answers
    ``{"sums": [[...]], "mm": [[...]]}``, tensor by tensor, page by page;
    compare with :func:`expected`.

Compute requests refuse unmapped pages (touching one would fault) and hold
the lock the map/unmap handler holds, so a kernel never runs while the pages
under it change. Replies are ``("ok", result)`` or ``("error", text)``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvcached_core.ipc import WorkerListener
from kvcached_core.ipc.paths import socket_path
from kvcached_core.ipc.worker import MapperHandler

__all__ = ["GROUP", "LAYERS", "MM", "PAGE", "PAGES", "TPWorkers", "expected", "pattern",
           "serve", "start_workers", "worker_device"]

PAGE = 2 << 20
PAGES = 64
LAYERS = 2
GROUP = 0
MM = 64
_CTX = mp.get_context("spawn")


def worker_device(rank: int, kind: str) -> str:
    """The device of ``rank``: ``cpu``, or ``cuda:{rank % number of GPUs}`` for ``cuda``."""
    if kind == "cpu":
        return "cpu"
    import torch

    count = torch.cuda.device_count()
    if kind != "cuda" or count == 0:
        raise RuntimeError(f"device kind {kind!r} is not usable here ({count} CUDA devices)")
    return f"cuda:{rank % count}"


def pattern(rank: int, tensor: int, page: int) -> int:
    """The int32 value rank ``rank`` writes all over ``page`` of tensor ``tensor``."""
    return rank * 1000 + tensor * 100 + page


def _mm_weight_total() -> int:
    return sum(i % 7 for i in range(MM * MM))


def expected(rank: int, pages: list[int], page_size: int = PAGE,
             tensors: int = 2 * LAYERS) -> dict[str, list[list[int]]]:
    """What ``read`` answers on ``rank`` after ``write`` of ``pages``, worked out by hand.

    A page of constant ``c`` sums to ``c * page_size / 4``; a constant ``MM x MM``
    block times the weight sums to ``c * MM * sum(weight)``.
    """
    words = page_size // 4
    mm = MM * _mm_weight_total()
    vals = [[pattern(rank, t, p) for p in pages] for t in range(tensors)]
    return {"sums": [[c * words for c in row] for row in vals],
            "mm": [[c * mm for c in row] for row in vals]}


class _Shard:
    """One rank's elastic K/V tensors and the kernels run over them."""

    def __init__(self, mapper: Any, device: str, rank: int, pages: int, layers: int,
                 page_size: int) -> None:
        import torch

        from kvcached_core.vmm import as_tensor, mapper_device

        self.torch = torch
        self.rank = rank
        self.device = torch.device(mapper_device(mapper).torch_device)
        self.vts = [mapper.reserve(pages * page_size) for _ in range(2 * layers)]  # K0 V0 K1 V1
        self.views = [as_tensor(vt, torch.int32).view(pages, page_size // 4) for vt in self.vts]
        if MM * MM > page_size // 4:
            raise ValueError(f"a {page_size}-byte page cannot hold a {MM}x{MM} block")
        self.weight = (torch.arange(MM * MM, device=self.device) % 7).float().view(MM, MM)

    def _index(self, pages: list[int]) -> Any:
        unmapped = [p for p in pages if not all(vt.is_mapped(p) for vt in self.vts)]
        if unmapped:
            raise LookupError(f"rank {self.rank}: pages {unmapped} are not mapped")
        return self.torch.tensor(pages, dtype=self.torch.int64, device=self.device)

    def write(self, pages: list[int]) -> None:
        idx = self._index(pages)
        for t, view in enumerate(self.views):
            values = (idx + (self.rank * 1000 + t * 100)).to(self.torch.int32)
            view.index_put_((idx,), values.unsqueeze(1))  # broadcast over the page
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)

    def read(self, pages: list[int]) -> dict[str, list[list[int]]]:
        idx = self._index(pages)
        sums, mm = [], []
        for view in self.views:
            rows = view.index_select(0, idx)
            sums.append(rows.sum(dim=1, dtype=self.torch.int64).tolist())
            blocks = rows[:, : MM * MM].float().view(-1, MM, MM)
            mm.append((blocks @ self.weight).sum(dim=(1, 2), dtype=self.torch.float64)
                      .round().long().tolist())
        return {"sums": sums, "mm": mm}


def serve(path: str, rank: int, kind: str, conn: Any, options: dict[str, int]) -> None:
    """Worker entry point: serve map/unmap/query on ``path`` and compute on ``conn``.

    Sends ``("ready", {"pid", "device"})`` once listening, then answers compute
    requests until ``conn`` reaches EOF (the parent closed it) or SIGTERM.
    ``options`` may set ``pages``, ``layers`` and ``page_size``.
    """
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    from kvcached_core.vmm import open_mapper

    device = worker_device(rank, kind)
    if device != "cpu":
        import torch

        torch.cuda.set_device(device)
    page_size = options.get("page_size", PAGE)
    mapper = open_mapper(device, page_size)
    shard = _Shard(mapper, device, rank, options.get("pages", PAGES), options.get("layers", LAYERS),
                   page_size)
    apply = MapperHandler(mapper, {GROUP: shard.vts})
    lock = threading.Lock()

    def handler(op: str, group: int, pages: list[int]) -> list[int] | None:
        with lock:
            return apply(op, group, pages)

    with WorkerListener(path, handler, rank=rank, label=f"tp worker {device}"):
        conn.send(("ready", {"pid": os.getpid(), "device": device}))
        while True:
            try:
                op, pages = conn.recv()
            except EOFError:
                return
            try:
                with lock:
                    if op == "write":
                        result: Any = shard.write(list(pages))
                    elif op == "read":
                        result = shard.read(list(pages))
                    else:
                        raise ValueError(f"unknown compute op {op!r}")
                conn.send(("ok", result))
            except Exception as exc:
                conn.send(("error", f"{type(exc).__name__}: {exc}"))


@dataclass
class TPWorkers:
    """Spawned TP workers: their socket paths, processes, pipes and devices."""

    paths: list[str]
    procs: list[Any]
    conns: list[Any]
    devices: list[str] = field(default_factory=list)

    def compute(self, rank: int, op: str, pages: list[int], timeout: float = 120.0) -> Any:
        """Run compute ``op`` on ``pages`` in worker ``rank``; its result.

        Raises:
            RuntimeError: the worker refused (its error text), or died.
            TimeoutError: no answer within ``timeout`` seconds.
        """
        conn = self.conns[rank]
        conn.send((op, list(pages)))
        if not conn.poll(timeout):
            raise TimeoutError(f"rank {rank}: no answer to {op!r} within {timeout:g} s")
        try:
            status, result = conn.recv()
        except EOFError:
            raise RuntimeError(f"rank {rank} died during {op!r}") from None
        if status != "ok":
            raise RuntimeError(result)
        return result

    def kill(self, rank: int) -> None:
        """SIGKILL worker ``rank`` (by pid) and reap it."""
        self.procs[rank].kill()
        self.procs[rank].join(10)

    def shutdown(self) -> None:
        """Close the pipes (workers exit on EOF); SIGTERM, then SIGKILL, a lingering one."""
        for conn in self.conns:
            conn.close()
        for proc in self.procs:
            proc.join(10)
            if proc.is_alive():
                proc.terminate()
                proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join(5)


def start_workers(n: int, kind: str, base: str | os.PathLike[str], name: str = "tp",
                  options: dict[str, int] | None = None, start_timeout: float = 180.0) -> TPWorkers:
    """Spawn ``n`` TP workers of device kind ``kind`` (``cpu``/``cuda``) and wait until they listen.

    Sockets go to namespace ``name`` under the private directory ``base``.
    """
    paths = [os.fspath(socket_path(name, r, 0, Path(base))) for r in range(n)]
    pipes = [_CTX.Pipe() for _ in range(n)]
    procs = [_CTX.Process(target=serve, args=(paths[r], r, kind, pipes[r][1], options or {}),
                          name=f"tp-worker-{r}", daemon=True) for r in range(n)]
    workers = TPWorkers(paths, procs, [ours for ours, _ in pipes])
    for proc in procs:
        proc.start()
    for _, theirs in pipes:
        theirs.close()  # so that the parent's close reaches the worker as EOF
    try:
        for r, conn in enumerate(workers.conns):
            if not conn.poll(start_timeout):
                raise RuntimeError(f"TP worker {r} did not start within {start_timeout:g} s")
            status, info = conn.recv()
            if status != "ready":
                raise RuntimeError(f"TP worker {r} said {status!r}: {info}")
            workers.devices.append(info["device"])
    except (EOFError, RuntimeError) as exc:
        codes = [p.exitcode for p in procs]
        workers.shutdown()
        raise RuntimeError(f"TP workers did not start (exit codes {codes}): {exc}") from None
    return workers

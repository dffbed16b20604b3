"""A worker process for the IPC tests: a real host page mapper behind a real listener.

Runs in processes started with the ``spawn`` method, so it is a module of its
own: ``conftest.py`` puts this directory on ``sys.path``, which children inherit.
"""

from __future__ import annotations

import signal
import sys
import time
from typing import Any

from kvcached_core.errors import DeviceOutOfMemoryError
from kvcached_core.ipc.worker import MapperHandler, WorkerListener
from kvcached_core.vmm import open_mapper

PAGE = 64 * 1024
PAGES = 32
GROUPS = (0, 1)


def serve(path: str, rank: int, options: dict[str, Any], ready: Any) -> None:
    """Serve map/unmap/query on ``path`` as ``rank`` until SIGTERM.

    (Not a shared stop event: setting one blocks while a SIGKILLed process
    still counts as one of its waiters.)

    ``options`` may hold ``fail_page`` (a map or unmap touching it raises),
    ``oom_page`` (a map touching it runs out of device memory),
    ``hang_page`` (a map touching it never returns) and ``pp_stage``.
    """
    mapper = open_mapper("cpu", PAGE)
    tensors = {g: [mapper.reserve(PAGES * PAGE)] for g in GROUPS}
    apply = MapperHandler(mapper, tensors)
    fail_page = options.get("fail_page")
    hang_page = options.get("hang_page")
    oom_page = options.get("oom_page")

    def handler(op: str, group: int, pages: list[int]) -> list[int] | None:
        if fail_page is not None and fail_page in pages and op != "query":
            raise RuntimeError(f"injected failure on rank {rank} for page {fail_page}")
        if op == "map" and oom_page is not None and oom_page in pages:
            raise DeviceOutOfMemoryError(f"no memory for page {oom_page} on rank {rank}")
        if hang_page is not None and hang_page in pages:
            time.sleep(3600)
        return apply(op, group, pages)

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    listener = WorkerListener(path, handler, rank=rank, pp_stage=options.get("pp_stage", 0))
    listener.start()
    try:
        ready.set()
        while True:
            time.sleep(3600)
    finally:
        listener.close(timeout=0.5)  # do not wait for a handler told to hang

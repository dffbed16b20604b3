"""Scheduler-to-worker broadcast latency over kvcached's IPC, end to end.

    python benchmarks/bench_ipc.py
    python benchmarks/bench_ipc.py --iters 5000 --page-mb 2

Two worker processes (spawned, like engine workers) each open a host page
mapper, reserve a virtual KV tensor and serve a :class:`WorkerListener` whose
handler really maps and unmaps pages. The scheduler side (this process) times,
per call and with the median as the headline:

  map TP=1     one-page map broadcast to worker 0 only
  map TP=2     the same to both workers (sent to both, then both replies awaited)
  unmap TP=1/2 the matching unmap
  ping TP=1/2  an empty round trip answered by the listener itself
  local map    the same one-page map in-process, without IPC (the floor)

Blocks of TP=1 and TP=2 calls alternate so drift hits both alike. Results
go to benchmarks/results/ipc-host.json with the command line.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

from _timing import map_unmap_pair, median_ratio, run_info, summary, timed, write_result
from kvcached_core.ipc import WorkerGroup, WorkerListener
from kvcached_core.ipc.paths import socket_path
from kvcached_core.ipc.worker import MapperHandler
from kvcached_core.vmm import open_mapper


def worker_main(path: str, rank: int, page_size: int, pages: int, ready) -> None:
    """A worker process: real mapper, real listener, until SIGTERM."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    mapper = open_mapper("cpu", page_size)
    vt = mapper.reserve(pages * page_size)
    with WorkerListener(path, MapperHandler(mapper, {0: [vt]}), rank=rank, label="bench"):
        ready.set()
        while True:
            time.sleep(3600)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=4000, help="calls per measurement")
    ap.add_argument("--blocks", type=int, default=8, help="alternating TP=1/TP=2 blocks")
    ap.add_argument("--page-mb", type=int, default=2)
    ap.add_argument("--pages", type=int, default=16, help="pages each worker reserves")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "ipc-host.json"))
    args = ap.parse_args(argv)
    page_size = args.page_mb << 20
    per_block = max(1, args.iters // args.blocks)

    ctx = mp.get_context("spawn")
    base = tempfile.mkdtemp(prefix="kvb-")  # mkdtemp makes it 0700
    paths = [os.fspath(socket_path("bench", r, 0, base)) for r in range(2)]
    readies = [ctx.Event() for _ in paths]
    procs = [ctx.Process(target=worker_main, args=(p, r, page_size, args.pages, readies[r]),
                         daemon=True) for r, p in enumerate(paths)]
    for proc in procs:
        proc.start()
    for ev in readies:
        if not ev.wait(60):
            raise SystemExit("a worker did not start within 60 s")

    samples: dict[str, list[float]] = {k: [] for k in (
        "map_tp1", "unmap_tp1", "map_tp2", "unmap_tp2", "ping_tp1", "ping_tp2",
        "map_local", "unmap_local")}
    tp1 = WorkerGroup(paths[:1], timeout=10, connect_timeout=10)
    tp2 = WorkerGroup(paths, timeout=10, connect_timeout=10)
    mapper = open_mapper("cpu", page_size)
    vt = mapper.reserve(args.pages * page_size)
    try:
        for group in (tp1, tp2):  # warm up connections, page pools and caches
            map_unmap_pair(lambda p, g=group: g.map(0, [p]), lambda p, g=group: g.unmap(0, [p]),
                           args.pages, 300, {"map_w": [], "unmap_w": []}, "w")
        for _ in range(args.blocks):
            for tag, group in (("tp1", tp1), ("tp2", tp2)):
                map_unmap_pair(lambda p, g=group: g.map(0, [p]),
                               lambda p, g=group: g.unmap(0, [p]), args.pages, per_block,
                               samples, tag)
                samples[f"ping_{tag}"] += timed(lambda _i, g=group: g.ping(), per_block)
            map_unmap_pair(lambda p: mapper.map([vt], [p]), lambda p: mapper.unmap([vt], [p]),
                           args.pages, per_block, samples, "local")
    finally:
        tp1.close()
        tp2.close()
        for proc in procs:
            proc.terminate()
            proc.join(10)
        shutil.rmtree(base, ignore_errors=True)

    lat = {k: summary(v) for k, v in samples.items()}
    result = {**run_info("ipc", backend="host", page_bytes=page_size, workers=2), "latency": lat,
              "tp2_over_tp1_map": median_ratio(lat, "map_tp2", "map_tp1")}
    write_result(args.out, result, "one-page call")
    print(f"TP=2 / TP=1 map median: {result['tp2_over_tp1_map']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Map-broadcast latency per page at TP=1 against TP=N, one device per rank, same run.

    python benchmarks/bench_tp_broadcast.py --device cpu --ranks 2
    python benchmarks/bench_tp_broadcast.py --device cuda --ranks 2

N worker processes (spawned, like an engine's GPU workers; rank ``r`` on
``cuda:{r % GPUs}``, so several ranks share a GPU when there are fewer GPUs,
or the host backend for ``cpu``) each reserve the elastic K and V tensors of
two layers and serve a :class:`WorkerListener` with the standard
:class:`MapperHandler`: mapping page ``p`` backs page ``p`` of all four tensors.
Unmaps synchronise the device first (the default), as the engine does. The
workers are those of the TP tests (``kvcached_testing/tp_worker.py``).

The scheduler (this process) times, per page, with the median as the headline:

  map/unmap tp1           one-page broadcast to worker 0 only
  map/unmap tpN           the same to all N workers
  map/unmap tp1_batchB    a B-page batch (default 32) to worker 0, per page
  map/unmap tpN_batchB    the same to all N workers, per page

Blocks of TP=1 and TP=N calls alternate (and swap order every block) so drift
hits both alike. Results go to benchmarks/results/tp-broadcast-<backend>.json
with the command line and, on GPUs, their number and names.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # kvcached_testing, kvcached_core

from _timing import (  # noqa: E402
    map_unmap_pair, median_ratio, run_info, summary, write_result)
from kvcached_core.ipc import WorkerGroup  # noqa: E402
from kvcached_testing.tp_worker import GROUP, LAYERS, PAGE, PAGES, start_workers  # noqa: E402

RESULTS = Path(__file__).parent / "results"


def gpu_info() -> dict[str, object]:
    """The number and names of the CUDA GPUs this process sees."""
    import torch

    n = torch.cuda.device_count()
    return {"gpus": n, "gpu_names": [torch.cuda.get_device_name(i) for i in range(n)]}


def measure(groups: dict[str, WorkerGroup], batch: int, blocks: int, per_block: int,
            batch_per_block: int) -> dict[str, list[float]]:
    """Alternating blocks of one-page and ``batch``-page map/unmap calls on each group."""
    batches = [list(range(i * batch, (i + 1) * batch)) for i in range(PAGES // batch)]
    samples: dict[str, list[float]] = {}
    for tag in groups:
        for name in (tag, f"{tag}_batch{batch}"):
            samples[f"map_{name}"], samples[f"unmap_{name}"] = [], []

    def run(tag: str, g: WorkerGroup, n: int, nb: int, into: dict[str, list[float]]) -> None:
        map_unmap_pair(lambda p: g.map(GROUP, [p]), lambda p: g.unmap(GROUP, [p]),
                       PAGES, n, into, tag)
        map_unmap_pair(lambda b: g.map(GROUP, batches[b]), lambda b: g.unmap(GROUP, batches[b]),
                       len(batches), nb, into, f"{tag}_batch{batch}")

    for tag, g in groups.items():  # warm up connections, spare handles and caches
        warm = {k: [] for k in samples}
        run(tag, g, 2 * PAGES, 2 * len(batches), warm)
    order = list(groups.items())
    for b in range(blocks):
        for tag, g in order if b % 2 == 0 else order[::-1]:
            run(tag, g, per_block, batch_per_block, samples)
    return samples


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--ranks", type=int, default=2, help="TP size of the full broadcast")
    ap.add_argument("--iters", type=int, default=4000, help="one-page calls per measurement")
    ap.add_argument("--batch", type=int, default=32, help="pages per batch call")
    ap.add_argument("--batch-iters", type=int, default=400, help="batch calls per measurement")
    ap.add_argument("--blocks", type=int, default=8, help="alternating TP=1/TP=N blocks")
    ap.add_argument("--out", default=None, help="default: results/tp-broadcast-<backend>.json")
    args = ap.parse_args(argv)
    if args.ranks < 2:
        ap.error("--ranks must be at least 2 (TP=1 is measured on worker 0 of them)")
    if not 0 < args.batch <= PAGES // 2:
        ap.error(f"--batch must be 1 to {PAGES // 2}")
    backend = "host" if args.device == "cpu" else "cuda"
    info = gpu_info() if args.device == "cuda" else {}

    base = tempfile.mkdtemp(prefix="kvtb-", dir="/tmp")  # 0700, short for socket paths
    workers = start_workers(args.ranks, args.device, base, name="bench")
    tp1 = WorkerGroup(workers.paths[:1], timeout=30, connect_timeout=30)
    tpn = WorkerGroup(workers.paths, timeout=30, connect_timeout=30)
    full = f"tp{args.ranks}"
    try:
        samples = measure({"tp1": tp1, full: tpn}, args.batch, args.blocks,
                          max(1, args.iters // args.blocks),
                          max(1, args.batch_iters // args.blocks))
    finally:
        tp1.close()
        tpn.close()
        workers.shutdown()
        shutil.rmtree(base, ignore_errors=True)

    lat = {k: summary(v, per=args.batch if "_batch" in k else 1) for k, v in samples.items()}
    batch = f"_batch{args.batch}"
    result = {
        **run_info("tp-broadcast", backend=backend, ranks=args.ranks,
                   worker_devices=workers.devices, **info, page_bytes=PAGE,
                   tensors_per_worker=2 * LAYERS,
                   note="latency per KV page (a page backs all tensors_per_worker tensors of a "
                        "worker); batch rows are per page of one batch call; unmaps synchronise "
                        "the device"),
        "latency": lat,
        f"{full}_over_tp1_map": median_ratio(lat, f"map_{full}", "map_tp1"),
        f"{full}_over_tp1_unmap": median_ratio(lat, f"unmap_{full}", "unmap_tp1"),
        f"{full}_over_tp1_map{batch}": median_ratio(lat, f"map_{full}{batch}", f"map_tp1{batch}"),
    }
    write_result(args.out or RESULTS / f"tp-broadcast-{backend}.json", result, "per page")
    print(f"TP={args.ranks} / TP=1 one-page map median: {result[f'{full}_over_tp1_map']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

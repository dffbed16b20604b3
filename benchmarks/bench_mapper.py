"""Page-mapper latency and bandwidth: kvcached against raw driver calls, same run.

    python benchmarks/bench_mapper.py --device cpu
    python benchmarks/bench_mapper.py --device cuda:0

Per 2 MiB page (median microseconds), each kvcached call timed twice: from
Python (what an engine adapter pays) and inside C++ (the mapper's own cost):
  cold grow      kvcached map of a page with no spare handle   vs raw create+map+set-access
  recycled grow  kvcached map with a spare handle               vs raw map+set-access
  shrink         kvcached unmap (handle kept as a spare)        vs raw unmap
  shrink+release kvcached unmap keeping no spares (pool limit 0) vs raw unmap+release
Also: reservation time of the virtual KV tensors of a 32-layer model
(per-layer K and V buffers). On GPUs, elastic memory against plain cudaMalloc
memory: the read bandwidth of a kernel streaming over it, and of a gather of
random blocks (a paged-attention read: many pages touched at once, so the
GPU's address translation is exercised). And whether page traffic slows the
GPU's other work: a launch-bound loop of small kernels and a compute-bound
loop of matmuls, each timed alone and while another thread maps and unmaps
pages (without and with the device synchronisation an engine's unmap does).

Results go to benchmarks/results/mapper-<backend>.json with the command line.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

from _timing import save_json

from kvcached_core import _native
from kvcached_core.vmm import as_tensor, open_mapper

PAGE = 2 << 20


def median(xs):
    return statistics.median(xs)


def per_page_sum(*series):
    return [sum(vals) for vals in zip(*series)]


def timed_calls(fn, items):
    out = []
    for item in items:
        t0 = time.perf_counter_ns()
        fn(item)
        out.append((time.perf_counter_ns() - t0) / 1e3)
    return out


def bench_latency(device: str, backend: str, index: int, pages: int, rounds: int) -> dict:
    raw_cold, raw_recycled, raw_unmap, raw_unmap_release = [], [], [], []
    kv_cold, kv_recycled, kv_shrink, kv_shrink_release = [], [], [], []
    nat = {"cold_map_us": [], "unmap_us": [], "recycled_map_us": [], "unmap_release_us": []}
    for _ in range(rounds):
        raw = _native.time_raw_driver_calls(backend, index, PAGE, pages)
        raw_cold += per_page_sum(raw["create_us"], raw["map_us"], raw["set_access_us"])
        raw_recycled += per_page_sum(raw["map_us"], raw["set_access_us"])
        raw_unmap += raw["unmap_us"]
        raw_unmap_release += per_page_sum(raw["unmap_us"], raw["release_us"])

        mapper = open_mapper(device, PAGE)
        vt = mapper.reserve(pages * PAGE)
        group = mapper.group([vt])  # as KVTensors maps: page indices only
        mapper.synchronize()
        kv_cold += timed_calls(lambda p: group.map([p]), range(pages))
        kv_shrink += timed_calls(lambda p: group.unmap([p], synchronize=False), range(pages))
        kv_recycled += timed_calls(lambda p: group.map([p]), range(pages))
        mapper.set_pool_limit(0)
        kv_shrink_release += timed_calls(lambda p: group.unmap([p], synchronize=False), range(pages))
        del group, vt, mapper
        native = _native.time_mapper_calls(open_mapper(device, PAGE), pages)
        for key, values in native.items():
            nat[key] += values

    def pair(kv, raw):
        return {"kvcached_us": round(median(kv), 3), "raw_us": round(median(raw), 3),
                "ratio": round(median(kv) / median(raw), 4)}

    return {
        "pages_per_round": pages,
        "rounds": rounds,
        "cold_grow": pair(kv_cold, raw_cold),
        "recycled_grow": pair(kv_recycled, raw_recycled),
        "shrink": pair(kv_shrink, raw_unmap),
        "shrink_release": pair(kv_shrink_release, raw_unmap_release),
        # the same calls timed inside C++: the mapper's own cost, no interpreter
        "native": {
            "cold_grow": pair(nat["cold_map_us"], raw_cold),
            "recycled_grow": pair(nat["recycled_map_us"], raw_recycled),
            "shrink": pair(nat["unmap_us"], raw_unmap),
            "shrink_release": pair(nat["unmap_release_us"], raw_unmap_release),
        },
    }


def bench_batched(device: str, pages: int, batch: int) -> dict:
    """Per-page cost when the allocator maps and unmaps `batch` pages per call."""
    mapper = open_mapper(device, PAGE)
    vt = mapper.reserve(pages * PAGE)
    batches = [list(range(i, i + batch)) for i in range(0, pages - batch + 1, batch)]
    cold = timed_calls(lambda b: mapper.map([vt], b), batches)
    shrink = timed_calls(lambda b: mapper.unmap([vt], b, synchronize=True), batches)
    recycled = timed_calls(lambda b: mapper.map([vt], b), batches)
    return {"batch_pages": batch,
            "cold_grow_us_per_page": round(median(cold) / batch, 3),
            "recycled_grow_us_per_page": round(median(recycled) / batch, 3),
            "shrink_with_sync_us_per_page": round(median(shrink) / batch, 3)}


def bench_threads(device: str, pages: int, counts=(1, 2, 4, 8), repeats: int = 3) -> dict:
    """Wall time per page when ``n`` threads, each with a mapper of its own (a mapper
    serialises its calls), map and unmap ``pages // n`` pages at once: whether the driver
    lets map calls overlap, so that a large grow could be split across threads. Cold (new
    handles) and recycled (spare handles) grows."""
    import threading

    out: dict = {"pages": pages}
    for n in counts:
        per = pages // n
        mappers = [open_mapper(device, PAGE) for _ in range(n)]
        vts = [m.reserve(per * PAGE) for m in mappers]
        ids = list(range(per))

        def run(op) -> float:
            threads = [threading.Thread(target=op, args=(m, vt)) for m, vt in zip(mappers, vts)]
            t = time.perf_counter()
            for th in threads:
                th.start()
            for th in threads:
                th.join()
            return (time.perf_counter() - t) * 1e6 / (per * n)

        cold, recycled, shrink = [], [], []
        for _ in range(repeats):
            for m in mappers:
                m.trim_pool(0)
            cold.append(run(lambda m, vt: m.map([vt], ids)))
            shrink.append(run(lambda m, vt: m.unmap([vt], ids, synchronize=False)))
            recycled.append(run(lambda m, vt: m.map([vt], ids)))
            for m, vt in zip(mappers, vts):
                m.unmap([vt], ids, synchronize=False)
        for m in mappers:
            m.trim_pool(0)
        out[f"threads_{n}"] = {"cold_grow_us_per_page": round(median(cold), 2),
                               "recycled_grow_us_per_page": round(median(recycled), 2),
                               "shrink_us_per_page": round(median(shrink), 2)}
    return out


def bench_unmap_sync(device: str, pages: int) -> dict:
    """Cost of the device synchronisation an unmap does before touching a page."""
    mapper = open_mapper(device, PAGE)
    vt = mapper.reserve(pages * PAGE)
    mapper.map([vt], list(range(pages)))
    synced = timed_calls(lambda p: mapper.unmap([vt], [p], synchronize=True), range(pages))
    return {"unmap_with_sync_us": round(median(synced), 3)}


def bench_reservation(device: str, layers: int, per_buffer: int, repeats: int) -> dict:
    mapper = open_mapper(device, PAGE)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        tensors = [mapper.reserve(per_buffer) for _ in range(2 * layers)]
        times.append((time.perf_counter() - t0) * 1e3)
        del tensors
    return {"layers": layers, "buffers": 2 * layers, "bytes_per_buffer": per_buffer,
            "virtual_bytes": 2 * layers * per_buffer, "median_ms": round(median(times), 3),
            "max_ms": round(max(times), 3)}


def bench_bandwidth(device: str, nbytes: int, iters: int) -> dict:
    import torch

    mapper = open_mapper(device, PAGE)
    vt = mapper.reserve(nbytes)
    mapper.map([vt], list(range(nbytes // PAGE)))
    elastic = as_tensor(vt, torch.float32)
    plain = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    elastic.uniform_()
    plain.copy_(elastic)

    def read_gbps(t):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(3):
            t.sum()
        samples = []
        for _ in range(iters):
            start.record()
            t.sum()
            end.record()
            end.synchronize()
            samples.append(nbytes / (start.elapsed_time(end) / 1e3) / 1e9)
        return samples

    # interleave so clocks and neighbours affect both alike
    el, pl = [], []
    for _ in range(5):
        el += read_gbps(elastic)
        pl += read_gbps(plain)
    assert torch.equal(elastic.sum(), plain.sum())
    result = {"bytes": nbytes, "elastic_GBps": round(median(el), 1),
              "plain_GBps": round(median(pl), 1), "ratio": round(median(el) / median(pl), 4)}
    del elastic, plain
    mapper.unmap([vt], list(range(nbytes // PAGE)))
    return result


def bench_gather(device: str, nbytes: int, block_bytes: int, blocks: int, iters: int) -> dict:
    """Read bandwidth of gathering ``blocks`` random ``block_bytes`` blocks (elastic vs plain)."""
    import torch

    mapper = open_mapper(device, PAGE)
    vt = mapper.reserve(nbytes)
    mapper.map([vt], list(range(nbytes // PAGE)))
    elastic = as_tensor(vt, torch.float16).view(-1, block_bytes // 2)
    plain = torch.empty_like(elastic)
    elastic.uniform_()
    plain.copy_(elastic)
    gen = torch.Generator(device=device).manual_seed(0)
    index = torch.randint(elastic.shape[0], (blocks,), device=device, generator=gen)
    out = torch.empty(blocks, block_bytes // 2, dtype=torch.float16, device=device)

    def gbps(t):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.index_select(t, 0, index, out=out)
        samples = []
        for _ in range(iters):
            start.record()
            torch.index_select(t, 0, index, out=out)
            end.record()
            end.synchronize()
            samples.append(blocks * block_bytes / (start.elapsed_time(end) / 1e3) / 1e9)
        return samples

    el, pl = [], []
    for _ in range(5):  # interleaved, as bench_bandwidth
        el += gbps(elastic)
        pl += gbps(plain)
    result = {"bytes": nbytes, "block_bytes": block_bytes, "blocks_per_gather": blocks,
              "elastic_GBps": round(median(el), 1), "plain_GBps": round(median(pl), 1),
              "ratio": round(median(el) / median(pl), 4)}
    del elastic, plain, out
    mapper.unmap([vt], list(range(nbytes // PAGE)))
    return result


def bench_interference(device: str, pages: int, reps: int) -> dict:
    """GPU work timed alone and while another thread maps and unmaps pages.

    ``launch``: 2000 in-place adds on a 1 MiB tensor (bound by kernel launches, as
    a small model's decode step in eager mode); ``graph``: the same adds as 10
    replays of a captured CUDA graph of 200 (as with CUDA graphs); ``compute``: 40
    matmuls of 4096^2 (bound by the GPU). Each is timed by wall clock to the end of its work, in rounds that rotate
    the page traffic: none, map/unmap batches of 16 pages without a device
    synchronisation, and with one before each unmap (what an engine's page thread
    does). Ratios are medians over ``reps`` rounds against the quiet runs.
    """
    import threading

    import torch

    mapper = open_mapper(device, PAGE)
    vt = mapper.reserve(pages * PAGE)
    small = torch.zeros(1 << 18, device=device)
    a = torch.randn(4096, 4096, device=device, dtype=torch.float16)
    b = torch.randn(4096, 4096, device=device, dtype=torch.float16)

    def launch():
        for _ in range(2000):
            small.add_(1.0)

    def compute():
        for _ in range(40):
            torch.mm(a, b)

    # A CUDA graph of 200 such adds, replayed: how an engine's decode steps launch.
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        small.add_(1.0)  # warm-up outside the capture, as torch asks
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        for _ in range(200):
            small.add_(1.0)

    def replay():
        for _ in range(10):
            graph.replay()

    stop = threading.Event()
    calls = [0]

    def traffic(sync: bool):
        batches = [list(range(i, i + 16)) for i in range(0, pages - 15, 16)]
        while not stop.is_set():
            for batch in batches:
                mapper.map([vt], batch)
                mapper.unmap([vt], batch, synchronize=sync)
                calls[0] += 2 * len(batch)
                if stop.is_set():
                    break

    def timed(work, mode):
        stop.clear()
        thread = None
        if mode != "quiet":
            thread = threading.Thread(target=traffic, args=(mode == "synced",), daemon=True)
            thread.start()
            time.sleep(0.01)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        work()
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        stop.set()
        if thread is not None:
            thread.join()
        return seconds

    modes = ("quiet", "unsynced", "synced")
    result = {"pages": pages, "reps": reps}
    for name, work in (("launch", launch), ("graph", replay), ("compute", compute)):
        work()
        torch.cuda.synchronize()
        times: dict[str, list[float]] = {m: [] for m in modes}
        calls[0] = 0
        for r in range(reps):
            for k in range(len(modes)):
                mode = modes[(r + k) % len(modes)]
                times[mode].append(timed(work, mode))
        quiet = median(times["quiet"])
        result[name] = {"quiet_ms": round(quiet * 1e3, 3),
                        **{f"{m}_ratio": round(median(times[m]) / quiet, 4) for m in modes[1:]},
                        "page_calls_during": calls[0]}
    mapper.trim_pool(0)
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--pages", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--bandwidth-gib", type=int, default=8)
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/mapper-<backend>.json)")
    ap.add_argument("--only-threads", action="store_true",
                    help="only the threaded map measurement (bench_threads)")
    args = ap.parse_args(argv)

    from kvcached_core.device import parse_device

    dev = parse_device(args.device)
    result = {
        "benchmark": "mapper",
        "command": "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "device": args.device,
        "backend": dev.backend,
        "page_bytes": PAGE,
        "host": platform.node(),
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"),
    }
    if dev.is_gpu:
        import torch

        result["gpu"] = torch.cuda.get_device_name(dev.index)
        result["torch"] = torch.__version__
    result["threads"] = bench_threads(args.device, 4 * args.pages)
    if args.only_threads:
        save_json(args.out or Path(__file__).parent / "results" / f"mapper-threads-{dev.backend}.json",
                  result)
        print(json.dumps(result["threads"]))
        return 0
    result["latency"] = bench_latency(args.device, dev.backend, dev.index, args.pages, args.rounds)
    result["latency"].update(bench_unmap_sync(args.device, args.pages))
    result["batched"] = bench_batched(args.device, args.pages, 32)
    # a 32-layer model's K and V buffers, 2 GiB of virtual space each
    result["reserve_32_layers"] = bench_reservation(args.device, 32, 2 << 30, 10)
    if dev.is_gpu:
        result["read_bandwidth"] = bench_bandwidth(dev.torch_device, args.bandwidth_gib << 30, 20)
        result["gather_bandwidth"] = [
            bench_gather(dev.torch_device, args.bandwidth_gib << 30, block, 32768, 20)
            for block in (32 << 10, 4 << 10)]
        result["interference"] = bench_interference(dev.torch_device, 256, 15)

    out = save_json(args.out or Path(__file__).parent / "results" / f"mapper-{dev.backend}.json",
                    result)
    lat = result["latency"]
    print(f"{'per 2 MiB page':<16}{'from Python':>12}{'ratio':>8}{'in C++':>10}{'ratio':>8}{'raw us':>10}")
    for key in ("cold_grow", "recycled_grow", "shrink", "shrink_release"):
        r, n = lat[key], lat["native"][key]
        print(f"{key:<16}{r['kvcached_us']:>12}{r['ratio']:>8}{n['kvcached_us']:>10}{n['ratio']:>8}{r['raw_us']:>10}")
    print(f"unmap with device sync: {lat['unmap_with_sync_us']} us")
    print(f"32-page batches, per page: {result['batched']}")
    print(f"reserve 32-layer KV tensors: {result['reserve_32_layers']['median_ms']} ms")
    if "read_bandwidth" in result:
        bw = result["read_bandwidth"]
        print(f"read bandwidth elastic {bw['elastic_GBps']} GB/s, plain {bw['plain_GBps']} GB/s, ratio {bw['ratio']}")
        for g in result["gather_bandwidth"]:
            print(f"gather of {g['block_bytes']} B blocks: elastic {g['elastic_GBps']} GB/s, "
                  f"plain {g['plain_GBps']} GB/s, ratio {g['ratio']}")
        print(f"GPU work during page traffic: {result['interference']}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
